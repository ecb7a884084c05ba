"""Sampler logprobs equal the trainer's full-forward scoring; an optimizer step shows up in the next call."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sampler_fixtures import PAD_ID, PROMPTS

from jaxrl_llm.losses.logprob import token_logprobs
from jaxrl_llm.models import forward_hidden, lm_head_weight
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from jaxrl_llm.sampler.core import sample_program

NEW_TOKENS = 10


def rescore(params, cfg, out, temperature):
    """The trainer's way: one forward over prompt + response, fused logprob at `temperature`."""
    ids = jnp.concatenate([out.prompt_ids, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.response_mask], axis=1)
    hidden, _ = forward_hidden(params, cfg, ids, mask)
    p = out.prompt_ids.shape[1]
    return token_logprobs(hidden[:, p - 1:-1], lm_head_weight(params, cfg), out.tokens, temperature=temperature)


def run(params, cfg, sp, seed=0):
    settings, knobs = sp.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    ids, mask = left_pad(PROMPTS, PAD_ID)
    return sample(params, cfg, ids, mask, jax.random.key(seed), knobs, settings=settings)


@pytest.mark.parametrize("sp, score_temperature", [
    # truncated sampling still reports the full-softmax logprob at T (what the trainer scores)
    (SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=20, top_p=0.9, n=2), 0.7),
    (SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.3), 1.3),
], ids=["T0.7_topk_topp_n2", "T1.3"])
def test_logprobs_equal_full_forward(llama_tiny, sp, score_temperature):
    cfg, params = llama_tiny
    out = run(params, cfg, sp)
    assert out.tokens.shape == (len(PROMPTS) * sp.n, NEW_TOKENS)
    mask = np.asarray(out.response_mask, bool)
    assert mask.sum() > len(PROMPTS)
    ref = np.asarray(rescore(params, cfg, out, score_temperature))
    got = np.asarray(out.log_probs)
    np.testing.assert_allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    assert np.all(got[~mask] == 0)
    if sp.n > 1:  # samples of the same prompt are different draws
        assert not np.array_equal(np.asarray(out.tokens[0]), np.asarray(out.tokens[1]))


def test_optimizer_update_is_seen_by_next_sample(llama_tiny):
    cfg, params = llama_tiny
    # greedy (temperature 0.7 is ignored): logprobs are reported at temperature 1
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False, temperature=0.7)
    before = run(params, cfg, sp)
    compiled = sample_program._cache_size()

    target = 42  # one SGD step on -log p(42) at every prompt position makes 42 the greedy choice

    def loss_fn(p):
        ids, mask = left_pad(PROMPTS, PAD_ID)
        hidden, _ = forward_hidden(p, cfg, jnp.asarray(ids), jnp.asarray(mask))
        lp = token_logprobs(hidden, lm_head_weight(p, cfg), jnp.full(ids.shape, target, jnp.int32))
        return -jnp.sum(lp * mask) / mask.sum()

    opt = optax.sgd(2.0)
    grads = jax.grad(loss_fn)(params)
    updates, _ = opt.update(grads, opt.init(params), params)
    new_params = optax.apply_updates(params, updates)

    after = run(new_params, cfg, sp)  # the new pytree goes straight in: no copy, no reload
    assert sample_program._cache_size() == compiled  # same program, new weights
    before_t, after_t = np.asarray(before.tokens), np.asarray(after.tokens)
    assert not np.array_equal(before_t, after_t)
    assert (after_t == target).sum() > (before_t == target).sum() + len(PROMPTS)
    for p, out in ((params, before), (new_params, after)):
        mask = np.asarray(out.response_mask, bool)
        np.testing.assert_allclose(np.asarray(out.log_probs)[mask],
                                   np.asarray(rescore(p, cfg, out, 1.0))[mask], atol=1e-5, rtol=0)
