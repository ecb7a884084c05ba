"""Export -> transformers.from_pretrained: same logits, same greedy continuation; sharded export."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import build_hf_model, family_case, left_padded_batch, torch_logits

from jaxrl_llm.hf import export_hf, load_hf_folder, load_tokenizer
from jaxrl_llm.models import compute_logits, greedy_generate

compute_logits = jax.jit(compute_logits, static_argnums=1)
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", chat_template=CHAT_TEMPLATE)


def _hf_greedy(model, ids: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


@pytest.mark.parametrize("case,shard", [("qwen3", None), ("llama", 40_000), ("qwen2_moe", 40_000), ("mixtral", None),
                                        ("qwen2_moe_mixed", 40_000), ("qwen3_layer_types", None),
                                        ("gemma2", None), ("gemma3", 40_000), ("gpt_oss", 40_000),
                                        ("gemma4", 40_000), ("gemma4_plain", None), ("gemma4_moe", 40_000),
                                        ("deepseek_v3", 40_000), ("deepseek_v3_plain", None), ("qwen3_5", 40_000)])
def test_export_roundtrip_logits_and_greedy(case, shard, tmp_path, np_rng):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family, overrides = family_case(case)
    build_hf_model(family, tmp_path / "src", tie_word_embeddings=(family == "llama"), **overrides)
    cfg, params = load_hf_folder(tmp_path / "src")
    out = tmp_path / "out"
    kw = {} if shard is None else {"max_shard_size": shard}
    export_hf(cfg, params, out, tokenizer=_tiny_tokenizer(), **kw)
    if shard is not None:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert not (out / "model.safetensors").exists()
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"], gen["bos_token_id"]) == (2, 0, 1)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == cfg.architecture
    ids, mask = left_padded_batch(np_rng, cfg.vocab_size)
    expected = torch_logits(hf, ids, mask)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - expected[valid]).max() <= 1e-4

    ours_tokens = np.asarray(greedy_generate(params, cfg, jnp.asarray(ids), jnp.asarray(mask), 6))
    np.testing.assert_array_equal(ours_tokens, _hf_greedy(hf, ids, mask, 6))

    cfg2, params2 = load_hf_folder(out)  # our own loader reads the export back
    assert cfg2 == cfg
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params,
                                            params2)))
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "</s>"
    assert load_tokenizer(out).pad_token == "<pad>"


def test_export_score_head_and_bf16(tmp_path, np_rng):
    from transformers import AutoModelForSequenceClassification

    build_hf_model("qwen2", tmp_path / "src", head="score", num_labels=1)
    cfg, params = load_hf_folder(tmp_path / "src")
    export_hf(cfg, params, tmp_path / "out", dtype=jnp.bfloat16)
    hf_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["Qwen2ForSequenceClassification"]
    assert hf_cfg["dtype"] == "bfloat16"
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert hf.config.num_labels == 1
    cfg2, params2 = load_hf_folder(tmp_path / "out")
    assert params2["score"]["kernel"].shape == (cfg.hidden_size, 1)
    np.testing.assert_allclose(np.asarray(params2["score"]["kernel"]),
                               np.asarray(params["score"]["kernel"]), rtol=1e-2, atol=1e-2)


def test_convert_to_hf_cli(tmp_path):
    import importlib.util
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[2] / "launch" / "convert_to_hf.py"
    spec = importlib.util.spec_from_file_location("convert_to_hf", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    build_hf_model("mistral", tmp_path / "src")
    assert module.main(["--input", str(tmp_path / "src"), "--output", str(tmp_path / "out"),
                        "--dtype", "bfloat16", "--no-tokenizer"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    cfg, params = load_hf_folder(tmp_path / "out", dtype=jnp.bfloat16)
    assert cfg.model_type == "mistral" and params["embedding"].dtype == jnp.bfloat16
