"""Speculative decoding in the paged engine (rollout.speculative): greedy output token-identical to
plain decoding, samples that follow the model's distribution (a seeded chi-square test of the
probability integral transform of every emitted token), stored log-probs equal to full-forward
scoring, samples that do not depend on slot count or queue order, drafts looked up as specified.

Two tiny models: the random one of the other sampler tests (its greedy text rarely repeats, so
drafts are mostly rejected) and a "cycling" one whose head mostly predicts a fixed successor of the
current token (cycles of three tokens), with attention and MLP scaled down but not off (they still
move every logit), so drafts are often kept."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_fixtures import PAD_ID, PROMPTS, tiny_params
from scipy import stats as scipy_stats
from test_sampler_logprobs import rescore

from jaxrl_llm.models import forward_hidden, logits_from_hidden
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.engine import EngineSpec, PagedEngine
from jaxrl_llm.sampler.speculative import SpeculativeSpec, ngram_drafts

NEW = 24
# repeated patterns, so n-gram lookups find drafts from the first step on
SPEC_PROMPTS = PROMPTS + [[5, 6, 7, 8] * 4, [9, 3] * 7 + [9]]


def cycling_params(cfg, params, sharpness=8.0, residual=0.02):  # successor ~0.7 likely
    """`params` whose head scores token perm(t) high after token t (perm: 3-cycles), blocks scaled by `residual`."""
    v = cfg.vocab_size
    cycles = np.arange(v - v % 3).reshape(-1, 3)
    successor = np.arange(v)
    successor[cycles.ravel()] = np.roll(cycles, -1, axis=1).ravel()
    e = np.asarray(params["embedding"], np.float64)
    unit = e / np.linalg.norm(e, axis=1, keepdims=True)
    head = np.zeros((e.shape[1], v))
    head[:, successor] = unit.T * sharpness / np.sqrt(e.shape[1])  # the final norm scales h to norm sqrt(d)
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    layers = {**params["layers"], "attn": {**attn, "o_proj": {"kernel": attn["o_proj"]["kernel"] * residual}},
              "mlp": {**mlp, "down_proj": {"kernel": mlp["down_proj"]["kernel"] * residual}}}
    return {**params, "lm_head": {"kernel": jnp.asarray(head, jnp.float32)}, "layers": layers}


@pytest.fixture(scope="module")
def models(llama_tiny):
    cfg, params = llama_tiny
    return cfg, {"random": params, "cycling": cycling_params(cfg, params)}


@pytest.fixture(scope="module")
def draft_model(llama_tiny):
    """A one-layer draft of the same vocabulary, other weights: its own pool dims; its head mostly
    predicts the cycling target's successor, less sharply (so drafts are kept and rejected)."""
    cfg, _ = llama_tiny
    draft_cfg = dataclasses.replace(cfg, num_hidden_layers=1)
    return draft_cfg, cycling_params(draft_cfg, tiny_params(draft_cfg, seed=3), sharpness=6.0, residual=0.1)


def _draft_spec(draft_model, k):
    return SpeculativeSpec("draft", num_tokens=k, draft_cfg=draft_model[0])


def _engine(cfg, speculative, *, slots=4, num_pages=48, steps=4):
    spec = EngineSpec(max_num_seqs=slots, page_size=4, num_pages=num_pages, pages_per_slot=12,
                      speculative=speculative)
    return PagedEngine(cfg, spec, steps_per_call=steps, precompile_drain=False)


def _args(cfg, sp):
    return sp.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)


def test_ngram_drafts_continue_the_latest_match():
    hist = np.zeros((4, 16), np.int32)
    hist[0, :7] = [1, 2, 3, 9, 1, 2, 3]  # suffix (1, 2, 3) ends at 2 earlier: drafts 9, 1, 2, 3
    hist[1, :6] = [4, 4, 4, 4, 4, 4]  # a run: the latest earlier match is one back, period 1
    hist[2, :5] = [7, 8, 5, 7, 8]  # (7, 8) at 0..1: drafts 5, 7, 8 then the period-3 repeat 5
    hist[3, :4] = [1, 2, 3, 4]  # no match: the last token, k times
    drafts, found = ngram_drafts(jnp.asarray(hist), jnp.asarray([7, 6, 5, 4]), 4, 3, 1)
    assert np.asarray(found).tolist() == [True, True, True, False]
    assert np.asarray(drafts).tolist() == [[9, 1, 2, 3], [4, 4, 4, 4], [5, 7, 8, 5], [4, 4, 4, 4]]
    # only the shortest suffix n = 1 of row 0 allowed: token 3 was last seen at 2 too
    drafts, _ = ngram_drafts(jnp.asarray(hist[:1]), jnp.asarray([7]), 2, 1, 1)
    assert np.asarray(drafts).tolist() == [[9, 1]]


@pytest.mark.parametrize("model, k", [("random", 4), ("cycling", 1), ("cycling", 4)])
def test_greedy_is_token_identical_to_plain_decoding(models, model, k):
    cfg, all_params = models
    params = all_params[model]
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=NEW, do_sample=False, n=2))
    plain, plain_stats = _engine(cfg, None).run(params, SPEC_PROMPTS, jax.random.key(0), knobs, settings)
    out, stats = _engine(cfg, SpeculativeSpec(num_tokens=k)).run(params, SPEC_PROMPTS, jax.random.key(0), knobs,
                                                                 settings)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_array_equal(out.finish_reason, plain.finish_reason)
    m = out.response_mask.astype(bool)
    np.testing.assert_allclose(out.log_probs[m], plain.log_probs[m], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out.log_probs[m], np.asarray(rescore(params, cfg, out, 1.0))[m], atol=1e-5, rtol=1e-5)
    metrics = stats.metrics()
    assert stats.spec_emitted == int(out.lengths.sum()) - out.lengths.size  # token 0 comes from the prefill
    assert plain_stats.metrics()["rollout/tokens_per_step"] == 1.0
    if model == "cycling":  # drafts kept: more than one token per step, fewer steps
        assert metrics["rollout/spec_accept_rate"] > 0.5
        assert metrics["rollout/tokens_per_step"] > 1 + 0.5 * k
        assert stats.decode_steps < plain_stats.decode_steps
    else:
        assert 0 <= metrics["rollout/spec_accept_rate"] < 0.1


@pytest.mark.parametrize("draft", ["other", "target"])
def test_draft_model_greedy_is_token_identical_to_plain_decoding(models, draft_model, draft):
    """A draft model of other dims and weights, and the target itself as its own draft (every draft kept)."""
    cfg, all_params = models
    params = all_params["cycling"]
    k = 3
    speculative, draft_params = _draft_spec(draft_model, k), draft_model[1]
    if draft == "target":
        speculative, draft_params = SpeculativeSpec("draft", num_tokens=k, draft_cfg=cfg), params
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=NEW, do_sample=False, n=2))
    plain, plain_stats = _engine(cfg, None).run(params, SPEC_PROMPTS, jax.random.key(0), knobs, settings)
    out, stats = _engine(cfg, speculative).run(params, SPEC_PROMPTS, jax.random.key(0), knobs, settings,
                                               draft_params=draft_params)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.finish_reason, plain.finish_reason)
    m = out.response_mask.astype(bool)
    np.testing.assert_allclose(out.log_probs[m], np.asarray(rescore(params, cfg, out, 1.0))[m], atol=1e-5, rtol=1e-5)
    rate = stats.metrics()["rollout/spec_accept_rate"]
    if draft == "target":
        assert rate == 1.0
        assert stats.metrics()["rollout/tokens_per_step"] > 0.8 * (k + 1)
    else:
        assert 0.2 < rate < 1.0
    assert stats.decode_steps < plain_stats.decode_steps
    with pytest.raises(ValueError, match="draft_params"):
        _engine(cfg, speculative).run(params, SPEC_PROMPTS, jax.random.key(0), knobs, settings)


def test_sampled_logprobs_equal_scoring_and_do_not_depend_on_slots(models):
    cfg, all_params = models
    params = all_params["cycling"]
    sp = SamplingParams(max_new_tokens=NEW, temperature=0.7, top_k=20, top_p=0.9, n=3)
    settings, knobs = _args(cfg, sp)
    spec = SpeculativeSpec(num_tokens=3)
    out, stats = _engine(cfg, spec).run(params, SPEC_PROMPTS, jax.random.key(7), knobs, settings)
    m = out.response_mask.astype(bool)
    ref = np.asarray(rescore(params, cfg, out, 0.7))
    np.testing.assert_allclose(out.log_probs[m], ref[m], atol=1e-5, rtol=1e-5)
    assert stats.spec_accepted > 0 and stats.spec_accepted < stats.spec_proposed
    order = [(i, j) for i in reversed(range(len(SPEC_PROMPTS))) for j in reversed(range(3))]
    # 2 slots, reversed queue, a small pool: requests wait for pages; a token's draws do not move
    other, other_stats = _engine(cfg, spec, slots=2, num_pages=14).run(params, SPEC_PROMPTS, jax.random.key(7),
                                                                       knobs, settings, order=order)
    np.testing.assert_array_equal(other.tokens, out.tokens)
    assert other_stats.waits_for_pages > 0


def randomized_pit(params, cfg, out, rng):
    """Per emitted token, F(x - 1) + U p(x) under the model's full softmax given its prefix: i.i.d.
    uniform on (0, 1) exactly when every token was drawn from the model's conditional distribution."""
    ids = jnp.concatenate([out.prompt_ids, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.response_mask], axis=1)
    hidden, _ = forward_hidden(params, cfg, ids, mask)
    p = out.prompt_ids.shape[1]
    probs = np.asarray(jax.nn.softmax(logits_from_hidden(params, cfg, hidden[:, p - 1:-1]), axis=-1), np.float64)
    tok = np.asarray(out.tokens)[..., None]
    below = np.sum(np.where(np.arange(probs.shape[-1]) < tok, probs, 0.0), axis=-1)
    at = np.take_along_axis(probs, tok, axis=-1)[..., 0]
    u = below + rng.uniform(size=at.shape) * at
    return u[np.asarray(out.response_mask, bool)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_samples_follow_the_model_at_temperature_one(models, draft_model, method):
    """Seeded (engine key 11, numpy seed 0): deterministic, so it cannot flake; ~12k tokens, 20 bins."""
    cfg, all_params = models
    params = all_params["cycling"]
    speculative, draft_params = SpeculativeSpec(num_tokens=3), None
    if method == "draft":
        speculative, draft_params = _draft_spec(draft_model, 3), draft_model[1]
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=16, temperature=1.0, n=256))
    prompts = [[5, 6, 7, 8] * 2, [9, 3] * 3, [40, 41, 42]]  # 768 samples
    results = {}
    for name, spec in (("plain", None), (method, speculative)):
        out, stats = _engine(cfg, spec, slots=64, num_pages=400, steps=16).run(
            params, prompts, jax.random.key(11), knobs, settings, draft_params=None if spec is None else draft_params)
        u = randomized_pit(params, cfg, out, np.random.default_rng(0))
        counts = np.histogram(u, bins=20, range=(0.0, 1.0))[0]
        results[name] = (scipy_stats.chisquare(counts).pvalue, stats, u.size)
    pvalue, stats, draws = results[method]
    assert draws > 10000
    assert pvalue > 1e-3, results
    assert results["plain"][0] > 1e-3, results  # the same test passes plain sampling
    assert 0.05 < stats.spec_accepted / stats.spec_proposed < 0.95  # both branches of the rule ran
