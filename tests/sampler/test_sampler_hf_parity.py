"""Greedy decoding is token-identical to transformers `generate` (left-padded, different lengths)."""
import jax
import numpy as np
import pytest

from jaxrl_llm.hf import load_hf_folder
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from sampler_fixtures import EOS_ID, PAD_ID, PROMPTS, hf_greedy
from tiny_models import build_hf_model

NEW_TOKENS = 12


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers(family, tmp_path):
    torch_model = build_hf_model(family, tmp_path)
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
def test_smollm2_greedy_matches_transformers(smollm2_gguf):
    import torch
    import transformers

    from jaxrl_llm.hf import load_gguf  # the GGUF loader of the hf bridge

    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    cfg, params = load_gguf(smollm2_gguf)
    chats = [[{"role": "user", "content": "What is 2+3?"}],
             [{"role": "user", "content": "Name a colour of the sky on a clear day, in one word."}]]
    prompts = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for c in chats]
    pad = tok.pad_token_id
    eos = tok.eos_token_id
    hf_ids, hf_mask = left_pad(prompts, pad, length=max(map(len, prompts)))
    expected = hf_greedy(torch_model, hf_ids, hf_mask, 16, eos, pad)

    ids, mask = left_pad(prompts, pad)
    settings, knobs = SamplingParams(max_new_tokens=16, do_sample=False).compile_args(
        [eos], pad, vocab_size=cfg.vocab_size)
    out = sample(params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
