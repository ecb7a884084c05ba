"""The routed experts of a mixture-of-experts layer (models/moe.py routes the tokens): the dropless layout,
the grouped-matmul kernels and the expert FFNs, as pure functions over one layer's `experts` params.

Dropless experts: the N x k (token, expert) assignments are sorted by expert, each expert's run padded
to a multiple of `moe_block_rows`, and the runs cut into blocks of that many rows, each block owned by
one expert (`expert_layout`). The grouped matmul then multiplies each block by its expert's weights:
compute and activation memory grow with N x k + E x block_rows rows, never with N x E, and no token
is dropped (there is no capacity). Two kernels run that layout (`grouped_matmul`):

- `blocked` (ours): a loop over blocks (`lax.scan`), one [block_rows, K] x [K, F] matmul each; empty
  tail blocks are skipped. Its backward is written out (`_blocked_bwd`): dx is the same loop over
  the transposed weights, dW accumulates each block's x^T dy into its expert's slice in place. Any backend.
- `ragged_dot`: `jax.lax.ragged_dot` over the same padded groups. XLA:TPU runs it as a native
  grouped matmul; JAX lowers it on CPU / GPU to a dense tokens x experts masked matmul, so `auto`
  picks it on TPU only.

A decode step's few assignments (no more than one block) skip the layout: each reads its expert's weights
(`gathered_expert_ffn`).

Expert parallelism (models/expert_parallel.py) hands a device its group's tokens, all of them, with the ids of
the experts other devices hold set to E_held. Laying out all N x k assignments there made every buffer of the
layout (the gathered rows, the kernels' fp32 outputs, the [N, k, H] outputs before the mix) the group's size
where the device computes 1 / expert of it: a 30B-A3B decode step on v5p-32 (16 expert ways) moved ~300 MB a
layer a chip of them beside its 75 MB of expert weights. A device lays out only its own assignments instead
(`_own_expert_ffn`): `own_capacity` of them a trip (twice their expected count), as many trips as its count
needs (a `lax.cond` skips the rest of a static number: dropless, whatever the routing), each trip's outputs
added into the tokens' rows.

Batch-invariant mode (`model.batch_invariant`, models/invariant.py): every token runs the blocked kernel (a
decode step's few too: no gather, no ragged_dot) whose blocks multiply by the fixed-tile GEMM, and a token's k
expert outputs are mixed by a fixed tree, so a token's output does not depend on which tokens share its call
(under expert parallelism the slots go home unmixed: `held_expert_slots`, `mix_slots`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.arrays import DType
from jaxrl_llm.models import invariant
from jaxrl_llm.models.activations import gated_product
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.moe import Routing
from jaxrl_llm.models.numerics import MATMUL_2D
from jaxrl_llm.platform.target import target_platform

Array = jax.Array

# an expert-parallel device lays out its own assignments in trips of this many times their expected count (a
# routing's imbalance up to that fits one trip; more runs another: `_own_expert_ffn`)
OWN_ROWS_SLACK = 2.0


class ExpertLayout(NamedTuple):
    dest: Array          # [N, k] int32: the padded row of each assignment
    src_token: Array     # [R] int32: the token each padded row reads (N: an empty row)
    block_expert: Array  # [R / block_rows] int32: the expert owning each block
    block_used: Array    # [R / block_rows] bool: False for the empty blocks at the end
    group_sizes: Array   # [E] int32: each expert's padded row count (sums to <= R)


def _mix_experts(weights: Array, outputs: Array) -> Array:
    """fp32 [N, H] = sum_k weights [N, k] * outputs [N, k, H]; in batch-invariant mode the k products are
    added by a fixed tree (an einsum's reduction order may follow N)."""
    if invariant.enabled():
        return invariant.tree_sum(weights[..., None] * outputs, axis=1)
    return jnp.einsum("nk,nkh->nh", weights, outputs)


class ExpertSlots(NamedTuple):
    """A token's k expert outputs before they are weighted and mixed, zeros in the slots another device holds
    (batch-invariant expert parallelism: the devices' sum of one value and zeros is exact in any order, and
    moves each slot to the token's home device, which mixes them as one device does: `mix_slots`)."""

    outputs: Array  # fp32 [N, k, H]: expert_k(token)
    bias: Array | None  # fp32 [N, k, H]: down_bias[expert_k] (GPT-OSS), or None


def mix_slots(weights: Array, slots: ExpertSlots) -> Array:
    """fp32 [N, H]: the slots mixed by weights [N, k] with `_held_expert_ffn`'s own expression (the weighting
    after the exchange, as one device weights a gathered output: XLA may contract a product into the tree's
    adds as an FMA, and then does so alike in both programs)."""
    return _mix_experts(weights, slots.outputs) + (0.0 if slots.bias is None else _mix_experts(weights, slots.bias))


def num_blocks(tokens: int, top_k: int, num_experts: int, block_rows: int) -> int:
    """Static block count that holds any routing: each expert's run rounds up to whole blocks (at
    most one partial block per expert), and no expert gets more than `tokens` rows."""
    return min(math.ceil(tokens * top_k / block_rows) + num_experts,
               num_experts * math.ceil(tokens / block_rows))


def expert_layout(ids: Array, num_experts: int, block_rows: int, computed: int | None = None) -> ExpertLayout:
    """The padded, expert-sorted row layout of the assignments ids [N, k] (see the module doc). Only
    the first `computed` experts' blocks are used (default all): under expert parallelism the last
    group collects the assignments other devices compute (models/expert_parallel.py)."""
    computed = num_experts if computed is None else computed
    n, k = ids.shape
    flat = ids.reshape(-1)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    padded = (counts + block_rows - 1) // block_rows * block_rows
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    start = jnp.cumsum(counts) - counts
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - start[sorted_experts]
    dest = jnp.zeros_like(flat).at[order].set(pad_start[sorted_experts] + rank)
    nb = num_blocks(n, k, num_experts, block_rows)
    src_token = jnp.full((nb * block_rows,), n, jnp.int32).at[dest].set(
        jnp.arange(flat.shape[0], dtype=jnp.int32) // k)
    block_start = jnp.arange(nb, dtype=jnp.int32) * block_rows
    # searchsorted(pad_end, block_start, side="right") as a count ([blocks, E] compares): jnp.searchsorted
    # fails to trace inside shard_map (expert parallelism) in jax 0.10
    block_expert = jnp.minimum(jnp.sum(pad_end[None, :] <= block_start[:, None], axis=1), num_experts - 1)
    return ExpertLayout(dest.reshape(n, k), src_token, block_expert.astype(jnp.int32),
                        block_start < pad_end[computed - 1], padded[:computed])


# ---------------------------------------------------------------------------------------------- kernels
def _expert(w: Array, e: Array) -> Array:
    return lax.dynamic_index_in_dim(w, e, 0, keepdims=False)


def _blocks(x: Array, layout_blocks: int) -> Array:
    return x.reshape(layout_blocks, -1, x.shape[-1])


def _blocked_loop(x: Array, w: Array, block_expert: Array, block_used: Array, dims, unroll: int | bool) -> Array:
    """fp32 [R, F]: each block of x [R, K] times its expert's w[e] (contracted by `dims`), 0 for unused."""
    xb = _blocks(x, block_expert.shape[0])
    out_cols = w.shape[2] if dims == MATMUL_2D else w.shape[1]

    def one(_: None, block: tuple[Array, Array, Array]) -> tuple[None, Array]:
        rows, e, used = block
        if dims == MATMUL_2D and invariant.enabled():  # the forward, each row in a fixed order (models/invariant.py)
            product = lambda: invariant.matmul_on_device(rows, _expert(w, e))  # noqa: E731
        else:
            product = lambda: lax.dot_general(rows, _expert(w, e), dims, preferred_element_type=jnp.float32)  # noqa: E731
        skip = lambda: jnp.zeros((rows.shape[0], out_cols), jnp.float32)  # noqa: E731
        return None, lax.cond(used, product, skip)

    _, y = lax.scan(one, None, (xb, block_expert, block_used), unroll=unroll)
    return y.reshape(x.shape[0], out_cols)


def _blocked_gmm(x: Array, w: Array, block_expert: Array, block_used: Array, unroll: int | bool) -> Array:
    return _blocked_loop(x, w, block_expert, block_used, MATMUL_2D, unroll)


_blocked = jax.custom_vjp(_blocked_gmm, nondiff_argnums=(4,))


def _blocked_fwd(x, w, block_expert, block_used, unroll):
    return _blocked_gmm(x, w, block_expert, block_used, unroll), (x, w, block_expert, block_used)


def _blocked_bwd(unroll, residuals, dy):
    x, w, block_expert, block_used = residuals
    dy = dy.astype(x.dtype)  # one rounding of the fp32 cotangent to the compute dtype (models/numerics.py)
    dx = _blocked_loop(dy, w, block_expert, block_used, (((1,), (1,)), ((), ())), unroll).astype(x.dtype)
    xb, dyb = _blocks(x, block_expert.shape[0]), _blocks(dy, block_expert.shape[0])

    def accumulate(dw: Array, block: tuple[Array, Array, Array, Array]) -> tuple[Array, None]:
        rows, grads, e, used = block
        contribution = lax.dot_general(rows, grads, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        updated = lax.dynamic_update_index_in_dim(dw, _expert(dw, e) + contribution, e, 0)
        return jnp.where(used, updated, dw), None

    dw, _ = lax.scan(accumulate, jnp.zeros(w.shape, jnp.float32), (xb, dyb, block_expert, block_used), unroll=unroll)
    return dx, dw.astype(w.dtype), None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def resolve_kernel(name: str) -> str:
    """`auto` -> `ragged_dot` on TPU (XLA's native grouped matmul), `blocked` elsewhere; the platform is
    the one programs are built for (a TPU slice compiled from this host: `platform.target`)."""
    if name == "auto":
        return "ragged_dot" if target_platform() == "tpu" else "blocked"
    return name


def experts_kernel(cfg: ModelConfig) -> str:
    """The grouped-matmul kernel `cfg`'s routed experts run: `moe_kernel` resolved, `blocked` in batch-invariant
    mode (every token through the fixed-tile blocks: `_held_expert_ffn`)."""
    return "blocked" if cfg.batch_invariant else resolve_kernel(cfg.moe_kernel)


def routed_expert_flops(cfg: ModelConfig, tokens: float) -> float:
    """FLOPs of the routed experts' three matmuls for `tokens` tokens through every sparse layer, forward
    (2 x tokens x k x 3 x H x F per layer; a backward is twice that)."""
    per_token = 2.0 * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return per_token * len(cfg.moe_layer_ids) * tokens


def uncounted_expert_flops(cfg: ModelConfig, tokens: float, layout_tokens: int = 0, ways: int = 1) -> float:
    """The routed-expert FLOPs XLA's cost analysis misses for `tokens` forward-equivalent token passes,
    `layout_tokens` of them laid out at once on a device (`held_expert_ffn`; its group's under expert
    parallelism over `ways` devices). The `blocked` kernel (batch-invariant mode's too) is a loop whose body (one
    block) XLA counts once. The `ragged_dot` kernel is one op, counted as a dense matmul over the rows of one
    chunk (`token_chunks`) or, on an expert-parallel device laying out its own assignments, of one trip
    (`own_capacity`): negative where that is more than the device's share (a decode step's trip holds twice
    its expected assignments). 0 for a dense model."""
    if not cfg.is_moe:
        return 0.0
    routed = routed_expert_flops(cfg, tokens)
    if experts_kernel(cfg) == "blocked":
        return routed
    if not layout_tokens:
        return 0.0
    k = cfg.num_experts_per_tok
    chunks = token_chunks(layout_tokens, k, cfg.moe_chunk_rows)
    per_chunk = layout_tokens * k // chunks  # assignments a chunk lays out (its group's)
    own = per_chunk if ways == 1 else own_capacity(per_chunk, cfg.num_experts // ways, cfg.num_experts,
                                                   cfg.moe_block_rows)
    counted = own * ways / (layout_tokens * k)  # what XLA counts, of the device's own share
    return routed * (1.0 - counted)


def grouped_matmul(x: Array, w: Array, layout: ExpertLayout, kernel: str = "auto", *,
                   unroll: int | bool = 1) -> Array:
    """fp32 [R, F] = each padded row of x [R, K] times its expert's w [E, K, F] (compute-dtype
    operands, fp32 accumulation). `unroll`: the blocked kernel's loop unrolling (cost analysis
    counts a loop body once; tests unroll fully to count every block)."""
    w = w.astype(x.dtype)
    if resolve_kernel(kernel) == "ragged_dot":
        return lax.ragged_dot(x, w, layout.group_sizes, preferred_element_type=jnp.float32)
    return _blocked(x, w, layout.block_expert, layout.block_used, unroll)


def expert_ffn(experts: dict, tokens: Array, routing: Routing, cfg: ModelConfig, *, dtype: DType,
               kernel: str | None = None, unroll: int | bool = 1) -> Array:
    """fp32 [N, H]: sum_k weight_k * SwiGLU_{expert_k}(token), dropless (module doc). With no more
    assignments than one block holds (a decode step), each assignment reads its expert's weights
    directly (`gathered_expert_ffn`) instead; `kernel`: force one ("gather" or a MOE_KERNELS name)."""
    return held_expert_ffn(experts, tokens, routing.ids, routing.weights, cfg, dtype=dtype, kernel=kernel,
                           unroll=unroll)


def held_expert_ffn(experts: dict, tokens: Array, ids: Array, weights: Array, cfg: ModelConfig, *, dtype: DType,
                    kernel: str | None = None, unroll: int | bool = 1) -> Array:
    """`expert_ffn` over the experts `experts` holds ([E_held, ...]): all of them, or one device's
    share under expert parallelism, where an id equal to E_held marks an assignment another device
    computes (its weight is 0 and no block runs it). ids / weights [N, k].

    More than `cfg.moe_chunk_rows` assignments run in equal chunks of tokens (`lax.map`, each chunk
    rematerialised in the backward): the same numbers, with the padded rows, their SwiGLU and the
    [N, k, H] outputs held for one chunk at a time. A Qwen3-30B-A3B update on v5p-32 (16 expert
    ways, one 5k-token sequence per chip) laid out its group's 655k assignments whole: 5 GiB a buffer."""
    out = _in_chunks(experts, tokens, ids, weights, cfg, dtype=dtype, kernel=kernel, unroll=unroll, slots=False)
    assert isinstance(out, jax.Array)
    return out


def held_expert_slots(experts: dict, tokens: Array, ids: Array, cfg: ModelConfig, *, dtype: DType) -> ExpertSlots:
    """`held_expert_ffn`'s k expert outputs per token, unweighted and unmixed, zeros where ids [N, k] == E_held
    (another device's expert; batch-invariant expert parallelism: `mix_slots` weights and mixes them as
    `held_expert_ffn` does)."""
    unread = jnp.zeros(ids.shape, jnp.float32)  # the weights: the slots are weighted at the tokens' home
    out = _in_chunks(experts, tokens, ids, unread, cfg, dtype=dtype, kernel=None, unroll=1, slots=True)
    assert isinstance(out, ExpertSlots)
    return out


def _in_chunks(experts: dict, tokens: Array, ids: Array, weights: Array, cfg: ModelConfig, *, dtype: DType,
               kernel: str | None, unroll: int | bool, slots: bool) -> Array | ExpertSlots:
    """`_held_expert_ffn` over equal chunks of the tokens (`held_expert_ffn`'s doc)."""
    n, k = ids.shape
    chunks = token_chunks(n, k, cfg.moe_chunk_rows)
    if chunks == 1:
        return _held_expert_ffn(experts, tokens, ids, weights, cfg, dtype=dtype, kernel=kernel, unroll=unroll,
                                slots=slots)

    @jax.checkpoint
    def one(chunk: tuple[Array, Array, Array]) -> Array | ExpertSlots:
        return _held_expert_ffn(experts, *chunk, cfg, dtype=dtype, kernel=kernel, unroll=unroll, slots=slots)

    def split(a: Array) -> Array:
        return a.reshape(chunks, n // chunks, *a.shape[1:])

    out = lax.map(one, (split(tokens), split(ids), split(weights)))
    return jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), out)


def token_chunks(tokens: int, top_k: int, chunk_rows: int) -> int:
    """How many equal chunks `tokens` tokens of `top_k` assignments each are cut into: the fewest
    that divide `tokens` with at most `chunk_rows` assignments a chunk (one token a chunk at worst)."""
    chunks = max(1, -(-tokens * top_k // chunk_rows))
    while tokens % chunks:
        chunks += 1
    return min(chunks, max(tokens, 1))


def own_capacity(assignments: int, held: int, num_experts: int, block_rows: int) -> int:
    """How many of a device's own assignments `_own_expert_ffn` lays out a trip, of `assignments` of which those
    to its `held` of `num_experts` experts are its own: OWN_ROWS_SLACK times their expected count, in whole blocks
    (all of them at most)."""
    expected = OWN_ROWS_SLACK * assignments * held / num_experts
    return min(math.ceil(max(expected, block_rows) / block_rows) * block_rows, assignments)


def _held_expert_ffn(experts: dict, tokens: Array, ids: Array, weights: Array, cfg: ModelConfig, *, dtype: DType,
                     kernel: str | None, unroll: int | bool, slots: bool = False, own_only: bool = True
                     ) -> Array | ExpertSlots:
    """`held_expert_ffn` in one pass; under expert parallelism (ids == E_held: another device's expert) over its
    own assignments only where they are fewer than all (`own_only`: `_own_expert_ffn`)."""
    n, hidden = tokens.shape
    held = experts["gate_proj"]["kernel"].shape[0]
    if own_only and held < cfg.num_experts and kernel != "gather" and not (invariant.enabled() or slots):
        capacity = own_capacity(ids.size, held, cfg.num_experts, cfg.moe_block_rows)
        if capacity < ids.size:
            return _own_expert_ffn(experts, tokens, ids, weights, cfg, dtype=dtype, kernel=kernel, unroll=unroll,
                                   capacity=capacity)
    few = kernel is None and ids.size <= cfg.moe_block_rows
    if (kernel == "gather" or few) and not (invariant.enabled() or slots):  # the mode: every token through the blocks
        return gathered_expert_ffn(experts, tokens, jnp.minimum(ids, held - 1), weights, dtype=dtype, cfg=cfg)
    groups = held + 1 if held < cfg.num_experts else held
    layout = expert_layout(ids, groups, cfg.moe_block_rows, computed=held)
    rows = jnp.concatenate([tokens, jnp.zeros((1, hidden), tokens.dtype)])[layout.src_token]
    kernel = "blocked" if invariant.enabled() else kernel or cfg.moe_kernel

    def gmm(x: Array, name: str) -> Array:
        y = grouped_matmul(x, experts[name]["kernel"], layout, kernel, unroll=unroll)
        if "bias" in experts[name] and name != "down_proj":  # each padded row's expert's (unused rows: a clipped id)
            row_expert = jnp.repeat(jnp.minimum(layout.block_expert, held - 1), cfg.moe_block_rows,
                                    total_repeat_length=y.shape[0])
            y = y + experts[name]["bias"].astype(dtype)[row_expert]
        return y

    out = gmm(expert_glu(cfg, gmm(rows, "gate_proj"), gmm(rows, "up_proj"), dtype), "down_proj")  # [R, H] fp32
    if slots:  # this device's slots; zeros where another device holds the expert
        mine = (ids < held)[..., None]
        bias = experts["down_proj"].get("bias")
        bias_rows = None if bias is None else bias.astype(dtype)[jnp.minimum(ids, held - 1)].astype(jnp.float32)
        return ExpertSlots(jnp.where(mine, out[layout.dest], 0.0),
                           None if bias_rows is None else jnp.where(mine, bias_rows, 0.0))
    mixed = _mix_experts(weights, out[layout.dest])
    return mixed + down_bias(experts, jnp.minimum(ids, held - 1), weights, dtype)


def _own_expert_ffn(experts: dict, tokens: Array, ids: Array, weights: Array, cfg: ModelConfig, *, dtype: DType,
                    kernel: str | None, unroll: int | bool, capacity: int) -> Array:
    """`_held_expert_ffn` of an expert-parallel device, laying out only its own assignments (ids [N, k] < E_held;
    module doc): `capacity` of them a trip, in (token, slot) order, each trip's mixed outputs added into its
    tokens' rows. A static number of trips holds any routing (all N x k assignments its own); those past the
    device's count are skipped."""
    n, hidden = tokens.shape
    held = experts["gate_proj"]["kernel"].shape[0]
    flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
    mine = flat_ids < held
    count = jnp.sum(mine, dtype=jnp.int32)
    trips = -(-flat_ids.shape[0] // capacity)
    # the own assignments first, in (token, slot) order; what a trip picks past `count` is masked
    order = jnp.argsort(jnp.logical_not(mine), stable=True).astype(jnp.int32)
    order = jnp.pad(order, (0, trips * capacity - order.shape[0]))
    padded_tokens = jnp.concatenate([tokens, jnp.zeros((1, hidden), tokens.dtype)])  # row n: a masked pick's

    def trip(out: Array, start: Array) -> tuple[Array, None]:
        def run(out: Array) -> Array:
            picked = lax.dynamic_slice_in_dim(order, start, capacity)
            valid = start + jnp.arange(capacity, dtype=jnp.int32) < count
            token = jnp.where(valid, picked // ids.shape[1], n)
            own_ids = jnp.where(valid, flat_ids[picked], held)[:, None]
            own_weights = jnp.where(valid, flat_weights[picked], 0.0)[:, None]
            y = _held_expert_ffn(experts, padded_tokens[token], own_ids, own_weights, cfg, dtype=dtype, kernel=kernel,
                                 unroll=unroll, own_only=False)
            return out.at[token].add(y, mode="drop")  # a masked pick's row (n) is dropped

        return lax.cond(start < count, run, lambda out: out, out), None

    starts = jnp.arange(trips, dtype=jnp.int32) * capacity
    out, _ = lax.scan(trip, jnp.zeros((n, hidden), jnp.float32), starts)
    return out


def down_bias(experts: dict, ids: Array, weights: Array, dtype: DType) -> Array | float:
    """sum_k weight_k * down_bias[expert_k] for ids / weights [N, k] (GPT-OSS's experts' output bias, added
    once per token: under a `tensor` split of the experts' width it follows the partial sums' reduction)."""
    bias = experts["down_proj"].get("bias")
    if bias is None:
        return 0.0
    return _mix_experts(weights, bias.astype(dtype)[ids].astype(jnp.float32))


def expert_glu(cfg: ModelConfig, gate: Array, up: Array, dtype: DType) -> Array:
    """The experts' gated product: SwiGLU (GeGLU for Gemma 4, the model's activation), or GPT-OSS's clamped
    SwiGLU (`swiglu_limit`)."""
    clamp = None if cfg.swiglu_limit is None else (cfg.swiglu_limit, cfg.swiglu_alpha)
    return gated_product(gate, up, cfg.hidden_act, dtype, clamp)


def gathered_expert_ffn(experts: dict, tokens: Array, ids: Array, mix: Array, *, dtype: DType,
                        cfg: ModelConfig) -> Array:
    """`expert_ffn` for a few tokens: the N x k assignments (ids, mixing weights mix [N, k]) each gather
    their expert's matrices ([N, k, H, F] weights read, N x k SwiGLUs computed), no sort and no padded
    blocks. A decode step's batch would otherwise run one mostly empty block per expert it touches."""
    weights = {name: experts[name]["kernel"][ids].astype(dtype) for name in ("gate_proj", "up_proj", "down_proj")}
    x = tokens.astype(dtype)

    def biased(y: Array, name: str) -> Array:
        return y + experts[name]["bias"].astype(dtype)[ids] if "bias" in experts[name] else y

    gate = biased(jnp.einsum("nh,nkhf->nkf", x, weights["gate_proj"], preferred_element_type=jnp.float32), "gate_proj")
    up = biased(jnp.einsum("nh,nkhf->nkf", x, weights["up_proj"], preferred_element_type=jnp.float32), "up_proj")
    out = jnp.einsum("nkf,nkfh->nkh", expert_glu(cfg, gate, up, dtype), weights["down_proj"],
                     preferred_element_type=jnp.float32)
    return jnp.einsum("nk,nkh->nh", mix, out) + down_bias(experts, ids, mix, dtype)


def dense_expert_ffn(experts: dict, tokens: Array, routing: Routing, *, dtype: DType, cfg: ModelConfig) -> Array:
    """The all-experts reference of `expert_ffn`: every token through every expert (N x E SwiGLUs),
    mixed by the routing weights scattered to [N, E]. Tests and bench/moe.py only."""
    def biased(y: Array, name: str) -> Array:  # y [E, N, out]
        return y + experts[name]["bias"].astype(dtype)[:, None] if "bias" in experts[name] else y

    gate = biased(jnp.einsum("nh,ehf->enf", tokens, experts["gate_proj"]["kernel"].astype(dtype),
                             preferred_element_type=jnp.float32), "gate_proj")
    up = biased(jnp.einsum("nh,ehf->enf", tokens, experts["up_proj"]["kernel"].astype(dtype),
                           preferred_element_type=jnp.float32), "up_proj")
    out = biased(jnp.einsum("enf,efh->enh", expert_glu(cfg, gate, up, dtype),
                            experts["down_proj"]["kernel"].astype(dtype), preferred_element_type=jnp.float32),
                 "down_proj")
    mix = jnp.zeros((tokens.shape[0], out.shape[0]), jnp.float32).at[
        jnp.arange(tokens.shape[0])[:, None], routing.ids].add(routing.weights)
    return jnp.einsum("ne,enh->nh", mix, out)
