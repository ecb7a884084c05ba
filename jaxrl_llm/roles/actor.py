"""The actor (policy) loss and its jitted update, configured by `actor_rollout_ref.actor`.

loss = policy loss (registry[policy_loss.loss_mode])
       - entropy_coeff * agg(entropy)                 (entropy bonus)
       + kl_loss_coef * agg(kl_penalty(lp, ref_lp))   (when use_kl_loss)
       + router_aux_loss_coef * load_balancing_loss     (mixture-of-experts models; HF's formula)
       + router_z_loss_coef * router_z_loss             (mixture-of-experts models)
       + distill_topk_coef * agg(topk_forward_kl)         (algorithm.distillation, signal topk_forward_kl)
each aggregated with `loss_agg_mode` over the mini-batch's global token / sequence counts; the MoE
terms are computed per micro-batch forward (as HF does per forward) and weighted by the micro-batch's
share of the mini-batch's response tokens.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxrl_llm.arrays import ArrayTree
from jaxrl_llm.batching import UpdateLayout
from jaxrl_llm.config.spec import ActorSpec
from jaxrl_llm.losses.agg import agg_loss
from jaxrl_llm.losses.distill import topk_forward_kl
from jaxrl_llm.losses.kl import kl_penalty
from jaxrl_llm.losses.policy import POLICY_LOSSES, compute_policy_loss, m2po_keep_mask
from jaxrl_llm.losses.rollout_correction import rollout_is_weights
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.lora import with_lora
from jaxrl_llm.models.moe import MoeOut, expert_load_max, load_balancing_loss, router_z_loss
from jaxrl_llm.roles.experience import Experience, required
from jaxrl_llm.roles.forward import response_log_probs, response_scores
from jaxrl_llm.roles.update import TOKEN_OUTPUT, Denominators, TokenPrepass, run_update_epochs, with_lora_loss

sg = jax.lax.stop_gradient
OLD_LOG_PROBS = TOKEN_OUTPUT + "old_log_probs"  # the update's own log-probs, [N, R] (update.py TOKEN_OUTPUT)

def actor_loss(params: dict, mb: Experience, denoms: Denominators, *, model_cfg: ModelConfig,
               s: ActorSpec, mesh: Mesh | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of one micro-batch, normalised by the mini-batch's global counts."""
    mask = mb.response_mask
    response_len = mask.shape[1]
    topk_ids = (required(mb.teacher_topk_ids, "teacher_topk_ids", "algorithm.distillation (topk_forward_kl)")
                if s.distill_topk_coef else None)
    log_prob, entropy, router, topk = response_scores(
        params, model_cfg, mb.input_ids, mb.attention_mask, response_len,
        temperature=s.temperature, compute_dtype=s.compute_dtype, remat=s.remat, with_entropy=True,
        packing=mb.packing, logprob_impl=s.logprob_impl, mesh=mesh, replay=mb.routing, topk_ids=topk_ids,
        images=mb.images)
    assert entropy is not None
    counts: dict[str, Any] = dict(num_tokens=denoms.num_tokens, num_seqs=denoms.num_seqs,
                                  loss_scale_factor=s.loss_scale_factor)
    # one optimizer step per RL step: the old policy IS the current one (config/spec.py)
    old_log_prob = sg(log_prob) if s.old_log_probs_from_update else mb.old_log_probs
    is_weights = mb.rollout_is_weights
    if s.rollout_is_in_loss is not None:  # rollout correction from this forward (RunSpec.rollout_is_in_update,
        # bypass mode's reinforce loss): old_log_probs hold the sampler's log-probs; the update returns its own
        # for the diagnostics
        is_weights = rollout_is_weights(sg(log_prob), mb.old_log_probs, mask, rollout_is=s.rollout_is_in_loss,
                                        rollout_is_threshold=s.rollout_is_threshold,
                                        batch_normalize=s.rollout_is_batch_normalize)
    pg_loss, metrics = compute_policy_loss(
        s.loss_mode, old_log_prob, log_prob, mb.advantages, mask,
        loss_agg_mode=s.loss_agg_mode, clip_ratio_low=s.clip_ratio_low,
        clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c,
        rollout_is_weights=is_weights, policy_agg_mode=s.policy_loss_agg_mode, token_mask=mb.loss_token_mask,
        dual_clip=s.dual_clip, scores=mb.sequence_scores,
        **counts, **dict(s.loss_kwargs))
    # The entropy is always reported; it carries gradient only when it is part of the loss.
    entropy_agg = agg_loss(entropy if s.entropy_coeff else sg(entropy), mask, s.loss_agg_mode, **counts)
    loss = pg_loss - s.entropy_coeff * entropy_agg
    metrics = dict(metrics)
    if s.rollout_is_in_loss is not None or s.old_log_probs_from_update:  # the trainer's rollout_corr/ diagnostics
        metrics[OLD_LOG_PROBS] = jnp.where(mask > 0, sg(log_prob), 0.0)
    metrics["actor/pg_loss"] = sg(pg_loss)
    metrics["actor/entropy"] = sg(entropy_agg)
    if s.use_kl_loss:
        kl = kl_penalty(log_prob, required(mb.ref_log_probs, "ref_log_probs", "actor.use_kl_loss"),
                        s.kl_loss_type)
        kl_loss = agg_loss(kl, mask, s.loss_agg_mode, **counts)
        loss = loss + s.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = sg(kl_loss)
    if topk is not None:  # the forward KL over the teacher's top-k tokens (losses/distill.py)
        teacher = required(mb.teacher_topk_log_probs, "teacher_topk_log_probs", "algorithm.distillation")
        distill_loss = agg_loss(topk_forward_kl(topk.log_probs, teacher), mask, s.loss_agg_mode, **counts)
        loss = loss + s.distill_topk_coef * distill_loss
        metrics["actor/distill_topk_kl"] = sg(distill_loss)
    if router is not None:
        loss, metrics = _with_router_losses(loss, metrics, router, mask, denoms, model_cfg, s, mb.routing is not None)
    return loss, metrics


def current_log_probs(params: dict, mb: Experience, *, model_cfg: ModelConfig, s: ActorSpec,
                      mesh: Mesh | None = None) -> jax.Array:
    """The policy's log-probs of the micro-batch's response tokens (0 off its mask), no gradient: the
    update's pre-pass for a loss that reads the whole mini-batch first."""
    log_prob = response_log_probs(params, model_cfg, mb.input_ids, mb.attention_mask, mb.response_mask.shape[1],
                                  temperature=s.temperature, compute_dtype=s.compute_dtype, packing=mb.packing,
                                  logprob_impl=s.logprob_impl, mesh=mesh, replay=mb.routing,
                                  images=mb.images)
    return jnp.where(mb.response_mask > 0, sg(log_prob), 0.0)


def token_mask_prepass(s: ActorSpec, model_cfg: ModelConfig, mesh: Mesh | None, frozen: dict | None,
                       lora_scale: float) -> TokenPrepass | None:
    """The pre-pass of a `needs_token_mask` policy loss (M2PO): the mini-batch's current log-probs against
    its old ones (the sampler's: bypass mode) -> `Experience.loss_token_mask`."""
    if not POLICY_LOSSES.capability(s.loss_mode, "needs_token_mask"):
        return None
    threshold = dict(s.loss_kwargs)["m2_threshold"]

    def forward(params: dict, mb: Experience) -> jax.Array:
        full = params if frozen is None else with_lora(frozen, params["lora"], lora_scale)
        return current_log_probs(full, mb, model_cfg=model_cfg, s=s, mesh=mesh)

    def finish(mini: Experience, log_probs: jax.Array) -> Experience:
        keep = m2po_keep_mask(log_probs - mini.old_log_probs, mini.response_mask, mini.advantages, threshold)
        return dataclasses.replace(mini, loss_token_mask=keep)

    return TokenPrepass(forward, finish)


def router_aux_loss_coef(s: ActorSpec, model_cfg: ModelConfig) -> float:
    """`actor.router_aux_loss_coef`, or when unset the model's own: config.json's `router_aux_loss_coef`
    where `output_router_logits` is true (transformers adds the loss only then), else 0."""
    if s.router_aux_loss_coef is not None:
        return s.router_aux_loss_coef
    return model_cfg.router_aux_loss_coef if model_cfg.output_router_logits else 0.0


def _with_router_losses(loss: jax.Array, metrics: dict, router: MoeOut, mask: jax.Array, denoms: Denominators,
                        model_cfg: ModelConfig, s: ActorSpec, replayed: bool) -> tuple[jax.Array, dict]:
    """The load-balancing and z-loss terms of a MoE forward, weighted by this micro-batch's share of the
    mini-batch's response tokens (the update sums micro-batches)."""
    share = mask.astype(jnp.float32).sum() / jnp.maximum(denoms.num_tokens, 1.0)
    aux, z = load_balancing_loss(router.stats), router_z_loss(router.stats)
    coef = router_aux_loss_coef(s, model_cfg)
    if coef:
        loss = loss + share * coef * aux
    if s.router_z_loss_coef:
        loss = loss + share * s.router_z_loss_coef * z
    metrics["moe/aux_loss"] = sg(share * aux)
    metrics["moe/z_loss"] = sg(share * z)
    metrics["moe/expert_load_max"] = sg(share * expert_load_max(router.stats))
    if replayed:  # how often the update's own router picks the experts the sampler ran
        stats = router.stats
        metrics["moe/routing_agreement"] = sg(share * jnp.sum(stats.agree) / jnp.maximum(jnp.sum(stats.tokens), 1.0))
    return loss, metrics


def update_actor(params: dict, opt_state: ArrayTree, batch: Experience, rng: jax.Array, lr: jax.Array | None = None,
                 packing: UpdateLayout | None = None, frozen: dict | None = None, *, model_cfg: ModelConfig,
                 s: ActorSpec, tx: optax.GradientTransformation, num_mini_batches: int, num_micro_batches: int,
                 rows_sharding: Any = None, lora_scale: float = 0.0, lora_dropout: float = 0.0):
    """`ppo_epochs` x mini-batches x micro-batches of actor updates at learning rate `lr` (one XLA
    program once jitted, which `TrainedRole.update` does). LoRA: `params` is {"lora": adapters}, the
    only leaves differentiated and updated, and `frozen` the base they are attached to; `lora_dropout`:
    PEFT's dropout on the adapters' input in this forward (a key per micro-batch)."""
    mesh = None if rows_sharding is None else rows_sharding.mesh
    loss_fn = functools.partial(actor_loss, model_cfg=model_cfg, s=s, mesh=mesh)
    loss_fn, dropout = with_lora_loss(loss_fn, frozen, lora_scale, lora_dropout)
    own_log_probs = s.rollout_is_in_loss is not None or s.old_log_probs_from_update  # see actor_loss
    return run_update_epochs(
        params, opt_state, batch, rng, lr, tx=tx, loss_fn=loss_fn, metric_prefix="actor",
        ppo_epochs=s.ppo_epochs, num_mini_batches=num_mini_batches,
        num_micro_batches=num_micro_batches, shuffle=s.shuffle, rows_sharding=rows_sharding,
        packing=packing, token_outputs=(OLD_LOG_PROBS,) if own_log_probs else (), loss_takes_rng=dropout,
        prepass=token_mask_prepass(s, model_cfg, mesh, frozen, lora_scale))
