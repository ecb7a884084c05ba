"""Gemma 3 multimodal against transformers (a tiny random `Gemma3ForConditionalGeneration`, fp32, sliding and full
layers): its folder loads as a Gemma 3 text model plus its SigLIP tower and projector; the tower's image-token
embeddings within 1e-5; logits with images and left padding within 1e-4, an image's tokens seeing each other (a
causal mask is off, and so is a query chunk that stops at its last row where an image straddles two chunks); greedy
tokens equal `transformers.generate` through the reference decoding, the static sampler and the paged engine
(chunked prefill asked for: an image prompt prefills whole); the trainer's log-probs, unpacked and packed, equal
the sampled ones; the export with the tower reloads in transformers."""
import dataclasses

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

PAD, BOS, START, END, IMAGE = 0, 1, 288, 289, 290
TOKENS_PER_IMAGE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=56, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=IMAGE,
                                       boi_token_index=START, eoi_token_index=END, pad_token_id=PAD, eos_token_id=2,
                                       bos_token_id=BOS, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers' init leaves Gemma's (1 + w) norms and the projector near identity
        for p in model.model.vision_tower.parameters():
            p.normal_(0.0, 0.2)
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0.0, 0.3)
        for name, p in model.model.language_model.named_parameters():
            p.normal_(0.0, 0.15 if "norm" in name else 0.1)
    folder = tmp_path_factory.mktemp("gemma3vl")
    model.save_pretrained(folder)
    return model, folder


def batch(long: bool = False):
    """(ids, mask, pixel_values, grids) of two left-padded prompts: one image, and two images between texts; `long`:
    the first prompt's image straddles the first 128-token query chunk's end."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in [(70, 50), (56, 56),
                                                                                            (40, 90)]]
    pixels = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3)(
        images=images, return_tensors="np")["pixel_values"]
    image = [START] + [IMAGE] * TOKENS_PER_IMAGE + [END]
    lead = list(range(3, 128)) if long else [10, 11]
    rows = [[BOS, *lead, *image, 12, 13], [BOS, 20, *image, 21, 22, *image, 23, 24, 25]]
    width = max(map(len, rows))
    ids = np.array([[PAD] * (width - len(r)) + r for r in rows], np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int64)
    return ids, mask, np.asarray(pixels, np.float32), np.ones((len(images), 3), np.int64)


def hf_inputs(ids, mask, pixels):
    return dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                pixel_values=torch.from_numpy(pixels), token_type_ids=torch.from_numpy((ids == IMAGE).astype(np.int64)))


def test_tower_and_logits_with_images_match_transformers(checkpoint):
    from jaxrl_llm.models.vision.siglip import siglip_features

    model, folder = checkpoint
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    assert (cfg.architecture, cfg.bidirectional_image_tokens, cfg.local_layer_ids) == ("Gemma3ForCausalLM", 4, (0, 2))
    assert (vl.image_token_id, vl.vision.mm_tokens_per_image, vl.vision.pool) == (IMAGE, 4, 2)
    for long in (False, True):
        ids, mask, pixels, grid = batch(long)
        with torch.no_grad():
            expected = model(**hf_inputs(ids, mask, pixels)).logits.numpy()
            tower = model.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
        np.testing.assert_allclose(np.asarray(siglip_features(vision, vl.vision, pixels)), tower, atol=1e-5, rtol=0)
        got = np.asarray(image_text_logits(params, cfg, vision, vl, ids, mask, pixels, grid))
        valid = mask.astype(bool)
        np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=0)
        # causal image tokens (Qwen's mask) miss what each image token sees of the image's later ones
        causal = np.asarray(image_text_logits(params, dataclasses.replace(cfg, bidirectional_image_tokens=0), vision,
                                              vl, ids, mask, pixels, grid))
        assert np.abs(causal[valid] - expected[valid]).max() > 1e-3


def test_greedy_with_images_matches_transformers_generate_through_both_samplers(checkpoint):
    import jax

    from jaxrl_llm.sampler.engine.requests import RequestImages

    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        out = model.generate(**hf_inputs(ids, mask, pixels), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=PAD)
    expected = out[:, ids.shape[1]:].numpy()
    assert len(np.unique(expected)) > 4  # the random model does not repeat one token
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    np.testing.assert_array_equal(np.asarray(image_text_greedy(params, cfg, vision, vl, ids, mask, pixels, grid, 6)),
                                  expected)
    images = image_prompt(vision, vl, ids, mask, pixels, grid)
    requests = RequestImages.of_batch(images, mask)  # each prompt's features stay on the devices
    assert all(isinstance(r.features, jax.Array) and r.features.shape == (8, 64) for r in requests)
    # 8: an image would straddle two chunks; its prompt prefills whole
    assert_both_samplers_decode(params, cfg, images, ids, mask, expected, prefill_chunks=(None, 8))


def test_the_trainers_log_probs_equal_the_sampled_ones_unpacked_and_packed(checkpoint):
    import jax.numpy as jnp

    from jaxrl_llm.roles.forward import response_log_probs

    _, folder = checkpoint
    ids, mask, pixels, grid = batch()
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    scored = assert_trainer_reads_the_sampled_log_probs(params, cfg, image_prompt(vision, vl, ids, mask, pixels, grid),
                                                        ids, mask)
    input_ids, attention, rows, sampled, on = scored
    causal = np.asarray(response_log_probs(params, dataclasses.replace(cfg, bidirectional_image_tokens=0), input_ids,
                                           attention, 6, images=rows))
    assert np.abs(causal - sampled)[on].max() > 1e-3
    # in bf16 the rollout keeps the features in bf16 (half the bytes): every pass rounds them so first, same bits
    bf16 = lambda images: response_log_probs(params, cfg, input_ids, attention, 6, images=images,  # noqa: E731
                                             compute_dtype="bfloat16")
    halved = rows._replace(features=rows.features.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(bf16(halved)), np.asarray(bf16(rows)))


def test_export_with_the_tower_reloads_in_transformers(checkpoint, tmp_path):
    model, folder = checkpoint
    ids, mask, pixels, _ = batch()
    assert_export_reloads(model, transformers.Gemma3ForConditionalGeneration, folder, tmp_path / "hf",
                          hf_inputs(ids, mask, pixels), mask)


def test_a_trained_towers_row_features_are_the_batchs(checkpoint):
    # actor.freeze_vision_tower=False: each row's pixels through SigLIP and the projector give its image tokens'
    # features as the batch's tower does
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models.vision.tower_rows import prompt_tower_rows, row_tower_features

    _, folder = checkpoint
    ids, mask, pixels, grid = batch()
    vl, vision = load_vision_tower(folder)
    prompt = image_prompt(vision, vl, ids, mask, pixels, grid)
    rows = prompt_tower_rows(vl.vision, pixels, grid, [1, 2], 8)
    assert rows.pixels.shape == (2, 2, 3, 56, 56)  # I = 2: the first prompt repeats its image
    features, deepstack = row_tower_features(vision, vl.vision, jax.tree.map(jnp.asarray, rows))
    assert deepstack is None
    np.testing.assert_allclose(np.asarray(features[0, :4]), np.asarray(prompt.features[:4]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(features[1, :8]), np.asarray(prompt.features[4:12]), atol=1e-5)
