"""The batch-invariant attention's Pallas kernels (models/invariant_attention.py): Triton and Mosaic, run by Pallas's
interpreters here (the device's own order: docs/performance.md). Their values are softmax attention's; a row's bits
do not depend on the cache size, the other rows, or which key blocks without a valid key the walk skips; and the
real compilers take them (Mosaic for a v5e chip, Triton IR for CUDA)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import invariant, invariant_attention, invariant_paged_attention
from jaxrl_llm.models.precision import MASKED_SCORE
from jaxrl_llm.platform import export_for_cuda, kernel_calls, tpu_target
from jaxrl_llm.platform.tpu import libtpu_installed

KERNELS = {"triton": invariant_attention.triton_attention, "mosaic": invariant_attention.mosaic_attention}


def _run(kernel: str, sink=None, softcap=None, groups=1):
    fn = functools.partial(KERNELS[kernel], sink=sink, softcap=softcap, groups=groups, interpret=True)
    return jax.jit(lambda q, k, v, valid: fn(q, k, v, valid))


def _normal(key, shape, dtype):
    return jax.random.normal(jax.random.key(key), shape).astype(dtype)


def _softmax_attention(q, k, v, valid, sink, softcap):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("bkqd,bksd->bkqs", q, k, precision="highest") / np.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(valid, s, -jnp.inf)
    if sink is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sink, s.shape[:3])[..., None]], axis=-1)
        v = jnp.concatenate([v, jnp.zeros_like(v[:, :, :1])], axis=2)
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bkqs,bksd->bkqd", jnp.exp(s - lse[..., None]), v, precision="highest")
    return out, lse


@pytest.mark.parametrize("kernel", ["triton", "mosaic"])
@pytest.mark.parametrize("dtype,head_dim,per_kv,sinks", [(jnp.bfloat16, 16, False, False),
                                                          (jnp.float32, 40, True, True)])
def test_kernels_compute_softmax_attention(kernel, dtype, head_dim, per_kv, sinks):
    """bf16 and fp32; a head width that is not a power of 2 (Triton reads it in pieces of 32 and 16, the last
    zero-padded); a mask per kv head; GPT-OSS's sinks with Gemma 2's soft cap; a row without a valid key (zeros,
    lse MASKED_SCORE)."""
    b, nkv, rows, keys = 3, 2, 5, 150
    q, k, v = (_normal(i, shape, dtype) for i, shape in enumerate(
        [(b, nkv, rows, head_dim), (b, nkv, keys, head_dim), (b, nkv, keys, head_dim)]))
    lengths = jnp.array([[5, 140], [70, 0], [150, 33]])[:, :nkv if per_kv else 1]  # batch 1, kv 1: nothing valid
    valid = jnp.arange(keys)[None, None, None, :] < lengths[:, :, None, None]
    valid = jnp.broadcast_to(valid, (b, valid.shape[1], rows, keys))
    sink = jnp.linspace(-1.0, 1.0, nkv * rows).reshape(1, nkv, rows) if sinks else None
    softcap = 5.0 if sinks else None
    out, lse = _run(kernel, sink, softcap)(q, k, v, valid)
    assert out.shape == (b, nkv, rows, head_dim) and lse.shape == (b, nkv, rows) and out.dtype == jnp.float32
    want_out, want_lse = _softmax_attention(q, k, v, valid, sink, softcap)
    seen = np.asarray(jnp.any(valid, axis=-1) | sinks)
    seen = np.broadcast_to(seen, lse.shape)
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(want_out)[seen], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], rtol=2e-5, atol=2e-5)
    assert (np.asarray(out)[~seen] == 0).all() and (np.asarray(lse)[~seen] == MASKED_SCORE).all()
    if not per_kv:  # one example of the blocked XLA form's values (its rounding is its own)
        xla_out, _ = invariant.xla_attend_blocks(q, k, v, valid, None, None)
        np.testing.assert_allclose(np.asarray(out), np.asarray(xla_out), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kernel", ["triton", "mosaic"])
def test_a_rows_bits_do_not_depend_on_the_call(kernel):
    """A causal training forward of 300 tokens (3 query heads a kv head, rows g-major; its mask one row per token,
    each group's rows padded to whole tiles) against: the same forward with the mask repeated per row (rows packed
    across groups), one token's decode step over a 700-key cache (its rows alone, the cache's empty slots
    masked), and a prefill of a few of the tokens among other rows. `==`: the kernel's blocks are the same shapes
    in every call, and the blocks it skips (past a row's last key, before a window) would add exact zeros."""
    b, nkv, g, t, d = 2, 2, 3, 300, 32
    q = _normal(0, (b, nkv, g, t, d), jnp.bfloat16)
    k, v = _normal(1, (b, nkv, t, d), jnp.bfloat16), _normal(2, (b, nkv, t, d), jnp.bfloat16)
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]  # [query, key]
    run = _run(kernel)
    valid = jnp.broadcast_to(jnp.tile(causal, (g, 1))[None, None], (b, 1, g * t, t))
    train_out, train_lse = _run(kernel, groups=g)(q.reshape(b, nkv, g * t, d), k, v,
                                                   jnp.broadcast_to(causal, (b, 1, t, t)))
    per_row = run(q.reshape(b, nkv, g * t, d), k, v, valid)
    for got, want in zip(per_row, (train_out, train_lse)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    train_out = np.asarray(train_out).reshape(b, nkv, g, t, d)
    train_lse = np.asarray(train_lse).reshape(b, nkv, g, t)

    cache = 700
    k_cache, v_cache = (jnp.pad(x, ((0, 0), (0, 0), (0, cache - t), (0, 0))) for x in (k, v))
    for token in (0, 63, 64, 200, 299):  # the first key, either side of a block edge, the last token
        row_valid = jnp.broadcast_to(jnp.arange(cache) <= token, (b, 1, g, cache))
        out, lse = run(q[:, :, :, token], k_cache, v_cache, row_valid)
        np.testing.assert_array_equal(np.asarray(out), train_out[:, :, :, token])
        np.testing.assert_array_equal(np.asarray(lse), train_lse[:, :, :, token])

    # a chunked prefill of tokens 130..149 whose rows share tiles with 40 other rows (a slot that is empty)
    chunk = slice(130, 150)
    rows = jnp.concatenate([q[:, :, :, chunk].reshape(b, nkv, g * 20, d), jnp.ones((b, nkv, 40, d), jnp.bfloat16)],
                           axis=2)
    chunk_valid = jnp.concatenate([jnp.tile(causal[chunk], (g, 1)), jnp.zeros((40, t), bool)])
    out, _ = run(rows, k, v, jnp.broadcast_to(chunk_valid[None, None], (b, 1, g * 20 + 40, t)))
    np.testing.assert_array_equal(np.asarray(out)[:, :, :g * 20].reshape(b, nkv, g, 20, d), train_out[:, :, :, chunk])

    # a sliding window of 100 keys: the walk starts past the blocks before it, the same bits as visiting them
    window = causal & (jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < 100)
    valid = jnp.broadcast_to(jnp.tile(window, (g, 1))[None, None], (b, 1, g * t, t))
    lo, hi = invariant_attention.visited_blocks(jnp.pad(valid, ((0, 0), (0, 0), (0, 124), (0, 84))), 64, 64)
    assert int(lo.max()) > 0 and int(hi.min()) < 6  # the late tiles start past block 0, the early end early
    windowed, _ = run(q.reshape(b, nkv, g * t, d), k, v, valid)
    token = 250
    out, _ = run(q[:, :, :, token], k_cache, v_cache,
                 jnp.broadcast_to((jnp.arange(cache) <= token) & (jnp.arange(cache) > token - 100), (b, 1, g, cache)))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(windowed).reshape(b, nkv, g, t, d)[:, :, :, token])


def test_visited_blocks_are_each_tiles_first_and_last_block_with_a_valid_key():
    valid = np.zeros((2, 1, 8, 16), bool)  # 2 tiles of 4 rows, 4 blocks of 4 keys
    valid[0, 0, 1, 5] = valid[0, 0, 2, 13] = True  # batch 0 tile 0: blocks 1..3
    valid[1, 0, 6, 0] = True  # batch 1 tile 1: block 0; batch 0 tile 1, batch 1 tile 0: nothing
    lo, hi = invariant_attention.visited_blocks(jnp.asarray(valid), 4, 4)
    assert lo.tolist() == [1, 0, 0, 0] and hi.tolist() == [4, 0, 0, 1]


@pytest.mark.skipif(not libtpu_installed(), reason="libtpu not installed (pip install '.[tpu-plan]')")
def test_the_kernels_compile_for_tpu_and_lower_for_cuda():
    """`attend_blocks` at a decode step's shapes (16 slots, 7 query heads a kv head, a 4096-key cache, sinks), a
    training forward's (7 x 512 rows, head width 128) and MLA's absorbed width (576): one Mosaic call each,
    compiled by the TPU compiler for a v5e chip, and one Triton call each in the CUDA lowering; and the paged form
    over an MLA pool lowered for CUDA."""
    from jax.sharding import SingleDeviceSharding

    device = tpu_target("v5e:2x2").devices[0]
    cases = {"decode": (16, 2, 7, 64, 4096, True), "train": (2, 2, 7 * 512, 128, 512, False),
             "mla": (2, 1, 16 * 64, 576, 1024, False)}  # MLA's absorbed width: Triton's pieces of 512 and 64
    for name, (b, nkv, rows, d, keys, sinks) in cases.items():
        shapes = [((b, nkv, rows, d), jnp.bfloat16), ((b, nkv, keys, d), jnp.bfloat16),
                  ((b, nkv, keys, d), jnp.bfloat16), ((b, 1, rows, keys), jnp.bool_)]
        shapes += [((1, nkv, rows), jnp.float32)] if sinks else []

        def fn(q, k, v, valid, *sink):
            return invariant.attend_blocks(q, k, v, valid, sink[0] if sink else None, None)

        on_tpu = [jax.ShapeDtypeStruct(s, dt, sharding=SingleDeviceSharding(device)) for s, dt in shapes]
        compiled = jax.jit(fn).lower(*on_tpu).compile()
        assert dict(kernel_calls(compiled.as_text(), "tpu")) == {"tpu_custom_call": 1}, name
        exported = export_for_cuda(jax.jit(fn), *[jax.ShapeDtypeStruct(s, dt) for s, dt in shapes])
        assert dict(kernel_calls(exported.mlir_module(), "cuda")) == {"__gpu$xla.gpu.triton": 1}, name
    # the paged form reads MLA's 576-wide pool in place on GPU: its pieces (512, 64) are blocks of the pool
    assert invariant_paged_attention.paged_supported("triton", 576, 576, 16)

    def paged(q, pool, lengths, table):
        return invariant_paged_attention.paged_attention(q, pool, pool, lengths, table, layer=jnp.int32(0), window=None,
                                                         sink=None, softcap=None, variant="triton")

    exported = export_for_cuda(jax.jit(paged), *[jax.ShapeDtypeStruct(s, dt) for s, dt in [
        ((16, 1, 16, 576), jnp.bfloat16), ((2, 1, 512, 16, 576), jnp.bfloat16), ((16,), jnp.int32),
        ((16, 64), jnp.int32)]])
    assert dict(kernel_calls(exported.mlir_module(), "cuda")) == {"__gpu$xla.gpu.triton": 1}


@pytest.mark.parametrize("variant,d", [("triton", 32), ("triton", 48), ("mosaic", 32)])
def test_the_paged_kernel_reads_pages_in_place_with_the_contiguous_kernels_bits(variant, d):
    """The paged engine's decode step (`paged_attention`: the slot's pages read from the pool in place, the mask made
    from its length) against the contiguous kernel on the same pages gathered in order with the mask `pos < length`:
    `==`, for slots of 0 (empty), 1, a block edge and a whole table of keys, a sliding window, sinks, and a stacked
    pool read at a layer (a TPU pool's lanes padded past the head width); on GPU a head width of two pieces (48 =
    32 + 16, `head_pieces`: each piece a block of the pool)."""
    layers, slots, nkv, g, page_size, per_slot = 2, 5, 2, 3, 16, 12
    pool_width = d if variant == "triton" else 128
    num_pages = slots * per_slot + 3
    k_pool, v_pool = (jnp.pad(_normal(i, (layers, nkv, num_pages, page_size, d), jnp.bfloat16),
                              ((0, 0),) * 4 + ((0, pool_width - d),)) for i in (1, 2))
    q = _normal(0, (slots, nkv, g, d), jnp.bfloat16)
    table = jax.random.permutation(jax.random.key(3), num_pages)[:slots * per_slot].reshape(slots, per_slot)
    lengths = jnp.array([0, 1, 64, 130, per_slot * page_size], jnp.int32)
    sink = jnp.linspace(-0.5, 0.5, nkv * g).reshape(nkv, g)
    layer = jnp.int32(1)
    contiguous = KERNELS[variant]
    for window, with_sink in ((None, False), (40, True)):
        got = jax.jit(lambda q, kp, vp: invariant_paged_attention.paged_attention(
            q, kp, vp, lengths, table, layer=layer, window=window, sink=sink if with_sink else None, softcap=None,
            variant=variant, interpret=True))(q, k_pool, v_pool)
        keys = [pool[1][:, table].transpose(1, 0, 2, 3, 4).reshape(slots, nkv, per_slot * page_size, pool_width)
                [..., :d] for pool in (k_pool, v_pool)]
        pos = jnp.arange(per_slot * page_size)[None, :]
        valid = pos < lengths[:, None]
        if window is not None:
            valid &= pos >= (lengths - window)[:, None]
        want, _ = jax.jit(lambda q, k, v, valid: contiguous(q, k, v, valid, sink[None] if with_sink else None, None,
                                                            interpret=True))(
            q, *keys, jnp.broadcast_to(valid[:, None, None], (slots, 1, g, per_slot * page_size)))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.abs(np.asarray(got)[1:]).max() > 0 and (np.asarray(got)[0] == 0).all()
