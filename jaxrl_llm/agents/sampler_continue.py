"""A `continue_fn` for `run_multi_turn` over the static sampler (`jaxrl_llm.sampler.sample`).

    cont = StaticSamplerContinue(params, model_cfg, SamplingParams(temperature=1.0), pad_token_id=pad)
    result = run_multi_turn(trajs, cont, limits=..., stop_token_ids=tool_call_stop_ids(tokenizer))

Each call left-pads the active prefixes to a length bucket (or to the fixed `prefix_length`, e.g.
the maximum total length: then every round reuses one compiled program) and the batch to a batch
bucket, and generates max(max_new_tokens) rounded up to a multiple of `token_bucket`;
a row is then cut to its own budget (finish "length" when cut). The sampler has no per-row
budgets or in-flight admission: finished rows idle until the longest one ends. The continuous-
batching engine replaces this class behind the same `continue_fn` signature.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.agents.driver import Generated
from jaxrl_llm.agents.tool_parser import TOOL_CALL_END
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.moe import NOT_RECORDED, routing_dtype
from jaxrl_llm.sampler import FINISH_REASONS, SamplingParams, bucket_batch, left_pad, sample
from jaxrl_llm.sampler.engine.requests import RequestImages, batch_image_prompt
from jaxrl_llm.sharding import batch_axis_size, shard_batch


def tool_call_stop_ids(tokenizer: Tokenizer, end: str = TOOL_CALL_END) -> tuple[int, ...]:
    """(id,) when `end` is one token of `tokenizer` (Qwen's `</tool_call>`), else () (the turn then
    runs to EOS, and the calls are parsed from the whole turn)."""
    ids = tokenizer(end, add_special_tokens=False)["input_ids"]
    return (int(ids[0]),) if len(ids) == 1 else ()


class StaticSamplerContinue:
    """`continue_fn` (see `jaxrl_llm.agents.driver`) sampling from `params` with `sampling_params`
    (its max_new_tokens and n are replaced per call; its stop ids are kept and extended)."""

    def __init__(self, params: dict, model_cfg: ModelConfig, sampling_params: SamplingParams, *,
                 pad_token_id: int, eos_token_ids: Sequence[int] | None = None, mesh: Mesh | None = None,
                 compute_dtype: str = "float32", token_bucket: int = 16, prefix_length: int | None = None) -> None:
        self.params, self.cfg, self.sampling_params = params, model_cfg, sampling_params
        self.pad_id = int(pad_token_id)
        self.eos = tuple(model_cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.mesh, self.compute_dtype, self.token_bucket = mesh, compute_dtype, int(token_bucket)
        self.prefix_length = prefix_length
        self.calls = 0

    def __call__(self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                 stop_token_ids: Sequence[int] = (), *, routings: Sequence[np.ndarray | None] | None = None,
                 images: Sequence[RequestImages | None] | None = None) -> list[Generated]:
        """`routings`: record a MoE model's routing, each prefix replaying its experts so far (None or
        NOT_RECORDED rows: the router's choice); each `Generated` then carries its whole record. `images`: a
        vision-language policy's, per prefix (`Trajectory.prefix_images`)."""
        if not prefixes or len(prefixes) != len(max_new_tokens) or min(max_new_tokens) < 1:
            raise ValueError(f"StaticSamplerContinue: {len(prefixes)} prefixes and budgets {list(max_new_tokens)} "
                             "(need one budget >= 1 per prefix)")
        params = round_sampling(self.sampling_params, max_new_tokens, stop_token_ids, self.token_bucket)
        settings, knobs = params.compile_args(self.eos, self.pad_id, vocab_size=self.cfg.vocab_size,
                                              compute_dtype=self.compute_dtype)
        rows = bucket_batch(len(prefixes), 1 if self.mesh is None else batch_axis_size(self.mesh))
        batch = list(prefixes) + [prefixes[0]] * (rows - len(prefixes))
        ids, mask = left_pad(batch, self.pad_id, length=self.prefix_length)
        replay = None
        if routings is not None and self.cfg.is_moe:
            settings = dataclasses.replace(settings, record_routing=True)
            replay = left_pad_routing(self.cfg, list(routings) + [routings[0]] * (rows - len(prefixes)),
                                      [len(p) for p in batch], ids.shape[1])
        if self.mesh is not None:
            ids, mask = shard_batch((ids, mask), self.mesh)
            replay = None if replay is None else shard_batch(replay, self.mesh)
        prompt_images = None
        if images is not None:  # the padding rows repeat the first prefix (its images too)
            rows_images = list(images) + [images[0]] * (rows - len(prefixes))
            prompt_images = batch_image_prompt(rows_images, [len(p) for p in batch], ids.shape[1])
        rng = jax.random.fold_in(jax.random.key(params.seed), self.calls)
        self.calls += 1
        out = sample(self.params, self.cfg, ids, mask, rng, knobs, settings=settings, mesh=self.mesh,
                     prompt_routing=replay, images=prompt_images)
        return cut_to_budgets(out, max_new_tokens, [len(p) for p in prefixes])


def left_pad_routing(cfg: ModelConfig, routings: Sequence[np.ndarray | None], lengths: Sequence[int],
                     width: int) -> np.ndarray:
    """Prefixes' recorded experts left-padded like their ids: [rows, width, L, k], NOT_RECORDED where
    the router chooses (padding, a prefix without a record, tokens never fed)."""
    out = np.full((len(lengths), width, cfg.num_hidden_layers, cfg.num_experts_per_tok), NOT_RECORDED,
                  routing_dtype(cfg.num_experts))
    for row, (rec, n) in enumerate(zip(routings, lengths)):
        if rec is not None:
            out[row, width - n:width - n + len(rec)] = rec[:n]
    return out


def round_sampling(sampling: SamplingParams, max_new_tokens: Sequence[int], stop_token_ids: Sequence[int],
                   token_bucket: int) -> SamplingParams:
    """One round's sampling: one sample per prefix, the largest budget rounded up to `token_bucket`
    (a few widths, so a few programs), the round's stop ids added to the configured ones."""
    width = -(-max(max_new_tokens) // token_bucket) * token_bucket
    return dataclasses.replace(sampling, max_new_tokens=width, n=1,
                               stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *stop_token_ids))))


def cut_to_budgets(out: Any, max_new_tokens: Sequence[int], prefix_lengths: Sequence[int] | None = None
                   ) -> list[Generated]:
    """A sampler output's rows (first `len(max_new_tokens)`) as `Generated`, each cut to its own budget
    (finish "length" when cut). With a recorded routing (and the rows' `prefix_lengths`), each carries
    the experts of its prefix and generated tokens."""
    tokens, log_probs = np.asarray(out.tokens), np.asarray(out.log_probs)
    lengths, finish = np.asarray(out.lengths), np.asarray(out.finish_reason)
    routing = None if out.routing is None or prefix_lengths is None else np.asarray(out.routing)
    width = np.asarray(out.prompt_ids).shape[1]
    result = []
    for i, budget in enumerate(max_new_tokens):
        n, reason = int(lengths[i]), FINISH_REASONS[int(finish[i])]
        if n > budget:
            n, reason = int(budget), "length"
        rec = None
        if routing is not None and prefix_lengths is not None:  # [prefix | the n kept tokens]
            rec = routing[i, width - prefix_lengths[i]:width + n]
        result.append(Generated(tokens[i, :n].tolist(), log_probs[i, :n].tolist(), reason, rec))
    return result


__all__ = ["StaticSamplerContinue", "cut_to_budgets", "left_pad_routing", "round_sampling", "tool_call_stop_ids"]
