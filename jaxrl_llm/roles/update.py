"""The update loop shared by actor and critic: `ppo_epochs` x mini-batches x micro-batches.

Everything runs inside one jitted function: an outer `lax.scan` over epochs (rows reshuffled each
epoch when `shuffle`), a scan over mini-batches (one optimizer step each) and an inner scan over
micro-batches that accumulates gradients. Losses are normalised by the mini-batch's global token /
sequence counts (`Denominators`), so the accumulated gradient is exactly the full mini-batch
gradient whatever the micro-batch size (docs/algorithms.md, "Loss aggregation").

Every optimizer update of a call uses the same learning rate `lr` (a traced scalar: veRL steps
its LR scheduler once per RL step, roles/optim.py). A mini-batch whose loss or gradient norm is
non-finite skips its optimizer update (params and optimizer state are kept, as veRL's actor skips
`optimizer.step()` on a non-finite grad norm); skips are counted in `<prefix>/num_nonfinite_skipped`
and the host's `NonFiniteGuard` (bookkeeping/nonfinite.py) stops a run after too many in a row.

The batch is any pytree of [N, ...] arrays with a `response_mask` attribute (an `Experience`).
`TrainedRole.update` (roles.py) is the one place these updates are jitted.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm.arrays import ArrayTree, Params
from jaxrl_llm.batching import UpdateLayout, response_coverage, unless_empty
from jaxrl_llm.bookkeeping.nonfinite import UpdateFlags, update_flags_metrics
from jaxrl_llm.models.lora import with_lora

Batch = Any  # a pytree of [N, ...] arrays with `.response_mask` (trainer.experience.Experience)
# the prefix of per-token loss outputs (`run_update_epochs`' token_outputs), which callers pop from
# the metrics
TOKEN_OUTPUT = "tokens/"
# loss_fn(params, micro-batch, denominators) -> (loss, metrics); with loss_takes_rng a 4th argument, its key
LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


class TokenPrepass(NamedTuple):
    """A per-token quantity a loss needs over its whole mini-batch before any gradient (M2PO's mask,
    whose selection does not split over micro-batches): `forward(params, micro)` gives [n, R] values
    (0 off the micro-batch's response mask) with the params of the mini-batch's optimizer step, no
    gradient; `finish(mini, values)` returns the mini-batch with what the loss reads set from the
    [N, R] values. One forward per mini-batch more."""

    forward: Callable[[Any, Any], jax.Array]
    finish: Callable[[Any, jax.Array], Any]


class Denominators(NamedTuple):
    """Global counts over one mini-batch, passed to every micro-batch's loss."""

    num_tokens: jax.Array  # valid response tokens
    num_seqs: jax.Array  # rows with at least one valid token
    loss_scale_factor: jax.Array | None = None


def denominators(mask: jax.Array, loss_scale_factor: float | None = None) -> Denominators:
    mask = mask.astype(jnp.float32)
    scale = None if loss_scale_factor is None else jnp.float32(loss_scale_factor)
    # at least 1 (TRL's clamp): a mini-batch whose every response is masked out (mask_truncated_completions,
    # sample masks) has loss 0 and no gradient, not 0 / 0
    return Denominators(jnp.maximum(mask.sum(), 1.0), jnp.maximum((mask.sum(-1) > 0).sum().astype(jnp.float32), 1.0),
                        scale)


def _merge_leading(x: jax.Array) -> jax.Array:
    """[parts, n, ...] -> [parts * n, ...]: `_split`'s inverse for one array."""
    return x.reshape(-1, *x.shape[2:])


def _split(tree: Batch, parts: int, mesh_rows_spec: NamedSharding | None) -> Batch:
    """[N, ...] -> [parts, N/parts, ...], keeping the rows of each part spread over the data axes."""

    def one(x: jax.Array) -> jax.Array:
        y = x.reshape(parts, x.shape[0] // parts, *x.shape[1:])
        if mesh_rows_spec is not None:
            spec = PartitionSpec(None, *mesh_rows_spec.spec[:1], *([None] * (x.ndim - 1)))
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh_rows_spec.mesh, spec))
        return y

    return jax.tree.map(one, tree)


def run_update_epochs(
    params: Params,
    opt_state: ArrayTree,
    batch: Batch,
    rng: jax.Array,
    lr: jax.Array | None = None,
    *,
    tx: optax.GradientTransformation,
    loss_fn: LossFn,
    metric_prefix: str,
    ppo_epochs: int,
    num_mini_batches: int,
    num_micro_batches: int,
    shuffle: bool,
    rows_sharding: NamedSharding | None = None,
    loss_scale_factor: float | None = None,
    packing: UpdateLayout | None = None,
    token_outputs: tuple[str, ...] = (),
    loss_takes_rng: bool = False,
    prepass: TokenPrepass | None = None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """Returns updated (params, opt_state) and metrics: `loss_fn` metrics must be normalised by the
    global `Denominators` (so they are summed over micro-batches), then averaged over mini-batches
    and epochs, plus `<metric_prefix>/grad_norm` per optimizer step, `<metric_prefix>/lr` (when
    `lr` is given: `tx.update` then receives it as `learning_rate=lr`, roles/optim.py) and the
    non-finite counters of `nonfinite.update_flags_metrics`. Call inside `jax.jit`.

    token_outputs: names of loss metrics that are per-token fp32 arrays shaped like the micro-batch's
    `response_mask` (0 off its tokens; by convention under the `TOKEN_OUTPUT` prefix): returned as
    [N, R] in `batch`'s row order, each row's values from its micro-batch in epoch 0, not summed.

    packing: a `batching.UpdateLayout` (sequence packing): its `order` replaces the device shuffle
    (the host drew the same permutations) and each micro-batch gets its packed layout as
    `micro.packing` (the batch must then be an `Experience`). A `by_budget` layout (token budget)
    brings its own micro-batches (num_micro_batches must be 1): each reads the whole mini-batch with
    the response mask cut to its own sequences, and empty ones are skipped by a `lax.cond`.

    loss_takes_rng: `loss_fn(params, micro, denominators, key)` with a key of its own per micro-batch,
    epoch and mini-batch (LoRA dropout), drawn from `rng` apart from the shuffle's.

    prepass: a `TokenPrepass` run on each mini-batch before its gradients (micro-batch by micro-batch,
    packed as they are)."""
    num_rows = jax.tree.leaves(batch)[0].shape[0]
    if num_rows % (num_mini_batches * num_micro_batches):
        raise ValueError(
            f"{num_rows} rows do not split into {num_mini_batches} mini-batches x "
            f"{num_micro_batches} micro-batches"
        )
    def loss_with_key(params: Any, micro: Any, denoms: Any, key: jax.Array) -> Any:
        return loss_fn(params, micro, denoms, key) if loss_takes_rng else loss_fn(params, micro, denoms)

    grad_fn = jax.value_and_grad(loss_with_key, has_aux=True)
    by_budget = packing is not None and packing.by_budget
    if by_budget and num_micro_batches != 1:
        raise ValueError("token-budget packing splits mini-batches itself: pass num_micro_batches=1")
    tx = optax.with_extra_args_support(tx)
    lr_args = {} if lr is None else {"learning_rate": lr}

    def mini_step(carry, xs):
        (params, opt_state), (mini, layouts, mini_key) = carry, xs
        denoms = denominators(mini.response_mask, loss_scale_factor)
        micros = _split(mini, num_micro_batches, rows_sharding)
        micro_keys = None if mini_key is None else jax.random.split(
            mini_key, num_micro_batches if not by_budget else jax.tree.leaves(layouts)[0].shape[0])

        def micro_step(acc, xs):
            micro, layout, key = xs
            if layout is not None:
                micro = micro.replace(packing=layout)
            (loss, metrics), grads = grad_fn(params, micro, denoms, key)
            return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

        def budget_micro(layout, mini):
            # every micro-batch reads the whole mini-batch and scores the sequences its rows hold:
            # the other rows' tokens are masked out (their log-probs come back as 0)
            covered = response_coverage(layout, mini.response_mask.shape[0], mini.response_mask.shape[1])
            return mini.replace(packing=layout, response_mask=mini.response_mask * covered)

        def prepass_values(prepass: TokenPrepass, params, mini, micros, layouts):
            if by_budget:  # each micro-batch's values hold the mini-batch's rows, 0 off its own sequences
                def one_budget(total, layout):
                    micro = budget_micro(layout, mini)
                    return total + unless_empty(layout, lambda: prepass.forward(params, micro)), None
                return jax.lax.scan(one_budget, jnp.zeros(mini.response_mask.shape, jnp.float32), layouts)[0]

            def one(xs):
                micro, layout = xs
                return prepass.forward(params, micro if layout is None else micro.replace(packing=layout))
            return _merge_leading(jax.lax.map(one, (micros, layouts)))

        if prepass is not None:
            mini = prepass.finish(mini, jax.lax.stop_gradient(prepass_values(prepass, params, mini, micros, layouts)))
            micros = _split(mini, num_micro_batches, rows_sharding)

        def budget_micro_step(acc, xs):
            layout, key = xs
            grads_acc, tokens_acc = acc
            micro = budget_micro(layout, mini)
            (loss, metrics), grads = unless_empty(layout, lambda: grad_fn(params, micro, denoms, key))
            # each micro-batch's token outputs hold the mini-batch's rows, 0 off its own sequences:
            # added up in the carry (stacking them would keep [micro-batches, N, R])
            tokens = {k: metrics.pop(k) for k in token_outputs}
            return (jax.tree.map(jnp.add, grads_acc, grads), jax.tree.map(jnp.add, tokens_acc, tokens)), (loss, metrics)

        zeros = jax.tree.map(jnp.zeros_like, params)
        if by_budget:
            tokens = {k: jnp.zeros(mini.response_mask.shape, jnp.float32) for k in token_outputs}
            (grads, tokens), (losses, metrics) = jax.lax.scan(budget_micro_step, (zeros, tokens),
                                                              (layouts, micro_keys))
        else:
            grads, (losses, metrics) = jax.lax.scan(micro_step, zeros, (micros, layouts, micro_keys))
            # the micro-batches are consecutive slices of the mini-batch's rows
            tokens = {k: _merge_leading(metrics.pop(k)) for k in token_outputs}
        grad_norm = optax.tree.norm(grads)
        loss_ok = jnp.isfinite(jnp.sum(losses))
        finite = loss_ok & jnp.isfinite(grad_norm)
        updates, new_opt_state = tx.update(grads, opt_state, params, **lr_args)
        new_params = optax.apply_updates(params, updates)
        # A non-finite loss or gradient skips this optimizer update: the select keeps the old
        # params and optimizer state (Adam's moments and step count included), so a skipped
        # update leaves no trace, exactly as if that mini-batch had not been there.
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        # Loss and metrics are partial sums over the mini-batch's global denominators, so the
        # micro-batch values add up to the mini-batch values.
        metrics = jax.tree.map(jnp.sum, metrics)
        metrics[f"{metric_prefix}/grad_norm"] = grad_norm
        return (params, opt_state), (metrics, UpdateFlags(~finite, ~loss_ok), tokens)

    def epoch_step(carry, xs):
        epoch_rng, order, layouts = xs
        perm = None
        if order is not None:  # packed: the host drew this epoch's permutation (or arange)
            perm = order
        elif shuffle:
            perm = jax.random.permutation(epoch_rng, num_rows)
        rows = batch if perm is None else jax.tree.map(lambda x: x[perm], batch)
        minis = _split(rows, num_mini_batches, rows_sharding)
        # the loss's own keys (LoRA dropout), apart from the shuffle's
        mini_keys = jax.random.split(jax.random.fold_in(epoch_rng, 1), num_mini_batches) if loss_takes_rng else None
        carry, (metrics, flags, tokens) = jax.lax.scan(mini_step, carry, (minis, layouts, mini_keys))
        tokens = {k: _merge_leading(v) for k, v in tokens.items()}  # [N, ...] in `rows`' order
        if perm is not None:  # back to the batch's order
            tokens = {k: jnp.zeros_like(v).at[perm].set(v) for k, v in tokens.items()}
        return carry, (metrics, flags, tokens)

    order, layouts = (None, None) if packing is None else (packing.order, packing.layout)
    (params, opt_state), (metrics, flags, tokens) = jax.lax.scan(
        epoch_step, (params, opt_state), (jax.random.split(rng, ppo_epochs), order, layouts)
    )
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics.update({k: v[0] for k, v in tokens.items()})
    metrics.update(update_flags_metrics(metric_prefix, flags))
    if lr is not None:
        metrics[f"{metric_prefix}/lr"] = jnp.asarray(lr, jnp.float32)
    return params, opt_state, metrics


def with_lora_loss(loss_fn: LossFn, frozen: dict | None, lora_scale: float, lora_dropout: float
                   ) -> tuple[LossFn, bool]:
    """`loss_fn` of the params for `run_update_epochs`: with LoRA (`frozen` the base) a loss of
    {"lora": adapters} attached to the base, PEFT's dropout on their input from a key of its own per
    micro-batch; and whether it takes that key (`loss_takes_rng`)."""
    if frozen is None:
        return loss_fn, False
    def lora_loss(p: Any, mb: Any, d: Any, key: jax.Array | None = None) -> Any:
        return loss_fn(with_lora(frozen, p["lora"], lora_scale, lora_dropout, key), mb, d)

    return lora_loss, lora_dropout > 0.0
