"""Fused token log-probs / entropy / full KL from hidden states, never holding [B, T, V] logits.

`token_logprobs` streams the vocabulary in chunks with an online logsumexp; its custom VJP
recomputes each chunk's logits in the backward pass, so peak memory is O(tokens x chunk) instead
of O(tokens x vocab). The forward statistics come from a Pallas kernel on TPU (Mosaic) and, when
asked for, GPU (Triton) (`logprob_pallas.py`), and from the chunked-XLA scan otherwise
(`logprob_xla.py`); the backward is the chunked-XLA recompute on every backend. `impl="auto"`
picks by the platform the program is lowered for (`lax.platform_dependent`), not by the host's
default backend, so a program compiled here for a TPU topology (platform/target.py says so while
it is built) gets the Mosaic kernel; GPU programs, a vocabulary no kernel block divides, and a
program for this CPU host take the XLA path (on an H200 it was faster than the Triton kernel). All paths equal
`log_softmax(hidden @ W / temperature)` and its gradients. This module is the public API: it
checks the inputs, picks the backend and wires the custom VJPs.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_llm.losses.logprob_xla import (
    KLLayout,
    Layout,
    Stats,
    invariant_stats,
    kl_backward,
    kl_stats,
    vocab_size,
    xla_backward,
    xla_stats,
)
from jaxrl_llm.models import invariant
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sharding.mesh import BATCH_AXES, context_parallel_size
from jaxrl_llm.sharding.rules import with_activation_constraint

Array = jax.Array
DEFAULT_CHUNK = 2048
ROW_BLOCK = 256  # rows per block of `rows_in_use` skipping
# auto: the lowering platform's kernel where it serves the vocabulary, else XLA; pallas: the platform's
# kernel (CPU: the Triton kernel in interpret mode, for tests); or one backend by name
IMPLS = ("auto", "xla", "pallas", "pallas_triton", "pallas_mosaic")


def _resolve_vocab_major(hidden_size: int, unembed: Array, vocab_major: bool | None) -> bool:
    if unembed.ndim != 2:
        raise ValueError(f"unembed must be 2-D [H, V] or [V, H], got shape {unembed.shape}")
    if vocab_major is not None:
        expect = unembed.shape[1] if vocab_major else unembed.shape[0]
        if expect != hidden_size:
            raise ValueError(f"unembed {unembed.shape} does not match hidden size {hidden_size} "
                             f"with vocab_major={vocab_major}")
        return vocab_major
    rows_h, cols_h = unembed.shape[0] == hidden_size, unembed.shape[1] == hidden_size
    if rows_h and cols_h:
        raise ValueError(f"unembed {unembed.shape} is square: pass vocab_major=True ([V, H]) or False ([H, V])")
    if not (rows_h or cols_h):
        raise ValueError(f"unembed {unembed.shape} has no axis of hidden size {hidden_size}")
    return cols_h


class Backend(NamedTuple):
    """How the forward statistics run (hashable: a non-differentiable argument)."""

    impl: str  # IMPLS
    interpret: bool  # a named kernel in interpret mode
    mesh: Mesh | None  # the program's mesh: a kernel runs per shard of the rows under shard_map


def _kernel_stats(h, w, targets, lay: Layout, impl: str, interpret: bool) -> Stats:
    from jaxrl_llm.losses import logprob_pallas  # imported on first use: Pallas is only needed on GPU/TPU

    if impl in logprob_pallas.KINDS:
        return logprob_pallas.pallas_stats(h, w, targets, lay, kind=impl, interpret=interpret)
    kernels = impl == "pallas" or logprob_pallas.supports(vocab_size(w, lay.vocab_major))

    def xla(h, w, t):
        return tuple(xla_stats(h, w, t, lay))

    def kernel(kind: str, interpret: bool = False):
        if not kernels:
            return xla
        # a shape the kernel does not serve (Triton: a hidden size no piece divides) is its XLA fallback
        return lambda h, w, t: tuple(logprob_pallas.pallas_stats(h, w, t, lay, kind=kind, interpret=interpret))

    # the branch of the platform being lowered for (one platform: the others are not lowered). On GPU
    # `auto` is the XLA path: on an H200 the Triton kernel's value and gradient took 1.1-1.2x the XLA
    # path's time in bf16 and 3-4x in fp32 (bench/device_check.py, docs/performance-history.md); "pallas" forces it
    default = kernel("pallas_triton", interpret=True) if impl == "pallas" else xla
    cuda = kernel("pallas_triton") if impl == "pallas" else xla
    return Stats(*jax.lax.platform_dependent(h, w, targets, cuda=cuda, tpu=kernel("pallas_mosaic"), default=default))


def _row_axes(mesh: Mesh, rows: int) -> tuple[str, ...] | None:
    """The mesh's batch axes the rows are split over inside shard_map (None: they do not divide)."""
    axes = tuple(a for a in BATCH_AXES if dict(mesh.shape).get(a, 1) > 1)
    ways = math.prod(dict(mesh.shape)[a] for a in axes)
    return axes if rows % ways == 0 else None


def _stats(h, w, targets, lay: Layout, be: Backend) -> Stats:
    # a program for this CPU host has no kernel to choose: the XLA path alone (no platform switch, no
    # per-shard wrapper in every CPU program)
    if invariant.enabled():  # batch-invariant numerics: the same chunks and sums as the sampler's log-probs
        return invariant_stats(h, w, targets, lay)
    if be.impl == "xla" or (be.impl == "auto" and target_platform() == "cpu"):
        return xla_stats(h, w, targets, lay)
    if be.mesh is None or be.mesh.size == 1:
        return _kernel_stats(h, w, targets, lay, be.impl, be.interpret)
    # XLA cannot partition a kernel's custom call: each device runs it on its own rows, with the
    # whole unembedding (gathered when it is sharded; the backward stays in auto-partitioned XLA)
    axes = _row_axes(be.mesh, h.shape[0])
    if axes is None:
        return xla_stats(h, w, targets, lay)
    rows = P(axes or None)
    per_shard = jax.shard_map(lambda h, w, t: tuple(_kernel_stats(h, w, t, lay, be.impl, be.interpret)),
                              mesh=be.mesh, in_specs=(P(axes or None, None), P(None, None), rows),
                              out_specs=(rows, rows, rows), check_vma=False)
    return Stats(*per_shard(h, w, targets))


def _blocks(n: int, live: Array | None) -> list[slice] | None:
    """Row slices of the live-block flags `live` [n / block] (None: one pass over all rows)."""
    if live is None:
        return None
    size = n // live.shape[0]
    return [slice(b * size, (b + 1) * size) for b in range(live.shape[0])]


def _blocked_stats(h, w, targets, live, lay: Layout, be: Backend) -> Stats:
    """`_stats`, run only on the row blocks that `live` marks (zeros elsewhere: log-prob 0)."""
    blocks = _blocks(h.shape[0], live)
    if blocks is None:
        return _stats(h, w, targets, lay, be)
    run = lambda hb, tb: _stats(hb, w, tb, lay, be)  # noqa: E731
    skip = lambda hb, tb: Stats(*(jnp.zeros(tb.shape, jnp.float32),) * 3)  # noqa: E731
    parts = [jax.lax.cond(live[i], run, skip, h[rows], targets[rows]) for i, rows in enumerate(blocks)]
    return Stats(*(jnp.concatenate(field) for field in zip(*parts)))


def _fused_primal(h, w, targets, live, lay: Layout, be: Backend) -> tuple[Array, Array]:
    st = _blocked_stats(h, w, targets, live, lay, be)
    return st.target_logit - st.lse, st.lse - st.mean_logit


def _fused_fwd(h, w, targets, live, lay, be):
    st = _blocked_stats(h, w, targets, live, lay, be)
    return (st.target_logit - st.lse, st.lse - st.mean_logit), (h, w, targets, live, st)


def _fused_bwd(lay, be, res, cotangents):
    h, w, targets, live, st = res
    g_lp, g_ent = cotangents
    blocks = _blocks(h.shape[0], live)
    if blocks is None:
        dh, dw = xla_backward(h, w, targets, st, g_lp, g_ent, lay)
        return dh, dw, None, None
    # skipped blocks add nothing; live ones add into one fp32 dW (no per-block copy of it)
    dw, dh = jnp.zeros(w.shape, jnp.float32), []
    for i, rows in enumerate(blocks):
        def run(dw, rows=rows):
            return xla_backward(h[rows], w, targets[rows], Stats(*(x[rows] for x in st)), g_lp[rows], g_ent[rows],
                                lay, dw_into=dw)
        dh_i, dw = jax.lax.cond(live[i], run, lambda dw, rows=rows: (jnp.zeros(h[rows].shape, h.dtype), dw), dw)
        dh.append(dh_i)
    return jnp.concatenate(dh), dw.astype(w.dtype), None, None


_fused = jax.custom_vjp(_fused_primal, nondiff_argnums=(4, 5))
_fused.defvjp(_fused_fwd, _fused_bwd)


def token_logprobs(hidden: Array, unembed: Array, targets: Array, *, temperature: float = 1.0,
                   return_entropy: bool = False, chunk_size: int | None = None,
                   vocab_major: bool | None = None, impl: str = "auto", interpret: bool = False,
                   rows_in_use: Array | None = None, row_block: int | None = None, mesh: Mesh | None = None,
                   softcap: float | None = None):
    """log p(target) under `softmax(hidden @ W / temperature)` (and the entropy), fp32 `[B, T]`.
    `softcap`: the logits are `cap * tanh(hidden @ W / cap)` before the temperature (Gemma 2's
    final_logit_softcapping), forward and backward.

    `unembed` is `[H, V]` or `[V, H]` (tied embeddings), told apart by shape or `vocab_major`.
    Differentiable w.r.t. `hidden` and `unembed` (entropy too, for an entropy bonus).
    `impl`: "auto" (Mosaic on TPU, for the platform the program is lowered for, where a kernel vocab
    block divides V; chunked XLA otherwise, GPU included: it measured faster than the Triton kernel
    on an H200), "pallas" (the platform's kernel; on CPU the Triton kernel interpreted), "xla", or
    a kernel by name ("pallas_triton", "pallas_mosaic"); `interpret=True` runs a named kernel in
    interpret mode (CPU tests).
    `rows_in_use` [B, T] bool: the tokens whose results are read. The flattened rows then run in
    blocks of `row_block` (default ROW_BLOCK), and a block with none in use is skipped in both directions (its
    log-probs and entropy are 0): a caller with a fixed capacity of rows filled from the front
    (packed response slots) pays for the rows it fills, not for the capacity. On a multi-device
    CPU `mesh` every block runs: a skipped block is a `lax.cond` whose branch holds the collectives
    that gather the head's weight shards, and XLA:CPU's devices, which run independent thunks
    concurrently, met different collectives there and deadlocked (fsdp 8, packed multi-turn rows
    with routing replay); GPU and TPU programs keep the skip.
    `mesh`: the mesh of the program (a multi-device program runs a kernel per shard of the rows:
    XLA cannot partition its custom call); None for a single-device program.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if impl not in IMPLS:
        raise ValueError(f"Unknown token_logprobs impl {impl!r}; valid names: {list(IMPLS)}")
    hidden_size = hidden.shape[-1]
    vm = _resolve_vocab_major(hidden_size, unembed, vocab_major)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {targets.shape} must match hidden {hidden.shape} without the last axis")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    lay = Layout(float(temperature), int(chunk_size or DEFAULT_CHUNK), vm, bool(return_entropy),
                 None if softcap is None else float(softcap))
    lead = hidden.shape[:-1]
    live, n = None, math.prod(lead)
    if rows_in_use is not None and (mesh is None or mesh.size == 1 or target_platform() != "cpu"):
        if rows_in_use.shape != lead:
            raise ValueError(f"rows_in_use {rows_in_use.shape} must match hidden {hidden.shape} without the last axis")
        block = row_block or ROW_BLOCK
        if n > block and n % block == 0:
            live = jnp.any(rows_in_use.reshape(-1, block), axis=1)
    rows, row_targets = hidden.reshape(-1, hidden_size), targets.reshape(-1).astype(jnp.int32)
    if context_parallel_size() > 1:  # the flattened rows lost the token split (models/decoder.py): restore it
        rows = with_activation_constraint(rows, ("tokens", None))
        row_targets = with_activation_constraint(row_targets, ("tokens",))
    lp, ent = _fused(rows, unembed, row_targets, live, lay, Backend(impl, interpret, mesh))
    lp = lp.reshape(lead)
    return (lp, ent.reshape(lead)) if return_entropy else lp


# ---------------------------------------------------------------- full KL between two heads


def _kl_fused_primal(hp, wp, hr, wr, lay: KLLayout) -> Array:
    return kl_stats(hp, wp, hr, wr, lay)[0]


def _kl_fwd(hp, wp, hr, wr, lay):
    kl, lse_p, lse_q, mean_diff = kl_stats(hp, wp, hr, wr, lay)
    return kl, (hp, wp, hr, wr, lse_p, lse_q, mean_diff)


def _kl_bwd(lay, res, g):
    hp, wp, hr, wr, lse_p, lse_q, mean_diff = res
    return kl_backward(hp, wp, hr, wr, lse_p, lse_q, mean_diff, g, lay)


_kl_fused = jax.custom_vjp(_kl_fused_primal, nondiff_argnums=(4,))
_kl_fused.defvjp(_kl_fwd, _kl_bwd)


def token_kl_full(h_policy: Array, w_policy: Array, h_ref: Array, w_ref: Array, *, temperature: float = 1.0,
                  chunk_size: int | None = None, policy_vocab_major: bool | None = None,
                  ref_vocab_major: bool | None = None, softcap: float | None = None) -> Array:
    """Exact per-token KL(pi || ref) over the vocabulary, `[B, T]`, streamed over vocab chunks
    (`softcap`: both heads' logits soft-capped, as `token_logprobs`).

    Differentiable w.r.t. all four inputs (stop-gradient the reference side at the call site).
    """
    hs = h_policy.shape[-1]
    pvm = _resolve_vocab_major(hs, w_policy, policy_vocab_major)
    rvm = _resolve_vocab_major(h_ref.shape[-1], w_ref, ref_vocab_major)
    if vocab_size(w_policy, pvm) != vocab_size(w_ref, rvm):
        raise ValueError(f"policy and reference vocab sizes differ: {w_policy.shape} vs {w_ref.shape}")
    if h_policy.shape[:-1] != h_ref.shape[:-1]:
        raise ValueError(f"h_policy {h_policy.shape} and h_ref {h_ref.shape} must share [B, T]")
    lay = KLLayout(float(temperature), int(chunk_size or DEFAULT_CHUNK), pvm, rvm,
                   None if softcap is None else float(softcap))
    lead = h_policy.shape[:-1]
    kl = _kl_fused(h_policy.reshape(-1, hs), w_policy, h_ref.reshape(-1, h_ref.shape[-1]), w_ref, lay)
    return kl.reshape(lead)
