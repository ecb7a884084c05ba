"""What the Qwen2.5-VL and Qwen3-VL parity tests share: the tiny checkpoints' special token ids, left-padded prompt
rows with image runs, transformers' keyword inputs, and the check that sampled tokens' log-probs are the full
forward's with images."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

PAD, START, END, IMAGE = 0, 288, 289, 290


def image_rows(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int64 of two left-padded prompts: text, one image of counts[0] tokens, text; and text, two images
    of counts[1] and counts[2] tokens between texts."""
    def image(n: int) -> list[int]:
        return [START] + [IMAGE] * n + [END]

    rows = [[10, 11, *image(counts[0]), 12, 13],
            [20, *image(counts[1]), 21, 22, *image(counts[2]), 23, 24, 25]]
    width = max(map(len, rows))
    ids = np.array([[PAD] * (width - len(r)) + r for r in rows], np.int64)
    mask = (np.arange(width)[None] >= (width - np.array([len(r) for r in rows]))[:, None]).astype(np.int64)
    return ids, mask


def hf_inputs(ids: np.ndarray, mask: np.ndarray, pixels: np.ndarray, grid: np.ndarray) -> dict[str, Any]:
    """transformers' keyword inputs of a batch with images (image tokens marked in mm_token_type_ids)."""
    import torch

    return dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.from_numpy(grid),
                mm_token_type_ids=torch.from_numpy((ids == IMAGE).astype(np.int64)))


def assert_rescored(tokens: Any, response_mask: Any, log_probs: Any, ids: np.ndarray, mask: np.ndarray,
                    pixels: np.ndarray, grid: np.ndarray, model: tuple[Any, Any, Any, Any]) -> None:
    """Two samples per prompt of `image_rows`' batch: each sampled token's log-prob equals the full forward's on
    the prompt with its images (the first prompt holds image 0, the second images 1 and 2); `model` is (params,
    cfg, tower params, VisionLanguage)."""
    import jax

    from jaxrl_llm.models.vision.qwen_vl import image_text_logits

    params, cfg, vision, vl = model
    tokens, response_mask, log_probs = (np.asarray(x) for x in (tokens, response_mask, log_probs))
    full = np.concatenate([np.repeat(ids, 2, 0), tokens], axis=1)
    full_mask = np.concatenate([np.repeat(mask, 2, 0), response_mask], axis=1)
    first = int(grid[0].prod())  # each prompt's images once per sample: the grids repeated in row order
    rows_grid = np.concatenate([grid[:1], grid[:1], grid[1:], grid[1:]])
    rows_pixels = np.concatenate([pixels[:first], pixels[:first], pixels[first:], pixels[first:]])
    logits = image_text_logits(params, cfg, vision, vl, full, full_mask, rows_pixels, rows_grid)
    logp = np.asarray(jax.nn.log_softmax(logits[:, ids.shape[1] - 1:-1], axis=-1))
    picked = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    on = response_mask.astype(bool)
    np.testing.assert_allclose(log_probs[on], picked[on], atol=1e-5)


class Scored(NamedTuple):
    """Two samples per prompt of a batch with images, and what the trainer's passes read of them."""

    input_ids: Any  # [4, P + 6] prompts and sampled tokens
    attention: Any
    rows: Any  # their `RowImages`
    sampled: np.ndarray  # [4, 6] the sampler's log-probs
    on: np.ndarray  # [4, 6] the sampled tokens


def assert_trainer_reads_the_sampled_log_probs(params: Any, cfg: Any, images: Any, ids: np.ndarray,
                                               mask: np.ndarray, pad: int = PAD) -> Scored:
    """Samples 2 x 6 tokens per prompt with the static sampler and checks that the trainer's log-probs on the rows
    with their images (`RowImages`) are the sampled ones, unpacked and packed with the rows of a prompt sharing its
    tokens (within 1e-5); returns what an ablation reads."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.batching import StepRows
    from jaxrl_llm.batching.plan import plan_chunks
    from jaxrl_llm.models.vision.qwen_vl import RowImages, row_images
    from jaxrl_llm.roles.forward import response_log_probs
    from jaxrl_llm.sampler import SamplingParams, sample

    settings, knobs = SamplingParams(max_new_tokens=6, n=2).compile_args((), pad, vocab_size=cfg.vocab_size)
    out = sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(5), knobs, settings=settings,
                 images=images)
    rows = RowImages(**jax.tree.map(jnp.asarray, row_images(jax.tree.map(np.asarray, images), mask, 2, 6)))
    input_ids = jnp.concatenate([out.prompt_ids, out.tokens], axis=1)
    attention = jnp.concatenate([out.prompt_mask, out.response_mask], axis=1)
    on = np.asarray(out.response_mask) > 0
    sampled = np.asarray(out.log_probs)
    unpacked = np.asarray(response_log_probs(params, cfg, input_ids, attention, 6, images=rows))
    np.testing.assert_allclose(unpacked[on], sampled[on], atol=1e-5)
    layout = plan_chunks(StepRows.of_mask(np.asarray(attention), 6, prompt_groups=np.repeat(np.arange(2), 2)), 4, 1)
    packed = np.asarray(response_log_probs(params, cfg, input_ids, attention, 6, images=rows,
                                           packing=jax.tree.map(lambda x: x[0], layout)))
    np.testing.assert_allclose(packed[on], sampled[on], atol=1e-5)
    return Scored(input_ids, attention, rows, sampled, on)


def assert_export_reloads(model: Any, model_class: Any, folder: Any, out: Any, inputs: dict[str, Any],
                          mask: np.ndarray, **load: Any) -> None:
    """The folder's text model and tower exported by `export_vision_language` to `out` reload as `model_class`
    (transformers) with `model`'s logits on `inputs` (its valid tokens, within 1e-6)."""
    import torch

    from jaxrl_llm.hf import load_hf_folder
    from jaxrl_llm.hf.hf_folder import read_hf_config
    from jaxrl_llm.hf.vision import export_vision_language, load_vision_tower

    cfg, params = load_hf_folder(folder)
    _, vision = load_vision_tower(folder)
    exported = export_vision_language(cfg, params, read_hf_config(folder), vision, out)
    reloaded = model_class.from_pretrained(exported, dtype=torch.float32, **load).eval()
    with torch.no_grad():
        expected = model(**inputs).logits.numpy()
        got = reloaded(**inputs).logits.numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], expected[valid], atol=1e-6, rtol=0)


def assert_both_samplers_decode(params: Any, cfg: Any, images: Any, ids: np.ndarray, mask: np.ndarray,
                                expected: np.ndarray, prefill_chunks: tuple[int | None, ...] = (None,)) -> None:
    """Greedy, two samples per prompt: the static sampler and the paged engine (each prefill chunk asked for)
    decode `expected` [B, 6] from the prompts with their images (`ImagePrompt`)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.sampler import SamplingParams, sample
    from jaxrl_llm.sampler.engine import PagedEngine
    from jaxrl_llm.sampler.engine.requests import RequestImages
    from jaxrl_llm.sampler.engine.setup import EngineOptions, engine_spec

    settings, knobs = SamplingParams(max_new_tokens=6, do_sample=False, n=2).compile_args((), PAD,
                                                                                         vocab_size=cfg.vocab_size)
    static = sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(3), knobs, settings=settings,
                    images=images)
    np.testing.assert_array_equal(np.asarray(static.tokens), np.repeat(expected, 2, 0))
    spec = engine_spec(cfg, EngineOptions(engine="paged"), num_requests=4, max_prompt_len=ids.shape[1],
                       max_new_tokens=6, compute_dtype="float32")
    for chunk in prefill_chunks:
        paged, _ = PagedEngine(cfg, spec, steps_per_call=2, prefill_chunk=chunk, precompile_drain=False).run(
            params, [row[m > 0].tolist() for row, m in zip(ids, mask)], jax.random.key(3), knobs, settings,
            images=RequestImages.of_batch(images, mask))
        np.testing.assert_array_equal(paged.tokens, np.repeat(expected, 2, 0))


def assert_export_reads_and_generates(trainer: Any, out: Any, model_class: Any, tower_params: Any,
                                      hf_inputs: Any) -> Any:
    """A trained VL policy's export at `out`: transformers' `model_class` reads the actor's logits (with the tower at
    `tower_params`) on a training prompt with its picture, within 1e-4; reloaded through `jrl.load_model`, a content
    list's picture and question decode transformers.generate's greedy tokens through both engines (up to an EOS of
    the random model's). `hf_inputs(ids, pixels, grid)`: transformers' keyword inputs. Returns the reloaded model."""
    import jax
    import torch

    import jaxrl_llm as jrl
    from jaxrl_llm.data.images import load_image
    from jaxrl_llm.data.vision_prompts import chat_with_images
    from jaxrl_llm.models.vision.qwen_vl import image_text_logits

    vision = trainer.generator.vision
    model = model_class.from_pretrained(out, dtype=torch.float32).eval()
    batch = next(trainer.train_loader)
    ids = np.asarray(batch["raw_prompt_ids"][0], np.int64)[None]
    pixels, grid = vision.tokens.pixels(batch["images"][0])
    ours = np.asarray(image_text_logits(jax.device_get(trainer.actor.model_params), trainer.actor.model_cfg,
                                        tower_params, vision.vl, ids, np.ones_like(ids), pixels, grid))
    with torch.no_grad():
        theirs = model(**hf_inputs(ids, pixels, grid)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-4
    reloaded = jrl.load_model(out)
    assert reloaded.vision is not None
    picture = load_image(batch["images"][0][0])
    chat = [{"role": "user", "content": [{"type": "image", "image": picture},
                                         {"type": "text", "text": "How many red shapes are there?"}]}]
    ids, _ = chat_with_images(chat, reloaded.vision.tokens, reloaded.tokenizer)
    pixels, grid = reloaded.vision.tokens.pixels([picture])
    with torch.no_grad():
        expected = model.generate(**hf_inputs(ids[None].astype(np.int64), pixels, grid), max_new_tokens=6,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].numpy()
    for engine in ("static", "paged"):
        got = jrl.generate(reloaded, chat, jrl.SamplingParams(max_new_tokens=6, temperature=0.0),
                           engine=engine).token_ids[0]
        np.testing.assert_array_equal(got, expected[:len(got)])
        assert len(got) == 6 or got[-1] in (reloaded.config.eos_token_ids or ())
    return reloaded
