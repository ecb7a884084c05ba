"""The facade's tokenizer: `jrl.load_model` attaches the model's own tokenizer (HF folder, GGUF,
training checkpoint), `jrl.generate(model, "Hi")` renders a string as a chat user message, and
`jrl.export_hf(model, dir)` writes the attached tokenizer."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from tiny_models import make_char_tokenizer

import jaxrl_llm as jrl
from jaxrl_llm.hf import export_hf
from jaxrl_llm.models import ModelConfig, init_params

GREEDY = jrl.SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same tiny llama twice: with the char-level ChatML tokenizer and without one."""
    base = tmp_path_factory.mktemp("models")
    cfg = ModelConfig.tiny("llama")
    params = init_params(cfg, jax.random.key(1))
    with_tok = export_hf(cfg, params, base / "with_tok", tokenizer=make_char_tokenizer())
    bare = export_hf(cfg, params, base / "bare")
    return with_tok, bare


def test_load_model_attaches_folder_tokenizer_and_string_is_a_chat_message(folders):
    with_tok, _ = folders
    model = jrl.load_model(with_tok)
    tok = model.tokenizer
    assert tok is not None and tok.eos_token == "<|im_end|>" and "im_start" in tok.chat_template
    out = jrl.generate(model, "Hi", GREEDY)
    chat = jrl.generate(model, [[{"role": "user", "content": "Hi"}]], GREEDY, tokenizer=tok)
    np.testing.assert_array_equal(out.tokens, chat.tokens)
    assert out.texts is not None and len(out.texts) == 1 and isinstance(out.texts[0], str)
    both = jrl.generate(model, ["Hi", "Hello there"], GREEDY)  # a list of strings: one message each
    assert both.tokens.shape == (2, 5)
    np.testing.assert_array_equal(both.tokens[0], out.tokens[0])
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                  add_generation_prompt=True)
    by_ids = jrl.generate(model, [tok(ids, add_special_tokens=False)["input_ids"]], GREEDY)
    np.testing.assert_array_equal(both.tokens[1], by_ids.tokens[0])
    # chat=False: the string is raw text
    raw = jrl.generate(model, "Hi", GREEDY, chat=False)
    np.testing.assert_array_equal(raw.tokens, jrl.generate(model, [tok("Hi")["input_ids"]], GREEDY).tokens)


def test_generate_defaults_to_sampling_params(folders, monkeypatch):
    import jaxrl_llm.api as api

    seen = {}
    monkeypatch.setattr(api, "_generate", lambda model, prompts, params, **kw: seen.update(params=params, **kw))
    model = jrl.load_model(folders[0])
    jrl.generate(model, "Hi")
    assert seen["params"] == jrl.SamplingParams() and seen["tokenizer"] is model.tokenizer


def test_no_tokenizer_is_a_clear_error_and_override_works(folders):
    with_tok, bare = folders
    model = jrl.load_model(bare)
    assert model.tokenizer is None
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        jrl.generate(model, "Hi", GREEDY)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        jrl.generate(model, ["Hi", [5, 6]], GREEDY)
    assert jrl.generate(model, [[5, 6, 7]], GREEDY).texts is None  # token ids need no tokenizer
    want = jrl.generate(jrl.load_model(with_tok), "Hi", GREEDY).tokens
    by_path = jrl.load_model(bare, tokenizer=with_tok)  # override: a path to load one from
    np.testing.assert_array_equal(jrl.generate(by_path, "Hi", GREEDY).tokens, want)
    by_object = jrl.load_model(bare, tokenizer=make_char_tokenizer())
    np.testing.assert_array_equal(jrl.generate(by_object, "Hi", GREEDY).tokens, want)
    np.testing.assert_array_equal(jrl.generate(model, "Hi", GREEDY, tokenizer=by_object.tokenizer).tokens, want)
    assert jrl.load_model(with_tok, tokenizer=False).tokenizer is None


def test_export_hf_writes_the_attached_tokenizer(folders, tmp_path):
    with_tok, bare = folders
    model = jrl.load_model(with_tok)
    out = jrl.export_hf(model, tmp_path / "again")
    assert (out / "tokenizer.json").is_file()
    again = jrl.load_model(out)
    assert again.tokenizer.chat_template == model.tokenizer.chat_template
    np.testing.assert_array_equal(jrl.generate(again, "Hi", GREEDY).tokens, jrl.generate(model, "Hi", GREEDY).tokens)
    assert not (jrl.export_hf(model, tmp_path / "no_tok", tokenizer=False) / "tokenizer.json").exists()
    assert not (jrl.export_hf(jrl.load_model(bare), tmp_path / "bare") / "tokenizer.json").exists()


def test_checkpoint_brings_the_tokenizer_its_run_used(folders, tmp_path):
    from jaxrl_llm.checkpoint import CheckpointStore

    with_tok, _ = folders
    model = jrl.load_model(with_tok)
    state = {"actor": {"params": model.params, "opt_state": {}}}

    def save(run, tokenizer):
        store = CheckpointStore(str(tmp_path / run / "checkpoints"), async_save=False)
        store.save(3, state, {}, {"global_step": 3, "model_config": model.config.to_hf_config(),
                                  "tokenizer": tokenizer})
        store.close()
        return tmp_path / run

    restored = jrl.load_model(save("run", str(with_tok)) / "checkpoints" / "3")
    assert restored.tokenizer is not None and restored.tokenizer.chat_template == model.tokenizer.chat_template
    np.testing.assert_array_equal(jrl.generate(restored, "Hi", GREEDY).tokens,
                                  jrl.generate(model, "Hi", GREEDY).tokens)
    with pytest.warns(UserWarning, match="does not exist"):
        gone = jrl.load_model(save("gone", str(tmp_path / "missing.gguf")))
    assert gone.tokenizer is None


@pytest.mark.slow
def test_smollm2_gguf_load_model_generate_from_a_string(smollm2_gguf):
    model = jrl.load_model(smollm2_gguf)
    tok = model.tokenizer
    assert tok is not None and tok.eos_token == "<|im_end|>"
    params = jrl.SamplingParams(temperature=0.0, max_new_tokens=6)
    out = jrl.generate(model, "What is the capital of France?", params)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(out.tokens, jrl.generate(model, [ids], params).tokens)
    assert "Paris" in out.texts[0], out.texts
