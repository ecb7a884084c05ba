"""Optimizer and learning-rate schedule from an `OptimSpec` (veRL's names and numbers).

veRL builds torch AdamW + a LambdaLR that it steps once per RL step (after the actor's, or the
critic's, whole update), so every optimizer update of RL step k (all mini-batches and epochs)
uses lr(k). We do the same: the schedule is a function of the role's RL-step count, evaluated on
the host and passed to the jitted update as a traced argument (`learning_rate` below), so the
compiled program never changes and the logged `actor/lr` is the rate that was applied:
- `lr_scheduler_type="constant"`: lr * min(1, step / warmup)  (veRL `get_constant_schedule_with_warmup`)
- `lr_scheduler_type="cosine"`: linear warmup, then
  `max(min_lr_ratio, cos(pi * num_cycles * 2 * progress) * (1-min)/2 + (1+min)/2)`
  with progress = (step - warmup) / max(1, total - warmup)  (veRL `get_cosine_schedule_with_warmup`).
- `lr_scheduler_type="linear"`: linear warmup, then `max(min_lr_ratio, (total - step) / max(1, total - warmup))`
  (transformers' `get_linear_schedule_with_warmup`, TRL's default, when min_lr_ratio = 0).
- `lr_scheduler_type="wsd"`: linear warmup, lr for the first `int(stable_ratio * (total - warmup))` steps
  after it, then the cosine above over the remaining (decay) steps, and `min_lr_ratio` from `total` on
  (veRL `get_wsd_schedule_with_warmup`, its SFT trainer's `lr_scheduler: wsd`).
Warmup and total steps count RL steps; they are resolved by `jaxrl_llm.config.resolve`
(docs/config.md, `*.optim`: `lr_warmup_steps < 0` means `lr_warmup_steps_ratio * total`, as veRL).
"""
from __future__ import annotations

from typing import Any, Callable, cast

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm.arrays import ArrayTree, DType, Params
from jaxrl_llm.config.spec import OptimSpec

SCHEDULES = ("constant", "cosine", "linear", "wsd")
Schedule = Callable[[Any], jnp.ndarray]


def make_lr_schedule(optim: OptimSpec) -> Schedule:
    """The learning rate as a function of the RL-step count (0-based, like torch LambdaLR's epoch)."""
    if optim.lr_scheduler_type not in SCHEDULES:
        raise ValueError(f"optim.lr_scheduler_type={optim.lr_scheduler_type!r} is not one of {SCHEDULES}")
    if optim.total_steps is None or optim.warmup_steps is None:
        raise ValueError("optim.total_training_steps is not resolved (the dataset size is not known yet)")
    lr, warmup, style = optim.lr, max(optim.warmup_steps, 0), optim.lr_scheduler_type
    total = max(optim.total_steps, 1)

    def schedule(step: Any) -> jnp.ndarray:
        step = jnp.asarray(step, jnp.float32)
        warm = step / max(1, warmup)
        if style == "constant":
            factor = jnp.where(step < warmup, warm, 1.0)
        elif style == "linear":
            remaining = jnp.maximum(optim.min_lr_ratio, (total - step) / max(1, total - warmup))
            factor = jnp.where(step < warmup, warm, remaining)
        elif style == "wsd":
            stable = int((total - warmup) * optim.stable_ratio) if total > warmup else 0
            decay_start = warmup + stable
            progress = (step - decay_start) / max(1, total - decay_start)
            cosine = jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * optim.num_cycles * 2.0 * progress)))
            floor = optim.min_lr_ratio
            decayed = jnp.where(step < total, (1.0 - floor) * cosine + floor, floor)
            factor = jnp.where(step < warmup, warm, jnp.where(step < decay_start, 1.0, decayed))
        else:
            progress = (step - warmup) / max(1, total - warmup)
            cosine = jnp.cos(jnp.pi * optim.num_cycles * 2.0 * progress)
            floor = optim.min_lr_ratio
            decayed = jnp.maximum(floor, cosine * (1.0 - floor) * 0.5 + (1.0 + floor) * 0.5)
            factor = jnp.where(step < warmup, warm, decayed)
        return lr * factor

    return schedule


def scale_by_learning_rate_arg() -> optax.GradientTransformationExtraArgs:
    """`updates * -learning_rate`, the rate given to `update(..., learning_rate=lr)` (a traced
    scalar), so one compiled update serves every step of the schedule. Stateless."""

    def init(params: Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: ArrayTree, state: optax.EmptyState, params: Params | None = None, *,
               learning_rate: jax.Array | float, **extra: Any) -> tuple[ArrayTree, optax.EmptyState]:
        del params, extra
        # the same product optax's own scale_by_learning_rate forms: (-lr cast to the dtype) * u
        return jax.tree.map(lambda u: jnp.asarray(-learning_rate, u.dtype) * u, updates), state

    # optax types the `update` field without extra arguments although this class exists to carry them
    return optax.GradientTransformationExtraArgs(init, cast(optax.TransformUpdateFn, update))


def scale_by_adam_stored_as(dtype: DType, **adam: Any) -> optax.GradientTransformation:
    """optax.scale_by_adam whose moments (mu, nu) are stored in `dtype` between steps: each step reads them
    back in float32, runs optax's own update on them and stores the new moments rounded to `dtype`. With
    bfloat16 the state is 4 bytes a parameter instead of 8; the update a step applies is computed from
    moments with an 8-bit mantissa (optax's `mu_dtype` alone covers mu, not nu)."""
    inner = optax.scale_by_adam(**adam)

    def stored(state: ArrayTree, to: DType) -> ArrayTree:
        return state._replace(mu=optax.tree.cast(state.mu, to), nu=optax.tree.cast(state.nu, to))

    def init(params: Params) -> ArrayTree:
        return stored(inner.init(params), dtype)

    def update(updates: ArrayTree, state: ArrayTree, params: Params | None = None) -> tuple[ArrayTree, ArrayTree]:
        updates, new_state = inner.update(updates, stored(state, jnp.float32), params)
        return updates, stored(new_state, dtype)

    return optax.GradientTransformation(init, update)


def make_optimizer(optim: OptimSpec) -> tuple[optax.GradientTransformationExtraArgs, Schedule]:
    """AdamW (torch defaults for eps) with global-norm clipping, and the configured schedule.

    `tx.update(grads, state, params, learning_rate=schedule(step))`: the transformation is
    optax.adamw's chain (scale_by_adam, add_decayed_weights, scale by -lr) with the rate passed in;
    `optim.moment_dtype` other than float32 stores the moments in it (`scale_by_adam_stored_as`).
    """
    schedule = make_lr_schedule(optim)
    parts = []
    if optim.grad_clip is not None and optim.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(optim.grad_clip))
    b1, b2, eps = optim.betas[0], optim.betas[1], optim.eps
    if optim.moment_dtype == "float32":
        parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    else:
        parts.append(scale_by_adam_stored_as(jnp.dtype(optim.moment_dtype), b1=b1, b2=b2, eps=eps))
    parts += [optax.add_decayed_weights(optim.weight_decay, mask=decayed_leaves), scale_by_learning_rate_arg()]
    return optax.chain(*parts), schedule


# leaves no update may move: DeepSeek's router correction bias (models/moe.py `deepseek_choice`) gets no gradient,
# and weight decay would otherwise shrink it a little every step
_FIXED_LEAVES = ("score_bias",)


def decayed_leaves(params: Params) -> ArrayTree:
    """The weight-decay mask: every leaf but `_FIXED_LEAVES`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in _FIXED_LEAVES for k in path), params)
