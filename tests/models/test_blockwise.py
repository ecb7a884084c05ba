"""models/blockwise.py: the flash-attention recurrence in XLA (query chunks x key blocks, one pair at a
time, only the pairs the mask lets see anything). It equals the trainer's chunked attention
(models/attention.py) in values and gradients on packed rows with shared-prompt branches, sliding
windows and soft-capping; the decoder runs it for rows of BLOCKWISE_MIN_TOKENS or more with the same
log-probs and gradients; and it holds a fraction of the chunked attention's temporaries."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, blockwise, init_params
from jaxrl_llm.models.attention import attend
from jaxrl_llm.roles.forward import response_log_probs


def packed_mask(b, t, window=None, pad=0):
    """[B, T, T] causal mask: three segments in row 0, a prompt with two branches in row 1, `pad`
    padding tokens (fully masked query rows) at the end of row 0."""
    segments = np.zeros((b, t), int)
    segments[0, t // 3:], segments[0, t // 2 + 5:] = 1, 2
    branches = np.zeros((b, t), int)
    branches[-1, t // 4: t // 2], branches[-1, t // 2:] = 1, 2
    valid = np.ones((b, t), bool)
    if pad:
        valid[0, t - pad:] = False
    idx = np.arange(t)
    allowed = idx[:, None] >= idx[None, :]
    if window is not None:
        allowed &= idx[:, None] - idx[None, :] < window
    allowed = allowed[None] & (segments[:, :, None] == segments[:, None, :]) & valid[:, None, :]
    allowed &= (branches[:, None, :] == 0) | (branches[:, :, None] == branches[:, None, :])
    return allowed, valid


@pytest.mark.parametrize("window,softcap", [(None, None), (200, 30.0)])
def test_blockwise_equals_the_chunked_attention(window, softcap):
    b, t, nh, nkv, d = 2, 1024, 4, 2, 8
    rng = np.random.default_rng(0)
    q, w = (jnp.asarray(rng.normal(size=(b, t, nh, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(b, nkv, t, d)), jnp.float32) for _ in range(2))
    allowed, valid = packed_mask(b, t, window, pad=40)
    allowed = jnp.asarray(allowed)
    read = jnp.asarray(valid)[:, :, None, None]  # padding rows' outputs are read by nothing

    def chunked(q, k, v):
        return jnp.sum(jnp.where(read, attend(q, k, v, allowed, nkv, causal=True, softcap=softcap).reshape(q.shape)
                                 * w, 0.0))

    def flash(q, k, v):
        out = blockwise.causal_blockwise_attend(q, k, v, allowed, None, nkv, softcap)  # no attention sinks
        return jnp.sum(jnp.where(read, out * w, 0.0))

    assert blockwise.chunk_rows(t) == 128  # 8 chunks of queries, 8 blocks of keys
    want, want_grads = jax.value_and_grad(chunked, argnums=(0, 1, 2))(q, k, v)
    got, grads = jax.jit(jax.value_and_grad(flash, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for g, wg in zip(grads, want_grads):
        np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-5)


def test_the_decoder_runs_long_rows_blockwise(monkeypatch):
    """Response log-probs and parameter gradients of a tiny model, 2 x 512 tokens, with the blockwise
    pass switched on from 256 tokens, equal the chunked pass's; and a 4096-token row's compiled value and
    gradient holds under a third of the chunked pass's temporaries."""
    cfg = ModelConfig.tiny("llama", vocab_size=128, max_position_embeddings=4096)
    params = init_params(cfg, jax.random.key(0))

    def run(ids, min_tokens, compile_only=False):
        monkeypatch.setattr(blockwise, "BLOCKWISE_MIN_TOKENS", min_tokens)
        mask = jnp.ones(ids.shape, jnp.int32).at[0, -7:].set(0)  # right padding on row 0

        def loss(params):
            return jnp.sum(response_log_probs(params, cfg, ids, mask, ids.shape[1] // 2) * mask[:, ids.shape[1] // 2:])

        fn = jax.jit(jax.value_and_grad(loss))
        if compile_only:
            return fn.lower(params).compile().memory_analysis().temp_size_in_bytes
        return fn(params)

    ids = jnp.asarray(np.random.default_rng(0).integers(3, 128, size=(2, 512)), jnp.int32)
    (want, want_grads), (got, grads) = run(ids, 1 << 30), run(ids, 256)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), grads, want_grads)
    long_ids = jnp.asarray(np.random.default_rng(1).integers(3, 128, size=(1, 4096)), jnp.int32)
    assert run(long_ids, 4096, compile_only=True) < run(long_ids, 1 << 30, compile_only=True) / 3
