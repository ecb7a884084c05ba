"""Pure-JAX model tests: KV-cache decode == full forward, remat/bf16, heads, logical axes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import (
    ModelConfig,
    init_cache,
    init_params,
    last_valid_index,
    param_logical_axes,
    score_from_hidden,
    value_from_hidden,
)
from jaxrl_llm.models import compute_logits as _compute_logits
from jaxrl_llm.models import forward_hidden as _forward_hidden

compute_logits = jax.jit(_compute_logits, static_argnums=1, static_argnames=("compute_dtype", "remat"))
forward_hidden = jax.jit(_forward_hidden, static_argnums=1, static_argnames=("compute_dtype",))
LOGICAL = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "layers", None}


def _left_padded(rng, vocab, lengths):
    t = max(lengths)
    ids = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), np.int32)
    for row, n in enumerate(lengths):
        ids[row, t - n:] = rng.integers(0, vocab, n)
        mask[row, t - n:] = 1
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_kv_cache_decode_matches_full_forward_left_padded(family):
    overrides = {"sliding_window": 5} if family == "mistral" else {}
    cfg = ModelConfig.tiny(family, **overrides)
    params = init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(0)
    prompt, pmask = _left_padded(rng, cfg.vocab_size, (6, 4, 2))
    steps = 4
    new = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, steps)), jnp.int32)
    full_ids = jnp.concatenate([prompt, new], axis=1)
    full_mask = jnp.concatenate([pmask, jnp.ones_like(new)], axis=1)
    expected = np.asarray(compute_logits(params, cfg, full_ids, full_mask))

    step = jax.jit(lambda p, i, m, c: _compute_logits(p, cfg, i, m, cache=c))
    cache = init_cache(cfg, batch=3, max_len=prompt.shape[1] + steps + 2)
    logits, cache = step(params, prompt, pmask, cache)
    got = [np.asarray(logits)]
    for s in range(steps):
        logits, cache = step(params, new[:, s:s + 1], jnp.ones((3, 1), jnp.int32), cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    valid = np.asarray(full_mask).astype(bool)
    assert int(cache["index"]) == full_ids.shape[1]
    assert np.abs(got[valid] - expected[valid]).max() <= 1e-4


def test_remat_and_bf16_compute():
    cfg = ModelConfig.tiny("llama")
    params = init_params(cfg, jax.random.key(0))
    ids, mask = _left_padded(np.random.default_rng(1), cfg.vocab_size, (7, 3))
    ref = np.asarray(compute_logits(params, cfg, ids, mask))

    def loss(p, remat):
        logits = compute_logits(p, cfg, ids, mask, remat=remat)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g0, g1 = grad(params, False), grad(params, True)
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), g0, g1))) < 1e-5
    bf16 = np.asarray(compute_logits(params, cfg, ids, mask, compute_dtype=jnp.bfloat16))
    hidden, _ = forward_hidden(params, cfg, ids, mask, compute_dtype=jnp.bfloat16)
    assert hidden.dtype == jnp.bfloat16 and bf16.dtype == np.float32
    valid = np.asarray(mask).astype(bool)
    assert 0 < np.abs(bf16[valid] - ref[valid]).max() < 0.1


def test_logical_axes_cover_every_param_dim():
    for family, head in (("qwen2", "lm"), ("qwen3", "value"), ("llama", "score")):
        cfg = ModelConfig.tiny(family, tie_word_embeddings=(head == "lm"))
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), head=head,
                                                    num_labels=2))
        axes = param_logical_axes(cfg, head=head, num_labels=2)
        pairs = jax.tree.map(lambda a, p: (a, p.shape), axes, params,
                             is_leaf=lambda x: isinstance(x, tuple))
        for a, shape in jax.tree.leaves(pairs, is_leaf=lambda x: isinstance(x, tuple)
                                        and len(x) == 2 and isinstance(x[1], tuple)):
            assert len(a) == len(shape) and set(a) <= LOGICAL
        assert axes["layers"]["attn"]["k_proj"]["kernel"] == ("layers", "embed", "kv_heads",
                                                               "head_dim")
        assert ("lm_head" in params) == (head == "lm" and not cfg.tie_word_embeddings)


def test_value_and_score_heads_formulas():
    cfg = ModelConfig.tiny("llama")
    params = init_params(cfg, jax.random.key(0), head="value")
    params.update(init_params(cfg, jax.random.key(1), head="score", num_labels=2))
    params["value_head"]["bias"] = jnp.array([0.5])
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])  # left- and right-padded rows
    ids = jnp.array([[2, 2, 5, 2, 7], [3, 2, 9, 2, 2]])  # pad id 2 also inside the content
    hidden, _ = forward_hidden(params, cfg, ids, mask)
    h = np.asarray(hidden)
    values = np.asarray(value_from_hidden(params, hidden))
    np.testing.assert_allclose(values, h @ np.asarray(params["value_head"]["kernel"])[:, 0] + 0.5,
                               rtol=1e-5, atol=1e-5)
    assert list(np.asarray(last_valid_index(mask))) == [4, 2]
    scores = np.asarray(score_from_hidden(params, hidden, mask))
    kernel = np.asarray(params["score"]["kernel"])
    np.testing.assert_allclose(scores, np.stack([h[0, 4], h[1, 2]]) @ kernel, rtol=1e-5, atol=1e-5)


def test_config_roundtrip_and_rope_parameters():
    cfg = ModelConfig.tiny("qwen3", rope_theta=1e6)
    again = ModelConfig.from_hf_config(cfg.to_hf_config())
    assert again == cfg and hash(again) == hash(cfg)
    d = cfg.to_hf_config()
    del d["rope_theta"]  # transformers 5 layout: theta only under rope_parameters
    assert ModelConfig.from_hf_config(d).rope_theta == 1e6
    legacy = {**d, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    del legacy["rope_parameters"]
    got = ModelConfig.from_hf_config(legacy)
    assert got.rope_theta == 5e5 and got.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
