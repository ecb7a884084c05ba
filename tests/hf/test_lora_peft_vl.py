"""A vision-language policy's LoRA adapters as a PEFT folder (`export_peft(..., tower=)`): the text model's adapters
under transformers 5's `model.language_model.layers.*`, LoRA on the tower under the tower's module paths (Qwen2.5-VL's
fused qkv as it is, SigLIP's split into its q / k / v projections with the shared A, Gemma 4's clippable linears'
inner `.linear`), `target_modules` the regex of exactly those modules; `PeftModel.from_pretrained` on transformers'
VL model gives our logits on rows with images (base + adapters, the tower's merged)."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from vl_cases import END, IMAGE, PAD, START, image_rows  # noqa: E402

PROCESSOR4 = {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2}


def _pictures(sizes):
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def qwen2_5_vl(folder):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=291,
        pad_token_id=PAD, tie_word_embeddings=False)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    out = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16)(
        images=_pictures([(56, 56), (56, 84), (84, 56)]), return_tensors="np")
    ids, mask = image_rows((out["image_grid_thw"].prod(-1) // 4).tolist())
    inputs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                  mm_token_type_ids=(ids == IMAGE).astype(np.int64))
    return model, ids, mask, out["pixel_values"], out["image_grid_thw"], inputs


def gemma3(folder):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    text = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=56, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START,
                                       eoi_token_index=END, pad_token_id=PAD, tie_word_embeddings=False)
    model = transformers.Gemma3ForConditionalGeneration(config)
    pixels = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})(
        images=_pictures([(56, 56), (60, 40), (40, 90)]), return_tensors="np")["pixel_values"]
    ids, mask = image_rows([4, 4, 4])
    return model, ids, mask, pixels, np.ones((3, 3), np.int64), dict(
        pixel_values=pixels, token_type_ids=(ids == IMAGE).astype(np.int64))


def gemma4(folder):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    text = transformers.Gemma4TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention="vision", pad_token_id=PAD)
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                             pooling_kernel_size=2, patch_size=4, position_embedding_size=64)
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None,
                                       image_token_id=IMAGE, boi_token_id=START, eoi_token_id=END)
    model = transformers.Gemma4ForConditionalGeneration(config)
    out = Gemma4ImageProcessorPil(**PROCESSOR4)(images=_pictures([(56, 40), (40, 40), (30, 60)]),
                                                return_tensors="np")
    positions = out["image_position_ids"]
    grid = np.stack([np.ones(3, np.int64), positions[..., 1].max(1) + 1, positions[..., 0].max(1) + 1], 1)
    ids, mask = image_rows(list(out["num_soft_tokens_per_image"]))
    return model, ids, mask, out["pixel_values"], grid, dict(pixel_values=out["pixel_values"],
                                                             image_position_ids=positions,
                                                             mm_token_type_ids=(ids == IMAGE).astype(np.int64))


@pytest.mark.parametrize("build", [qwen2_5_vl, gemma3, gemma4], ids=["qwen2_5_vl", "gemma3", "gemma4"])
def test_vl_peft_folder_loads_with_our_logits_tower_adapters_included(build, tmp_path):
    from peft import PeftModel

    from jaxrl_llm.hf import load_hf_folder
    from jaxrl_llm.hf.peft import export_peft
    from jaxrl_llm.hf.vision import load_vision_tower
    from jaxrl_llm.models.lora import LoraConfig, init_lora, with_lora
    from jaxrl_llm.models.vision.qwen_vl import image_text_logits
    from jaxrl_llm.models.vision.tower_lora import init_tower_lora, merged_tower

    torch.manual_seed(0)
    model, ids, mask, pixels, grid, extra = build(tmp_path / "base")
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15 if "norm" in name else 0.1)
    model.eval().save_pretrained(tmp_path / "base")
    if build is gemma4:
        (tmp_path / "base" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR4))
    cfg, params = load_hf_folder(tmp_path / "base")
    vl, vision = load_vision_tower(tmp_path / "base")
    lora = LoraConfig(rank=2, alpha=4.0, targets="all-linear")
    adapters = init_lora(cfg, lora, jax.random.key(1))
    adapters["vision"] = init_tower_lora(vision, 2, jax.random.key(2))
    keys = iter(jax.random.split(jax.random.key(3), 256))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)  # B != 0
    adapters["vision"] = jax.tree.map(lambda x: x + 0.5 * jax.random.normal(next(keys), x.shape), adapters["vision"])
    export_peft(cfg, adapters, lora, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"),
                tower=vl.vision)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    targets = config["target_modules"]  # the regex of exactly the adapted modules, the text's and the tower's
    assert isinstance(targets, str) and r"model\.language_model\.layers\.0\.self_attn\.q_proj" in targets.split("|")
    assert sum(m.startswith(r"model\.vision_tower" if build is not qwen2_5_vl else r"model\.visual")
               for m in targets.split("|")) >= 2 * len(adapters["vision"]["blocks"])

    ours = np.asarray(image_text_logits(with_lora(params, {k: v for k, v in adapters.items() if k != "vision"},
                                                  lora.scale), cfg,
                                        merged_tower(vision, adapters["vision"], lora.scale), vl, ids, mask, pixels,
                                        grid))
    base = type(model).from_pretrained(tmp_path / "base", dtype=torch.float32, attn_implementation="eager").eval()
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                            **{k: torch.from_numpy(np.asarray(v)) for k, v in extra.items()}).logits.numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=1e-4)
    # the tower's adapters are in what PEFT loaded: without them the logits move
    no_tower = np.asarray(image_text_logits(with_lora(params, {k: v for k, v in adapters.items() if k != "vision"},
                                                      lora.scale), cfg, vision, vl, ids, mask, pixels, grid))
    assert np.abs(no_tower[valid] - theirs[valid]).max() > 1e-3
