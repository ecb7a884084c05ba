"""SFT steps on the policy before the first RL step, in the same run (Trinity-RFT's
`sft_warmup_steps` / `sft_warmup_dataset`; `sft.warmup_steps` / `sft.warmup_files`).

The warm-up trains the RL actor itself: its params, its optimizer and optimizer state (the Adam moments
carry into RL, as in Trinity, whose trainer runs both with one optimizer), its LoRA adapters. Each step is
one optimizer step over `data.train_batch_size` SFT sequences (cycling through the warm-up rows), at the
actor's peak learning rate `optim.lr` (the RL schedule counts RL steps and starts after the warm-up). It runs
on a fresh start only: a resumed run's checkpoint already holds the warmed-up policy.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from tqdm.auto import tqdm

from jaxrl_llm.batching import StepBatching
from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.data.spec import SftSpec
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.roles.trained import TrainedRole
from jaxrl_llm.sft.batch import SftLoader
from jaxrl_llm.sft.data import read_sft_examples
from jaxrl_llm.sft.loss import METRIC_PREFIX
from jaxrl_llm.sft.steps import sft_batch_plan, sft_step, sft_update_fn
from jaxrl_llm.sharding import batch_axis_size


def run_sft_warmup(actor: TrainedRole, spec: RunSpec, sft: SftSpec, tokenizer: Tokenizer, rows_sharding: Any,
                   rng: jax.Array, *, is_main: bool) -> dict[str, float]:
    """`sft.warmup_steps` SFT steps on `actor` (updated in place); the summary metrics `sft_warmup/*`."""
    assert sft.warmup_files, "validation requires sft.warmup_files with sft.warmup_steps"
    data = spec.data
    examples = read_sft_examples(sft.warmup_files, data, sft, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_size = data.train_batch_size
    loader = SftLoader(examples, batch_size, shuffle=data.shuffle, seed=data.seed, pad_id=pad_id)
    dp = batch_axis_size(rows_sharding.mesh)
    plan = sft_batch_plan(batch_size, dp, sft, loader.longest())
    lr = spec.actor_optim.lr
    warm = dataclasses.replace(actor, update_fn=sft_update_fn(actor.model_cfg, spec), batch=plan.actor,
                               schedule=lambda step: lr, _compiled={})
    batching = StepBatching(plan, dp)
    losses = []
    for step in tqdm(range(sft.warmup_steps), desc="sft warm-up", disable=not is_main):
        metrics = sft_step(warm, loader.next(), batching, jax.random.fold_in(rng, step), lr_step=step,
                           rows_sharding=rows_sharding)
        losses.append(metrics[f"{METRIC_PREFIX}/loss"])
    actor.params, actor.opt_state = warm.params, warm.opt_state
    return {"sft_warmup/steps": float(sft.warmup_steps), "sft_warmup/loss_first": losses[0],
            "sft_warmup/loss_last": losses[-1]}
