"""Experience: what the update needs beyond the rollout, computed on device, and the one function
that builds it.

reference log-probs (when a KL is used) -> old log-probs (the sampler's when they are exact) ->
critic values -> KL in reward (fixed / adaptive controller) -> advantages
(registry[algorithm.adv_estimator], or TRL's RLOO form) -> rollout correction (IS weights,
rejection-sampling mask) -> `Experience`. Formulas: docs/algorithms.md.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.batching import PackedLayout, StepRows
from jaxrl_llm.batching.ops import pad_columns, pad_routing
from jaxrl_llm.config.spec import AdvantageSpec, RolloutCorrectionSpec
from jaxrl_llm.losses.advantages import compute_advantage
from jaxrl_llm.losses.kl import kl_in_reward
from jaxrl_llm.losses.rollout_correction import compute_rollout_correction, mismatch_metrics
from jaxrl_llm.losses.shaping import clip_sequence_scores, clip_symmetric, normalize_scores, pf_ppo_rows, whiten_tokens
from jaxrl_llm.losses.trl_rloo import trl_rloo_with
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.vision.qwen_vl import RowImages
from jaxrl_llm.roles.forward import (
    budget_chunked,
    micro_batched,
    response_log_probs,
    response_scores,
    response_values,
)

Array = jax.Array


@flax.struct.dataclass
class Experience:
    """One step's training batch, rows sharded over the mesh's batch axes. Immutable: a pytree the
    jitted updates split into mini- and micro-batches. Optional fields are None when unused."""

    input_ids: Array  # int32 [N, P + R]
    attention_mask: Array  # int32 [N, P + R]
    response_mask: Array  # float32 [N, R], after rejection sampling
    old_log_probs: Array  # float32 [N, R]
    advantages: Array  # float32 [N, R]
    returns: Array  # float32 [N, R]
    ref_log_probs: Array | None = None  # the KL loss reads it
    values: Array | None = None  # the critic's value loss reads it
    rollout_is_weights: Array | None = None  # rollout-correction importance weights
    # routing replay (actor.router_replay = rollout): the sampler's expert ids [N, P + R, L, k]
    routing: Array | None = None
    # a vision-language policy's rows' image features and M-RoPE positions (models/vision/qwen_vl.py)
    images: RowImages | None = None
    # top-k distillation (algorithm.distillation.signal = topk_forward_kl): the teacher's [N, R, k]
    teacher_topk_ids: Array | None = None
    teacher_topk_log_probs: Array | None = None
    # set per micro-batch by the update when sequences are packed (model.use_remove_padding)
    packing: PackedLayout | None = None
    # set per mini-batch by the update's pre-pass: a policy loss's keep-mask over the whole mini-batch (M2PO)
    loss_token_mask: Array | None = None
    # [N] the rows' sequence scores, for a policy loss that splits rows by them (TOPR)
    sequence_scores: Array | None = None


def required(value: Array | None, field: str, needed_by: str) -> Array:
    """An optional `Experience` field that `needed_by` reads; a missing one is a wiring bug (the
    trainer fills each field its settings need), named here rather than failing inside a loss."""
    if value is None:
        raise ValueError(f"{needed_by} needs the experience's {field}, and it is None")
    return value


_RESPONSE_FIELDS = ("response_mask", "old_log_probs", "advantages", "returns", "ref_log_probs", "values",
                    "rollout_is_weights")


def pad_experience(exp: Experience, prompt_pad: int, response_pad: int) -> Experience:
    """`exp` padded as `pad_columns` pads (its sequences and every per-response-token field)."""
    sequences, responses = pad_columns(
        {"input_ids": exp.input_ids, "attention_mask": exp.attention_mask},
        {f: getattr(exp, f) for f in _RESPONSE_FIELDS if getattr(exp, f) is not None}, prompt_pad, response_pad)
    if exp.routing is not None:
        sequences["routing"] = pad_routing(exp.routing, prompt_pad, response_pad)
    if exp.images is not None:
        sequences["images"] = exp.images.pad_columns(prompt_pad, response_pad)
    for f in ("teacher_topk_ids", "teacher_topk_log_probs"):  # [N, R, k]: response columns padded with 0s
        if getattr(exp, f) is not None:
            responses[f] = jnp.pad(getattr(exp, f), ((0, 0), (0, response_pad), (0, 0)))
    return dataclasses.replace(exp, **sequences, **responses)


@jax.jit
def _take_rows(exp: Experience, idx: Array) -> Experience:
    return jax.tree.map(lambda x: x[idx], exp)


def pf_ppo_resample(exp: Experience, rows: StepRows, scores: np.ndarray, pf_ppo: tuple[str, float], *,
                    seed: tuple[int, int]) -> tuple[Experience, StepRows, float]:
    """veRL's pf-PPO: `exp`'s rows (and their layout `rows`) resampled with replacement by score
    (losses/shaping.py `pf_ppo_rows`); the fraction of distinct rows drawn. Duplicated rows share no
    prompt tokens in a packed layout (each is packed whole)."""
    idx = pf_ppo_rows(scores, *pf_ppo, seed=seed)
    resampled = _take_rows(exp, idx.astype(np.int32))  # the same indices on every process
    layout = dataclasses.replace(rows, start=rows.start[idx], length=rows.length[idx], prompt_groups=None)
    return resampled, layout, float(len(np.unique(idx)) / len(idx))


@functools.partial(jax.jit, static_argnames=("model_cfg", "temperature", "compute_dtype", "micro_rows",
                                             "logprob_impl", "mesh"))
def log_probs_no_grad(params: dict, input_ids: Array, attention_mask: Array, response_mask: Array,
                      packing: PackedLayout | None = None, routing: Array | None = None, *, model_cfg: ModelConfig,
                      temperature: float, compute_dtype: str, micro_rows: int, logprob_impl: str = "auto",
                      mesh: Mesh | None = None, images: RowImages | None = None) -> Array:
    """Response log-probs [N, R] computed `micro_rows` rows at a time (reference / old policy);
    `packing`: one layout per chunk (batching/plan.py `plan_chunks`) to run packed, or with
    micro_rows 0 token-budget chunks over all rows (`plan_capacity_chunks`); `routing`: a MoE
    policy's recorded routing [N, P + R, L, k] replayed (actor.router_replay); `images`: a vision-language
    policy's rows' images."""
    response_len = response_mask.shape[1]

    def one(chunk: dict) -> Array:
        return response_log_probs(params, model_cfg, chunk["ids"], chunk["mask"], response_len,
                                  temperature=temperature, compute_dtype=compute_dtype,
                                  packing=chunk.get("per_chunk"), logprob_impl=logprob_impl, mesh=mesh,
                                  replay=chunk.get("routing"), images=chunk.get("images"))

    batch: dict = {"ids": input_ids, "mask": attention_mask}
    if routing is not None:
        batch["routing"] = routing
    if images is not None:
        batch["images"] = images
    return _chunked(one, batch, micro_rows, packing)


@functools.partial(jax.jit, static_argnames=("model_cfg", "temperature", "compute_dtype", "micro_rows", "topk",
                                             "logprob_impl", "mesh"))
def teacher_no_grad(params: dict, input_ids: Array, attention_mask: Array, response_mask: Array,
                    packing: PackedLayout | None = None, *, model_cfg: ModelConfig, temperature: float,
                    compute_dtype: str, micro_rows: int, topk: int = 0, logprob_impl: str = "auto",
                    mesh: Mesh | None = None) -> dict[str, Array]:
    """A teacher's scores of the responses, chunked as `log_probs_no_grad`: "log_probs" [N, R] of the
    sampled tokens, and with `topk` its k most likely tokens at each position ("topk_ids",
    "topk_log_probs" [N, R, k]; 0 where no response token)."""
    response_len = response_mask.shape[1]

    def one(chunk: dict) -> dict[str, Array]:
        scores = response_scores(params, model_cfg, chunk["ids"], chunk["mask"], response_len,
                                 temperature=temperature, compute_dtype=compute_dtype, packing=chunk.get("per_chunk"),
                                 logprob_impl=logprob_impl, mesh=mesh, topk=topk)
        out = {"log_probs": scores.log_prob}
        if scores.topk is not None:
            keep = chunk["response"][..., None] > 0  # 0 where no response token
            out.update(topk_ids=jnp.where(keep, scores.topk.ids, 0),
                       topk_log_probs=jnp.where(keep, scores.topk.log_probs, 0.0))
        return out

    batch = {"ids": input_ids, "mask": attention_mask, "response": response_mask}
    return _chunked(one, batch, micro_rows, packing)


@functools.partial(jax.jit, static_argnames=("model_cfg", "compute_dtype", "micro_rows"))
def values_no_grad(params: dict, input_ids: Array, attention_mask: Array, response_mask: Array,
                   packing: PackedLayout | None = None, *, model_cfg: ModelConfig, compute_dtype: str,
                   micro_rows: int, images: RowImages | None = None) -> Array:
    """Critic values [N, R] `micro_rows` rows at a time (as `log_probs_no_grad`); `images`: the rows' images."""
    response_len = response_mask.shape[1]

    def one(chunk: dict) -> Array:
        return response_values(params, model_cfg, chunk["ids"], chunk["mask"], response_len,
                               compute_dtype=compute_dtype, packing=chunk.get("per_chunk"),
                               images=chunk.get("images"))

    batch: dict = {"ids": input_ids, "mask": attention_mask}
    if images is not None:
        batch["images"] = images
    return _chunked(one, batch, micro_rows, packing)


def _chunked(fn: Any, batch: dict, micro_rows: int, packing: PackedLayout | None) -> Any:
    if micro_rows == 0:  # token-budget chunks (their shapes come from the config alone)
        if packing is None:
            raise ValueError("token-budget chunks (micro_rows=0) need their packed layouts")
        return budget_chunked(fn, batch, packing)
    return micro_batched(fn, batch, micro_rows, packing)


@functools.partial(jax.jit, static_argnames=("s",))
def advantages_and_returns(token_level_scores: Array, response_mask: Array, group_ids: Array,
                           old_log_probs: Array, ref_log_probs: Array | None, values: Array | None,
                           reward_baselines: Array | None, kl_coef: Array, *, s: AdvantageSpec
                           ) -> dict[str, Array]:
    """token_level_rewards (scores - beta * KL when KL is in the reward), advantages, returns; ROLL's
    shaping around the estimator where set (losses/shaping.py, in ROLL's order: batch reward normalisation,
    reward clip, KL,
    reward whitening, the estimator, the grpo score's clip, advantage whitening, advantage clip)."""
    out: dict[str, Array] = {}
    rewards = token_level_scores
    if s.norm_mean_type or s.norm_std_type:  # ROLL's reward_norm, before its reward clip
        rewards = normalize_scores(rewards, response_mask, group_ids, mean_type=s.norm_mean_type,
                                   std_type=s.norm_std_type)
    clip_score_first = s.adv_estimator != "grpo"  # grpo clips its normalised score, after the estimator
    if s.reward_clip is not None and clip_score_first:
        rewards, out["critic/reward_clip_frac"] = clip_sequence_scores(rewards, response_mask, s.reward_clip)
    if s.use_kl_in_reward:
        rewards, current_kl = kl_in_reward(rewards, old_log_probs,
                                           required(ref_log_probs, "ref_log_probs", "algorithm.use_kl_in_reward"),
                                           response_mask,
                                           kl_coef, s.kl_penalty)
        out["current_kl"] = current_kl
    if s.whiten_rewards:
        rewards = whiten_tokens(rewards, response_mask)
    advantages, returns = compute_advantage(
        s.adv_estimator, rewards, response_mask, group_ids=group_ids, values=values, gamma=s.gamma,
        lam=s.lam, norm_adv_by_std_in_grpo=s.norm_adv_by_std_in_grpo, reward_baselines=reward_baselines,
        log_probs=old_log_probs, ref_log_probs=ref_log_probs, trl_rloo=s.trl_rloo)
    tokens = response_mask > 0
    if s.reward_clip is not None and not clip_score_first:  # a grpo advantage is its row's normalised score
        row_score = jnp.sum(jnp.where(tokens, advantages, 0.0), -1) / jnp.maximum(jnp.sum(tokens, -1), 1)
        out["critic/reward_clip_frac"] = clip_symmetric(row_score, s.reward_clip, jnp.any(tokens, axis=-1))[1]
        advantages = jnp.clip(advantages, -s.reward_clip, s.reward_clip)
    if s.whiten_advantages:
        advantages = whiten_tokens(advantages, response_mask)
    if s.advantage_clip is not None:
        advantages, out["critic/advantage_clip_frac"] = clip_symmetric(advantages, s.advantage_clip, tokens)
    if s.adv_estimator == "trl_rloo":  # TRL's logged rewards: the score with the KL folded in, and the KL term
        ref = required(ref_log_probs, "ref_log_probs", "algorithm.adv_estimator=trl_rloo")
        _, trl_rewards = trl_rloo_with(s.trl_rloo, rewards.sum(-1), old_log_probs, ref, response_mask, group_ids)
        out.update({f"critic/{k}/mean": v.mean() for k, v in trl_rewards.items()})
    out.update(token_level_rewards=rewards, advantages=advantages, returns=returns)
    return out


@jax.jit
def rollout_mismatch(trainer_log_probs: Array, rollout_log_probs: Array, response_mask: Array) -> dict[str, Array]:
    """max |trainer - rollout| log-prob and the fraction of equal tokens (losses/rollout_correction.py)."""
    return mismatch_metrics(trainer_log_probs, rollout_log_probs.astype(jnp.float32), response_mask)


@functools.partial(jax.jit, static_argnames=("s",))
def rollout_correction(old_log_probs: Array, rollout_log_probs: Array, response_mask: Array, *,
                       s: RolloutCorrectionSpec):
    """(IS weights or None, response mask after rejection sampling, metrics) for the actor update."""
    return compute_rollout_correction(
        old_log_probs, rollout_log_probs, response_mask, rollout_is=s.rollout_is,
        rollout_is_threshold=s.rollout_is_threshold, rollout_is_batch_normalize=s.rollout_is_batch_normalize,
        rollout_rs=s.rollout_rs, rollout_rs_threshold=s.rollout_rs_threshold)


class DistillSignal(NamedTuple):
    """What a teacher adds to a step (roles/teacher.py): a per-token advantage to mix in (reverse
    KL; None for the top-k loss), and the teacher's top-k for the actor's loss (or None)."""

    advantages: Array | None  # [N, R], already discounted
    coef: float  # its weight
    reward_coef: float  # the task advantage's weight
    topk_ids: Array | None = None  # [N, R, k]
    topk_log_probs: Array | None = None


@jax.jit
def mix_advantages(task: Array, distill: Array | None, reward_coef: Array, coef: Array) -> Array:
    """reward_coef * task advantage + coef * distillation advantage (docs/algorithms.md, distillation)."""
    mixed = reward_coef * task
    return mixed if distill is None else mixed + coef * distill


def make_experience(
    *,
    input_ids: Array,
    attention_mask: Array,
    response_mask: Array,
    token_level_scores: Array,
    rollout_log_probs: Array,
    group_ids: Array,
    old_log_probs: Array,
    ref_log_probs: Array | None,
    values: Array | None,
    reward_baselines: Array | None,
    kl_coef: float,
    advantage: AdvantageSpec,
    correction: RolloutCorrectionSpec,
    routing: Array | None = None,
    distill: DistillSignal | None = None,
    images: RowImages | None = None,
) -> tuple[Experience, Array, dict[str, Any]]:
    """The step's `Experience`, its token-level rewards [N, R] and device-side metrics: advantages
    and returns (KL in the reward first when configured), mixed with a teacher's signal
    (`distill`), then rollout correction."""
    adv = advantages_and_returns(token_level_scores, response_mask, group_ids, old_log_probs, ref_log_probs,
                                 values, reward_baselines, jax.numpy.float32(kl_coef), s=advantage)
    if distill is not None:
        adv["advantages"] = mix_advantages(adv["advantages"], distill.advantages, jnp.float32(distill.reward_coef),
                                           jnp.float32(distill.coef))
    metrics: dict[str, Any] = {k: v for k, v in adv.items() if k == "current_kl" or k.startswith("critic/")}
    weights, mask = None, response_mask
    if correction.enabled:
        weights, mask, rc_metrics = rollout_correction(old_log_probs, rollout_log_probs, response_mask, s=correction)
        metrics.update(rc_metrics)
    exp = Experience(input_ids=input_ids, attention_mask=attention_mask, response_mask=mask,
                     old_log_probs=old_log_probs, advantages=adv["advantages"], returns=adv["returns"],
                     ref_log_probs=ref_log_probs, values=values, rollout_is_weights=weights, routing=routing,
                     images=images,
                     teacher_topk_ids=None if distill is None else distill.topk_ids,
                     teacher_topk_log_probs=None if distill is None else distill.topk_log_probs)
    return exp, adv["token_level_rewards"], metrics
