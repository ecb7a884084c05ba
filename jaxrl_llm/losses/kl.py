"""KL estimators (veRL's `kl_penalty` kinds), KL controllers, and KL-in-reward shaping.

Formulas, config keys and defaults: docs/algorithms.md, "KL".
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.masked import masked_mean
from jaxrl_llm.losses.registry import Registry

Array = jax.Array
KL_ESTIMATORS: Registry[Callable[[Array, Array], Array]] = Registry("kl penalty kind")


@KL_ESTIMATORS.register("kl", "k1")
def _k1(lp: Array, ref: Array) -> Array:
    return lp - ref


@KL_ESTIMATORS.register("abs")
def _abs(lp: Array, ref: Array) -> Array:
    # |d| as d * sign(d): its gradient is sign(d), 0 at d == 0 as torch's abs (jnp.abs gives 1 there)
    d = lp - ref
    return d * jax.lax.stop_gradient(jnp.sign(d))


@KL_ESTIMATORS.register("mse", "k2")
def _k2(lp: Array, ref: Array) -> Array:
    return 0.5 * jnp.square(lp - ref)


@KL_ESTIMATORS.register("low_var_kl", "k3")
def _k3(lp: Array, ref: Array) -> Array:
    # Schulman's k3 with veRL's clamps; jnp.clip has zero gradient where it clips.
    x = jnp.clip(ref - lp, -20.0, 20.0)
    return jnp.clip(jnp.exp(x) - x - 1.0, -10.0, 10.0)


def kl_penalty_full(policy_logits: Array, ref_logits: Array) -> Array:
    """Exact per-token KL(pi || ref) = sum_v p (log p - log q) from full logits [..., V]."""
    logp = jax.nn.log_softmax(policy_logits.astype(jnp.float32), axis=-1)
    logq = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def kl_penalty_kinds() -> list[str]:
    """Every `kind` `kl_penalty` accepts: the registry's, each also with a trailing `+`, and `full`."""
    base = KL_ESTIMATORS.names()
    return sorted(base + [name + "+" for name in base] + ["full"])


def kl_penalty(logprob: Array, ref_logprob: Array, kind: str) -> Array:
    """Elementwise KL estimate, unmasked. `kind` is veRL's `kl_penalty` / `kl_loss_type`.

    `kl|k1`, `abs`, `mse|k2`, `low_var_kl|k3`; a trailing `+` (e.g. `k3+`) gives the base value
    with the k2 gradient (straight-through). `full` takes full logits `[B, T, V]` for both
    arguments and returns the exact KL (docs/algorithms.md, "KL"); for the memory-safe streamed
    version from hidden states use `jaxrl_llm.losses.logprob.token_kl_full`.
    """
    if kind == "full":
        if logprob.ndim < 3:
            raise ValueError("kl_penalty kind 'full' needs full logits [B, T, V] for both arguments")
        return kl_penalty_full(logprob, ref_logprob)
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(f"Unknown kl penalty kind {kind!r}; valid names: {kl_penalty_kinds()}")
    lp = jnp.asarray(logprob, jnp.float32)
    ref = jnp.asarray(ref_logprob, jnp.float32)
    value = KL_ESTIMATORS.get(base)(lp, ref)
    if not straight_through:
        return value
    k2 = _k2(lp, ref)
    return k2 + jax.lax.stop_gradient(value - k2)


class FixedKLController:
    """Constant KL coefficient (veRL `algorithm.kl_ctrl.type=fixed`)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


class AdaptiveKLController:
    """Adaptive KL (Ziegler et al.): coef *= 1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """A non-finite KL (NaN log-probs) is ignored: the coefficient keeps its value, since one NaN
        would otherwise stay in it for the rest of the run (bookkeeping/nonfinite.py)."""
        if not math.isfinite(float(current_kl)):
            return
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kind: str, kl_coef: float, *, target_kl: float,
                       horizon: int) -> FixedKLController | AdaptiveKLController:
    """veRL's `algorithm.kl_ctrl`: `kind` fixed or adaptive (which also uses target_kl, horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown algorithm.kl_ctrl.type {kind!r}; valid names: ['adaptive', 'fixed']")


def kl_in_reward(token_level_scores: Array, old_log_prob: Array, ref_log_prob: Array, response_mask: Array,
                 beta: float | Array, kind: str = "kl") -> tuple[Array, Array]:
    """Jittable core of `apply_kl_penalty`: (scores - beta * kl * mask, mean over rows of row KL)."""
    mask = jnp.asarray(response_mask, jnp.float32)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind)
    kld = jnp.where(mask > 0, kld, 0.0)
    rewards = token_level_scores - beta * kld
    current_kl = jnp.mean(masked_mean(kld, mask, axis=-1))
    return rewards, current_kl


def apply_kl_penalty(token_level_scores: Array, old_log_prob: Array, ref_log_prob: Array, response_mask: Array,
                     controller: FixedKLController | AdaptiveKLController, kind: str = "kl",
                     ) -> tuple[Array, dict[str, float]]:
    """veRL's KL in reward: beta read before the update, then `controller.update(kl, n_steps=B)`.

    Host-side (reads the scalar KL to update the controller); the array maths is `kl_in_reward`.
    """
    beta = controller.value
    rewards, current_kl = kl_in_reward(token_level_scores, old_log_prob, ref_log_prob, response_mask, beta, kind)
    current_kl = float(current_kl)
    controller.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
