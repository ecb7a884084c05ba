"""Qwen2.5-VL (models/vision/qwen_vl.py, hf/vision.py) against transformers' Qwen2_5_VLForConditionalGeneration:
a tiny random checkpoint saved by transformers and loaded by ours; logits with images and left padding within
1e-4 (fp32), M-RoPE positions and decode deltas equal to get_rope_index's; M-RoPE and the image features each
matter; the folder's text model alone loads for text RL."""
import dataclasses

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from vl_cases import END, IMAGE, PAD, START, assert_rescored, hf_inputs, image_rows  # noqa: E402

from jaxrl_llm.hf import load_hf_folder  # noqa: E402
from jaxrl_llm.hf.vision import load_vision_tower  # noqa: E402
from jaxrl_llm.models import compute_logits  # noqa: E402
from jaxrl_llm.models.vision.qwen_vl import image_text_logits, mrope_positions  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                         tie_word_embeddings=False),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=291,
        pad_token_id=PAD, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the init's 0.02: the features and positions then move the logits clearly
        for p in model.model.visual.parameters():
            p.normal_(0.0, 0.2)
        for name, p in model.model.language_model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    folder = tmp_path_factory.mktemp("qwen25vl")
    model.save_pretrained(folder)
    return model, folder


def batch():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(1)
    sizes = [(84, 56), (56, 56), (56, 112)]  # 6, 4 and 8 image tokens
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    out = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 64)(images=images, return_tensors="np")
    ids, mask = image_rows((out["image_grid_thw"].prod(-1) // 4).tolist())
    return ids, mask, out["pixel_values"], out["image_grid_thw"]


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """(transformers.generate's 6 greedy tokens per prompt, repeated for n = 2 samples; (params, cfg, tower
    params, VisionLanguage) as ours loads the folder): what both samplers' tests check against."""
    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        out = model.generate(**hf_inputs(ids, mask, pixels, grid), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=PAD)
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    return np.repeat(out[:, ids.shape[1]:].numpy(), 2, 0), (params, cfg, vision, vl)


def test_logits_with_images_match_transformers(checkpoint):
    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        expected = model(**hf_inputs(ids, mask, pixels, grid)).logits.numpy()
        hf_positions, hf_deltas = model.model.get_rope_index(
            torch.from_numpy(ids), mm_token_type_ids=torch.from_numpy((ids == IMAGE).astype(np.int64)),
            image_grid_thw=torch.from_numpy(grid), attention_mask=torch.from_numpy(mask))
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    assert cfg.mrope_section == (2, 3, 3) and cfg.architecture == "Qwen2ForCausalLM"
    positions, deltas = mrope_positions(ids, mask, grid, vl)
    np.testing.assert_array_equal(positions, hf_positions.numpy())
    np.testing.assert_array_equal(deltas, hf_deltas.numpy()[:, 0])
    got = np.asarray(image_text_logits(params, cfg, vision, vl, ids, mask, pixels, grid))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=0)
    # M-RoPE's streams and the image features each move the logits
    plain = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(plain[valid] - expected[valid]).max() > 1e-3
    flat = np.asarray(image_text_logits(params, dataclasses.replace(cfg, mrope_section=(8, 0, 0)), vision, vl, ids,
                                        mask, pixels, grid))  # every frequency on the temporal stream
    assert np.abs(flat[valid] - expected[valid]).max() > 1e-3


def test_text_rows_need_no_vision_tower(checkpoint):
    # the folder's text model alone (what text RL trains): text-only rows equal transformers' without images
    model, folder = checkpoint
    cfg, params = load_hf_folder(folder)
    ids = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = (ids > 0).astype(np.int64)
    mask[1] = 1
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    got = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(got[mask > 0], expected[mask > 0], atol=1e-4, rtol=0)


def test_token_and_image_counts_must_agree(checkpoint):
    _, folder = checkpoint
    vl, _ = load_vision_tower(folder)
    ids, mask, _, grid = batch()
    with pytest.raises(ValueError, match=r"row 1: a run of 4 image tokens for an image of 8 merged blocks"):
        mrope_positions(ids, mask, grid[[0, 2, 1]], vl)
    with pytest.raises(ValueError, match="more runs of image tokens than images"):
        mrope_positions(ids, mask, grid[:2], vl)


def test_greedy_with_images_matches_transformers_generate(checkpoint, monkeypatch):
    # decode positions: each row's 1-D position plus its M-RoPE delta (left padding in row 0)
    from jaxrl_llm.models.vision import qwen_vl
    from jaxrl_llm.models.vision.qwen_vl import image_text_greedy

    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        out = model.generate(**hf_inputs(ids, mask, pixels, grid), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=PAD)
    expected = out[:, ids.shape[1]:].numpy()
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    got = np.asarray(image_text_greedy(params, cfg, vision, vl, ids, mask, pixels, grid, 8))
    np.testing.assert_array_equal(got, expected)
    # without the deltas (decode at the row's token count) the continuation changes
    positions_of = qwen_vl.mrope_positions
    monkeypatch.setattr(qwen_vl, "mrope_positions", lambda *a: (positions_of(*a)[0], np.zeros(2, np.int32)))
    assert (np.asarray(image_text_greedy(params, cfg, vision, vl, ids, mask, pixels, grid, 8)) != expected).any()


def test_static_sampler_with_images_follows_transformers_and_the_rescoring(loaded):
    # the sampler's prefill with the image features and M-RoPE positions, decode at each row's delta: greedy
    # tokens (n = 2 samples a prompt) are transformers', sampled tokens' log-probs the full forward's
    import jax

    from jaxrl_llm.models.vision.qwen_vl import image_prompt
    from jaxrl_llm.sampler import SamplingParams, sample

    expected, (params, cfg, vision, vl) = loaded
    ids, mask, pixels, grid = batch()
    images = image_prompt(vision, vl, ids, mask, pixels, grid)
    for sp in (SamplingParams(max_new_tokens=6, do_sample=False, n=2), SamplingParams(max_new_tokens=6, n=2)):
        settings, knobs = sp.compile_args((), PAD, vocab_size=cfg.vocab_size)
        got = sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(3), knobs, settings=settings,
                     images=images)
        if not sp.do_sample:
            np.testing.assert_array_equal(np.asarray(got.tokens), expected)
            continue
        assert_rescored(got.tokens, got.response_mask, got.log_probs, ids, mask, pixels, grid,
                        (params, cfg, vision, vl))


@pytest.mark.parametrize("chunk", [None, 8])
def test_paged_engine_with_images_follows_transformers_and_the_rescoring(loaded, chunk):
    # each prompt prefilled once with its features and M-RoPE positions (whole, or 8 tokens at a time), its two
    # samples sharing its pages (cascade attention), each slot decoding at its position plus its delta: greedy
    # tokens are transformers', sampled tokens' log-probs the full forward's
    import jax

    from jaxrl_llm.models.vision.qwen_vl import image_prompt
    from jaxrl_llm.sampler import SamplingParams
    from jaxrl_llm.sampler.engine import PagedEngine
    from jaxrl_llm.sampler.engine.requests import RequestImages
    from jaxrl_llm.sampler.engine.setup import EngineOptions, engine_spec

    expected, (params, cfg, vision, vl) = loaded
    ids, mask, pixels, grid = batch()
    requests = RequestImages.of_batch(jax.tree.map(np.asarray, image_prompt(vision, vl, ids, mask, pixels, grid)),
                                      mask)
    prompts = [row[m > 0].tolist() for row, m in zip(ids, mask)]
    spec = dataclasses.replace(engine_spec(cfg, EngineOptions(engine="paged"), num_requests=4,
                                           max_prompt_len=ids.shape[1], max_new_tokens=6, compute_dtype="float32"),
                               cascade=True)
    engine = PagedEngine(cfg, spec, steps_per_call=2, prefill_chunk=chunk, batch_prefill=True)
    for sp in (SamplingParams(max_new_tokens=6, do_sample=False, n=2), SamplingParams(max_new_tokens=6, n=2)):
        settings, knobs = sp.compile_args((), PAD, vocab_size=cfg.vocab_size)
        got, _ = engine.run(params, prompts, jax.random.key(3), knobs, settings, images=requests)
        if not sp.do_sample:
            np.testing.assert_array_equal(got.tokens, expected)
            continue
        assert_rescored(got.tokens, got.response_mask, got.log_probs, ids, mask, pixels, grid,
                        (params, cfg, vision, vl))
    # without the deltas, the decode steps read other positions
    blind = [dataclasses.replace(r, delta=0) for r in requests]
    greedy = SamplingParams(max_new_tokens=6, do_sample=False, n=2).compile_args((), PAD, vocab_size=cfg.vocab_size)
    got, _ = engine.run(params, prompts, jax.random.key(3), greedy[1], greedy[0], images=blind)
    assert (got.tokens != expected).any()
    # speculative verification (n-gram drafts) turns its k + 1 tokens by the slot's delta too: greedy unchanged
    from jaxrl_llm.sampler.speculative import SpeculativeSpec

    verifying = PagedEngine(cfg, dataclasses.replace(spec, speculative=SpeculativeSpec(num_tokens=2)),
                            steps_per_call=2, prefill_chunk=chunk)
    got, _ = verifying.run(params, prompts, jax.random.key(3), greedy[1], greedy[0], images=requests)
    np.testing.assert_array_equal(got.tokens, expected)


def test_export_with_the_tower_reloads_in_transformers(checkpoint, tmp_path):
    # the text model under the released names, the tower under visual.*, the source config.json: transformers'
    # Qwen2_5_VLForConditionalGeneration loads it with the same logits on rows with images
    from jaxrl_llm.hf.hf_folder import read_hf_config
    from jaxrl_llm.hf.vision import export_vision_language

    model, folder = checkpoint
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    out = export_vision_language(cfg, params, read_hf_config(folder), vision, tmp_path / "export")
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    ids, mask, pixels, grid = batch()
    kw = hf_inputs(ids, mask, pixels, grid)
    with torch.no_grad():
        expected, got = model(**kw).logits.numpy(), reloaded(**kw).logits.numpy()
    np.testing.assert_allclose(got[mask > 0], expected[mask > 0], atol=1e-6, rtol=0)
    # and ours reads the export back
    cfg2, params2 = load_hf_folder(out)
    vl2, vision2 = load_vision_tower(out)
    ours = np.asarray(image_text_logits(params2, cfg2, vision2, vl2, ids, mask, pixels, grid))
    np.testing.assert_allclose(ours[mask > 0], expected[mask > 0], atol=1e-4, rtol=0)
