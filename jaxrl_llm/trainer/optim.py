"""Optimizer and learning-rate schedule from an `optim` config section (veRL's names and numbers).

veRL builds torch AdamW + a LambdaLR; we build the optax equivalent so a ported run gets the same
learning rate at every step:
- `lr_scheduler_type="constant"` (veRL's older name: `warmup_style`): lr * min(1, step / warmup)  (veRL `get_constant_schedule_with_warmup`)
- `lr_scheduler_type="cosine"`: linear warmup, then
  `max(min_lr_ratio, cos(pi * num_cycles * 2 * progress) * (1-min)/2 + (1+min)/2)`
  (veRL `get_cosine_schedule_with_warmup`).
`lr_warmup_steps < 0` means `int(lr_warmup_steps_ratio * total_steps)`.
"""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine")


def _get(section: Any, key: str, default: Any) -> Any:
    value = section.get(key, default) if hasattr(section, "get") else getattr(section, key, default)
    return default if value is None else value


def warmup_steps_from(optim_cfg: Any, total_steps: int) -> int:
    steps = int(_get(optim_cfg, "lr_warmup_steps", -1))
    if steps < 0:
        steps = int(float(_get(optim_cfg, "lr_warmup_steps_ratio", 0.0)) * total_steps)
    return max(steps, 0)


def make_lr_schedule(optim_cfg: Any, total_steps: int) -> Callable[[jnp.ndarray], jnp.ndarray]:
    """The learning rate as a function of the optimizer step count (0-based, like torch LambdaLR)."""
    lr = float(_get(optim_cfg, "lr", 1e-6))
    style = str(_get(optim_cfg, "lr_scheduler_type", _get(optim_cfg, "warmup_style", "constant")))
    if style not in SCHEDULES:
        raise ValueError(f"optim.lr_scheduler_type={style!r} is not one of {SCHEDULES}")
    warmup = warmup_steps_from(optim_cfg, total_steps)
    min_lr_ratio = float(_get(optim_cfg, "min_lr_ratio", 0.0))
    num_cycles = float(_get(optim_cfg, "num_cycles", 0.5))
    total = max(int(total_steps), 1)

    def schedule(step: jnp.ndarray) -> jnp.ndarray:
        step = jnp.asarray(step, jnp.float32)
        warm = step / max(1, warmup)
        if style == "constant":
            factor = jnp.where(step < warmup, warm, 1.0)
        else:
            progress = (step - warmup) / max(1, total - warmup)
            cosine = jnp.cos(jnp.pi * num_cycles * 2.0 * progress)
            decayed = jnp.maximum(
                min_lr_ratio, cosine * (1.0 - min_lr_ratio) * 0.5 + (1.0 + min_lr_ratio) * 0.5
            )
            factor = jnp.where(step < warmup, warm, decayed)
        return lr * factor

    return schedule


def make_optimizer(
    optim_cfg: Any, total_steps: int, *, grad_clip: float | None = None
) -> tuple[optax.GradientTransformation, Callable[[jnp.ndarray], jnp.ndarray]]:
    """AdamW (torch defaults for eps) with global-norm clipping and the configured schedule."""
    schedule = make_lr_schedule(optim_cfg, total_steps)
    betas = tuple(_get(optim_cfg, "betas", (0.9, 0.999)))
    if len(betas) != 2:
        raise ValueError(f"optim.betas must have two values, got {betas!r}")
    clip = grad_clip if grad_clip is not None else _get(optim_cfg, "clip_grad", None)
    parts = []
    if clip is not None and float(clip) > 0:
        parts.append(optax.clip_by_global_norm(float(clip)))
    parts.append(
        optax.adamw(
            learning_rate=schedule,
            b1=float(betas[0]),
            b2=float(betas[1]),
            eps=float(_get(optim_cfg, "eps", 1e-8)),
            weight_decay=float(_get(optim_cfg, "weight_decay", 0.01)),
        )
    )
    return optax.chain(*parts), schedule
