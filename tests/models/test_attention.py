"""The attention core (models/attention.py): its hand-written backward and causal query chunks give
the numbers of plain softmax attention differentiated by JAX, on packed rows with padding."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import attention

B, T, NH, NKV, D = 2, 300, 4, 2, 8  # T > CAUSAL_CHUNK: the causal path runs in chunks


def _reference(q, k, v, allowed):
    """Plain grouped-query softmax attention (keys repeated per query head), fp32 [B, T, heads, D]."""
    g = q.shape[2] // k.shape[1]
    k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)  # [B, heads, S, D]
    scores = jnp.einsum("bthd,bhsd->bhts", q, k) * q.shape[-1] ** -0.5
    scores = jnp.where(allowed[:, None], scores, -1e30)
    return jnp.einsum("bhts,bhsd->bthd", jax.nn.softmax(scores, axis=-1), v)


def _packed_case(seed=0):
    """Two rows: row 0 holds three sequences then padding, row 1 left padding then one sequence."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    seg[0, :90], seg[0, 90:200], seg[0, 200:270] = 1, 2, 3
    seg[1, 40:] = 1
    causal = np.tril(np.ones((T, T), bool))
    allowed = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    q = rng.standard_normal((B, T, NH, D)).astype(np.float32)
    k = rng.standard_normal((B, NKV, T, D)).astype(np.float32)
    v = rng.standard_normal((B, NKV, T, D)).astype(np.float32)
    w = rng.standard_normal((B, T, NH, D)).astype(np.float32)
    # the loss reads real query rows only (a padding row's output is never consumed)
    w *= (seg > 0)[:, :, None, None]
    return [jnp.asarray(x) for x in (q, k, v, allowed, w)], seg


def test_chunk_bounds_cover_the_rows_in_order():
    assert attention.chunk_bounds(300) == [(0, 128), (128, 256), (256, 300)]
    assert attention.chunk_bounds(128) == [(0, 128)]
    bounds = attention.chunk_bounds(4096)  # long rows: at most MAX_CHUNKS chunks
    assert len(bounds) == attention.MAX_CHUNKS and bounds[-1][1] == 4096
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("causal", [True, False])
def test_attend_and_its_gradients_equal_plain_attention(causal):
    (q, k, v, allowed, w), seg = _packed_case()

    def ours(q, k, v):
        out = attention.attend(q, k, v, allowed, NKV, causal=causal).reshape(B, T, NH, D)
        return jnp.sum(out * w), out

    def plain(q, k, v):
        out = _reference(q, k, v, allowed)
        return jnp.sum(out * w), out

    (loss, out), grads = jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (ref_loss, ref_out), ref_grads = jax.value_and_grad(plain, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    real = seg > 0
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref_out)[real], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert float(jnp.abs(r).max()) > 1e-2, name  # a real gradient
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4, err_msg=name)
    assert np.isfinite(np.asarray(out)).all()  # left-padding rows (no visible key) stay finite


def test_causal_chunks_change_nothing_for_real_rows_in_bf16():
    """The chunked and the single-chunk forward agree bit for bit on every real query row in bf16
    (masked keys add exact zeros), and so do their gradients up to fp32 summation order."""
    (q, k, v, allowed, w), seg = _packed_case(1)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))

    def run(causal):
        def loss(q, k, v):
            out = attention.attend(q, k, v, allowed, NKV, causal=causal).reshape(B, T, NH, D)
            return jnp.sum(out * w), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (_, chunked), g_chunked = run(True)
    (_, whole), g_whole = run(False)
    real = seg > 0
    np.testing.assert_array_equal(np.asarray(chunked)[real], np.asarray(whole)[real])
    for a, b in zip(g_chunked, g_whole):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2, rtol=2e-2)


def test_bf16_matmul_backward_runs_on_the_rounded_cotangent():
    """models/numerics.py `matmul_f32`: a 2-D bf16 matmul's backward rounds the fp32 output
    cotangent to bf16 once and runs dx = g @ w^T, dw = x^T @ g as bf16 x bf16 matmuls with fp32
    accumulation (mixed-precision training's usual gradient), exactly; and stays within bf16
    rounding of the fp32 gradient."""
    from jaxrl_llm.models.numerics import matmul_f32

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 24)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(24, 40)), jnp.bfloat16)
    c = jnp.asarray(rng.normal(size=(64, 40)), jnp.float32)
    out, vjp = jax.vjp(matmul_f32, x, w)
    assert out.dtype == jnp.float32
    dx, dw = vjp(c)
    g = c.astype(jnp.bfloat16).astype(jnp.float32)
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    np.testing.assert_allclose(np.asarray(dx, np.float32),
                               np.asarray(jnp.dot(g, w32.T, precision=hi).astype(jnp.bfloat16), np.float32),
                               rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw, np.float32),
                               np.asarray(jnp.dot(x32.T, g, precision=hi).astype(jnp.bfloat16), np.float32),
                               rtol=2 ** -7, atol=1e-6)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    # against the fp32 gradient of the same function: bf16 rounding of the cotangent and result only
    fdx, fdw = jax.grad(lambda a, b: jnp.sum(jnp.dot(a, b, precision=hi) * c), argnums=(0, 1))(x32, w32)
    for got, want in ((dx, fdx), (dw, fdw)):
        err = np.abs(np.asarray(got, np.float32) - np.asarray(want)).max() / np.abs(np.asarray(want)).max()
        assert 0 < err < 2e-2
    # rows and tokens kept apart ([B, T, K] x [K, F]): the same numbers as the flattened matmul
    out3, vjp3 = jax.vjp(matmul_f32, x.reshape(4, 16, 24), w)
    dx3, dw3 = vjp3(c.reshape(4, 16, 40))
    for got, want in ((out3.reshape(out.shape), out), (dx3.reshape(dx.shape), dx), (dw3, dw)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # fp32 operands keep JAX's own gradient
    d32 = jax.grad(lambda a: jnp.sum(matmul_f32(a, w32) * c))(x32)
    np.testing.assert_allclose(np.asarray(d32), np.asarray(jnp.dot(c, w32.T, precision=hi)), rtol=1e-5, atol=1e-5)
