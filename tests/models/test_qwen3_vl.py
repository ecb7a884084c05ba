"""Qwen3-VL against transformers (a tiny random `Qwen3VLForConditionalGeneration`, fp32): its folder loads as a
Qwen3 text model with interleaved M-RoPE plus its tower; logits with images and left padding within 1e-4; greedy
tokens equal `transformers.generate` through the reference decoding, the static sampler and the paged engine; the
deepstack features and the interleaved layout each matter."""
import dataclasses

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vl_cases import (  # noqa: E402
    END,
    IMAGE,
    PAD,
    START,
    assert_export_reloads,
    assert_trainer_reads_the_sampled_log_probs,
    hf_inputs,
    image_rows,
)

from jaxrl_llm.hf import load_hf_folder  # noqa: E402
from jaxrl_llm.hf.vision import load_vision_tower  # noqa: E402
from jaxrl_llm.models.vision.qwen_vl import image_prompt, image_text_greedy, image_text_logits  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                         tie_word_embeddings=False),
        vision_config=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=25, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=291,
        pad_token_id=PAD, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.normal_(0.0, 0.2)
        for name, p in model.model.language_model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    folder = tmp_path_factory.mktemp("qwen3vl")
    model.save_pretrained(folder)
    return model, folder


def batch():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(1)
    sizes = [(96, 64), (64, 64), (64, 128)]  # 6, 4 and 8 image tokens (32-pixel merge blocks)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    out = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32, max_pixels=32 * 32 * 64)(
        images=images, return_tensors="np")
    ids, mask = image_rows((out["image_grid_thw"].prod(-1) // 4).tolist())
    return ids, mask, out["pixel_values"], out["image_grid_thw"]


def test_logits_with_images_match_transformers(checkpoint):
    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        expected = model(**hf_inputs(ids, mask, pixels, grid)).logits.numpy()
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.mrope_interleaved and cfg.mrope_section == (2, 3, 3)
    assert vl.deepstack_layers == 2
    got = np.asarray(image_text_logits(params, cfg, vision, vl, ids, mask, pixels, grid))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=0)
    # the interleaved layout and the deepstack features each move the logits
    contiguous = np.asarray(image_text_logits(params, dataclasses.replace(cfg, mrope_interleaved=False), vision, vl,
                                              ids, mask, pixels, grid))
    assert np.abs(contiguous[valid] - expected[valid]).max() > 1e-3
    no_deepstack = {**vision, "deepstack": jax_zeros_like(vision["deepstack"])}
    flat = np.asarray(image_text_logits(params, cfg, no_deepstack, vl, ids, mask, pixels, grid))
    assert np.abs(flat[valid] - expected[valid]).max() > 1e-3


def jax_zeros_like(tree):
    import jax

    return jax.tree.map(np.zeros_like, tree)


def test_greedy_with_images_matches_transformers_generate_through_both_samplers(checkpoint):
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.sampler import SamplingParams, sample
    from jaxrl_llm.sampler.engine import PagedEngine
    from jaxrl_llm.sampler.engine.requests import RequestImages
    from jaxrl_llm.sampler.engine.setup import EngineOptions, engine_spec

    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        out = model.generate(**hf_inputs(ids, mask, pixels, grid), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=PAD)
    expected = out[:, ids.shape[1]:].numpy()
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    np.testing.assert_array_equal(np.asarray(image_text_greedy(params, cfg, vision, vl, ids, mask, pixels, grid, 6)),
                                  expected)
    images = image_prompt(vision, vl, ids, mask, pixels, grid)
    settings, knobs = SamplingParams(max_new_tokens=6, do_sample=False, n=2).compile_args((), PAD,
                                                                                         vocab_size=cfg.vocab_size)
    static = sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(3), knobs, settings=settings,
                    images=images)
    np.testing.assert_array_equal(np.asarray(static.tokens), np.repeat(expected, 2, 0))
    requests = RequestImages.of_batch(jax.tree.map(np.asarray, images), mask)
    spec = engine_spec(cfg, EngineOptions(engine="paged"), num_requests=4, max_prompt_len=ids.shape[1],
                       max_new_tokens=6, compute_dtype="float32")
    for chunk in (None, 8):
        engine = PagedEngine(cfg, spec, steps_per_call=2, prefill_chunk=chunk)
        paged, _ = engine.run(params, [row[m > 0].tolist() for row, m in zip(ids, mask)], jax.random.key(3), knobs,
                              settings, images=requests)
        np.testing.assert_array_equal(paged.tokens, np.repeat(expected, 2, 0))


def test_the_trainers_log_probs_read_the_deepstack_features_unpacked_and_packed(checkpoint):
    # each row's features and deepstack features (RowImages) give the trainer's forward the sampler's log-probs;
    # packed with the rows of a prompt sharing its tokens, the same
    import jax.numpy as jnp

    from jaxrl_llm.roles.forward import response_log_probs

    _, folder = checkpoint
    ids, mask, pixels, grid = batch()
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    input_ids, attention, rows, sampled, on = assert_trainer_reads_the_sampled_log_probs(
        params, cfg, image_prompt(vision, vl, ids, mask, pixels, grid), ids, mask)
    assert rows.deepstack is not None and rows.deepstack.shape[:2] == (4, 2)
    blind = np.asarray(response_log_probs(params, cfg, input_ids, attention, 6,
                                          images=rows._replace(deepstack=jnp.zeros_like(rows.deepstack))))
    assert np.abs(blind - sampled)[on].max() > 1e-3


def test_export_with_the_tower_reloads_in_transformers(checkpoint, tmp_path):
    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    assert_export_reloads(model, transformers.Qwen3VLForConditionalGeneration, folder, tmp_path / "hf",
                          hf_inputs(ids, mask, pixels, grid), mask)


def test_a_trained_towers_row_features_are_the_batchs(checkpoint):
    # actor.freeze_vision_tower=False: each row's pixels through the tower (models/vision/tower_rows.py) give the
    # features and deepstack features the batch's image-by-image tower gives its image tokens
    import jax.numpy as jnp

    from jaxrl_llm.models.vision.qwen_vl import feature_bucket
    from jaxrl_llm.models.vision.tower_rows import prompt_tower_rows, row_tower_features

    _, folder = checkpoint
    ids, mask, pixels, grid = batch()
    vl, vision = load_vision_tower(folder)
    prompt = image_prompt(vision, vl, ids, mask, pixels, grid)
    counts = [1, 2]
    room = feature_bucket(int((np.asarray(prompt.slots) >= 0).sum(axis=1).max()))
    rows = prompt_tower_rows(vl.vision, pixels, grid, counts, room)
    features, deepstack = row_tower_features(vision, vl.vision, jax_tree(jnp.asarray, rows))
    per_row = (grid.prod(-1) // 4).tolist()  # 6; 4 + 8 features
    own = [(0, per_row[0]), (per_row[0], per_row[0] + per_row[1] + per_row[2])]
    for b, (start, end) in enumerate(own):
        np.testing.assert_allclose(np.asarray(features[b, :end - start]), np.asarray(prompt.features[start:end]),
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(deepstack[b, :, :end - start]),
                                   np.asarray(prompt.deepstack[:, start:end]), atol=1e-5)


def jax_tree(fn, tree):
    import jax

    return jax.tree.map(fn, tree)
