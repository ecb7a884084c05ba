"""Temperature / top-k / top-p draw from the right distribution; SamplingParams from the config."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_llm.config import default_config, resolve_sampling
from jaxrl_llm.sampler import SampleSettings, SamplingParams, choose_tokens

LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0], np.float32)
DRAWS = 40_000


def expected_probs(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """numpy reference: softmax(logits / T), keep top-k, renormalise, keep the smallest prefix whose
    mass reaches top_p, renormalise."""
    z = LOGITS.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    keep[order[:top_k if top_k > 0 else len(p)]] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    sorted_q = q[order]
    before = np.cumsum(sorted_q) - sorted_q
    keep_sorted = (before < top_p) & (sorted_q > 0)
    final = np.zeros_like(q)
    final[order[keep_sorted]] = q[order[keep_sorted]]
    return final / final.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.5, -1, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.8), (2.0, 5, 0.7), (0.8, 0, 0.95)])
def test_sampling_distribution(temperature, top_k, top_p):
    sp = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    settings, knobs = sp.compile_args([], 0, vocab_size=len(LOGITS))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, len(LOGITS)))
    tokens, logprobs = jax.jit(choose_tokens, static_argnums=3)(logits, jax.random.key(123), knobs, settings)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS))
    want = expected_probs(temperature, top_k, top_p)
    assert np.all(counts[want == 0] == 0), (counts, want)  # truncated tokens are never drawn
    kept = want > 0
    assert kept.sum() >= 2
    chi2 = stats.chisquare(counts[kept], want[kept] * DRAWS)
    assert chi2.pvalue > 1e-3, (counts, want * DRAWS)
    # the reported logprob is the untruncated softmax at temperature T, whatever was filtered
    full = jax.nn.log_softmax(jnp.asarray(LOGITS) / temperature)
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(full)[np.asarray(tokens)], atol=1e-6)


def test_a_wrong_distribution_is_detected():
    """The test above can fail: T=0.5 draws do not fit the T=1 distribution."""
    sp = SamplingParams(max_new_tokens=1, temperature=0.5)
    settings, knobs = sp.compile_args([], 0, vocab_size=len(LOGITS))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, len(LOGITS)))
    tokens, _ = choose_tokens(logits, jax.random.key(123), knobs, settings)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS))
    assert stats.chisquare(counts, expected_probs(1.0, -1, 1.0) * DRAWS).pvalue < 1e-6


def test_greedy_is_argmax_with_temperature_one_logprob():
    settings, knobs = SamplingParams(max_new_tokens=1, temperature=0.0).compile_args([], 0, vocab_size=8)
    assert settings.greedy and float(knobs.temperature) == 1.0
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]))
    tokens, lp = choose_tokens(logits, jax.random.key(0), knobs, settings)
    np.testing.assert_array_equal(np.asarray(tokens), [0, 7])
    np.testing.assert_allclose(np.asarray(lp), np.asarray(jax.nn.log_softmax(jnp.asarray(LOGITS)))[[0, 0]],
                               atol=1e-6)


def test_sampling_params_from_config():
    cfg = default_config()
    rollout = cfg.actor_rollout_ref.rollout
    rollout.update(dict(n=4, temperature=0.9, top_k=50, top_p=0.95, do_sample=True, response_length=64,
                        ignore_eos=True, stop_token_ids=[7, 9]))
    sp = resolve_sampling(rollout)
    assert sp == SamplingParams(max_new_tokens=64, temperature=0.9, top_k=50, top_p=0.95, do_sample=True,
                                n=4, ignore_eos=True, stop_token_ids=(7, 9))
    val = resolve_sampling(rollout, validation=True)
    assert (val.n, val.temperature, val.do_sample, val.greedy, val.max_new_tokens) == (1, 0.0, False, True, 64)
    assert val.stop_token_ids == (7, 9) and val.ignore_eos

    settings, knobs = sp.compile_args([2, 5], 0, vocab_size=100)
    assert settings == SampleSettings(max_new_tokens=64, n=4, greedy=False, top_k=50, use_top_p=True)
    assert knobs.eos_ids.tolist() == [-1] * 4  # ignore_eos drops EOS, keeps the stop ids
    assert knobs.stop_ids.tolist() == [7, 9, -1, -1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(n=0), r"\.n="), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(stop_token_ids=(-3,)), "stop_token_ids")])
def test_sampling_params_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_compile_args_rejects_out_of_range_ids():
    sp = SamplingParams(max_new_tokens=4, stop_token_ids=(300,))
    with pytest.raises(ValueError, match=r"stop_token_ids \[300\]"):
        sp.compile_args([2], 0, vocab_size=256)
    with pytest.raises(ValueError, match="pad_token_id=999"):
        SamplingParams(max_new_tokens=4).compile_args([2], 999, vocab_size=256)
