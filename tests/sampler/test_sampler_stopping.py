"""EOS, extra stop tokens, ignore_eos, finish reasons, early loop exit; knobs never recompile."""
import jax
import numpy as np
import pytest
from sampler_fixtures import PAD_ID, PROMPTS

from jaxrl_llm.sampler import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SamplingParams, left_pad, sample
from jaxrl_llm.sampler.core import sample_program

R = 10


def greedy(cfg, params, eos, **kwargs):
    settings, knobs = SamplingParams(max_new_tokens=R, do_sample=False, **kwargs).compile_args(
        eos, PAD_ID, vocab_size=cfg.vocab_size)
    ids, mask = left_pad(PROMPTS, PAD_ID)
    return sample(params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)


def expected(reference: np.ndarray, eos: set, stop: set):
    """(tokens, lengths, reasons) when generation stops at the first eos/stop token of each row."""
    tokens = np.full_like(reference, PAD_ID)
    lengths, reasons = [], []
    for row, seq in enumerate(reference):
        hits = [i for i, t in enumerate(seq) if t in eos or t in stop]
        n = hits[0] + 1 if hits else R
        tokens[row, :n] = seq[:n]
        lengths.append(n)
        reasons.append(FINISH_LENGTH if not hits else FINISH_EOS if seq[hits[0]] in eos else FINISH_STOP)
    return tokens, np.array(lengths), np.array(reasons)


@pytest.fixture(scope="module")
def reference(llama_tiny):
    cfg, params = llama_tiny
    out = greedy(cfg, params, [])  # no EOS at all: every row runs R tokens
    assert int(out.num_steps) == R and np.all(np.asarray(out.lengths) == R)
    return np.asarray(out.tokens), np.asarray(out.log_probs)


def check(out, reference, eos, stop):
    ref_tokens, ref_lp = reference
    tokens, lengths, reasons = expected(ref_tokens, set(eos), set(stop))
    np.testing.assert_array_equal(np.asarray(out.tokens), tokens)
    np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
    np.testing.assert_array_equal(np.asarray(out.finish_reason), reasons)
    mask = np.arange(R)[None] < lengths[:, None]
    np.testing.assert_array_equal(np.asarray(out.response_mask), mask.astype(np.int32))
    lp = np.asarray(out.log_probs)
    np.testing.assert_array_equal(lp[mask], ref_lp[mask])  # finished rows do not disturb the others
    assert np.all(lp[~mask] == 0)
    # the loop ran exactly until the last row finished
    assert int(out.num_steps) == lengths.max()
    return lengths, reasons


def test_eos_stops_each_row_and_the_loop_exits_early(llama_tiny, reference):
    cfg, params = llama_tiny
    ref_tokens = reference[0]
    eos = sorted({int(ref_tokens[row, 2]) for row in range(len(PROMPTS))})  # every row ends by step 3
    out = greedy(cfg, params, eos)
    lengths, reasons = check(out, reference, eos, ())
    assert lengths.max() <= 3 < R and np.all(reasons == FINISH_EOS)


def test_stop_tokens_and_eos_together(llama_tiny, reference):
    cfg, params = llama_tiny
    ref_tokens = reference[0]
    eos, stop = [int(ref_tokens[0, 3])], [int(ref_tokens[1, 1]), int(ref_tokens[2, 4])]
    out = greedy(cfg, params, eos, stop_token_ids=stop)
    _, reasons = check(out, reference, eos, stop)
    assert FINISH_EOS in reasons and FINISH_STOP in reasons


def test_ignore_eos_keeps_going_but_stop_tokens_still_stop(llama_tiny, reference):
    cfg, params = llama_tiny
    ref_tokens = reference[0]
    eos = sorted({int(t) for t in ref_tokens[:, 1]})
    stop = [int(ref_tokens[3, 5])]
    out = greedy(cfg, params, eos, ignore_eos=True, stop_token_ids=stop)
    _, reasons = check(out, reference, (), stop)
    assert FINISH_STOP in reasons and FINISH_EOS not in reasons


def test_knobs_do_not_recompile_settings_do(llama_tiny, reference):
    cfg, params = llama_tiny
    before = sample_program._cache_size()
    ids, mask = left_pad(PROMPTS, PAD_ID)
    outs = []
    for temperature, top_p, eos in [(0.7, 0.9, [2]), (1.1, 0.5, [2, 3, 4]), (0.9, 0.99, [])]:
        sp = SamplingParams(max_new_tokens=R, temperature=temperature, top_p=top_p)
        settings, knobs = sp.compile_args(eos, PAD_ID, vocab_size=cfg.vocab_size)
        outs.append(sample(params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings))
    assert sample_program._cache_size() == before + 1  # one program for all three
    # ... and each call used its own values (not a frozen first one)
    lp = [np.asarray(o.log_probs[:, 0]) for o in outs]
    assert not np.allclose(lp[0], lp[1]) and not np.allclose(lp[1], lp[2])
    assert int(outs[2].finish_reason.max()) == FINISH_LENGTH
