"""The pieces of an SFT step, shared by `SftTrainer` (sft/trainer.py) and the RL run's SFT warm-up
(sft/warmup.py): the `sft` section resolved (`resolve_sft`), the RL keys an SFT run derives from it
(`sft_view`), the step's `BatchPlan`, the update bound to the policy, and one step (`sft_step`).
"""
from __future__ import annotations

import copy
import functools
from typing import Any

import jax
import ml_collections

from jaxrl_llm.batching import NO_PADS, StepBatching
from jaxrl_llm.batching.batch_plan import BatchPlan, MicroBatching, RoleBatch
from jaxrl_llm.batching.ops import pad_columns
from jaxrl_llm.config.derive import without_rl_step
from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.roles.trained import TrainedRole
from jaxrl_llm.sft.batch import HostBatch, SftBatch
from jaxrl_llm.sft.data import SftSpec
from jaxrl_llm.sft.loss import METRIC_PREFIX, update_sft
from jaxrl_llm.sharding import to_device


def sft_view(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with the RL keys an SFT run reuses derived from its `sft` section: one mini-batch of
    data.train_batch_size sequences (rollout.n = 1) split into sft.micro_batch_size_per_device (or
    token-budget) micro-batches, and a sequence budget of sft.max_length tokens."""
    cfg = without_rl_step(copy.deepcopy(config))
    s, arr = cfg.sft, cfg.actor_rollout_ref
    arr.rollout.n = 1
    arr.actor.ppo_micro_batch_size_per_device = s.micro_batch_size_per_device
    arr.actor.use_dynamic_bsz = s.use_dynamic_bsz
    arr.actor.ppo_max_token_len_per_device = s.max_token_len_per_device
    cfg.data.max_prompt_length = max(1, s.max_length - 1)
    cfg.data.max_response_length = 1
    return cfg


def sft_batch_plan(train_batch_size: int, dp_size: int, sft: SftSpec, longest: tuple[int, int]) -> BatchPlan:
    """The `BatchPlan` of one SFT step: one mini-batch of every sequence; `longest` (prompt, response)
    tokens are what token-budget passes pad to."""
    micro = (MicroBatching("sft.max_token_len_per_device", None, sft.max_token_len_per_device) if sft.use_dynamic_bsz
             else MicroBatching("sft.micro_batch_size_per_device", sft.micro_batch_size_per_device, None))
    role = RoleBatch(train_batch_size, train_batch_size, 1, 1, train_batch_size // dp_size, micro)
    return BatchPlan(prompts=train_batch_size, n=1, dp_size=dp_size, max_prompt_length=longest[0],
                     response_length=longest[1], actor=role, critic=None, ref_log_prob=micro, old_log_prob=micro,
                     values=None)


def sft_update_fn(role_model_cfg: Any, spec: RunSpec) -> Any:
    """`update_sft` bound to the policy's model and compute settings (a `TrainedRole.update_fn`)."""
    lora = spec.model.lora
    return functools.partial(update_sft, model_cfg=role_model_cfg, compute_dtype=spec.actor.compute_dtype,
                             remat=spec.actor.remat, logprob_impl=spec.actor.logprob_impl,
                             lora_scale=lora.scale if lora else 0.0, lora_dropout=lora.dropout if lora else 0.0)


def sft_step(role: TrainedRole, host: HostBatch, batching: StepBatching, rng: jax.Array, *, lr_step: int,
             rows_sharding: Any) -> dict[str, float]:
    """One optimizer step of `role` (whose `update_fn` is `update_sft` and `batch` the SFT split) on
    `host`: micro-batches or packed layouts planned on the host (jaxrl_llm/batching)."""
    mesh = rows_sharding.mesh
    rows = batching.rows_of(host)
    split = batching.update(role.batch, role.model, rows, rng, epochs=1, shuffle=False)
    fields = to_device(host.device_fields(), mesh)
    if split.pads != NO_PADS:  # token budget: the run's longest shapes, one program
        seq, resp = pad_columns({"input_ids": fields["input_ids"], "attention_mask": fields["attention_mask"]},
                                {"response_mask": fields["response_mask"]}, *split.pads)
        fields = {**seq, **resp}
    metrics = role.update(SftBatch(**fields), rng, lr_step=lr_step, num_mini_batches=split.num_mini,
                          num_micro_batches=split.num_micro, rows_sharding=rows_sharding, packing=split.layout)
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    out[f"{METRIC_PREFIX}/global_tokens"] = float(host.num_tokens)
    return out
