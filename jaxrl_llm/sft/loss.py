"""The SFT loss and its jitted update.

loss = sum over trained tokens of -log p(token | prefix) / trained tokens of the whole batch
       (+ router_aux_loss_coef * load-balancing loss for mixture-of-experts models, as transformers adds
       it in training when output_router_logits)

The token mean is over the global batch (veRL's SFT trainer, transformers' loss over one batch), and
each micro-batch's sum is divided by that global count (`roles/update.py Denominators`), so gradient
accumulation gives the full-batch gradient exactly. Log-probs come from the fused log-prob head (no
[B, T, V] logits), packed when model.use_remove_padding.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxrl_llm.arrays import ArrayTree
from jaxrl_llm.batching import UpdateLayout
from jaxrl_llm.losses.agg import agg_loss
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.moe import load_balancing_loss
from jaxrl_llm.roles.forward import response_scores
from jaxrl_llm.roles.update import Denominators, run_update_epochs, with_lora_loss
from jaxrl_llm.sft.batch import SftBatch

sg = jax.lax.stop_gradient
METRIC_PREFIX = "train"  # veRL's SFT trainer logs train/loss, train/lr, val/loss


def sft_loss(params: dict, mb: SftBatch, denoms: Denominators, *, model_cfg: ModelConfig, compute_dtype: str,
             remat: bool | str, logprob_impl: str, mesh: Mesh | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-mean negative log-likelihood of one micro-batch's trained tokens, over the global count."""
    mask = mb.response_mask
    scores = response_scores(params, model_cfg, mb.input_ids, mb.attention_mask, mask.shape[1],
                             compute_dtype=compute_dtype, remat=remat, packing=mb.packing,
                             logprob_impl=logprob_impl, mesh=mesh)
    nll = agg_loss(-scores.log_prob, mask, "token-mean", num_tokens=denoms.num_tokens, num_seqs=denoms.num_seqs)
    loss, metrics = nll, {f"{METRIC_PREFIX}/loss": sg(nll)}
    coef = model_cfg.router_aux_loss_coef if model_cfg.output_router_logits else 0.0
    if scores.router is not None:
        share = mask.astype(jnp.float32).sum() / jnp.maximum(denoms.num_tokens, 1.0)
        aux = share * load_balancing_loss(scores.router.stats)
        loss = loss + coef * aux
        metrics["moe/aux_loss"] = sg(aux)
    return loss, metrics


def update_sft(params: dict, opt_state: ArrayTree, batch: SftBatch, rng: jax.Array, lr: jax.Array | None = None,
               packing: UpdateLayout | None = None, frozen: dict | None = None, *, model_cfg: ModelConfig,
               compute_dtype: str, remat: bool | str, logprob_impl: str, tx: optax.GradientTransformation,
               num_mini_batches: int, num_micro_batches: int, rows_sharding: Any = None, lora_scale: float = 0.0,
               lora_dropout: float = 0.0):
    """One optimizer step per mini-batch (an SFT step has one) over micro-batches at learning rate `lr`;
    LoRA: `params` is {"lora": adapters} on the `frozen` base, PEFT's dropout on their input."""
    loss_fn = functools.partial(sft_loss, model_cfg=model_cfg, compute_dtype=compute_dtype, remat=remat,
                                logprob_impl=logprob_impl, mesh=None if rows_sharding is None else rows_sharding.mesh)
    loss_fn, dropout = with_lora_loss(loss_fn, frozen, lora_scale, lora_dropout)
    return run_update_epochs(params, opt_state, batch, rng, lr, tx=tx, loss_fn=loss_fn, metric_prefix=METRIC_PREFIX,
                             ppo_epochs=1, num_mini_batches=num_mini_batches, num_micro_batches=num_micro_batches,
                             shuffle=False, rows_sharding=rows_sharding, packing=packing, loss_takes_rng=dropout)


@functools.partial(jax.jit, static_argnames=("model_cfg", "compute_dtype", "logprob_impl"))
def batch_nll(params: dict, input_ids: jax.Array, attention_mask: jax.Array, response_mask: jax.Array, *,
              model_cfg: ModelConfig, compute_dtype: str, logprob_impl: str) -> tuple[jax.Array, jax.Array]:
    """(summed negative log-likelihood of the trained tokens, their count) of one padded batch: the
    validation loss adds these up over the validation set."""
    scores = response_scores(params, model_cfg, input_ids, attention_mask, response_mask.shape[1],
                             compute_dtype=compute_dtype, logprob_impl=logprob_impl)
    return -jnp.sum(scores.log_prob * response_mask), jnp.sum(response_mask)
