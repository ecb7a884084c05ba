"""`generate` facade (strings / chat lists / token ids, n samples, texts) and the host helpers."""
import dataclasses

import jax
import numpy as np
import pytest
from sampler_fixtures import tiny_params
from tiny_models import make_char_tokenizer

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler import (
    GenerationResult,
    SamplingParams,
    bucket_batch,
    bucket_length,
    generate,
    left_pad,
    prompts_to_ids,
    sample,
)


@dataclasses.dataclass
class TinyModel:
    config: ModelConfig
    params: dict
    tokenizer: object = None


@pytest.fixture(scope="module")
def char_model():
    tok = make_char_tokenizer()
    cfg = ModelConfig.tiny("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    return TinyModel(cfg, tiny_params(cfg, seed=1), tok)


PROMPTS = ["2+2=", [{"role": "user", "content": "hi"}], [5, 6, 7, 8]]


def test_prompt_kinds_are_tokenised(char_model):
    tok = char_model.tokenizer
    ids = prompts_to_ids(PROMPTS, tok)
    assert ids[0] == tok("2+2=")["input_ids"]
    chat_text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids[1] == tok(chat_text, add_special_tokens=False)["input_ids"]
    assert ids[1][0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[2] == [5, 6, 7, 8]
    # a single prompt may come unwrapped
    assert prompts_to_ids("2+2=", tok) == [ids[0]]
    assert prompts_to_ids([5, 6, 7, 8]) == [[5, 6, 7, 8]]


def test_generate_greedy_matches_the_core(char_model):
    cfg, tok = char_model.config, char_model.tokenizer
    sp = SamplingParams(max_new_tokens=12, do_sample=False)
    res = generate(char_model, PROMPTS, sp, engine="paged")
    assert isinstance(res, GenerationResult) and res.tokens.shape == (3, 12)
    # the core on the same prompts, without the facade's batch padding
    ids, mask = left_pad(prompts_to_ids(PROMPTS, tok), cfg.pad_token_id)
    settings, knobs = sp.compile_args(cfg.eos_token_ids, cfg.pad_token_id, vocab_size=cfg.vocab_size)
    out = sample(char_model.params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    np.testing.assert_array_equal(res.tokens, np.asarray(out.tokens))
    # the facade runs the paged engine (online softmax over KV pages): same numbers within 1e-5
    np.testing.assert_allclose(res.log_probs, np.asarray(out.log_probs), atol=1e-5)
    static = generate(char_model, PROMPTS, sp, engine="static")
    np.testing.assert_allclose(static.log_probs, np.asarray(out.log_probs), atol=1e-6)
    for row in range(3):
        n = int(out.lengths[row])
        assert res.token_ids[row] == np.asarray(out.tokens[row, :n]).tolist()
        assert res.texts[row] == tok.decode(res.token_ids[row], skip_special_tokens=True)
        assert res.finish_reasons[row] == ("eos" if int(out.finish_reason[row]) == 1 else "length")
    np.testing.assert_array_equal(res.prompt_index, [0, 1, 2])


def test_generate_n_samples_per_prompt(char_model):
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True)
    res = generate(char_model, PROMPTS[:2], sp)
    assert res.tokens.shape == (6, 6) and list(res.prompt_index) == [0, 0, 0, 1, 1, 1]
    assert np.all(res.lengths == 6) and res.finish_reasons == ["length"] * 6
    assert len({tuple(r) for r in res.token_ids[:3]}) > 1  # the samples of one prompt differ
    again = generate(char_model, PROMPTS[:2], sp)
    np.testing.assert_array_equal(again.tokens, res.tokens)  # same seed, same draws
    other = generate(char_model, PROMPTS[:2], dataclasses.replace(sp, seed=8))
    assert not np.array_equal(other.tokens, res.tokens)


def test_generate_errors(char_model):
    bare = TinyModel(char_model.config, char_model.params)
    sp = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 is a string: pass tokenizer="):
        generate(bare, [[3, 4], "text"], sp)
    with pytest.raises(ValueError, match="prompt 0"):
        generate(bare, [[]], sp)
    with pytest.raises(ValueError, match="non-empty list"):
        generate(bare, [], sp)


def test_buckets_and_left_pad():
    assert [bucket_length(n) for n in (1, 16, 17, 100, 129, 500, 513, 600)] == [16, 16, 32, 112, 192, 512, 768, 768]
    assert [bucket_batch(n) for n in (1, 3, 5, 8)] == [1, 4, 8, 8]
    assert bucket_batch(3, multiple_of=8) == 8 and bucket_batch(9, multiple_of=6) == 18
    ids, mask = left_pad([[7, 8, 9], [4]], pad_id=2, length=5)
    np.testing.assert_array_equal(ids, [[2, 2, 7, 8, 9], [2, 2, 2, 2, 4]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    with pytest.raises(ValueError, match="prompt 1 has 6 tokens"):
        left_pad([[1], [1] * 6], 0, length=5)


def test_bfloat16_compute_tracks_float32(char_model):
    sp = SamplingParams(max_new_tokens=6, do_sample=False, ignore_eos=True)
    f32 = generate(char_model, PROMPTS, sp)
    bf16 = generate(char_model, PROMPTS, sp, compute_dtype="bfloat16")
    assert bf16.log_probs.dtype == np.float32
    same = (bf16.tokens == f32.tokens).all(axis=1)  # a near-tie may flip a row in bf16
    assert same.sum() >= 2
    np.testing.assert_allclose(bf16.log_probs[same], f32.log_probs[same], atol=0.1)
    assert not np.array_equal(bf16.log_probs, f32.log_probs)  # it really computed in bf16
