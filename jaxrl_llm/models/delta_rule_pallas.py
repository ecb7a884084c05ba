"""The gated delta rule's chunks as a Pallas kernel (TPU: Mosaic): `chunk_terms_pallas`, the numbers of
models/delta_rule.py `chunk_terms` (the parallel part of the chunked form: per chunk the decay matrix, the WY
system, its inverse by block doubling, the corrected values, the keys that read the incoming state and the causal
decayed q k^T), one grid step per (chunk, row, head), everything of a chunk kept in the core's memory between
the ~20 C x C matmuls instead of written out and read back between XLA's fusions. The state's pass from chunk to
chunk stays XLA's `lax.scan` (models/delta_rule.py).

fp32 throughout, matmuls at HIGHEST precision (the inverse cannot afford bf16-rounded operands). The backward is
`chunk_terms`' own (a custom VJP recomputing the chunk in XLA): the kernel serves the forward passes (scoring,
prefill, the update's forward); the gradient costs what it did. Used where `delta_rule_impl` says (a TPU, chunks
of a power of two from 8 on); elsewhere XLA's fusions serve as well. Tests run it interpreted on the CPU against
`chunk_terms` (tests/models/test_delta_rule.py) and compile it for v5e (tests/platform/test_platform_compile.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from jaxrl_llm.models.delta_rule import chunk_terms
from jaxrl_llm.sharding.mesh import row_split_axes

Array = jax.Array
_HIGHEST = lax.Precision.HIGHEST


def _mm(a: Array, b: Array, transpose_b: bool = False) -> Array:
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, beta_ref, cum_col_ref, cum_row_ref, began_col_ref, began_row_ref,
            values_ref, keys_ref, intra_ref) -> None:
    q, k, v = q_ref[0], k_ref[0], v_ref[0]  # [C, Dk], [C, Dk], [C, Dv]
    beta, cum_col, began_col = beta_ref[0], cum_col_ref[0], began_col_ref[0]  # [C, 1]
    cum_row, began_row = cum_row_ref[0], began_row_ref[0]  # [1, C]
    c = q.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    decay = jnp.exp(jnp.where((j <= i) & (began_col == began_row), cum_col - cum_row, -jnp.inf))
    k_beta = k * beta
    system = jnp.where(j < i, _mm(k_beta, k, transpose_b=True) * decay, 0.0)
    inverse = jnp.where(i == j, 1.0, 0.0).astype(jnp.float32)  # block doubling (delta_rule.unit_lower_inverse)
    shift = 0
    while (1 << shift) < c:  # blocks of m = 2^shift (shifts, not // and %: Mosaic lowers those via sign)
        bi, bj = lax.shift_right_logical(i, shift), lax.shift_right_logical(j, shift)
        lower_left = (bi == bj + 1) & ((bj & 1) == 0)
        inverse = inverse - _mm(_mm(inverse, jnp.where(lower_left, system, 0.0)), inverse)
        shift += 1
    seen = jnp.where(began_col == 0, jnp.exp(cum_col), 0.0)
    values_ref[0] = _mm(inverse, v * beta)
    keys_ref[0] = _mm(inverse, k_beta * seen)
    intra_ref[0] = _mm(q, k, transpose_b=True) * decay


def _pallas_terms(q: Array, k: Array, v: Array, beta: Array, cum: Array, began: Array, interpret: bool
                  ) -> tuple[Array, Array, Array]:
    lead, (c, dk), dv = q.shape[:-2], q.shape[-2:], v.shape[-1]
    flat = lambda x: x.reshape(-1, *x.shape[len(lead):]).astype(jnp.float32)  # noqa: E731
    q, k, v = flat(q), flat(k), flat(v)
    beta, cum, began = flat(beta), flat(cum), flat(began)  # [G, C]
    g = q.shape[0]

    def block(*shape: int) -> pl.BlockSpec:
        return pl.BlockSpec((1, *shape), lambda n: (n,) + (0,) * len(shape))

    values, keys, intra = pl.pallas_call(
        _kernel, grid=(g,),
        in_specs=[block(c, dk), block(c, dk), block(c, dv), block(c, 1), block(c, 1), block(1, c), block(c, 1),
                  block(1, c)],
        out_specs=[block(c, dv), block(c, dk), block(c, c)],
        out_shape=[jax.ShapeDtypeStruct((g, c, dv), jnp.float32), jax.ShapeDtypeStruct((g, c, dk), jnp.float32),
                   jax.ShapeDtypeStruct((g, c, c), jnp.float32)],
        interpret=interpret,
    )(q, k, v, beta[..., None], cum[..., None], cum[:, None, :], began[..., None], began[:, None, :])
    return values.reshape(*lead, c, dv), keys.reshape(*lead, c, dk), intra.reshape(*lead, c, c)


def _per_device_terms(q: Array, k: Array, v: Array, beta: Array, cum: Array, began: Array, interpret: bool
                      ) -> tuple[Array, Array, Array]:
    """`_pallas_terms` on each device's rows: a Mosaic kernel is not partitioned automatically, so on a mesh the
    call runs under `shard_map` with the rows (axis 1 of the [chunks, rows, heads, C, ...] layout) split over the
    batch axes where they divide, the rest whole on each device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _pallas_terms(q, k, v, beta, cum, began, interpret)
    rows = row_split_axes(dict(mesh.shape), q.shape[1])

    def spec(ndim: int) -> PartitionSpec:
        return PartitionSpec(None, rows, *([None] * (ndim - 2)))

    args = (q, k, v, beta, cum, began)
    run = jax.shard_map(functools.partial(_pallas_terms, interpret=interpret), mesh=mesh,
                        in_specs=tuple(spec(x.ndim) for x in args), out_specs=(spec(q.ndim),) * 3,  # [..., C, X]
                        check_vma=False)
    return run(*args)


def chunk_terms_pallas(q: Array, k: Array, v: Array, beta: Array, cum: Array, began: Array,
                       interpret: bool = False) -> tuple[Array, Array, Array]:
    """`chunk_terms` (models/delta_rule.py) computed by the kernel; same arguments ([chunks, rows, heads, C, ...]
    as `chunked_delta_rule` lays them out) and results."""
    return _kernel_terms(q, k, v, beta, cum, began, interpret)


def _forward(q: Array, k: Array, v: Array, beta: Array, cum: Array, began: Array, interpret: bool
             ) -> tuple[tuple[Array, Array, Array], tuple[Array, ...]]:
    return _per_device_terms(q, k, v, beta, cum, began, interpret), (q, k, v, beta, cum, began)


def _backward(interpret: bool, saved: tuple[Array, ...], grads: tuple[Array, Array, Array]) -> tuple:
    del interpret
    _, vjp = jax.vjp(chunk_terms, *saved)
    return vjp(grads)


_kernel_terms = jax.custom_vjp(_per_device_terms, nondiff_argnums=(6,))
_kernel_terms.defvjp(_forward, _backward)


def delta_rule_impl(platform: str, chunk: int) -> str:
    """"pallas" where the kernel serves (a TPU; chunks a power of two from 8 on), else "xla"."""
    return "pallas" if platform == "tpu" and chunk >= 8 and chunk & (chunk - 1) == 0 else "xla"
