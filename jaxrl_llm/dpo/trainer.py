"""`DpoTrainer(config).fit()`: direct preference optimisation on the RL stack (`launch/dpo.py` runs it).

    pairs (dpo/data.py: prompt, chosen, rejected)
      -> batches of data.train_batch_size pairs, rows interleaved (chosen, rejected), prompts shared
      -> the reference's log-probs of each response (the frozen initial policy, `actor_rollout_ref.ref.*`:
         the LoRA base with adapters; or the rows' precomputed ones; or 0 with dpo.reference_free)
      -> one optimizer step of the DPO loss (dpo/loss.py) over micro-batches of whole pairs
      -> val/* (the same metrics on held-out pairs) every trainer.test_freq steps, checkpoints, export

Everything else is the SFT run's (sft/trainer.py: loading, LoRA, optimizer, checkpoints, resume, loop).
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.batching.ops import run_no_grad_pass
from jaxrl_llm.config import ConfigError
from jaxrl_llm.data.spec import SftSpec
from jaxrl_llm.dpo.data import DpoSpec, PreferencePair, read_pairs
from jaxrl_llm.dpo.loss import DpoBatch, pair_losses, pair_metrics, update_dpo
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.roles.experience import log_probs_no_grad
from jaxrl_llm.roles.reference import ReferenceRole, make_reference_role
from jaxrl_llm.sft.batch import HostBatch, SftLoader, collate
from jaxrl_llm.sft.steps import sft_batch_plan
from jaxrl_llm.sft.trainer import SftTrainer
from jaxrl_llm.sharding import on_own_mesh, to_device


def resolve_dpo(cfg: ml_collections.ConfigDict) -> DpoSpec:
    d = cfg.dpo
    return DpoSpec(chosen_key=d.chosen_key, rejected_key=d.rejected_key, loss_type=d.loss_type, beta=float(d.beta),
                   label_smoothing=float(d.label_smoothing), reference_free=bool(d.reference_free),
                   ref_chosen_key=d.ref_chosen_key, ref_rejected_key=d.ref_rejected_key, max_length=int(d.max_length),
                   micro_batch_size_per_device=int(d.micro_batch_size_per_device))


def dpo_view(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The SFT view of a DPO config: its sequence budget, and its micro-batches counted in pairs as
    data.train_batch_size is (the plan doubles both: `DpoTrainer.batch_plan`)."""
    cfg = copy.deepcopy(config)
    cfg.sft.max_length = cfg.dpo.max_length
    cfg.sft.micro_batch_size_per_device = cfg.dpo.micro_batch_size_per_device
    cfg.sft.use_dynamic_bsz = False
    return cfg


class DpoTrainer(SftTrainer):
    """A DPO run: an SFT run whose items are preference pairs and whose update is the DPO loss."""

    kind = "dpo"
    loss_key = "train/loss"

    def __init__(self, config: ml_collections.ConfigDict, *, dry_run: bool = False):
        if config.dpo.label_smoothing and config.dpo.loss_type != "sigmoid":
            raise ConfigError(f"dpo.label_smoothing={config.dpo.label_smoothing}: only the sigmoid loss has it "
                              f"(dpo.loss_type={config.dpo.loss_type!r})")
        self.dpo = resolve_dpo(config)
        self.reference: ReferenceRole | None = None
        super().__init__(dpo_view(config), dry_run=dry_run)

    @property
    def max_length(self) -> int:
        return self.dpo.max_length

    def read_rows(self, files: Sequence[str], max_samples: int) -> list[Any]:
        return read_pairs(files, self.data, self.dpo, self.tokenizer, max_samples)

    def make_loader(self, items: list[Any], batch_size: int) -> SftLoader:
        return SftLoader(items, batch_size, shuffle=self.data.shuffle, seed=self.data.seed, pad_id=self.pad_id,
                         group_size=2)

    def batch_plan(self, dp: int) -> BatchPlan:
        rows = 2 * self.loader.batch_size
        micro = SftSpec(micro_batch_size_per_device=2 * self.dpo.micro_batch_size_per_device,
                        max_length=self.dpo.max_length)
        if micro.micro_batch_size_per_device * dp > rows or rows % (micro.micro_batch_size_per_device * dp):
            raise ConfigError(f"dpo.micro_batch_size_per_device={self.dpo.micro_batch_size_per_device} pairs x {dp} "
                              f"devices does not divide data.train_batch_size={self.loader.batch_size} pairs")
        return sft_batch_plan(rows, dp, micro, self.loader.longest())

    def update_fn(self, model_cfg: ModelConfig) -> Any:
        lora, d, a = self.spec.model.lora, self.dpo, self.spec.actor
        return functools.partial(update_dpo, model_cfg=model_cfg, loss_type=d.loss_type, beta=d.beta,
                                 label_smoothing=d.label_smoothing, compute_dtype=a.compute_dtype, remat=a.remat,
                                 logprob_impl=a.logprob_impl, lora_scale=lora.scale if lora else 0.0,
                                 lora_dropout=lora.dropout if lora else 0.0)

    @property
    def precomputed(self) -> bool:
        return self.train_examples[0].ref_logps is not None

    def after_policy(self, params: dict) -> None:
        if not (self.dpo.reference_free or self.precomputed):  # the frozen initial policy scores every batch
            self.reference = make_reference_role(self.spec.model, self.policy.model_cfg, params, self.spec.ref,
                                                 lora_base=self.policy.frozen)

    # ------------------------------------------------------------------ a step
    def ref_logps(self, host: HostBatch, pairs: Sequence[PreferencePair], fields: dict[str, jax.Array]) -> jax.Array:
        """The reference's summed log-prob of each row's response [2P] (rows interleaved)."""
        if self.dpo.reference_free:
            return jnp.zeros(host.input_ids.shape[0], jnp.float32)
        if pairs[0].ref_logps is not None:
            values = np.asarray([v for p in pairs for v in p.ref_logps], np.float32)  # type: ignore[union-attr]
            return to_device(values, self.mesh)
        return self.summed_logps(self.reference.device_params(), host, fields)  # type: ignore[union-attr]

    def summed_logps(self, params: dict, host: HostBatch, fields: dict[str, jax.Array]) -> jax.Array:
        """Each row's summed response log-prob under `params`, in the reference pass's micro-batches."""
        how = self.batching.no_grad(self.batching.plan.ref_log_prob, self.spec.model, self.batching.rows_of(host))
        tokens = run_no_grad_pass(log_probs_no_grad, params, fields["input_ids"], fields["attention_mask"],
                                  fields["response_mask"], how, model_cfg=self.policy.model_cfg, temperature=1.0,
                                  compute_dtype=self.spec.actor.compute_dtype,
                                  logprob_impl=self.spec.actor.logprob_impl, mesh=self.mesh)
        return jnp.sum(tokens * fields["response_mask"], axis=-1)

    def train_step(self, host: HostBatch, rng: jax.Array) -> dict[str, float]:
        fields = to_device(host.device_fields(), self.mesh)
        ref = self.ref_logps(host, self.loader.last_items, fields)
        split = self.batching.update(self.policy.batch, self.policy.model, self.batching.rows_of(host), rng,
                                     epochs=1, shuffle=False)
        metrics = self.policy.update(DpoBatch(**fields, ref_logps=ref), rng, lr_step=self.global_step,
                                     num_mini_batches=split.num_mini, num_micro_batches=split.num_micro,
                                     rows_sharding=self.rows_sharding, packing=split.layout)
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["train/global_tokens"] = float(host.num_tokens)
        return out

    @on_own_mesh
    def validate(self) -> dict[str, float]:
        """val/loss and TRL's reward metrics over every held-out pair."""
        d = self.dpo
        size = max(1, self.batching.plan.dp_size * d.micro_batch_size_per_device)
        scores: list[np.ndarray] = []
        for start in range(0, len(self.val_examples), size):
            pairs = self.val_examples[start:start + size]
            pairs = pairs + [pairs[0]] * (size - len(pairs))  # whole batches over the devices; extras cut below
            host = collate([e for p in pairs for e in p], self.pad_id, group_size=2)
            fields = to_device(host.device_fields(), self.mesh)
            policy = self.summed_logps(self.policy.model_params, host, fields)
            ref = self.ref_logps(host, pairs, fields)
            scores.append(np.stack(jax.device_get((policy, ref, fields["response_mask"].sum(-1))), axis=-1))
        table = np.concatenate(scores)[: 2 * len(self.val_examples)]
        policy, ref, counts = (table[:, i] for i in range(3))
        if d.loss_type == "ipo":  # TRL scores IPO pairs by the mean log-prob per token
            policy, ref = policy / np.maximum(counts, 1.0), ref / np.maximum(counts, 1.0)
        chosen, rejected, ref_c, ref_r = (jnp.asarray(x) for x in (policy[0::2], policy[1::2], ref[0::2], ref[1::2]))
        pairs = float(len(chosen))
        losses = pair_losses(chosen, rejected, ref_c, ref_r, loss_type=d.loss_type, beta=d.beta,
                             label_smoothing=d.label_smoothing)
        out = {f"val/{k}": float(v) for k, v in pair_metrics(chosen, rejected, ref_c, ref_r, beta=d.beta,
                                                             num_pairs=jnp.float32(pairs)).items()}
        out["val/loss"] = float(jnp.mean(losses))
        return out

    def summary(self) -> str:
        p = self.policy
        ref = ("none (reference_free)" if self.dpo.reference_free else "precomputed log-probs" if self.precomputed
               else self.reference.describe() if self.reference else "none")
        return "\n".join([
            f"dpo: {self.spec.model.path} ({p.model_cfg.architecture}, {p.num_params / 1e6:.1f}M params, "
            f"{p.num_trainable_params / 1e6:.2f}M trained{', LoRA' if self.spec.model.lora else ''}); "
            f"loss {self.dpo.loss_type}, beta {self.dpo.beta}; reference {ref}",
            f"data: {len(self.train_examples)} train / {len(self.val_examples)} val pairs, <= {self.dpo.max_length} "
            f"tokens a sequence",
            f"batch: {self.loader.batch_size} pairs per step, micro-batches of {self.dpo.micro_batch_size_per_device} "
            f"pairs/device; {self.total_steps} steps ({self.loader.batches_per_epoch} per epoch)",
            f"mesh: {dict(self.mesh.shape)}"])
