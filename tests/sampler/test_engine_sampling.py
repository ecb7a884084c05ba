"""The paged engine's per-row inverse-CDF sampler draws from the same distribution as
`choose_tokens` (temperature / top-k / top-p) with the same log-probs, row by row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.engine.programs import choose_per_row
from test_sampler_distribution import DRAWS, LOGITS, expected_probs


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.5, 3, 1.0), (2.0, 5, 0.7)])
def test_per_row_sampling_distribution(temperature, top_k, top_p):
    settings, knobs = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k,
                                     top_p=top_p).compile_args([], 0, vocab_size=len(LOGITS))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, len(LOGITS)))
    keys = jax.random.split(jax.random.key(7), DRAWS)
    draw = jax.jit(choose_per_row, static_argnums=3)
    tokens, logprobs = draw(logits, keys, knobs, settings)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS))
    want = expected_probs(temperature, top_k, top_p)
    assert np.all(counts[want == 0] == 0), (counts, want)
    kept = want > 0
    assert stats.chisquare(counts[kept], want[kept] * DRAWS).pvalue > 1e-3, (counts, want * DRAWS)
    full = jax.nn.log_softmax(jnp.asarray(LOGITS) / temperature)
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(full)[np.asarray(tokens)], atol=1e-6)
    # a row's draw depends on its key only, not on the other rows of the batch
    sub, _ = draw(logits[100:164], keys[100:164], knobs, settings)
    np.testing.assert_array_equal(np.asarray(sub), np.asarray(tokens)[100:164])


def test_per_row_sampling_detects_a_wrong_distribution_and_skips_masked_tokens():
    settings, knobs = SamplingParams(max_new_tokens=1, temperature=0.5).compile_args([], 0, vocab_size=len(LOGITS))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, len(LOGITS)))
    tokens, _ = choose_per_row(logits, jax.random.split(jax.random.key(3), DRAWS), knobs, settings)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS))
    assert stats.chisquare(counts, expected_probs(1.0, -1, 1.0) * DRAWS).pvalue < 1e-6
    # -inf logits (a masked vocabulary tail) are never drawn, even at the top of the cdf
    masked = logits.at[:, 4:].set(-jnp.inf)
    tokens, logprobs = choose_per_row(masked, jax.random.split(jax.random.key(4), DRAWS), knobs, settings)
    assert int(np.max(np.asarray(tokens))) <= 3 and np.all(np.isfinite(np.asarray(logprobs)))
