"""Optimizer and learning-rate schedule from an `OptimSpec` (veRL's names and numbers).

veRL builds torch AdamW + a LambdaLR; we build the optax equivalent so a ported run gets the same
learning rate at every step:
- `lr_scheduler_type="constant"`: lr * min(1, step / warmup)  (veRL `get_constant_schedule_with_warmup`)
- `lr_scheduler_type="cosine"`: linear warmup, then
  `max(min_lr_ratio, cos(pi * num_cycles * 2 * progress) * (1-min)/2 + (1+min)/2)`
  (veRL `get_cosine_schedule_with_warmup`).
Warmup and total steps are resolved by `jaxrl_llm.config.resolve` (docs/config.md, `*.optim`).
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import optax

from jaxrl_llm.config.spec import OptimSpec

SCHEDULES = ("constant", "cosine")


def make_lr_schedule(optim: OptimSpec) -> Callable[[jnp.ndarray], jnp.ndarray]:
    """The learning rate as a function of the optimizer step count (0-based, like torch LambdaLR)."""
    if optim.lr_scheduler_type not in SCHEDULES:
        raise ValueError(f"optim.lr_scheduler_type={optim.lr_scheduler_type!r} is not one of {SCHEDULES}")
    if optim.total_steps is None or optim.warmup_steps is None:
        raise ValueError("optim.total_training_steps is not resolved (the dataset size is not known yet)")
    lr, warmup, style = optim.lr, max(optim.warmup_steps, 0), optim.lr_scheduler_type
    total = max(optim.total_steps, 1)

    def schedule(step: jnp.ndarray) -> jnp.ndarray:
        step = jnp.asarray(step, jnp.float32)
        warm = step / max(1, warmup)
        if style == "constant":
            factor = jnp.where(step < warmup, warm, 1.0)
        else:
            progress = (step - warmup) / max(1, total - warmup)
            cosine = jnp.cos(jnp.pi * optim.num_cycles * 2.0 * progress)
            floor = optim.min_lr_ratio
            decayed = jnp.maximum(floor, cosine * (1.0 - floor) * 0.5 + (1.0 + floor) * 0.5)
            factor = jnp.where(step < warmup, warm, decayed)
        return lr * factor

    return schedule


def make_optimizer(optim: OptimSpec) -> tuple[optax.GradientTransformation, Callable[[jnp.ndarray], jnp.ndarray]]:
    """AdamW (torch defaults for eps) with global-norm clipping and the configured schedule."""
    schedule = make_lr_schedule(optim)
    parts = []
    if optim.grad_clip is not None and optim.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(optim.grad_clip))
    parts.append(optax.adamw(learning_rate=schedule, b1=optim.betas[0], b2=optim.betas[1], eps=optim.eps,
                             weight_decay=optim.weight_decay))
    return optax.chain(*parts), schedule
