"""LoRA adapters exported as a PEFT folder load onto the HF base (transformers + peft) with our
logits; the merged export loads with the same logits too."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from tiny_models import build_hf_model, family_case, left_padded_batch, torch_logits

from jaxrl_llm.hf import export_hf, load_hf_folder
from jaxrl_llm.hf.peft import export_peft
from jaxrl_llm.models import compute_logits
from jaxrl_llm.models.lora import LoraConfig, init_lora, merge_lora, module_groups, with_lora

compute_logits = jax.jit(compute_logits, static_argnums=1)


@pytest.mark.parametrize("case,targets", [("llama", "all-linear"), ("qwen2", ("q_proj", "v_proj", "down_proj")),
                                          ("qwen2_moe", ("q_proj", "v_proj", "down_proj")),
                                          ("qwen3_moe", "all-linear"), ("qwen2_moe_mixed", ("v_proj", "down_proj")),
                                          ("gemma2", "all-linear"), ("gemma3", ("q_proj", "v_proj", "up_proj")),
                                          ("gpt_oss", "all-linear"), ("gemma4", "all-linear")])
def test_peft_adapter_folder_loads_with_equal_logits(case, targets, tmp_path, np_rng):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    family, overrides = family_case(case)
    build_hf_model(family, tmp_path / "base", **overrides)
    cfg, params = load_hf_folder(tmp_path / "base")
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    ad = init_lora(cfg, lora, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), 64))
    ad = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), ad)  # "trained": B != 0
    export_peft(cfg, ad, lora, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1."
    # mixture of experts: adapters on the attention and a shared expert only (routed experts have none)
    targets_present = [m for m in lora.targets if m in module_groups(cfg)]
    if family in ("qwen3_moe", "gpt_oss"):
        assert targets_present == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert config["target_modules"] == targets_present
    if "down_proj" in targets_present:
        mlp, width = (("mlp.shared_expert", cfg.shared_expert_intermediate_size) if family == "qwen2_moe"
                      else ("mlp", cfg.intermediate_size))
        assert tensors[prefix + f"{mlp}.down_proj.lora_A.weight"].shape == (4, width)  # [r, in]
    v_layer = "base_model.model.model.layers.0." if cfg.typed_layers else prefix  # Gemma 4's 1 is k = v
    assert tensors[v_layer + "self_attn.v_proj.lora_B.weight"].shape == (
        cfg.num_key_value_heads * cfg.head_dim, 4)  # [out, r]
    if cfg.mixed_layers:  # a dense layer's MLP has its own adapters (layer 1 above is sparse)
        assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (
            4, cfg.intermediate_size)
    if cfg.typed_layers:  # k / v adapters on the 4 layers that compute K / V (not on layer 1 and 3's v: k = v)
        assert len(tensors) == 2 * (cfg.num_hidden_layers * 5 + 4 + 2)
        assert tensors["base_model.model.model.layers.5.mlp.up_proj.lora_B.weight"].shape == (
            2 * cfg.intermediate_size, 4)  # double-wide on a sharing layer
    else:
        assert len(tensors) == 2 * cfg.num_hidden_layers * len(targets_present)

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids, mask = left_padded_batch(np_rng, cfg.vocab_size)
    full = with_lora(params, ad, lora.scale)
    ours = np.asarray(compute_logits(full, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    theirs = torch_logits(model, ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=1e-4)
    base_logits = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(base_logits - ours)[valid].max() > 1e-2  # the adapters change the logits

    # the merged weights exported as a plain HF folder give the same logits
    export_hf(cfg, jax.device_get(merge_lora(full)), tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(torch_logits(merged, ids, mask)[valid], theirs[valid], atol=1e-4, rtol=1e-4)
