"""Qwen3-VL-MoE against transformers (a tiny random `Qwen3VLMoeForConditionalGeneration`, fp32): its folder loads as
Qwen3-MoE with interleaved M-RoPE and deepstack (each layer's experts in two fused tensors, in transformers 5's
layout or its releases' transposed one) plus its tower; logits with images and left padding within 1e-4; greedy
tokens equal `transformers.generate` through the static sampler and the paged engine; the trainer's log-probs equal
the sampled ones, unpacked and packed; the export with the tower reloads in transformers."""
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
    assert_both_samplers_decode,
    assert_export_reloads,
    assert_trainer_reads_the_sampled_log_probs,
    hf_inputs,
    image_rows,
)

from jaxrl_llm.hf import load_hf_folder  # noqa: E402
from jaxrl_llm.hf.vision import load_vision_tower  # noqa: E402
from jaxrl_llm.models.vision.qwen_vl import image_prompt, image_text_logits  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen3VLMoeConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=25, deepstack_visual_indexes=[0]),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=291,
        pad_token_id=PAD, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.normal_(0.0, 0.2)
        for name, p in model.model.language_model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
        model.lm_head.weight.normal_(0.0, 0.1)
    folder = tmp_path_factory.mktemp("qwen3vlmoe")
    model.save_pretrained(folder)
    return model, folder


def batch():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(2)
    sizes = [(96, 64), (64, 64), (64, 128)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    out = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32, max_pixels=32 * 32 * 64)(
        images=images, return_tensors="np")
    ids, mask = image_rows((out["image_grid_thw"].prod(-1) // 4).tolist())
    return ids, mask, out["pixel_values"], out["image_grid_thw"]


def released_layout(folder, out):
    """`folder` with its expert tensors as the Qwen3-VL-MoE releases store them ([E, in, out])."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensors[name] = np.ascontiguousarray(tensors[name].transpose(0, 2, 1))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_logits_and_greedy_with_images_match_transformers(checkpoint, tmp_path):


    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        expected = model(**hf_inputs(ids, mask, pixels, grid)).logits.numpy()
        greedy = model.generate(**hf_inputs(ids, mask, pixels, grid), max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=PAD)[:, ids.shape[1]:].numpy()
    valid = mask.astype(bool)
    for source in (folder, released_layout(folder, tmp_path / "released")):
        cfg, params = load_hf_folder(source)
        assert (cfg.model_type, cfg.num_experts, cfg.norm_topk_prob, cfg.experts_fused) == ("qwen3_moe", 4, True, True)
        vl, vision = load_vision_tower(source)
        got = np.asarray(image_text_logits(params, cfg, vision, vl, ids, mask, pixels, grid))
        np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=0)
    images = image_prompt(vision, vl, ids, mask, pixels, grid)
    assert_both_samplers_decode(params, cfg, images, ids, mask, greedy)
    assert_trainer_reads_the_sampled_log_probs(params, cfg, images, ids, mask)


def test_export_with_the_tower_reloads_in_transformers(checkpoint, tmp_path):
    model, folder = checkpoint
    ids, mask, pixels, grid = batch()
    assert_export_reloads(model, transformers.Qwen3VLMoeForConditionalGeneration, folder, tmp_path / "hf",
                          hf_inputs(ids, mask, pixels, grid), mask, attn_implementation="eager")


def test_routing_recorded_with_images_is_the_trainers_and_replays(checkpoint):
    # routing replay (actor.router_replay) on a vision-language MoE policy: both samplers record each prompt
    # token's experts from the forward that reads its image features and M-RoPE positions (the trainer's own top-k
    # over the same rows), each decoded token's at its position plus the row's delta; replaying them in the trainer
    # gives the sampled log-probs
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models.model import forward_hidden_moe
    from jaxrl_llm.models.moe import NOT_RECORDED
    from jaxrl_llm.models.vision.qwen_vl import RowImages, row_images
    from jaxrl_llm.roles.forward import response_log_probs
    from jaxrl_llm.sampler import SamplingParams, sample
    from jaxrl_llm.sampler.engine import PagedEngine
    from jaxrl_llm.sampler.engine.requests import RequestImages
    from jaxrl_llm.sampler.engine.setup import EngineOptions, engine_spec

    _, folder = checkpoint
    ids, mask, pixels, grid = batch()
    cfg, params = load_hf_folder(folder)
    vl, vision = load_vision_tower(folder)
    images = image_prompt(vision, vl, ids, mask, pixels, grid)
    settings, knobs = SamplingParams(max_new_tokens=6, do_sample=False, n=2).compile_args((), PAD,
                                                                                         vocab_size=cfg.vocab_size)
    settings = dataclasses.replace(settings, record_routing=True)
    static = sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(3), knobs, settings=settings,
                    images=images)
    plain = sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(3), knobs,
                   settings=dataclasses.replace(settings, record_routing=False), images=images)
    np.testing.assert_array_equal(np.asarray(static.tokens), np.asarray(plain.tokens))
    routing = np.asarray(static.routing)  # [4, P + 6, L, k]
    # the trainer's full forward over prompt + response with the rows' images routes every fed token the same way
    rows = RowImages(**{k: jnp.asarray(v) for k, v in row_images(images, mask, 2, 6).items()})
    full = jnp.concatenate([jnp.repeat(jnp.asarray(ids), 2, 0), static.tokens], axis=1)
    full_mask = jnp.concatenate([jnp.repeat(jnp.asarray(mask), 2, 0), static.response_mask], axis=1)
    positions, embeds = rows.decoder_inputs()
    _, moe = forward_hidden_moe(params, cfg, full, full_mask, positions=positions, embeds=embeds, record_routing=True)
    assert moe is not None and moe.routing is not None
    trainer_routing = np.moveaxis(np.asarray(moe.routing), 0, 2)  # [4, P + 6, L, k]
    fed = (np.asarray(full_mask) > 0) & (routing[..., 0, 0] != NOT_RECORDED)
    fed[:, -1] = False  # the last sampled token is never fed
    assert fed[:, :ids.shape[1]].sum() == np.asarray(mask).sum() * 2
    np.testing.assert_array_equal(np.sort(routing[fed], -1), np.sort(trainer_routing[fed], -1))
    # the paged engine records the same experts
    spec = engine_spec(cfg, EngineOptions(engine="paged"), num_requests=4, max_prompt_len=ids.shape[1],
                       max_new_tokens=6, compute_dtype="float32")
    paged, _ = PagedEngine(cfg, spec, steps_per_call=2).run(
        params, [row[m > 0].tolist() for row, m in zip(ids, mask)], jax.random.key(3), knobs, settings,
        images=RequestImages.of_batch(images, mask))
    np.testing.assert_array_equal(paged.tokens, np.asarray(static.tokens))
    width = routing.shape[1]  # the paged output's prompts are left-padded to its bucket: the same last columns
    np.testing.assert_array_equal(np.asarray(paged.prompt_mask)[:, -(width - 6):], np.repeat(mask, 2, 0))
    paged_routing = np.asarray(paged.routing)[:, -width:]
    np.testing.assert_array_equal(np.sort(paged_routing[fed], -1), np.sort(routing[fed], -1))
    # replayed in the trainer, the recorded experts give the sampled log-probs
    replayed = response_log_probs(params, cfg, full, full_mask, 6, images=rows, replay=jnp.asarray(routing))
    on = np.asarray(static.response_mask) > 0
    np.testing.assert_allclose(np.asarray(replayed)[on], np.asarray(static.log_probs)[on], atol=1e-5)
