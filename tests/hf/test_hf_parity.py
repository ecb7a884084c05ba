"""Logits parity with transformers (torch fp32) for tiny random models of every family."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import (
    DEEPSEEK,
    GEMMA,
    GEMMA4,
    GPT_OSS,
    MIXED_MOE,
    QWEN35,
    TINY_HF,
    WINDOW_LAYERS,
    build_hf_model,
    left_padded_batch,
    torch_logits,
)

from jaxrl_llm.hf import load_hf_folder
from jaxrl_llm.models import compute_logits, forward_hidden, score_from_hidden

compute_logits = jax.jit(compute_logits, static_argnums=1)
forward_hidden = jax.jit(forward_hidden, static_argnums=1)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5e5}

CASES = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama_linear_rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1e4}}),
    "mistral_window": ("mistral", {"sliding_window": 4}),
    **WINDOW_LAYERS,  # per-layer sliding windows: from max_window_layers, from layer_types
    **GEMMA,  # Gemma 2 (soft-caps) and Gemma 3 (QK-norm, local RoPE base)
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
    **MIXED_MOE,  # dense MLP layers between the sparse ones
    **GPT_OSS,  # attention sinks, biases, alternating windows, top-k softmax router, clamped SwiGLU, YaRN
    **GEMMA4,  # per-type head shapes, k = v, shared KV, per-layer inputs, layer scalars, proportional RoPE
    **DEEPSEEK,  # multi-head latent attention, YaRN with mscales, sigmoid group-limited router, shared experts
    **QWEN35,  # gated delta-net layers between gated attention layers, partial RoPE, (1 + w) norms
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_left_padded(case, tmp_path, np_rng):
    family, overrides = CASES[case]
    model = build_hf_model(family, tmp_path, **overrides)
    cfg, params = load_hf_folder(tmp_path)
    assert cfg.model_type == family
    assert cfg.mixed_windows == ("layer" in case or case in GEMMA or case in GPT_OSS or case in GEMMA4)
    ids, mask = left_padded_batch(np_rng, cfg.vocab_size)
    expected = torch_logits(model, ids, mask)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - expected[valid]).max() <= 1e-4
    # a left-padded row equals the same row run alone, unpadded
    n = int(mask[2].sum())
    alone = compute_logits(params, cfg, jnp.asarray(ids[2:, -n:]), jnp.ones((1, n), jnp.int32))
    assert np.abs(np.asarray(alone)[0] - ours[2, -n:]).max() <= 1e-4


def test_score_head_matches_sequence_classification(tmp_path, np_rng):
    model = build_hf_model("llama", tmp_path, head="score", num_labels=3)
    cfg, params = load_hf_folder(tmp_path)
    assert params["score"]["kernel"].shape == (cfg.hidden_size, 3)
    ids, mask = left_padded_batch(np_rng, cfg.vocab_size, pad_id=0)
    ids[mask == 0] = 0
    ids[mask == 1] = np.where(ids[mask == 1] == 0, 5, ids[mask == 1])  # HF finds pads by id
    expected = torch_logits(model, ids, mask)
    hidden, _ = forward_hidden(params, cfg, jnp.asarray(ids), jnp.asarray(mask))
    ours = np.asarray(score_from_hidden(params, hidden, jnp.asarray(mask)))
    assert ours.shape == (3, 3)
    assert np.abs(ours - expected).max() <= 1e-4


@pytest.mark.parametrize("family,rope", [
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}),
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4,
               "beta_fast": 16, "attention_factor": 0.9}),
    ("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
])
def test_rope_scaling_beyond_the_original_context_matches_transformers(family, rope, tmp_path):
    """YaRN (frequency ramp and attention factor) and dynamic NTK at positions past the pre-training
    context of 32: logits equal transformers', and dropping the scaling would not."""
    import dataclasses

    model = build_hf_model(family, tmp_path, rope_parameters=rope, max_position_embeddings=32)
    cfg, params = load_hf_folder(tmp_path)
    assert cfg.rope_scaling_dict["rope_type"] == rope["rope_type"]
    assert cfg.context_length == (128 if rope["rope_type"] == "yarn" else 64)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 60))
    mask = np.ones_like(ids)
    expected = torch_logits(model, ids, mask)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(ours - expected).max() <= 1e-4
    plain = np.asarray(compute_logits(params, dataclasses.replace(cfg, rope_scaling=None), jnp.asarray(ids),
                                      jnp.asarray(mask)))
    assert np.abs(plain - expected)[:, 33:].max() > 1e-3
    again = type(cfg).from_hf_config(cfg.to_hf_config())  # config.json round trip keeps the scaling
    assert again.rope_scaling == cfg.rope_scaling and again.context_length == cfg.context_length


def _multimodal_gemma(version: int):
    """(family, a random tiny Gemma 3 / Gemma 4 ForConditionalGeneration model: a vision tower beside the text
    model of the GEMMA / GEMMA4 case, image tokens 250-252)."""
    import torch
    import transformers

    if version == 3:
        family, overrides = GEMMA["gemma3"]
        text = transformers.Gemma3TextConfig(**{**TINY_HF, **overrides})
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                           mm_tokens_per_image=4, image_token_index=250, boi_token_index=251,
                                           eoi_token_index=252)
    else:
        family, overrides = GEMMA4["gemma4"]
        text = transformers.Gemma4TextConfig(**{**TINY_HF, **overrides})
        vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=2, head_dim=16)
        config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                           audio_config=None, image_token_id=250, boi_token_id=251, eoi_token_id=252)
    torch.manual_seed(0)
    model = getattr(transformers, f"Gemma{version}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return family, model


@pytest.mark.parametrize("version", [3, 4])
def test_gemma_multimodal_checkpoint_loads_its_text_tower(version, tmp_path, np_rng):
    """A Gemma3ForConditionalGeneration folder (vision tower, `language_model.model.*` tensors, a sparse
    text_config) or a Gemma4ForConditionalGeneration one (`model.language_model.*`, Gemma 4's traits) is read as
    its language model: logits equal the multimodal model's on text."""
    import json

    family, model = _multimodal_gemma(version)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == f"gemma{version}"
    cfg, params = load_hf_folder(tmp_path)
    assert (cfg.architecture, cfg.model_type) == (f"Gemma{version}ForCausalLM", family)
    assert cfg.local_layer_ids == ((0, 2) if version == 3 else (0, 2, 4))
    ids, mask = left_padded_batch(np_rng, cfg.vocab_size)
    ids[ids >= 250] = 5  # text only: no image placeholder tokens
    expected = torch_logits(model, ids, mask)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - expected[valid]).max() <= 1e-4


def test_qwen35_multimodal_checkpoint_loads_its_text_tower(tmp_path, np_rng):
    """A Qwen3_5ForConditionalGeneration folder (the released Qwen3.5 models: a vision tower, `model.visual.*`,
    beside `model.language_model.*`, the text model's config under `text_config`) is read as its language model,
    `Qwen3_5ForCausalLM`: logits equal the multimodal model's on text."""
    import json

    import torch
    import transformers

    family, overrides = QWEN35["qwen3_5"]
    text = transformers.Qwen3_5TextConfig(**{**TINY_HF, **overrides})
    vision = transformers.models.qwen3_5.configuration_qwen3_5.Qwen3_5VisionConfig(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                        image_token_id=250, video_token_id=251, vision_start_token_id=252,
                                        vision_end_token_id=253)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    cfg, params = load_hf_folder(tmp_path)
    assert (cfg.architecture, cfg.model_type, cfg.linear_layers) == ("Qwen3_5ForCausalLM", family, (0, 2))
    ids, mask = left_padded_batch(np_rng, cfg.vocab_size)
    ids[ids >= 250] = 5  # text only: no vision tokens
    expected = torch_logits(model, ids, mask)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - expected[valid]).max() <= 1e-4
