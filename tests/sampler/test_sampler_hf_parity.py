"""Greedy decoding is token-identical to transformers `generate` (left-padded, different lengths)."""
import jax
import numpy as np
import pytest
from sampler_fixtures import EOS_ID, PAD_ID, PROMPTS, hf_greedy
from tiny_models import GEMMA, MIXED_MOE, MOE_FAMILIES, QWEN35, WINDOW_LAYERS, build_hf_model, family_case

from jaxrl_llm.hf import load_hf_folder
from jaxrl_llm.sampler import SamplingParams, left_pad, sample

NEW_TOKENS = 12


@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES, *MIXED_MOE,
                                  *WINDOW_LAYERS, *GEMMA, *QWEN35])
def test_greedy_matches_transformers(case, tmp_path):
    family, overrides = family_case(case)
    torch_model = build_hf_model(family, tmp_path, **overrides)
    cfg, params = load_hf_folder(tmp_path)
    # ours: padded to the 16-token bucket; transformers: padded to the longest prompt only
    ids, mask = left_pad(PROMPTS, PAD_ID)
    assert ids.shape[1] == 16
    hf_ids, hf_mask = left_pad(PROMPTS, PAD_ID, length=max(map(len, PROMPTS)))
    expected = hf_greedy(torch_model, hf_ids, hf_mask, NEW_TOKENS, EOS_ID, PAD_ID)

    settings, knobs = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False).compile_args(
        cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    out = sample(params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens, expected)
    # lengths / finish reasons agree with where transformers stopped each row
    for row, seq in enumerate(expected):
        hits = np.flatnonzero(seq == EOS_ID)
        length = hits[0] + 1 if len(hits) else NEW_TOKENS
        assert out.lengths[row] == length
        assert out.finish_reason[row] == (1 if len(hits) else 0)


@pytest.mark.slow
@pytest.mark.optimized_xla  # real SmolLM2 forwards: running, not compiling
def test_smollm2_greedy_matches_transformers(smollm2_greedy):
    case = smollm2_greedy
    ids, mask = left_pad(case.prompts, case.pad_id)  # ours: padded to the sampler's length bucket
    settings, knobs = SamplingParams(max_new_tokens=case.new_tokens, do_sample=False).compile_args(
        [case.eos_id], case.pad_id, vocab_size=case.cfg.vocab_size)
    out = sample(case.params, case.cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    np.testing.assert_array_equal(np.asarray(out.tokens), case.expected)
