"""Multi-turn rollouts in the trainer (`actor_rollout_ref.rollout.multi_turn.enable`).

`MultiTurn` is built once at start from the `MultiTurnSpec` (tools and interactions are loaded
then: a bad YAML or class path is one `AgentConfigError` before the model loads). `generate_multi_turn`
replaces the single-turn generation of `RolloutGenerator.generate` for training, ReMax baselines
and validation alike:

    batch rows (raw_prompt chat messages, extra_info.tools_kwargs / interaction_kwargs)
      -> n trajectories per prompt (row-major: GRPO groups as today)
      -> with rollout.engine=paged: run_multi_turn_streaming through the paged engine on the policy's
         own params (each generation one request: a trajectory's token prefix; no rounds: the
         others keep decoding while one waits on its tools); with the static sampler, or paged
         over several processes: run_multi_turn in rounds over a continue_fn
      -> pad_trajectories -> Rollout

Masks (the one thing single-turn rollouts never needed): `Rollout.attention_mask` is 1 on every
prompt and response token, tool / user replies included (the model attends to them), while
`Rollout.response_mask`, which every loss, advantage, KL and metric reads as the loss mask, is 1
on model tokens only. The attention mask is contiguous from the prompt: `prompt_lengths` tokens
before the response columns, then `response_lengths`; packing plans from those lengths
(jaxrl_llm/batching). `rollout_log_probs` holds the sampler's log-probs on model tokens (0 on
context tokens, which the loss mask drops); recomputed old / reference log-probs are computed for
every position and read only where the loss mask is 1.

Reward of a trajectory (sum, as veRL adds its tool and interaction rewards to the score):
    scorer(last assistant message)            the reward manager's rule / custom function
  + sum of tool step rewards (execute)        e.g. a penalty for a failing call
  + sum of the tools' calc_reward             per tool instance, at the end
  + sum of interaction (environment) rewards  e.g. GuessNumberEnv's 1.0 when found
It is placed on the trajectory's last model token. `reward_extra_info` keeps the parts
(`tool_reward`, `interaction_reward`, `num_turns`) so validation reports them per data source.
`response_lengths` count every response token (model and context); `multi_turn/model_tokens/mean`
counts the trained ones.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.agents import (
    ChatRenderer,
    Generated,
    TurnLimits,
    load_interactions,
    load_tools,
    pad_trajectories,
    run_multi_turn,
    run_multi_turn_streaming,
    trajectories_from_rows,
)
from jaxrl_llm.agents.sampler_continue import StaticSamplerContinue, cut_to_budgets, round_sampling, tool_call_stop_ids
from jaxrl_llm.bookkeeping.nonfinite import sanitize_scores
from jaxrl_llm.config.spec import MultiTurnSpec
from jaxrl_llm.data.vision_prompts import ImageTokens
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.vision.qwen_vl import ImagePrompt
from jaxrl_llm.models.vision.tower_lora import tower_params
from jaxrl_llm.rollout.batch import Rollout, response_bucket, rollout_row_images, rows_meta, score_responses
from jaxrl_llm.sampler import SamplingParams, bucket_length
from jaxrl_llm.sampler.engine.requests import RequestImages
from jaxrl_llm.sampler.engine.setup import EngineOptions, prompt_room, sized_engine
from jaxrl_llm.sampler.host import left_pad
from jaxrl_llm.sharding import to_device_if_rows_split

log = logging.getLogger("jaxrl_llm")


class PagedContinue:
    """`continue_fn` over the paged engine: each active trajectory's token prefix is one request with
    its own remaining budget. Every round runs one engine, sized as the single-process streaming path
    sizes it (`num_requests` trajectories, prompts up to `max_prompt_len`, responses of the sampling's
    max_new_tokens): a conversation's prefix plus its remaining budget never exceeds its prompt plus
    the response length, so the growing prefixes of later rounds fit the first round's engine and
    reuse its compiled programs (sizing each round by its own prefixes built a new engine per round)."""

    def __init__(self, params: dict, model_cfg: ModelConfig, sampling: SamplingParams, *, eos: Sequence[int],
                 pad_token_id: int, opts: EngineOptions, mesh: Mesh | None, compute_dtype: str, rng: jax.Array,
                 draft_params: dict | None = None, num_requests: int = 1,
                 max_prompt_len: int = 1) -> None:
        self.params, self.cfg, self.sampling, self.draft_params = params, model_cfg, sampling, draft_params
        self.eos, self.pad_id = tuple(eos), pad_token_id
        self.opts, self.mesh, self.compute_dtype, self.rng = opts, mesh, compute_dtype, rng
        self.calls = 0
        self.num_requests, self.max_prompt_len = num_requests, max_prompt_len

    def __call__(self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                 stop_token_ids: Sequence[int] = (), *, routings: Sequence[np.ndarray | None] | None = None,
                 images: Sequence[Any] | None = None) -> list[Generated]:
        """`routings`: record the routing, each prefix's prefill replaying its experts so far; `images`: each
        prefix's (`RequestImages`, a vision-language policy's)."""
        # the programs' width: the response length (a round's largest budget is at most that), not
        # rounded, as the streaming path's, so both build the same engine
        width = max(self.sampling.max_new_tokens, max(max_new_tokens))
        params = round_sampling(self.sampling, [width], stop_token_ids, width)
        settings, knobs = params.compile_args(self.eos, self.pad_id, vocab_size=self.cfg.vocab_size,
                                              compute_dtype=self.compute_dtype)
        replay = None
        if routings is not None and self.cfg.is_moe:  # a prefix without a record yet is routed by the router
            settings = dataclasses.replace(settings, record_routing=True)
            replay = list(routings)
        # a prefix may be longer than any prompt, but prefix + budget <= prompt + response length
        room = max(len(p) + b for p, b in zip(prefixes, max_new_tokens)) - settings.max_new_tokens
        engine = sized_engine(self.cfg, self.opts, num_requests=max(len(prefixes), self.num_requests),
                              max_prompt_len=prompt_room(room, self.max_prompt_len), settings=settings, mesh=self.mesh)
        out, _ = engine.run(self.params, [list(p) for p in prefixes], jax.random.fold_in(self.rng, self.calls),
                            knobs, settings, prompt_routing=replay, draft_params=self.draft_params,
                            max_new_tokens=list(max_new_tokens), images=None if images is None else list(images))
        self.calls += 1
        return cut_to_budgets(out, max_new_tokens, [len(p) for p in prefixes])


class FixedShapeContinue:
    """Pads every round's active prefixes to the trajectory count (repeating the first; the extra
    rows are dropped): with a fixed prefix length and generation width, the whole multi-turn
    rollout runs ONE compiled sampler program instead of one per (active rows, prefix length,
    width) bucket, which on CPU costs far more in compiles than the idle rows cost in compute."""

    def __init__(self, inner: Any, rows: int) -> None:
        self.inner, self.rows = inner, rows

    def __call__(self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                 stop_token_ids: Sequence[int] = (), *, routings: Sequence[np.ndarray | None] | None = None,
                 images: Sequence[Any] | None = None) -> list[Generated]:
        k = len(prefixes)
        pad = max(self.rows - k, 0)
        padded = (list(prefixes) + [prefixes[0]] * pad, list(max_new_tokens) + [max_new_tokens[0]] * pad,
                  stop_token_ids)
        extra: dict[str, Any] = {}
        if routings is not None:
            extra["routings"] = list(routings) + [routings[0]] * pad
        if images is not None:
            extra["images"] = list(images) + [images[0]] * pad
        return list(self.inner(*padded, **extra)[:k])


class MultiTurn:
    """Tools, interactions, the chat renderer and the limits of multi-turn rollouts."""

    def __init__(self, spec: MultiTurnSpec, tokenizer: Tokenizer, image_tokens: ImageTokens | None = None) -> None:
        if tokenizer is None:
            raise ValueError("actor_rollout_ref.rollout.multi_turn.enable needs a tokenizer with a chat template")
        self.spec = spec
        self.tools = load_tools(spec.tool_config_path) if spec.tool_config_path else {}
        self.interactions = load_interactions(spec.interaction_config_path) if spec.interaction_config_path else None
        # a vision-language policy's prompts open with their images' tokens (agents/chat.py)
        self.renderer = ChatRenderer(tokenizer, tools=[t.tool_schema for t in self.tools.values()] or None,
                                     image_tokens=image_tokens)
        self.stop_ids = tool_call_stop_ids(tokenizer) if self.tools else ()

    def limits(self, response_length: int) -> TurnLimits:
        s = self.spec
        return TurnLimits(max_response_length=response_length, max_assistant_turns=s.max_assistant_turns,
                          max_user_turns=s.max_user_turns, max_tool_response_length=s.max_tool_response_length,
                          tool_response_truncate_side=s.tool_response_truncate_side)


def _rows(batch: dict[str, np.ndarray]) -> list[dict]:
    if "raw_prompt" not in batch:
        raise ValueError("multi-turn rollouts need the rows' chat messages (the batch has no raw_prompt; "
                         "data.return_raw_chat is forced on with multi_turn.enable)")
    keys = [k for k in ("data_source", "extra_info", "images") if k in batch]
    return [{"prompt": p, **{k: batch[k][i] for k in keys}} for i, p in enumerate(batch["raw_prompt"])]


def _trajectory_images(gen: Any, trajs: list, params: dict, pad_id: int, prompt_width: int) -> ImagePrompt | None:
    """A vision-language policy's trajectories' prompt images: the tower run once over every trajectory's prompt
    (left-padded to `prompt_width`; one row per trajectory, as the training rows); each trajectory's
    `prompt_images` (what its continuations prefill), shared by the trajectories of one prompt and picture.
    None when no trajectory has an image."""
    vision = gen.vision
    if vision is None or not any(t.images for t in trajs):
        return None
    ids, mask = left_pad([t.prompt_ids for t in trajs], pad_id, length=prompt_width)
    prompt = vision.prompt(ids, mask, [t.images for t in trajs],
                           params=tower_params(params) if vision.trained else None)
    shared: dict[tuple, Any] = {}
    for t, request in zip(trajs, RequestImages.of_batch(prompt, mask)):
        if t.images:  # one object per (prompt, pictures): the paged engine prefills it once for its samples
            t.prompt_images = shared.setdefault((tuple(t.prompt_ids), id(t.row.get("images"))), request)
    return prompt


def generate_multi_turn(gen: Any, batch: dict[str, np.ndarray], params: dict, sampling: SamplingParams,
                        rng: jax.Array) -> Rollout:
    """The multi-turn counterpart of `RolloutGenerator.generate` (`gen`): a scored `Rollout`."""
    mt: MultiTurn = gen.multi_turn
    cfg, mesh, tokenizer = gen.model_cfg, gen.mesh, gen.tokenizer
    pad_id, eos = gen.pad_id, list(gen.eos_ids)
    n = sampling.n
    trajs = trajectories_from_rows(_rows(batch), mt.renderer, interactions=mt.interactions, n=n)
    longest_prompt = max(len(t.prompt_ids) for t in trajs)
    if gen.max_prompt_length is not None and longest_prompt > gen.max_prompt_length:
        raise ValueError(f"data.max_prompt_length={gen.max_prompt_length}: a multi-turn prompt has {longest_prompt} "
                         "tokens once the tool instructions / the interaction's first message are added; raise it")
    images = _trajectory_images(gen, trajs, params, pad_id, bucket_length(longest_prompt))
    s, limits = mt.spec, mt.limits(sampling.max_new_tokens)
    calls: dict[str, Any] = dict(tools=mt.tools, max_parallel_calls=s.max_parallel_calls,
                                 tool_timeout_s=s.tool_call_timeout_s, sanity_check=s.sanity_check,
                                 tool_call_format=s.format)
    opts = gen.engine_for(sampling.max_new_tokens)
    # routing replay: every generation records its experts, and a continuation's prefill replays the
    # experts its conversation ran so far, so each token has one routing for all turns (docs/moe.md)
    record = bool(gen.record_routing)
    # engines are sized by the run's prompt bound (as the single-turn engine), so every step reuses one
    prompt_bound = prompt_room(longest_prompt, gen.max_prompt_length)
    if opts.engine == "paged" and jax.process_count() == 1:
        # no rounds: a trajectory waiting on a tool holds only itself (agents/streaming.py)
        params_r = round_sampling(sampling, [sampling.max_new_tokens], mt.stop_ids, sampling.max_new_tokens)
        settings, knobs = gen.compile_args(params_r)
        engine = sized_engine(cfg, opts, num_requests=len(trajs), max_prompt_len=prompt_bound, settings=settings,
                              mesh=mesh)
        stats: list = []
        serve = lambda source: stats.append(engine.serve(params, source, rng, knobs, settings,  # noqa: E731
                                                         gen.draft_params))
        result = run_multi_turn_streaming(trajs, serve, limits=limits, record_routing=record, **calls)
        gen.last_engine_stats = stats[0]
        engine_metrics = stats[0].metrics()
    else:
        engine_metrics = {}
        if opts.engine == "paged":  # several processes: rounds schedule identically on every host
            cont = PagedContinue(params, cfg, sampling, eos=eos, pad_token_id=pad_id, opts=opts, mesh=mesh,
                                 compute_dtype=gen.compute_dtype, rng=rng, draft_params=gen.draft_params,
                                 num_requests=len(trajs), max_prompt_len=prompt_bound)
        else:
            seed = int(jax.random.randint(rng, (), 0, np.iinfo(np.int32).max))
            width = sampling.max_new_tokens  # every round: the same rows, prefix length and width (one program)
            cont = FixedShapeContinue(StaticSamplerContinue(
                params, cfg, dataclasses.replace(sampling, seed=seed), pad_token_id=pad_id, eos_token_ids=eos,
                mesh=mesh, compute_dtype=gen.compute_dtype, token_bucket=width,
                prefix_length=bucket_length(longest_prompt) + width), len(trajs))
        result = run_multi_turn(trajs, cont, limits=limits, stop_token_ids=mt.stop_ids, record_routing=record, **calls)
    first_mismatch = next((m for m in result.mismatches if m is not None), None)
    if first_mismatch is not None:
        log.warning("multi_turn.enable_tokenization_sanity_check: %d trajectories differ from their re-rendering; "
                    "first: %s", sum(m is not None for m in result.mismatches), first_mismatch)

    trajs = result.trajectories
    resp_lengths = np.array([t.response_length for t in trajs], np.int32)
    width = response_bucket(int(resp_lengths.max()), sampling.max_new_tokens)
    padded = pad_trajectories(trajs, prompt_length=bucket_length(longest_prompt), response_length=width,
                              pad_id=pad_id)
    rows = np.repeat(np.arange(len(batch["raw_prompt"])), n)
    meta = rows_meta(batch, rows)

    # the scorer reads the final answer (the last assistant message); tools / interactions add theirs
    final_texts = [t.last_model_text for t in trajs]
    stopped = np.array([t.stop_reason != "length" for t in trajs])
    scored = score_responses(gen.reward_manager, final_texts, meta, response_lengths=resp_lengths,
                             finished_with_eos=stopped)
    parts = [t.reward_parts for t in trajs]
    tool_reward = np.array([p["tool_step"] + p["tool_final"] for p in parts], np.float32)
    interaction_reward = np.array([p["interaction"] for p in parts], np.float32)
    scores, num_nonfinite = sanitize_scores(np.asarray(scored.scores, np.float32) + tool_reward + interaction_reward)
    extra = {**scored.reward_extra_info, "score": scores.copy(), "tool_reward": tool_reward,
             "interaction_reward": interaction_reward, "num_turns": padded.num_turns.astype(np.float32)}
    loss_mask = padded.loss_mask.astype(np.float32)
    metrics = {**scored.metrics, **result.metrics, **engine_metrics, "reward/num_nonfinite": float(num_nonfinite),
               "multi_turn/model_tokens/mean": float(loss_mask.sum(-1).mean()),
               "multi_turn/reward/tool/mean": float(tool_reward.mean()),
               "multi_turn/reward/interaction/mean": float(interaction_reward.mean())}

    # the outcome reward on the last model token (the loss mask's last 1)
    last_model = width - 1 - np.argmax(loss_mask[:, ::-1] > 0, axis=1)
    token_scores = np.zeros((len(trajs), width), np.float32)
    token_scores[np.arange(len(trajs)), last_model] = scores
    arrays = to_device_if_rows_split({
        "input_ids": np.concatenate([padded.prompt_ids, padded.response_ids], 1),
        "attention_mask": np.concatenate([padded.prompt_mask, padded.response_mask], 1),
        "response_mask": loss_mask, "rollout_log_probs": padded.rollout_log_probs, "token_scores": token_scores,
        **({} if padded.routing is None else {"routing": padded.routing}),
    }, mesh)
    row_imgs = None
    if images is not None:  # each row's images for the trainer's passes (one row per trajectory)
        row_imgs = rollout_row_images(images, padded.prompt_mask, width, mesh, gen.vision)
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    return Rollout(
        input_ids=arrays["input_ids"], attention_mask=arrays["attention_mask"], response_mask=arrays["response_mask"],
        rollout_log_probs=arrays["rollout_log_probs"], token_level_scores=arrays["token_scores"],
        group_ids=rows.astype(np.int32), scores=scores, response_lengths=resp_lengths,
        prompt_lengths=np.array([len(t.prompt_ids) for t in trajs], np.int32),
        texts=[decode(t.response_ids) for t in trajs], prompt_texts=[decode(t.prompt_ids) for t in trajs],
        meta=meta, reward_extra_info=extra, reward_metrics=metrics, routing=arrays.get("routing"), images=row_imgs)


__all__ = ["FixedShapeContinue", "MultiTurn", "PagedContinue", "generate_multi_turn"]
