"""Gemma 4 multimodal against transformers (a tiny random `Gemma4ForConditionalGeneration`, fp32: sliding and full
layers, per-layer inputs, a vision tower with clipped linears and standardised soft tokens): its folder loads as a
Gemma 4 text model plus its tower and embedder; the tower's image-token embeddings within 1e-5 on images of three
aspect ratios (each its own token count); logits with images and left padding within 1e-4, an image's tokens
seeing each other on the sliding layers only (causal everywhere is off, and so is bidirectional on every layer; so
are per-layer inputs that read the image token's own id); greedy tokens equal `transformers.generate` through the
reference decoding, the static sampler and the paged engine; the trainer's log-probs equal the sampled ones; the
export with the tower reloads in transformers; a trained tower's row features are the batch's."""
import dataclasses
import json

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vl_cases import (  # noqa: E402
    assert_both_samplers_decode,
    assert_export_reloads,
    assert_trainer_reads_the_sampled_log_probs,
)

from jaxrl_llm.hf import load_hf_folder  # noqa: E402
from jaxrl_llm.hf.vision import load_vision_tower  # noqa: E402
from jaxrl_llm.models.vision.qwen_vl import image_prompt, image_text_greedy, image_text_logits  # noqa: E402

PAD, BOS, START, END, IMAGE = 0, 2, 288, 289, 290
PROCESSOR = {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    text = transformers.Gemma4TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=300, use_bidirectional_attention="vision", pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=1)
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, pooling_kernel_size=2, patch_size=4, position_embedding_size=256, use_clipped_linears=True,
        standardize=True)
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None,
                                       image_token_id=IMAGE, boi_token_id=START, eoi_token_id=END,
                                       tie_word_embeddings=True)
    config._attn_implementation = "eager"
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers' init leaves the norms at one and the clip bounds open
        for p in model.model.vision_tower.parameters():
            p.normal_(0.0, 0.2)
        for name, b in model.model.vision_tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.5)
            elif name.endswith("std_bias"):
                b.normal_(0.0, 0.3)
            elif name.endswith("std_scale"):
                b.uniform_(0.5, 1.5)
        for p in model.model.embed_vision.parameters():
            p.normal_(0.0, 0.3)
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("layer_scalar"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if "norm" in name else 0.1)
    folder = tmp_path_factory.mktemp("gemma4vl")
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return model, folder


def processed(sizes):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    out = Gemma4ImageProcessorPil(**PROCESSOR)(images=images, return_tensors="np")
    positions = out["image_position_ids"]
    grids = np.stack([np.ones(len(positions), np.int64), positions[..., 1].max(1) + 1, positions[..., 0].max(1) + 1], 1)
    return np.asarray(out["pixel_values"], np.float32), positions, grids, list(out["num_soft_tokens_per_image"])


def batch():
    """(ids, mask, pixel_values, positions, grids) of two left-padded prompts: one wide image, and a square and a
    tall one between texts (63, 64 and 56 image tokens)."""
    pixels, positions, grids, counts = processed([(70, 50), (40, 40), (30, 90)])

    def image(n):
        return [START] + [IMAGE] * n + [END]

    rows = [[BOS, 10, 11, *image(counts[0]), 12, 13], [BOS, 20, *image(counts[1]), 21, 22, *image(counts[2]), 23, 24]]
    width = max(map(len, rows))
    ids = np.array([[PAD] * (width - len(r)) + r for r in rows], np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int64)
    return ids, mask, pixels, positions, grids


def hf_inputs(ids, mask, pixels, positions):
    return dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                pixel_values=torch.from_numpy(pixels), image_position_ids=torch.from_numpy(positions),
                mm_token_type_ids=torch.from_numpy((ids == IMAGE).astype(np.int64)))


def test_tower_and_logits_with_images_match_transformers(checkpoint):
    from jaxrl_llm.models.vision.gemma4_vit import gemma4_vision_features

    model, folder = checkpoint
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    assert (cfg.architecture, cfg.bidirectional_image_tokens, cfg.local_layer_ids) == ("Gemma4ForCausalLM", 1120,
                                                                                       (0,))
    assert (vl.image_token_id, vl.vision.max_soft_tokens, vl.vision.pooling_kernel_size) == (IMAGE, 70, 2)
    ids, mask, pixels, positions, grid = batch()
    with torch.no_grad():
        expected = model(**hf_inputs(ids, mask, pixels, positions)).logits.numpy()
        tower = model.model.get_image_features(torch.from_numpy(pixels), torch.from_numpy(positions)).pooler_output
    ours = np.asarray(gemma4_vision_features(vision, vl.vision, pixels, positions))
    for i, image in enumerate(tower):
        np.testing.assert_allclose(ours[i, :len(image)], image.numpy(), atol=1e-5, rtol=0)
    got = np.asarray(image_text_logits(params, cfg, vision, vl, ids, mask, pixels, grid))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=0)
    # causal image tokens miss what each image token sees of the image's later ones on the sliding layers
    causal = np.asarray(image_text_logits(params, dataclasses.replace(cfg, bidirectional_image_tokens=0), vision,
                                          vl, ids, mask, pixels, grid))
    assert np.abs(causal[valid] - expected[valid]).max() > 1e-3
    # transformers' per-layer inputs read the pad token's identity at image tokens, not the image token's
    table = params["ple_embedding"]
    moved = {**params, "ple_embedding": table.at[IMAGE].set(table[PAD] + 1.0)}
    np.testing.assert_allclose(np.asarray(image_text_logits(moved, cfg, vision, vl, ids, mask, pixels, grid))[valid],
                               got[valid], atol=1e-6, rtol=0)


def test_bidirectional_attention_is_on_the_sliding_layers_only(checkpoint):
    # with the window past the prompt's length the sliding mask is bidirectional within each image; Gemma 3's rule
    # (every layer) differs from transformers where Gemma 4's (sliding only) does not
    import jax.numpy as jnp

    from jaxrl_llm.models import model as model_module

    model, folder = checkpoint
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    ids, mask, pixels, positions, grid = batch()
    with torch.no_grad():
        expected = model(**hf_inputs(ids, mask, pixels, positions)).logits.numpy()
    valid = mask.astype(bool)
    original = model_module.attention_context
    calls = []

    def every_layer(*args, **kwargs):  # the full layers' causal mask replaced by the bidirectional one
        out = original(*args, **kwargs)
        if len(args) < 8 and "image_blocks" not in kwargs:
            calls.append(1)
            return out[0], jnp.asarray(first[1]), out[2], out[3]
        first[:] = out
        return out

    first: list = []
    model_module.attention_context = every_layer
    try:
        wrong = np.asarray(image_text_logits(params, cfg, vision, vl, ids, mask, pixels, grid))
    finally:
        model_module.attention_context = original
    assert calls  # the full layers asked for their own causal mask
    assert np.abs(wrong[valid] - expected[valid]).max() > 1e-3


def test_greedy_with_images_matches_transformers_generate_through_both_samplers(checkpoint):
    model, folder = checkpoint
    ids, mask, pixels, positions, grid = batch()
    with torch.no_grad():
        out = model.generate(**hf_inputs(ids, mask, pixels, positions), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=PAD)
    expected = out[:, ids.shape[1]:].numpy()
    assert len(np.unique(expected)) > 4  # the random model does not repeat one token
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    np.testing.assert_array_equal(np.asarray(image_text_greedy(params, cfg, vision, vl, ids, mask, pixels, grid, 6)),
                                  expected)
    # chunked prefill asked for: an image prompt prefills whole
    assert_both_samplers_decode(params, cfg, image_prompt(vision, vl, ids, mask, pixels, grid), ids, mask, expected,
                                prefill_chunks=(32,))


def test_the_trainers_log_probs_equal_the_sampled_ones_unpacked_and_packed(checkpoint):
    from jaxrl_llm.roles.forward import response_log_probs

    _, folder = checkpoint
    ids, mask, pixels, _, grid = batch()
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    scored = assert_trainer_reads_the_sampled_log_probs(params, cfg, image_prompt(vision, vl, ids, mask, pixels, grid),
                                                        ids, mask)
    input_ids, attention, rows, sampled, on = scored
    causal = np.asarray(response_log_probs(params, dataclasses.replace(cfg, bidirectional_image_tokens=0), input_ids,
                                           attention, 6, images=rows))
    assert np.abs(causal - sampled)[on].max() > 1e-3


def test_export_with_the_tower_reloads_in_transformers(checkpoint, tmp_path):
    model, folder = checkpoint
    ids, mask, pixels, positions, _ = batch()
    assert_export_reloads(model, transformers.Gemma4ForConditionalGeneration, folder, tmp_path / "hf",
                          hf_inputs(ids, mask, pixels, positions), mask)


def test_a_trained_towers_row_features_are_the_batchs(checkpoint):
    # actor.freeze_vision_tower=False: each row's patches through the tower give its image tokens' features as the
    # batch's tower does (each image its own count of the budget's cells)
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models.vision.tower_rows import prompt_tower_rows, row_tower_features

    _, folder = checkpoint
    ids, mask, pixels, _, grid = batch()
    vl, vision = load_vision_tower(folder)
    prompt = image_prompt(vision, vl, ids, mask, pixels, grid)
    rows = prompt_tower_rows(vl.vision, pixels, grid, [1, 2], 128)
    assert rows.pixels.shape == (2, 2, 280, 48) and rows.layout.shape == (2, 2, 280, 2)
    features, deepstack = row_tower_features(vision, vl.vision, jax.tree.map(jnp.asarray, rows))
    assert deepstack is None
    np.testing.assert_allclose(np.asarray(features[0, :63]), np.asarray(prompt.features[:63]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(features[1, :120]), np.asarray(prompt.features[63:183]), atol=1e-5)
