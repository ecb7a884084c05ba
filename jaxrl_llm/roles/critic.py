"""The critic (value model) loss and its jitted update, configured by `critic`.

A critic is a decoder backbone with a scalar value head (`models` head="value"), initialised from
the critic's causal-LM checkpoint with a fresh head. Its loss is veRL's clipped value loss.
"""
from __future__ import annotations

import functools

import jax
import optax
from jax.sharding import NamedSharding

from jaxrl_llm.arrays import ArrayTree
from jaxrl_llm.batching import UpdateLayout
from jaxrl_llm.config.spec import CriticSpec
from jaxrl_llm.losses.masked import masked_sum
from jaxrl_llm.losses.value import compute_value_loss
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.roles.experience import Experience, required
from jaxrl_llm.roles.forward import response_values
from jaxrl_llm.roles.update import Denominators, run_update_epochs

sg = jax.lax.stop_gradient


def critic_loss(params: dict, mb: Experience, denoms: Denominators, *, model_cfg: ModelConfig,
                s: CriticSpec) -> tuple[jax.Array, dict[str, jax.Array]]:
    mask = mb.response_mask
    vpreds = response_values(params, model_cfg, mb.input_ids, mb.attention_mask, mask.shape[1],
                             compute_dtype=s.compute_dtype, remat=s.remat, packing=mb.packing, images=mb.images)
    old_values = required(mb.values, "values", "the critic's value loss")
    loss, clipfrac = compute_value_loss(vpreds, mb.returns, old_values, mask, s.cliprange_value,
                                        s.loss_agg_mode, num_tokens=denoms.num_tokens,
                                        num_seqs=denoms.num_seqs)
    vpred_mean = masked_sum(sg(vpreds), mask) / denoms.num_tokens
    return loss, {"critic/vf_loss": sg(loss), "critic/vf_clipfrac": clipfrac,
                  "critic/vpred_mean": vpred_mean}


def update_critic(params: dict, opt_state: ArrayTree, batch: Experience, rng: jax.Array, lr: jax.Array | None = None,
                  packing: UpdateLayout | None = None,
                  *, model_cfg: ModelConfig, s: CriticSpec, tx: optax.GradientTransformation,
                  num_mini_batches: int, num_micro_batches: int, rows_sharding: NamedSharding | None = None):
    loss_fn = functools.partial(critic_loss, model_cfg=model_cfg, s=s)
    return run_update_epochs(
        params, opt_state, batch, rng, lr, tx=tx, loss_fn=loss_fn, metric_prefix="critic",
        ppo_epochs=s.ppo_epochs, num_mini_batches=num_mini_batches,
        num_micro_batches=num_micro_batches, shuffle=s.shuffle, rows_sharding=rows_sharding,
        packing=packing)
