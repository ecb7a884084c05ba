"""`generate(model, prompts, sampling_params)`: the notebook-level entry point over the jitted core.

`model` is any object with `.config` (ModelConfig) and `.params`, and optionally `.tokenizer` and
`.mesh`. Prompts are strings (tokenised as raw text with the tokenizer's special tokens), chat
message lists (the tokenizer's chat template with add_generation_prompt=True), or lists of token
ids; a single prompt may be passed unwrapped. Prompts are left-padded to a length bucket and the
batch to a batch bucket (extra rows repeat prompt 0 and are dropped), so repeated calls reuse a
few compiled programs. With several processes, every process passes the same prompts and gets
the whole result. A vision-language model's prompts (already holding their image tokens) take `images` per
prompt, read by its tower (`vision`): the static sampler prefills them with the batch's features, the paged engine
each prompt with its own (`RequestImages`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.vision.qwen_vl import ImagePrompt
from jaxrl_llm.sampler.core import sample
from jaxrl_llm.sampler.engine.requests import RequestImages
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged
from jaxrl_llm.sampler.host import GenerationResult, bucket_batch, eos_ids_of, left_pad
from jaxrl_llm.sampler.params import SamplingParams
from jaxrl_llm.sharding import batch_axis_size, host_local_to_global, process_slice, shard_batch


class ImageEncoder(Protocol):
    """A vision-language model's tower as the sampler reads it (roles/vision.py `VisionTower`)."""

    def prompt(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, images: Sequence[Sequence[Any]]
               ) -> ImagePrompt: ...


def _is_ids(p: Any) -> bool:
    return isinstance(p, (list, tuple, np.ndarray)) and len(p) > 0 and all(
        isinstance(t, (int, np.integer)) for t in p)


def _is_chat(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(m, Mapping) for m in p)


def _need_tokenizer(tokenizer: Tokenizer | None, row: int, kind: str) -> Tokenizer:
    if tokenizer is None:
        raise ValueError(f"prompt {row} is {kind}: pass tokenizer= (or give the model a .tokenizer)")
    return tokenizer


def prompts_to_ids(prompts: Any, tokenizer: Tokenizer | None = None) -> list[list[int]]:
    """Token ids per prompt from strings / chat message lists / id lists (see the module docstring)."""
    if isinstance(prompts, str) or _is_ids(prompts) or _is_chat(prompts):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = list(prompts)
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty list of strings, chat message lists or token-id lists")
    out = []
    for row, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(list(_need_tokenizer(tokenizer, row, "a string")(p)["input_ids"]))
        elif _is_chat(p):
            tok = _need_tokenizer(tokenizer, row, "a chat message list")
            text = tok.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True)
            out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        elif _is_ids(p):
            out.append([int(t) for t in p])
        else:
            raise ValueError(f"prompt {row}: expected a string, a chat message list or a non-empty list of "
                             f"token ids, got {type(p).__name__}")
    return out


def _special_ids(cfg: ModelConfig, tokenizer: Tokenizer | None) -> tuple[list[int], int]:
    eos = list(eos_ids_of(cfg, tokenizer))
    pad = cfg.pad_token_id
    if pad is None:
        pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def generate(model: Any, prompts: Any, sampling_params: SamplingParams, *, tokenizer: Tokenizer | None = None,
             mesh: Mesh | None = None, compute_dtype: str = "float32", engine: EngineOptions | str | None = None,
             images: Sequence[Sequence[Any]] | None = None, vision: ImageEncoder | None = None) -> GenerationResult:
    """Samples `sampling_params.n` responses per prompt with `model`'s current params.

    engine: `EngineOptions`, or 'auto' (the default: 'paged' from 64 new tokens on, else 'static') /
    'paged' (the continuous-batching engine) / 'static' (one padded batch). images: per prompt, its images (a
    vision-language model's prompts, already holding their image tokens), read by `vision`, the model's tower.
    """
    opts = EngineOptions(engine=engine) if isinstance(engine, str) else (engine or EngineOptions())
    opts = opts.resolved(sampling_params.max_new_tokens)
    cfg, params = model.config, model.params
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    mesh = mesh if mesh is not None else getattr(model, "mesh", None)
    ids_list = prompts_to_ids(prompts, tokenizer)
    eos, pad = _special_ids(cfg, tokenizer)
    settings, knobs = sampling_params.compile_args(eos, pad, vocab_size=cfg.vocab_size,
                                                   compute_dtype=compute_dtype)
    if images is not None and (vision is None or len(images) != len(ids_list)):
        raise ValueError(f"images: {len(images)} rows for {len(ids_list)} prompts, read by a vision tower "
                         f"({'none given' if vision is None else 'given'})")
    if opts.engine == "paged":  # every process runs the same schedule and holds the whole result
        requests = None
        if images is not None and vision is not None:  # each prompt's own images, features and positions
            ids, mask = left_pad(ids_list, pad)
            requests = RequestImages.of_batch(vision.prompt(ids, mask, images), mask)
        out, _ = sample_paged(params, cfg, ids_list, jax.random.key(sampling_params.seed), knobs,
                              settings=settings, opts=opts, mesh=mesh, images=requests)
        return GenerationResult.from_arrays(out.tokens, out.response_mask, out.log_probs, out.lengths,
                                            out.finish_reason, num_steps=int(out.num_steps), n=sampling_params.n,
                                            tokenizer=tokenizer)
    ways = 1 if mesh is None else batch_axis_size(mesh)
    rows = bucket_batch(len(ids_list), ways)
    ids, mask = left_pad(ids_list + [ids_list[0]] * (rows - len(ids_list)), pad)
    image_prompt = None
    if images is not None and vision is not None:  # the padding rows repeat prompt 0's images
        image_prompt = vision.prompt(ids, mask, [*images, *[images[0]] * (rows - len(ids_list))])
    if mesh is None:
        prompt_ids, prompt_mask = ids, mask
    elif jax.process_count() > 1:
        local = process_slice(rows, mesh)
        prompt_ids, prompt_mask = host_local_to_global((ids[local], mask[local]), mesh)
    else:
        prompt_ids, prompt_mask = shard_batch((ids, mask), mesh)
    out = sample(params, cfg, prompt_ids, prompt_mask, jax.random.key(sampling_params.seed), knobs,
                 settings=settings, mesh=mesh, images=image_prompt)
    fields = (out.tokens, out.response_mask, out.log_probs, out.lengths, out.finish_reason)
    if jax.process_count() > 1:
        fields = multihost_utils.process_allgather(fields, tiled=True)
    keep = len(ids_list) * sampling_params.n
    host = [np.asarray(f)[:keep] for f in fields]
    steps = out.num_steps  # replicated: read this process's copy (the global array may span processes)
    steps = steps.addressable_data(0) if isinstance(steps, jax.Array) else steps
    return GenerationResult.from_arrays(*host, num_steps=int(steps),
                                        n=sampling_params.n, tokenizer=tokenizer)
