"""Batch-invariant numerics (models/invariant.py): each building block gives a row the same bits whatever
the other rows, and the values (and gradients) of the plain formulation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import sharding
from jaxrl_llm.losses.logprob_xla import Layout, invariant_stats, xla_stats
from jaxrl_llm.models import invariant, invariant_gemm, numerics
from jaxrl_llm.models.attention import attend, attend_invariant
from jaxrl_llm.platform.tpu import libtpu_installed


def _bf16(key, shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key), shape)).astype(jnp.bfloat16)


def test_tree_sum_is_a_sum_whose_rows_do_not_depend_on_the_others():
    x = jax.random.normal(jax.random.key(0), (37, 576))
    got = np.asarray(jax.jit(invariant.tree_sum)(x))
    np.testing.assert_allclose(got, np.asarray(x, np.float64).sum(-1), rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 8):
        np.testing.assert_array_equal(np.asarray(jax.jit(invariant.tree_sum)(x[:rows])), got[:rows])
    # along another axis, and a length that is a power of two already
    y = jax.random.normal(jax.random.key(1), (64, 5))
    np.testing.assert_allclose(np.asarray(invariant.tree_sum(y, axis=0)), np.asarray(y).sum(0), rtol=1e-5, atol=1e-5)


def test_matmul_rows_do_not_depend_on_the_row_count_and_gradients_are_the_plain_ones():
    x, w = _bf16(0, (70, 576)), _bf16(1, (576, 320), 0.05)
    mm = jax.jit(invariant.matmul)
    full = np.asarray(mm(x, w))
    plain = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(full, plain, rtol=1e-5, atol=1e-5)
    for rows in (1, 3, 8, 17):  # a one-token decode step, a few slots, a prefill
        np.testing.assert_array_equal(np.asarray(mm(x[:rows], w)), full[:rows])
    np.testing.assert_array_equal(np.asarray(mm(x[5:40], w)), full[5:40])  # another place among the rows
    # leading axes are rows too
    np.testing.assert_array_equal(np.asarray(mm(x.reshape(7, 10, 576), w)).reshape(70, -1), full)

    def loss(fn, x, w):
        return jnp.sum(jnp.sin(fn(x, w)))

    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)  # fp32: the backward's own rounding out of the way
    got = jax.grad(lambda x, w: loss(numerics.invariant_matmul, x, w), argnums=(0, 1))(x32, w32)
    want = jax.grad(lambda x, w: loss(lambda a, b: jnp.dot(a, b, precision="highest"), x, w), argnums=(0, 1))(x32, w32)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [{"fsdp": 4, "tensor": 2}, {"tensor": 8}, {"fsdp": 2, "context": 2, "tensor": 2}],
                         ids=["fsdp4_tensor2", "tensor8", "fsdp2_context2_tensor2"])
def test_a_split_matmul_computes_its_own_rows_and_columns_with_one_devices_bits(shape):
    """On a mesh each device computes its rows (a context split's tokens too) and, on a `tensor` split, its shard
    of the output columns over the whole contraction (the weight's columns stay split, the rows are gathered over
    `tensor`): one device's bits, no device holds the whole weight, the output split as the work was."""
    x, w = _bf16(0, (4, 18, 576)), _bf16(1, (576, 320), 0.05)
    one = np.asarray(jax.jit(invariant.matmul)(x, w))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1, **shape})
    with sharding.mesh_context(mesh):
        rows = NamedSharding(mesh, P("fsdp", "context", None))  # a training pass's activations
        placed = jax.device_put(x, rows), jax.device_put(w, NamedSharding(mesh, P("fsdp", "tensor")))
        mm = jax.jit(invariant.matmul)
        out = mm(*placed)
        text = mm.lower(*placed).compile().as_text()
    np.testing.assert_array_equal(np.asarray(out), one)
    assert out.sharding.spec[-1] == "tensor", out.sharding
    assert "bf16[576,320]" not in text  # the whole weight on a device: its column shard is [576, 320 / tensor]
    if "context" in shape:  # each device scores its own tokens: [4 / fsdp, 18 / context] rows, none gathered
        assert tuple(out.sharding.spec[:2]) == ("fsdp", "context") and "bf16[2,18,576]" not in text
    if shape == {"tensor": 8}:
        assert "all-gather" not in text and "all-to-all" not in text  # nothing moves


@pytest.mark.parametrize("shape", [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}], ids=["fsdp8", "fsdp4_tensor2"])
def test_within_weight_columns_each_device_computes_its_columns_for_every_row(shape):
    """The batch-invariant decode's split (`invariant.weight_columns`: engine/decode_layout.py `column_spec`): a
    weight split by its output columns over every axis stays where it is, each device runs every row against its
    columns (the rows are gathered), the output split as the weight is; one device's bits. A weight whose columns
    do not divide takes the rows' split (and is held whole)."""
    x, w, w_odd = _bf16(0, (8, 4, 576)), _bf16(1, (576, 320), 0.05), _bf16(2, (576, 324), 0.05)
    one, one_odd = np.asarray(jax.jit(invariant.matmul)(x, w)), np.asarray(jax.jit(invariant.matmul)(x, w_odd))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1, **shape})
    axes = tuple(a for a in ("tensor", "fsdp") if a in shape)
    columns = NamedSharding(mesh, P(None, axes))
    with sharding.mesh_context(mesh), invariant.weight_columns(axes):
        placed = jax.device_put(x, NamedSharding(mesh, P("fsdp"))), jax.device_put(w, columns)
        mm = jax.jit(invariant.matmul)
        out = mm(*placed)
        text = mm.lower(*placed).compile().as_text()
        assert invariant.column_split(320) == axes and invariant.column_split(321) == ()
        odd = jax.jit(invariant.matmul)(placed[0], w_odd)  # 324 columns: the rows' split
    np.testing.assert_array_equal(np.asarray(out), one)
    np.testing.assert_array_equal(np.asarray(odd), one_odd)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, axes)), 3)
    assert "bf16[576,320]" not in text and "bf16[576,40]" in text  # a device's columns only: 320 / 8


def test_the_gemm_kernels_give_a_column_its_bits_whatever_the_columns_beside_it():
    """A vocabulary shard's columns (the decode's split by columns) start anywhere and end anywhere: the Mosaic
    GEMM runs every column in a 128-wide block (the last one past the matrix's edge), the Triton GEMM in 64-wide
    ones (padded), so a column's sum runs as it does in the trainer's 4096-wide chunk; rows likewise in blocks
    of 128 or 256."""
    x, w = _bf16(0, (40, 192), 1.0), _bf16(1, (192, 4096), 0.05)
    full = [np.asarray(got) for got in invariant_gemm.gemm_for_tests(x, w)]
    for start, stop in ((0, 4096), (1000, 3374), (3000, 3100), (4033, 4096)):
        for got, whole in zip(invariant_gemm.gemm_for_tests(x, w[:, start:stop]), full):
            np.testing.assert_array_equal(np.asarray(got), whole[:, start:stop])
    tall = _bf16(2, (300, 192), 1.0)  # 300 rows: blocks of 256 rows on TPU
    gemms = invariant_gemm.gemm_for_tests
    for got, rows in zip(gemms(tall, w[:, :256]), gemms(tall[:40], w[:, :256])):
        np.testing.assert_array_equal(np.asarray(got)[:40], np.asarray(rows))


@pytest.mark.skipif(not libtpu_installed(), reason="libtpu not installed (pip install '.[tpu-plan]')")
def test_the_tpu_gemm_compiles_at_a_vocabulary_shards_width_with_its_costs():
    """The Mosaic GEMM at the 0.5B head's shard on 8 chips (896 x 18,992: no multiple of 128, the last block past
    the edge) compiles for a v5e chip, and XLA's cost analysis reports the kernel's FLOPs (its cost estimate: the
    plans' FLOPs of the mode's matmuls, which a custom call would otherwise not have)."""
    from jax.sharding import SingleDeviceSharding

    from jaxrl_llm.platform import tpu_target

    device = tpu_target("v5e:2x2").devices[0]
    on_tpu = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=SingleDeviceSharding(device)) for s in ((256, 896),
                                                                                                   (896, 18992))]
    compiled = jax.jit(invariant_gemm._mosaic_gemm).lower(*on_tpu).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    assert analysis["flops"] == pytest.approx(2 * 256 * 896 * 18992, rel=0.01)  # 149 blocks of 128 columns
    assert '"cost_estimate":{' in compiled.as_text()


def test_gpu_and_tpu_gemm_kernels_compute_the_product():
    """The Triton and Mosaic GEMMs (interpreted here; their order on a device: docs/performance.md), with
    sizes no block divides (padded), fp32 and bf16 operands."""
    for x, w in ((_bf16(0, (70, 576)), _bf16(1, (576, 320), 0.05)),
                 (jax.random.normal(jax.random.key(2), (9, 40)), jax.random.normal(jax.random.key(3), (40, 24)))):
        want = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
        for got in invariant_gemm.gemm_for_tests(x, w):
            assert got.shape == want.shape and got.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def _keys_case(length: int):
    b, nkv, rows, hd = 3, 2, 3, 16
    q = _bf16(0, (b, nkv, rows, hd))
    k, v = _bf16(1, (b, nkv, length, hd)), _bf16(2, (b, nkv, length, hd))
    valid = jnp.arange(length)[None, :] < jnp.array([5, 60, 97])[:, None]
    return q, k, v, jnp.broadcast_to(valid[:, None, None, :], (b, 1, rows, length))


def test_attention_blocks_do_not_depend_on_the_cache_size_and_equal_softmax_attention():
    q, k, v, valid = _keys_case(100)
    run = jax.jit(lambda q, k, v, valid: invariant.attend_blocks(q, k, v, valid, None, None))
    out, lse = run(q, k, v, valid)
    for size in (128, 300, 700):  # the cache's empty slots add exact zeros, in one block or many
        pad = size - 100
        padded = [jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (k, v)]
        got = run(q, *padded, jnp.pad(valid, ((0, 0), (0, 0), (0, 0), (0, pad))))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(lse))
    s = jnp.einsum("bkqd,bksd->bkqs", q.astype(jnp.float32), k.astype(jnp.float32)) / 4.0
    s = jnp.where(valid, s, -jnp.inf)
    want = jnp.einsum("bkqs,bksd->bkqd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jax.nn.logsumexp(s, axis=-1)), rtol=1e-5, atol=1e-5)


def test_invariant_attention_follows_the_row_not_its_padding_and_keeps_attends_gradient():
    b, t, nh, nkv, hd = 2, 20, 4, 2, 16
    q, k, v = _bf16(0, (b, t, nh, hd)), _bf16(1, (b, nkv, t, hd)), _bf16(2, (b, nkv, t, hd))
    mask = jnp.arange(t)[None, :] >= jnp.array([0, 7])[:, None]  # row 1: 7 slots of left padding
    allowed = (jnp.arange(t)[None, :, None] >= jnp.arange(t)[None, None, :]) & mask[:, None, :]
    start = jnp.argmax(mask, axis=1).astype(jnp.int32)
    out = attend_invariant(q, k, v, allowed, start, nkv, causal=True).reshape(b, t, nh, hd)
    want = attend(q, k, v, allowed, nkv, causal=True).reshape(b, t, nh, hd)
    np.testing.assert_allclose(np.asarray(out)[1, 7:], np.asarray(want)[1, 7:], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(out)[0], np.asarray(want)[0], rtol=2e-5, atol=2e-5)
    # row 1 without its padding: the same bits
    alone = attend_invariant(q[1:, 7:], k[1:, :, 7:], v[1:, :, 7:], allowed[1:, 7:, 7:], jnp.zeros((1,), jnp.int32),
                             nkv, causal=True).reshape(1, t - 7, nh, hd)
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(out)[1, 7:])

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(mask[:, :, None, None], jnp.cos(fn(q, k, v).reshape(b, t, nh, hd)), 0))

    exact = loss(lambda q, k, v: attend_invariant(q, k, v, allowed, start, nkv, causal=True))
    got = jax.grad(exact, (0, 1, 2))(q, k, v)
    ref = jax.grad(loss(lambda q, k, v: attend(q, k, v, allowed, nkv, causal=True)), (0, 1, 2))(q, k, v)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_the_samplers_log_prob_is_the_trainers_bit_for_bit(vocab_major):
    """The sampler's `token_log_prob` (logits by `chunked_logits`, a traced temperature) and the trainer's
    `invariant_stats` (a constant temperature, soft-capped logits, two vocabulary chunks, the second partial)."""
    h = _bf16(0, (11, 64))
    w = _bf16(1, (64, 5000), 0.3)
    unembed = w.T if vocab_major else w
    targets = jnp.arange(11) * 431
    lay = Layout(temperature=0.7, chunk=2048, vocab_major=vocab_major, with_entropy=True, softcap=30.0)
    stats = jax.jit(invariant_stats, static_argnums=3)(h, unembed, targets, lay)

    @jax.jit
    def sampler(h, w, temperature):  # what logits_from_hidden and choose_tokens do
        return invariant.token_log_prob(30.0 * jnp.tanh(invariant.chunked_logits(h, w) / 30.0), targets, temperature)

    np.testing.assert_array_equal(np.asarray(sampler(h, w, jnp.float32(0.7))),
                                  np.asarray(stats.target_logit - stats.lse))
    plain = xla_stats(h, unembed, targets, lay)  # and the values of the plain chunked-XLA statistics
    for got, want in zip(stats, plain):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
