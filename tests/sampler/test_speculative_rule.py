"""The speculative acceptance rule alone (sampler/speculative.py) keeps the target distribution.
Seeded, many draws: a chi-square test of the first emitted token that cannot flake at these seeds,
for n-gram (point-mass) drafts and a draft model's distribution, at temperature 1 and with
temperature 0.7 + top-k; greedy keeps only argmax drafts. The engine's use of it:
tests/sampler/test_speculative_engine.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.speculative import accept_drafts, target_distribution

V, DRAWS = 6, 20000


def _settings(**kw):
    return SamplingParams(max_new_tokens=4, **kw).compile_args([], 0, vocab_size=V)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("sp", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)])
def test_first_token_follows_the_target(kind, sp):
    settings, knobs = _settings(**sp)
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 2, V)) * 1.5, jnp.float32)  # k = 1
    p = np.asarray(target_distribution(logits[:, 0], knobs, settings))[0]
    keys = jax.random.split(jax.random.key(1), DRAWS * 2).reshape(DRAWS, 2)
    logits_b = jnp.broadcast_to(logits, (DRAWS, 2, V))
    if kind == "ngram":  # a fixed draft (the likeliest-looking continuation of the context)
        drafts, q = jnp.full((DRAWS, 1), 2, jnp.int32), None
    else:  # a draft model's distribution, its draft drawn from it
        qd = jax.nn.softmax(jnp.asarray(rng.normal(size=(V,)), jnp.float32))
        drafts = jax.random.categorical(jax.random.key(2), jnp.log(qd), shape=(DRAWS,))[:, None].astype(jnp.int32)
        q = jnp.broadcast_to(qd, (DRAWS, 1, V))
    tokens, lps, accepted = jax.jit(accept_drafts, static_argnames=("settings",))(
        logits_b, drafts, q, keys, knobs, settings=settings)
    first = np.asarray(tokens[:, 0])
    counts = np.bincount(first, minlength=V)
    support = p > 0
    assert counts[~support].sum() == 0
    expected = DRAWS * p[support].astype(np.float64) / p[support].sum(dtype=np.float64)
    _, pvalue = stats.chisquare(counts[support], expected)
    assert pvalue > 1e-3, (counts, DRAWS * p)
    # the log-probs are the target's full softmax at the temperature, at each emitted position
    scaled = np.asarray(logits_b[:, 0]) / float(knobs.temperature)
    want = scaled[np.arange(DRAWS), first] - jax.nn.logsumexp(scaled, axis=-1)
    np.testing.assert_allclose(np.asarray(lps[:, 0]), np.asarray(want), atol=1e-5)
    assert 0 < float(jnp.mean(accepted)) < 1


def test_greedy_keeps_argmax_drafts_only():
    settings, knobs = SamplingParams(max_new_tokens=4, do_sample=False).compile_args([], 0, vocab_size=V)
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, V)), jnp.float32)
    best = jnp.argmax(logits, axis=-1)
    drafts = jnp.stack([best[0, :2], jnp.asarray([best[1, 0], (best[1, 1] + 1) % V])])
    keys = jax.random.split(jax.random.key(0), 6).reshape(2, 3)
    tokens, _, accepted = accept_drafts(logits, drafts, None, keys, knobs, settings)
    assert accepted.tolist() == [2, 1]
    np.testing.assert_array_equal(np.asarray(tokens[0]), np.asarray(best[0]))
    np.testing.assert_array_equal(np.asarray(tokens[1, :2]), np.asarray(best[1, :2]))
