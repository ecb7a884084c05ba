"""Batch-invariant numerics (`actor_rollout_ref.model.batch_invariant`; docs/performance.md, "Exact rollouts").

With the mode on, every reduction of the decoder computes a token's row in an order that does not depend
on the other rows of the call: how many there are (a one-token decode step of 8 slots, a prefill, a
training forward of 8 x 1024 tokens), where the row sits among them, or how many keys the cache holds.
The sampler's log-probs are then bit-identical to the trainer's recomputation in bf16, because both run
the one decoder (models/decoder.py) through these functions.

Why each order is fixed:
- Matmuls (`matmul`; the kernels in models/invariant_gemm.py): XLA picks a kernel per shape (GPU: split-K for
  few rows or a long contraction; CPU: a GEMV path for one row, other blockings by row count;
  bench/row_invariance.py measures it), so a
  row's sum over K changes with the row count. Here the rows run in tiles of a fixed shape, so every call
  runs one kernel: on GPU a Pallas (Triton) GEMM with fixed blocks and a sequential K loop (no split-K),
  on TPU a Pallas (Mosaic) GEMM whose K axis is the grid's sequential axis, on CPU (and any other
  backend) `lax.map` over tiles of `CPU_ROW_TILE` rows, each one XLA dot of the same shape. The backward
  needs no invariance and runs the plain matmuls (numerics.matmul_f32's). A column's sum does not depend on
  the columns beside it either (the kernels run every column in a block of one width, the last one past the
  matrix's edge or padded), so the paged engine's decode splits each weight by its output columns over every
  chip (`weight_columns`; engine/decode_layout.py) and a chip's columns are the trainer's bits.
- Row sums (RMSNorm's mean of squares, the softmax denominators): `tree_sum`, a pairwise tree of
  elementwise adds written out, whose order no backend may change (XLA's own reduce vectorizes by the
  number of rows: bench/row_invariance.py).
- Attention (`attend_blocks`): keys in blocks of `KEY_BLOCK`, anchored at the row's first token (a
  left-padded trainer row, the static sampler's cache and the paged engine's pages then cut the same
  blocks; a packed row starts each of its sequences at a multiple of KEY_BLOCK: batching/plan.py); a
  two-pass softmax (the peak over all keys is exact in any order), each block's exp-sum by `tree_sum`
  and its probabilities x V as fixed-shape contractions (query rows padded to `MIN_ROWS`), blocks added
  one after another from the first. Keys past a row's length (the cache's empty slots, the
  trainer's later tokens) add exact zeros, so the number of blocks does not matter either. On GPU and
  TPU a Pallas kernel (models/invariant_attention.py) runs instead, on every path of that backend: one
  program per tile of query rows walks the key blocks in order with the online softmax, skipping the
  blocks without a valid key (exact zeros too); its blocks divide KEY_BLOCK, so the anchoring holds.
- Log-probs (`vocab_scan`): the vocabulary in chunks of `VOCAB_CHUNK`, each chunk's logits by `matmul`,
  merged by the online logsumexp in vocabulary order, within a chunk by `tree_sum`: the sampler and the
  trainer's fused log-prob run this one loop. Divisions by the temperature stay divisions on both sides
  (`vocab_scan`), so XLA cannot contract a product into an FMA in one program and not the other.
- Loops of one trip: XLA inlines them, and their bodies then fuse with their surroundings into other
  kernels; every loop here runs at least two trips (`attend_blocks`, `_xla_tiles`, `vocab_chunks`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.invariant_gemm import matmul_2d, pad_rows
from jaxrl_llm.models.precision import MASKED_SCORE, probs_times_values
from jaxrl_llm.sharding.mesh import BATCH_AXES, CONTEXT_AXIS, TENSOR_AXIS

Array = jax.Array

KEY_BLOCK = 128  # keys per attention block (the paged engine's XLA blocks: sampler/paged_blocks.py)
VOCAB_CHUNK = 4096  # vocabulary ids per log-prob chunk
MIN_ROWS = 8  # query rows per (row, kv head) in an attention contraction, padded up to

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_invariant", default=False)

# XLA:CPU's classic elemental emitters: with its default MLIR fusion emitters some programs came out off by a
# rounding (2026-12-06: the trainer's forward on a context split, 5 of 96 log-probs; a prefill vs the training
# forward on one row), cause not found; the classic ones gave every exactness test the same bits (the test suite
# compiles with them)
CPU_EXACT_FLAG = "--xla_cpu_use_fusion_emitters=false"


def cpu_codegen_caveat(backend: str, xla_flags: str) -> str | None:
    """A warning for a batch-invariant run on `backend` compiled with `xla_flags` (XLA_FLAGS), or None: on CPU
    without `CPU_EXACT_FLAG` the mode is not exact in every program."""
    if backend != "cpu" or CPU_EXACT_FLAG in xla_flags.split():
        return None
    return (f"model.batch_invariant on CPU: set XLA_FLAGS={CPU_EXACT_FLAG} before jax starts; XLA:CPU's default "
            "fusion emitters compile some programs to other roundings, so a few log-probs may differ "
            "(docs/performance.md, 'Exact rollouts')")


@contextlib.contextmanager
def mode(enabled: bool) -> Iterator[None]:
    """Trace the code inside with the batch-invariant numerics on (`enabled`) or as they were. A trace-time
    switch: callers pass `cfg.batch_invariant` (a static field of ModelConfig), so jit caches differ by it."""
    if not enabled:
        yield
        return
    token = _ENABLED.set(True)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    """Whether the code being traced runs the batch-invariant numerics."""
    return _ENABLED.get()


# the mesh axes the weights' output columns are split over (`weight_columns`): the paged engine's decode
_COLUMNS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("invariant_columns", default=())


@contextlib.contextmanager
def weight_columns(axes: tuple[str, ...]) -> Iterator[None]:
    """Within the block `matmul` takes each weight as split over the mesh `axes` by its output columns (held whole
    where they do not divide), and each device computes its own columns for every row: the paged engine's decode
    layout in the mode (engine/decode_layout.py `column_spec`). A decode step's rows are a few slots a chip, so
    moving them is cheap; splitting the rows instead would gather every weight every step. () leaves `matmul`
    as it is."""
    token = _COLUMNS.set(tuple(axes))
    try:
        yield
    finally:
        _COLUMNS.reset(token)


def column_split(columns: int) -> tuple[str, ...]:
    """The axes `matmul` splits a weight of `columns` output columns over within `weight_columns`, or ()."""
    axes = _COLUMNS.get()
    mesh = jax.sharding.get_abstract_mesh()
    if not axes or mesh.empty:
        return ()
    return axes if columns % math.prod(dict(mesh.shape)[a] for a in axes) == 0 else ()


# tests: the GPU / TPU attention kernels through Pallas's interpreter on CPU (`kernels_interpreted`)
_INTERPRETED: contextvars.ContextVar[str | None] = contextvars.ContextVar("invariant_interpreted", default=None)


@contextlib.contextmanager
def kernels_interpreted(variant: str) -> Iterator[None]:
    """Within the block, programs traced for CPU run the attention kernels of `variant` ('triton' or 'mosaic':
    models/invariant_attention.py, the paged engine's form too) in Pallas's interpreter instead of the blocked XLA
    form, so their data flow (tiles, padding, masks, pages, skipped blocks) is checked end to end off the device.
    JAX's caches are cleared on entry and exit: a program traced outside the block would be reused."""
    if variant not in ("triton", "mosaic"):
        raise ValueError(f"kernels_interpreted: variant {variant!r} is not 'triton' or 'mosaic'")
    jax.clear_caches()
    token = _INTERPRETED.set(variant)
    try:
        yield
    finally:
        _INTERPRETED.reset(token)
        jax.clear_caches()


def interpreted_kernel() -> str | None:
    """The kernel variant `kernels_interpreted` runs on CPU, or None (the blocked XLA form)."""
    return _INTERPRETED.get()


# ---- sums ----

def tree_sum(x: Array, axis: int = -1) -> Array:
    """The sum over `axis` as a pairwise tree of elementwise adds (zeros padded to a power of two): the same
    order on every backend, whatever the other axes hold."""
    axis = axis % x.ndim
    n = x.shape[axis]
    size = 1 << max(0, (n - 1).bit_length())
    if size != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, size - n)
        x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        x = lax.slice_in_dim(x, 0, half, axis=axis) + lax.slice_in_dim(x, half, 2 * half, axis=axis)
    return lax.squeeze(x, (axis,))


# ---- matmuls (the kernels: models/invariant_gemm.py) ----

def matmul_on_device(x: Array, w: Array) -> Array:
    """fp32 [N, F] = x [N, K] @ w [K, F], each row summed in the fixed order of `matmul`, for code already
    running on one device's rows (inside a `shard_map` that holds the whole contraction: the routed experts,
    models/expert_parallel.py)."""
    return matmul_2d(x, w)


def _matmul_rows(x: Array, w: Array) -> Array:
    """`matmul_2d` over every leading axis of x as rows."""
    return matmul_2d(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def matmul(x: Array, w: Array) -> Array:
    """fp32 [..., F] = x [..., K] @ w [K, F] (operands in their dtype, fp32 accumulation), each row summed in
    an order that does not depend on the other rows (module doc). On a mesh (the abstract mesh in context)
    each device runs its share of the rows against the whole contraction, under shard_map: XLA cannot
    partition a Pallas kernel, and a device's rows then meet the same kernel as one device's would. The rows
    are split as a training pass splits them: the leading axis over the batch axes and, on a `context` split
    of [B, T, K] rows, the token axis over `context`. On a `tensor` split that divides F each device computes
    its shard of the output columns (the weight's columns stay split; x is gathered over `tensor`, so a
    head-split input moves, not the weight): every column's sum over K runs on one device in the kernel's
    order, where Megatron's row-parallel layers would add partial products over `tensor`. Forward only: the
    decoder differentiates it through models/numerics.py `matmul_f32` (its bf16 backward; the backward needs
    no invariance). Within `weight_columns` a weight whose columns divide is split by its columns over those
    axes instead, and every device runs every row (gathered) against its columns."""
    mesh = jax.sharding.get_abstract_mesh()
    by_columns = column_split(w.shape[1])
    if by_columns:  # every row on every device (P(): gathered), its columns of the weight and of the output
        out_spec = P(*(None,) * (x.ndim - 1), by_columns)
        return jax.shard_map(_matmul_rows, mesh=mesh, in_specs=(P(), P(None, by_columns)), out_specs=out_spec,
                             check_vma=False)(x, w)
    sizes = {} if mesh.empty else dict(mesh.shape)
    axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    tensor, context = sizes.get(TENSOR_AXIS, 1), sizes.get(CONTEXT_AXIS, 1)
    columns = TENSOR_AXIS if tensor > 1 and w.shape[1] % tensor == 0 else None
    if not axes and columns is None and context == 1:
        return _matmul_rows(x, w)
    ways = math.prod(sizes[a] for a in axes)
    rows = axes or None
    if context > 1 and x.ndim >= 3 and x.shape[-2] % context == 0:  # [..., T, K]: each device's own tokens
        grid = x.reshape(-1, *x.shape[-2:])
        specs = (P(rows, CONTEXT_AXIS, None), P(None, columns)), P(rows, CONTEXT_AXIS, columns)
    else:
        grid = x.reshape(-1, x.shape[-1])
        specs = (P(rows, None), P(None, columns)), P(rows, columns)
    per_device = jax.shard_map(_matmul_rows, mesh=mesh, in_specs=specs[0], out_specs=specs[1], check_vma=False)
    out = per_device(pad_rows(grid, ways), w)[:grid.shape[0]]
    return out.reshape(*x.shape[:-1], w.shape[1])


# ---- attention ----

def _pad_axis(x: Array, axis: int, size: int, value: float | bool = 0) -> Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def anchor_keys(x: Array, start: Array, axis: int) -> Array:
    """x with each row's keys (along `axis`; rows on axis 0) shifted left by `start` [rows]: key `start`
    becomes key 0 (what falls off the front wraps to the end; callers mask it)."""
    size = x.shape[axis]
    idx = (jnp.arange(size, dtype=jnp.int32)[None, :] + start[:, None]) % size  # [rows, S]
    shape = [1] * x.ndim
    shape[0], shape[axis] = x.shape[0], size
    return jnp.take_along_axis(x, idx.reshape(shape), axis=axis)


def _block_scores(qg: Array, k_block: Array, softcap: float | None) -> Array:
    """fp32 scaled (soft-capped) scores [B, kv, rows, KB] of queries [B, kv, rows, D] (rows >= MIN_ROWS)."""
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k_block, preferred_element_type=jnp.float32) * (qg.shape[-1] ** -0.5)
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def attend_blocks(qg: Array, k: Array, v: Array, valid: Array, sink: Array | None, softcap: float | None,
                  groups: int = 1) -> tuple[Array, Array]:
    """(fp32 out [B, kv, rows, D], lse [B, kv, rows]) of grouped queries qg [B, kv, rows, D] over keys
    k / v [B, kv, S, D] anchored at key 0 (`anchor_keys`), where `valid` [B, kv or 1, rows / groups, S]: with
    `groups` > 1 the rows are g-major (row = group * t + token) and `valid` holds one row per token; `sink`
    (broadcastable to [B, kv, rows]) fp32 attention sinks or None. A row without a valid key gets zeros (lse
    MASKED_SCORE). By the platform the program is lowered for: on GPU and TPU the Pallas kernels of
    models/invariant_attention.py, elsewhere `xla_attend_blocks`; each backend runs one of them on every
    path, so a token's bits agree between the trainer and the sampler."""
    from jaxrl_llm.models import invariant_attention

    def xla(q: Array, k: Array, v: Array, valid: Array, sink: Array | None, softcap: float | None, groups: int
            ) -> tuple[Array, Array]:
        return xla_attend_blocks(q, k, v, jnp.tile(valid, (1, 1, groups, 1)) if groups > 1 else valid, sink, softcap)

    def branch(fn: Callable[..., tuple[Array, Array]]) -> Callable[..., tuple[Array, Array]]:
        return lambda q, k, v, valid, *sink: fn(q, k, v, valid, sink[0] if sink else None, softcap, groups)

    interpreted = interpreted_kernel()
    default = xla if interpreted is None else functools.partial(
        getattr(invariant_attention, f"{interpreted}_attention"), interpret=True)

    def kernels(*operands: Array) -> tuple[Array, Array]:
        return lax.platform_dependent(*operands, cuda=branch(invariant_attention.triton_attention),
                                      tpu=branch(invariant_attention.mosaic_attention), default=branch(default))

    if sink is not None:  # one value per (batch row, kv head, row), split as the queries are
        sink = jnp.broadcast_to(sink.astype(jnp.float32), qg.shape[:3])
    return _per_device(kernels, qg, k, v, valid, sink)


def _per_device(fn: Callable[..., tuple[Array, Array]], qg: Array, k: Array, v: Array, valid: Array,
                sink: Array | None) -> tuple[Array, Array]:
    """fn(qg, k, v, valid[, sink]) on each device's batch rows (and kv heads, on a `tensor` split that divides
    them), under shard_map over the mesh axes not already manual: XLA cannot partition a Pallas kernel. The
    batch is padded with rows of no valid key to a multiple of the batch ways."""
    mesh = jax.sharding.get_abstract_mesh()
    # the axes not already manual (inside a context split's shard_map every axis is); a Mosaic call must see
    # every axis manual, those of size 1 too
    free = {} if mesh.empty else {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                                         mesh.axis_types)
                                  if kind != jax.sharding.AxisType.Manual}
    operands = (qg, k, v, valid) + (() if sink is None else (sink,))
    if not free:
        return fn(*operands)
    batch = tuple(a for a in BATCH_AXES if free.get(a, 1) > 1)
    heads = "tensor" if free.get("tensor", 1) > 1 and qg.shape[1] % free["tensor"] == 0 else None
    ways = math.prod(free[a] for a in batch)
    b = qg.shape[0]
    padded = -(-b // ways) * ways
    if padded != b:
        operands = tuple(_pad_axis(x, 0, padded, False if x.dtype == jnp.bool_ else 0) for x in operands)
    row_spec = batch or None
    q_spec = P(row_spec, heads, None, None)
    valid_spec = P(row_spec, heads if valid.shape[1] > 1 else None, None, None)
    in_specs = (q_spec, q_spec, q_spec, valid_spec) + (() if sink is None else (P(row_spec, heads, None),))
    run = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(q_spec, P(row_spec, heads, None)),
                        axis_names=frozenset(free), check_vma=False)
    out, lse = run(*operands)
    return out[:b], lse[:b]


def xla_attend_blocks(qg: Array, k: Array, v: Array, valid: Array, sink: Array | None, softcap: float | None
                      ) -> tuple[Array, Array]:
    """`attend_blocks` in XLA ops (CPU, and any backend without a kernel): S padded to whole KEY_BLOCKs and
    the rows to at least MIN_ROWS, a two-pass softmax (module doc)."""
    b, nkv, rows, hd = qg.shape
    # at least two blocks: XLA inlines a loop of one trip, and the body then fuses with its surroundings
    # into other kernels (measured: another p.v sum order on CPU)
    blocks = max(2, -(-k.shape[2] // KEY_BLOCK))
    keys = blocks * KEY_BLOCK
    k, v = _pad_axis(k, 2, keys), _pad_axis(v, 2, keys)
    valid = _pad_axis(valid, 3, keys, False)
    padded_rows = max(rows, MIN_ROWS)
    qg = _pad_axis(qg, 2, padded_rows)
    valid = _pad_axis(valid, 2, padded_rows, False)

    k_blocks = jnp.moveaxis(k.reshape(b, nkv, blocks, KEY_BLOCK, hd), 2, 0)  # [blocks, B, kv, KB, D]
    v_blocks = jnp.moveaxis(v.reshape(b, nkv, blocks, KEY_BLOCK, hd), 2, 0)
    valid_blocks = jnp.moveaxis(valid.reshape(*valid.shape[:3], blocks, KEY_BLOCK), 3, 0)
    scores = lax.map(lambda kb: _block_scores(qg, kb, softcap), k_blocks)  # [blocks, B, kv, R, KB]
    scores = jnp.where(valid_blocks, scores, MASKED_SCORE)
    peak = jnp.max(scores, axis=(0, 4))  # exact in any order
    if sink is not None:
        peak = jnp.maximum(peak, _pad_axis(jnp.broadcast_to(sink, (b, nkv, rows)), 2, padded_rows))

    def add_block(carry, xs):
        total, acc = carry
        block_scores, block_valid, v_block = xs
        p = jnp.where(block_valid, jnp.exp(block_scores - peak[..., None]), 0.0)
        return (total + tree_sum(p), acc + probs_times_values("bkqs,bksd->bkqd", p, v_block)), None

    init = (jnp.zeros(peak.shape, jnp.float32), jnp.zeros((b, nkv, padded_rows, hd), jnp.float32))
    (total, acc), _ = lax.scan(add_block, init, (scores, valid_blocks, v_blocks))
    if sink is not None:
        total = total + jnp.exp(_pad_axis(jnp.broadcast_to(sink, (b, nkv, rows)), 2, padded_rows) - peak)
    seen = total > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, peak + jnp.log(jnp.where(seen, total, 1.0)), MASKED_SCORE)
    return out[:, :, :rows], lse[:, :, :rows]


# ---- log-probs ----

def vocab_chunks(w: Array, vocab_major: bool) -> tuple[Array, int]:
    """([chunks, H, VOCAB_CHUNK] the unembedding in the chunks both sides multiply by (zero columns past V),
    V). `w` is [H, V] or, `vocab_major`, [V, H]."""
    w = w.T if vocab_major else w
    hidden, vocab = w.shape
    chunks = _vocab_chunk_count(vocab)
    w = _pad_axis(w, 1, chunks * VOCAB_CHUNK)
    return jnp.moveaxis(w.reshape(hidden, chunks, VOCAB_CHUNK), 1, 0), vocab


def _vocab_chunk_count(vocab: int) -> int:
    return max(2, -(-vocab // VOCAB_CHUNK))  # at least two: a scan of one trip is inlined (`attend_blocks`)


def masked_chunk(z: Array, index: Array | int, vocab: int) -> Array:
    ids = index * VOCAB_CHUNK + jnp.arange(VOCAB_CHUNK, dtype=jnp.int32)
    return jnp.where(ids[None, :] < vocab, z, -jnp.inf)


def lse_update(m: Array, s: Array, z: Array) -> tuple[Array, Array, Array]:
    """The running (max, sum of exp(z - max)) of rows merged with one chunk of logits z [N, C], and the
    chunk's exp(z - new max)."""
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    e = jnp.exp(z - m_new[:, None])
    return m_new, s * jnp.exp(m - m_new) + tree_sum(e), e


def chunked_logits(h: Array, w: Array) -> Array:
    """fp32 [N, V] logits h [N, H] @ w [H, V], one `matmul` per VOCAB_CHUNK columns (the trainer's chunks)."""
    w_chunks, vocab = vocab_chunks(w, vocab_major=False)
    parts = [matmul(h, w_chunks[i]) for i in range(w_chunks.shape[0])]
    return jnp.concatenate(parts, axis=-1)[:, :vocab]


def vocab_scan(chunk_at: Callable[[Array], Array], rows: int, vocab: int, targets: Array, temperature: Array,
               with_entropy: bool = False) -> tuple[Array, Array, Array]:
    """(lse, target logit, E_p[z] or zeros) [rows] of logits at `temperature`, VOCAB_CHUNK ids at a time in
    vocabulary order: the one loop both the trainer's fused log-prob (losses/logprob_xla.invariant_stats)
    and the sampler (`token_log_prob`) run. `chunk_at(i)`: chunk i's fp32 logits [rows, VOCAB_CHUNK]
    (soft-capped, temperature 1; ids past `vocab` are masked here). `temperature` is divided, not multiplied
    by its reciprocal, and must be a traced value on both sides: XLA may turn a division by a constant into a
    product, and a product can be contracted with a neighbouring add into an FMA in one program and not in
    another (seen on CPU: 1 ulp)."""
    def step(state, index):
        m, s, a, tgt = state
        z = masked_chunk(chunk_at(index) / temperature, index, vocab)
        m_new, s_new, e = lse_update(m, s, z)
        if with_entropy:
            a = a * jnp.exp(m - m_new) + tree_sum(e * jnp.where(jnp.isfinite(z), z, 0.0))
        hit = (index * VOCAB_CHUNK + jnp.arange(VOCAB_CHUNK, dtype=jnp.int32))[None, :] == targets[:, None]
        tgt = tgt + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)  # one nonzero term: exact in any order
        return (m_new, s_new, a, tgt), None

    zeros = jnp.zeros((rows,), jnp.float32)
    init = (jnp.full((rows,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    (m, s, a, tgt), _ = lax.scan(step, init, jnp.arange(_vocab_chunk_count(vocab), dtype=jnp.int32))
    return m + jnp.log(s), tgt, (a / s if with_entropy else zeros)


def token_log_prob(logits: Array, tokens: Array, temperature: Array) -> Array:
    """The sampler's log-prob of `tokens` [N] under `logits` [N, V] (fp32, soft-capped, temperature 1) at the
    traced `temperature`, with the trainer's batch-invariant numbers (`vocab_scan`)."""
    rows, vocab = logits.shape
    padded = _pad_axis(logits.astype(jnp.float32), 1, _vocab_chunk_count(vocab) * VOCAB_CHUNK)

    def chunk_at(index: Array) -> Array:
        return lax.dynamic_slice_in_dim(padded, index * VOCAB_CHUNK, VOCAB_CHUNK, axis=1)

    lse, target, _ = vocab_scan(chunk_at, rows, vocab, tokens, temperature)
    return target - lse
