import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.losses.logprob import token_kl_full, token_logprobs

TOL = dict(atol=1e-5, rtol=1e-5)
B, T, H, V = 2, 9, 16, 640  # V is a multiple of 128 so the Pallas kernels run (not the fallback)


def inputs(seed=0, vocab=V):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = jax.random.normal(k[0], (B, T, H))
    w = jax.random.normal(k[1], (H, vocab)) * 0.7
    t = jax.random.randint(k[2], (B, T), 0, vocab)
    return h, w, t, k[3]


def naive(h, w, t, temp):
    logp = jax.nn.log_softmax(jnp.einsum("bth,hv->btv", h, w) / temp, -1)
    return jnp.take_along_axis(logp, t[..., None], -1)[..., 0], -jnp.sum(jnp.exp(logp) * logp, -1)


def objective(lp, ent, c):
    # a weighted sum touching both outputs, so both cotangents are exercised
    return jnp.sum(lp * c) + 0.37 * jnp.sum(ent * c[::-1])


@pytest.mark.parametrize("impl", ["auto", "xla", "pallas", "pallas_triton", "pallas_mosaic"])
@pytest.mark.parametrize("vocab_major", [False, True])
def test_values_match_naive(impl, vocab_major):
    h, w, t, _ = inputs()
    lp0, ent0 = naive(h, w, t, 0.7)
    ww = w.T if vocab_major else w
    lp, ent = token_logprobs(h, ww, t, temperature=0.7, return_entropy=True, chunk_size=256, impl=impl,
                             interpret=True)
    np.testing.assert_allclose(lp, lp0, **TOL)
    np.testing.assert_allclose(ent, ent0, **TOL)
    lp_only = token_logprobs(h, ww, t, temperature=0.7, impl=impl, interpret=True)
    np.testing.assert_allclose(lp_only, lp0, **TOL)


# 200: full chunks plus a remainder chunk; 4096 > V: one chunk
@pytest.mark.parametrize("chunk,vocab_major", [(128, False), (200, True), (4096, False)])
def test_grads_match_naive(chunk, vocab_major):
    h, w, t, k = inputs(1)
    c = jax.random.normal(k, (B, T))
    ww = w.T if vocab_major else w

    def fused(h, w):
        return objective(*token_logprobs(h, w, t, temperature=0.7, return_entropy=True, chunk_size=chunk), c)

    def ref(h, w):
        return objective(*naive(h, w.T if vocab_major else w, t, 0.7), c)

    v1, g1 = jax.jit(jax.value_and_grad(fused, (0, 1)))(h, ww)
    v0, g0 = jax.value_and_grad(ref, (0, 1))(h, ww)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_rows_in_use_skips_blocks_and_keeps_values_and_grads(vocab_major):
    """Rows in blocks of 3 (B * T = 18 -> 6 blocks); blocks 2 and 5 hold no row in use: they give
    0 (the dense value is not 0) and no gradient; every row in use equals the dense result, value
    and gradient (the objective reads only rows in use, as a packed caller does)."""
    h, w, t, k = inputs(3)
    in_use = np.ones((B, T), bool)
    flat = in_use.reshape(-1)
    flat[6:9] = False
    flat[15:18] = False
    flat[4] = False  # a row not in use inside a live block: computed, not read
    in_use = jnp.asarray(in_use)
    c = jax.random.normal(k, (B, T)) * in_use
    ww = w.T if vocab_major else w

    def fused(h, w):
        return token_logprobs(h, w, t, temperature=0.7, return_entropy=True, chunk_size=200,
                              rows_in_use=in_use, row_block=3)

    lp, ent = jax.jit(fused)(h, ww)
    lp0, ent0 = naive(h, w, t, 0.7)
    skipped = np.zeros(B * T, bool)
    skipped[6:9] = skipped[15:18] = True
    np.testing.assert_array_equal(np.asarray(lp).reshape(-1)[skipped], 0.0)
    assert np.all(np.asarray(lp0).reshape(-1)[skipped] != 0)
    np.testing.assert_allclose(np.asarray(lp).reshape(-1)[~skipped], np.asarray(lp0).reshape(-1)[~skipped], **TOL)
    np.testing.assert_allclose(np.asarray(ent).reshape(-1)[~skipped], np.asarray(ent0).reshape(-1)[~skipped], **TOL)
    g1 = jax.jit(jax.grad(lambda h, w: objective(*fused(h, w), c), (0, 1)))(h, ww)
    g0 = jax.grad(lambda h, w: objective(*naive(h, w.T if vocab_major else w, t, 0.7), c), (0, 1))(h, ww)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, **TOL)
    with pytest.raises(ValueError, match="rows_in_use"):
        token_logprobs(h, ww, t, rows_in_use=in_use[:, :4])


def test_pallas_forward_then_xla_backward_grads():
    h, w, t, k = inputs(2)
    c = jax.random.normal(k, (B, T))
    f = lambda h, w: objective(*token_logprobs(h, w, t, return_entropy=True, impl="pallas_mosaic",  # noqa: E731
                                               interpret=True), c)
    g1 = jax.grad(f, (0, 1))(h, w)
    g0 = jax.grad(lambda h, w: objective(*naive(h, w, t, 1.0), c), (0, 1))(h, w)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, **TOL)


def test_bf16_inputs_and_shape_errors():
    h, w, t, _ = inputs(3)
    lp = token_logprobs(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), t)
    assert lp.dtype == jnp.float32
    lp0, _ = naive(h.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32), t, 1.0)
    np.testing.assert_allclose(lp, lp0, atol=1e-4, rtol=1e-4)
    g = jax.grad(lambda x: token_logprobs(x, w.astype(jnp.bfloat16), t).sum())(h.astype(jnp.bfloat16))
    assert g.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="square"):
        token_logprobs(h, jnp.zeros((H, H)), t)
    with pytest.raises(ValueError, match="no axis of hidden size"):
        token_logprobs(h, jnp.zeros((5, 7)), t)
    with pytest.raises(ValueError, match="valid names"):
        token_logprobs(h, w, t, impl="cuda")


def test_sharded_tokens():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    k = jax.random.split(jax.random.PRNGKey(4), 3)
    h = jax.random.normal(k[0], (8, 3, H))
    w = jax.random.normal(k[1], (H, V))
    t = jax.random.randint(k[2], (8, 3), 0, V)
    hs = jax.device_put(h, NamedSharding(mesh, P("data")))
    ts = jax.device_put(t, NamedSharding(mesh, P("data")))
    f = jax.jit(jax.value_and_grad(lambda h, w: token_logprobs(h, w, ts, chunk_size=256).sum(), (0, 1)))
    v, g = f(hs, w)
    v0, g0 = jax.value_and_grad(lambda h, w: naive(h, w, t, 1.0)[0].sum(), (0, 1))(h, w)
    np.testing.assert_allclose(v, v0, rtol=1e-5)
    for a, b in zip(g, g0):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


def test_token_kl_full_values_and_grads():
    h, w, _, k = inputs(5)
    k1, k2 = jax.random.split(k)
    hr = h + 0.3 * jax.random.normal(k1, h.shape)
    wr = (w + 0.2 * jax.random.normal(k2, w.shape)).T  # reference head in the other layout

    def ref(hp, wp, hr, wr):
        lp = jax.nn.log_softmax(hp @ wp / 0.8, -1)
        lq = jax.nn.log_softmax(hr @ wr.T / 0.8, -1)
        return jnp.sum(jnp.exp(lp) * (lp - lq), -1)

    kl = token_kl_full(h, w, hr, wr, temperature=0.8, chunk_size=200)
    np.testing.assert_allclose(kl, ref(h, w, hr, wr), **TOL)
    assert float(jnp.min(kl)) >= 0
    g1 = jax.grad(lambda *a: token_kl_full(*a, temperature=0.8, chunk_size=200).sum(), (0, 1, 2, 3))(h, w, hr, wr)
    g0 = jax.grad(lambda *a: ref(*a).sum(), (0, 1, 2, 3))(h, w, hr, wr)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_allclose(token_kl_full(h, w, h, w), 0.0, atol=1e-5)


def test_never_materialises_full_logits():
    """The compiled value+grad holds no [N, V] fp32 buffer: temp memory well under one such array."""
    n, hid, vocab = 512, 32, 8192
    h = jnp.zeros((n, hid))
    w = jnp.zeros((hid, vocab))
    t = jnp.zeros((n,), jnp.int32)
    f = jax.value_and_grad(lambda h, w: token_logprobs(h, w, t, chunk_size=512, return_entropy=True)[0].sum(), (0, 1))
    mem = jax.jit(f).lower(h, w).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 0.25 * n * vocab * 4


def test_backends_import_public_names_only():
    """logprob.py dispatches; logprob_xla.py and logprob_pallas.py import no private name (no cycle); the
    XLA path takes only the model's logit cap from below (models/numerics.py, shared with the decoder)."""
    import ast
    import pathlib

    import jaxrl_llm.losses as losses

    root = pathlib.Path(losses.__file__).parent
    imported = {}
    for module in ("logprob", "logprob_xla", "logprob_pallas"):
        tree = ast.parse((root / f"{module}.py").read_text())
        imported[module] = [(node.module, alias.name) for node in ast.walk(tree)
                            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrl_llm")
                            for alias in node.names]
    for module, names in imported.items():
        assert all(not name.startswith("_") for _, name in names), (module, names)
    # and the batch-invariant numerics the sampler shares (models/invariant.py)
    assert sorted(imported["logprob_xla"]) == [("jaxrl_llm.models", "invariant"),
                                               ("jaxrl_llm.models.numerics", "cap_logits")]
    assert {m for m, _ in imported["logprob_pallas"]} == {"jaxrl_llm.losses.logprob_xla"}


@pytest.mark.parametrize("hidden,dtype", [(96, jnp.float32), (384, jnp.bfloat16)])
def test_triton_kernel_sums_hidden_pieces_in_its_inner_loop(hidden, dtype):
    # 96 fp32 = 3 pieces of 32, 384 bf16 = 3 pieces of 128: the inner loop's partial logits add up
    from jaxrl_llm.losses import logprob_pallas

    assert hidden // logprob_pallas.hidden_piece(hidden, jnp.dtype(dtype).itemsize) == 3
    k = jax.random.split(jax.random.PRNGKey(5), 3)
    h = jax.random.normal(k[0], (B * T, hidden)).astype(dtype)
    w = (jax.random.normal(k[1], (hidden, V)) / np.sqrt(hidden)).astype(dtype)
    t = jax.random.randint(k[2], (B * T,), 0, V)
    lp_k, ent_k = token_logprobs(h, w, t, return_entropy=True, impl="pallas_triton", interpret=True)
    lp_x, ent_x = token_logprobs(h, w, t, return_entropy=True, impl="xla")
    np.testing.assert_allclose(lp_k, lp_x, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(ent_k, ent_x, atol=1e-4, rtol=1e-5)


def test_triton_kernel_tiles_stay_inside_gpu_shared_memory_at_any_hidden_size():
    # An H200 refused the kernel that held all of a row block's hidden pieces: "Shared memory size
    # limit exceeded: requested 819200, available: 232448" at H = 896. Its pipelined tiles are now
    # a [64, piece] and a [piece, 128] slice per stage, whatever H is.
    from jaxrl_llm.losses import logprob_pallas as lp

    shared_memory = 232448  # H100 / H200, per block
    for hidden in (576, 896, 1536, 2048, 3584, 4096, 5120, 8192):
        for itemsize in (2, 4):
            piece = lp.hidden_piece(hidden, itemsize)
            assert piece >= lp.TRITON_MIN_PIECE and hidden % piece == 0, (hidden, itemsize)
            stage = (lp.TOKEN_BLOCK * piece + piece * lp.TRITON_VOCAB_BLOCK) * itemsize
            assert lp.TRITON_STAGES * stage <= shared_memory, (hidden, itemsize)
    # no power-of-two divisor of 16 or more: the Triton kernel does not serve (the XLA path does)
    assert not lp.supports(640, 24, 4, "pallas_triton") and lp.supports(640, 24, 4, "pallas_mosaic")
