"""The DPO losses (TRL's formulas) and their jitted update.

Rows come in pairs: row 2i is pair i's chosen response, row 2i + 1 its rejected one. With
s(y) = the summed log-prob of response y (IPO: its mean per token, as TRL averages for ipo), under the
policy (pi) and the frozen reference (ref):

    logits = (pi(y_c) - pi(y_r)) - (ref(y_c) - ref(y_r))
    sigmoid: -(1 - ls) * log sigmoid(beta * logits) - ls * log sigmoid(-beta * logits)   (ls: label_smoothing)
    ipo:     (logits - 1 / (2 * beta))^2
    hinge:   max(0, 1 - beta * logits)

The loss is the mean over the mini-batch's pairs; each micro-batch (an even number of rows, so pairs
never split) adds its pairs' sum over the global pair count, so gradient accumulation is exact.
Metrics with TRL's names: rewards/chosen = beta * (pi(y_c) - ref(y_c)) (mean), rewards/rejected,
rewards/margins, rewards/accuracies (chosen reward > rejected reward), logps/chosen, logps/rejected.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxrl_llm.arrays import ArrayTree
from jaxrl_llm.batching import PackedLayout, UpdateLayout
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.roles.forward import response_scores
from jaxrl_llm.roles.update import Denominators, run_update_epochs, with_lora_loss

sg = jax.lax.stop_gradient
LOSS_TYPES = ("sigmoid", "ipo", "hinge")


@flax.struct.dataclass
class DpoBatch:
    """Device rows of one step (pairs interleaved: chosen, rejected), with the reference's summed
    log-prob of each row's response."""

    input_ids: jax.Array  # int32 [2P, T]
    attention_mask: jax.Array  # int32 [2P, T]
    response_mask: jax.Array  # float32 [2P, R]
    ref_logps: jax.Array  # float32 [2P]: summed over the response
    packing: PackedLayout | None = None


def pair_losses(chosen: jax.Array, rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array, *,
                loss_type: str, beta: float, label_smoothing: float = 0.0) -> jax.Array:
    """Per-pair losses [P] from the (already length-normalised for ipo) scores (module doc)."""
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * logits) - \
            label_smoothing * jax.nn.log_sigmoid(-beta * logits)
    if loss_type == "ipo":
        return (logits - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * logits)
    raise ValueError(f"dpo.loss_type={loss_type!r}: one of {', '.join(LOSS_TYPES)}")


def pair_metrics(chosen: jax.Array, rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array, *,
                 beta: float, num_pairs: jax.Array) -> dict[str, jax.Array]:
    """TRL's metrics of these pairs, as sums over `num_pairs` (the mini-batch's: micro-batches add up)."""
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    mean = lambda x: jnp.sum(sg(x)) / num_pairs  # noqa: E731
    return {"rewards/chosen": mean(chosen_rewards), "rewards/rejected": mean(rejected_rewards),
            "rewards/margins": mean(chosen_rewards - rejected_rewards),
            "rewards/accuracies": mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
            "logps/chosen": mean(chosen), "logps/rejected": mean(rejected)}


def sequence_scores(token_logps: jax.Array, mask: jax.Array, loss_type: str) -> jax.Array:
    """A response's score: its summed log-prob (IPO: the mean per token)."""
    total = jnp.sum(token_logps * mask, axis=-1)
    return total / jnp.maximum(mask.sum(-1), 1.0) if loss_type == "ipo" else total


def dpo_loss(params: dict, mb: DpoBatch, denoms: Denominators, *, model_cfg: ModelConfig, loss_type: str,
             beta: float, label_smoothing: float, compute_dtype: str, remat: bool | str, logprob_impl: str,
             mesh: Mesh | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of one micro-batch's pairs over the mini-batch's pair count."""
    mask = mb.response_mask
    scores = response_scores(params, model_cfg, mb.input_ids, mb.attention_mask, mask.shape[1],
                             compute_dtype=compute_dtype, remat=remat, packing=mb.packing,
                             logprob_impl=logprob_impl, mesh=mesh)
    policy = sequence_scores(scores.log_prob, mask, loss_type)
    ref = mb.ref_logps / jnp.maximum(mask.sum(-1), 1.0) if loss_type == "ipo" else mb.ref_logps
    chosen, rejected, ref_chosen, ref_rejected = policy[0::2], policy[1::2], ref[0::2], ref[1::2]
    num_pairs = denoms.num_seqs / 2.0  # every row has a response token
    losses = pair_losses(chosen, rejected, ref_chosen, ref_rejected, loss_type=loss_type, beta=beta,
                         label_smoothing=label_smoothing)
    loss = jnp.sum(losses) / num_pairs
    metrics = pair_metrics(chosen, rejected, ref_chosen, ref_rejected, beta=beta, num_pairs=num_pairs)
    metrics["train/loss"] = sg(loss)
    return loss, metrics


def update_dpo(params: dict, opt_state: ArrayTree, batch: DpoBatch, rng: jax.Array, lr: jax.Array | None = None,
               packing: UpdateLayout | None = None, frozen: dict | None = None, *, model_cfg: ModelConfig,
               loss_type: str, beta: float, label_smoothing: float, compute_dtype: str, remat: bool | str,
               logprob_impl: str, tx: optax.GradientTransformation, num_mini_batches: int, num_micro_batches: int,
               rows_sharding: Any = None, lora_scale: float = 0.0, lora_dropout: float = 0.0):
    """One optimizer step over the batch's pairs (micro-batches accumulated); LoRA as sft/loss.py."""
    loss_fn = functools.partial(dpo_loss, model_cfg=model_cfg, loss_type=loss_type, beta=beta,
                                label_smoothing=label_smoothing, compute_dtype=compute_dtype, remat=remat,
                                logprob_impl=logprob_impl, mesh=None if rows_sharding is None else rows_sharding.mesh)
    loss_fn, dropout = with_lora_loss(loss_fn, frozen, lora_scale, lora_dropout)
    return run_update_epochs(params, opt_state, batch, rng, lr, tx=tx, loss_fn=loss_fn, metric_prefix="train",
                             ppo_epochs=1, num_mini_batches=num_mini_batches, num_micro_batches=num_micro_batches,
                             shuffle=False, rows_sharding=rows_sharding, packing=packing, loss_takes_rng=dropout)
