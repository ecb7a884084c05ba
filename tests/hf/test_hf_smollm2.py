"""SmolLM2-135M-Instruct (Q4_1 GGUF): parity with transformers' own GGUF load, tokenizer, export."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.hf import export_hf, load_gguf, load_tokenizer
from jaxrl_llm.models import compute_logits, greedy_generate

pytestmark = pytest.mark.slow


@pytest.mark.optimized_xla  # real SmolLM2 forwards: running, not compiling
def test_smollm2_gguf_parity_tokenizer_and_export(smollm2_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    cfg, params = load_gguf(smollm2_gguf)
    assert (cfg.rope_theta, cfg.tie_word_embeddings, cfg.num_key_value_heads) == (1e5, True, 3)
    tok = load_tokenizer(smollm2_gguf)
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    chat = [{"role": "user", "content": "What is 2+3?"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_end|>" in text

    prompts = [text, "The capital of France is"]
    batch = tok(prompts, return_tensors="np", padding=True, padding_side="left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert mask[1, 0] == 0  # the second row is left-padded

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = np.asarray(jax.jit(compute_logits, static_argnums=1)(params, cfg, jnp.asarray(ids),
                                                                jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - expected[valid]).max() <= 1e-3

    out = export_hf(cfg, params, tmp_path / "smollm2", tokenizer=tok)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        again = exported(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        hf_tokens = exported.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                      max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=tok.pad_token_id)[:, ids.shape[1]:].numpy()
    # the export holds exactly the weights transformers dequantises from the GGUF
    assert np.abs(again[valid] - expected[valid]).max() <= 1e-5
    assert np.abs(ours[valid] - again[valid]).max() <= 1e-3
    ours_tokens = np.asarray(greedy_generate(params, cfg, jnp.asarray(ids), jnp.asarray(mask), 8))
    np.testing.assert_array_equal(ours_tokens, hf_tokens)
    reloaded = load_tokenizer(out)
    assert reloaded.chat_template == tok.chat_template and reloaded.eos_token == "<|im_end|>"


def test_a_gguf_tokenizer_is_kept_as_a_folder_and_read_back_the_same(smollm2_gguf, tmp_path, monkeypatch):
    """Building a tokenizer from GGUF metadata takes seconds per process: the first load keeps it as an
    HF folder (jaxrl_llm/hf/tokenizer.py `tokenizer_cache_dir`) and the next reads that folder, with the
    same ids, special tokens and chat template as transformers' own GGUF load."""
    from transformers import AutoTokenizer

    from jaxrl_llm.hf import tokenizer as tokenizer_module

    monkeypatch.setenv("JAXRL_LLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf_reads = []
    real = AutoTokenizer.from_pretrained

    def counting(*args, **kwargs):
        gguf_reads.append(kwargs.get("gguf_file"))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counting)
    first = tokenizer_module._load_tokenizer_cached.__wrapped__(str(smollm2_gguf.resolve()), 0)
    [folder] = (tmp_path / "cache" / "tokenizers").iterdir()
    assert folder.name.startswith(smollm2_gguf.stem) and (folder / "tokenizer_config.json").is_file()
    second = tokenizer_module._load_tokenizer_cached.__wrapped__(str(smollm2_gguf.resolve()), 0)
    assert gguf_reads == [smollm2_gguf.name, None]  # the second load read the folder, not the GGUF file
    reference = real(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    texts = ["The capital of France is", "12+7=19, then 3*4=12.", "naïve café — ünïcödé 日本語", "  spaced\n\tout  "]
    for tok in (first, second):
        assert len(tok) == len(reference) and tok.chat_template == reference.chat_template
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
            reference.bos_token_id, reference.eos_token_id, reference.eos_token_id)
        assert [tok(t)["input_ids"] for t in texts] == [reference(t)["input_ids"] for t in texts]
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
            reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
