"""Rollout correction (sampler vs trainer mismatch): IS weights, rejection sampling, diagnostics.

Mirrors veRL's `algorithm.rollout_correction` keys (`rollout_is`, `rollout_is_threshold`,
`rollout_is_batch_normalize`, `rollout_rs`, `rollout_rs_threshold`); metrics are named
`rollout_corr/...` as veRL logs them. Jittable with the string/threshold arguments static.
Formulas, modes, thresholds and metrics: docs/algorithms.md, "Rollout correction".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.masked import masked_mean, masked_sum

Array = jax.Array
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
            "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
RS_LEGACY = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


@dataclass(frozen=True)
class RejectionRule:
    """One `rollout_rs` mode with its bounds: k1 is a log-ratio range, k2/k3 an upper bound."""

    mode: str
    lower: float  # log-space lower bound for k1 modes; unused for k2/k3
    upper: float  # log-space upper bound for k1 modes; the statistic's bound for k2/k3


def parse_rejection_rules(rollout_rs: str, rollout_rs_threshold) -> tuple[RejectionRule, ...]:
    """Parse `"mode[,mode...]"` with per-mode thresholds (number, `"lo_hi"`, or comma list)."""
    modes = [RS_LEGACY.get(m.strip(), m.strip()) for m in rollout_rs.split(",") if m.strip()]
    for m in modes:
        if m not in RS_MODES:
            raise ValueError(f"Unknown rollout_rs mode {m!r}; valid names: {sorted(RS_MODES + tuple(RS_LEGACY))}")
    if rollout_rs_threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold")
    if isinstance(rollout_rs_threshold, str):
        thresholds: Sequence = [t.strip() for t in rollout_rs_threshold.split(",")]
    elif isinstance(rollout_rs_threshold, (list, tuple)):
        thresholds = list(rollout_rs_threshold)
    else:
        thresholds = [rollout_rs_threshold]
    if len(thresholds) == 1:
        thresholds = list(thresholds) * len(modes)
    if len(thresholds) != len(modes):
        raise ValueError(f"rollout_rs_threshold has {len(thresholds)} entries for {len(modes)} modes {modes}")
    rules = []
    for mode, thr in zip(modes, thresholds):
        if mode.endswith("k1"):
            parts = str(thr).split("_")
            if len(parts) == 2:
                lo, hi = float(parts[0]), float(parts[1])
            elif len(parts) == 1:
                hi = float(parts[0])
                lo = 1.0 / hi
            else:
                raise ValueError(f"rollout_rs_threshold {thr!r} for {mode}: expected 't' or 'lo_hi'")
            if not 0 < lo <= hi:
                raise ValueError(f"rollout_rs_threshold {thr!r} for {mode}: need 0 < lo <= hi")
            rules.append(RejectionRule(mode, math.log(lo), math.log(hi)))
        else:
            if isinstance(thr, str) and "_" in thr:
                raise ValueError(f"rollout_rs_threshold {thr!r} for {mode}: k2/k3 take one upper bound")
            rules.append(RejectionRule(mode, -math.inf, float(thr)))
    return tuple(rules)


def _accept_mask(rule: RejectionRule, log_ratio: Array, mask: Array) -> Array:
    """[B, T] 1/0 acceptance of one rule (sequence modes broadcast over the row)."""
    level, stat = rule.mode.rsplit("_", 1)
    if stat == "k1":
        # The bounds are on the ratio, compared in log space: k1 = -log_ratio.
        if level == "token":
            x = log_ratio
        elif level == "seq_sum":
            x = masked_sum(log_ratio, mask, axis=-1)[:, None]
        else:
            x = masked_mean(log_ratio, mask, axis=-1)[:, None]
        ok = (x >= rule.lower) & (x <= rule.upper)
    else:
        k = 0.5 * jnp.square(log_ratio) if stat == "k2" else jnp.exp(log_ratio) - 1.0 - log_ratio
        if level == "token":
            x = k
        elif level == "seq_sum":
            x = masked_sum(k, mask, axis=-1)[:, None]
        elif level == "seq_mean":
            x = masked_mean(k, mask, axis=-1)[:, None]
        else:
            x = jnp.max(jnp.where(mask > 0, k, -jnp.inf), axis=-1)[:, None]
        ok = x <= rule.upper
    return jnp.broadcast_to(ok, log_ratio.shape).astype(jnp.float32)


def compute_rollout_correction(
    train_log_prob: Array,
    rollout_log_prob: Array,
    response_mask: Array,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold=None,
) -> tuple[Array | None, Array, dict[str, Array]]:
    """Returns `(rollout_is_weights or None, response_mask after rejection, metrics)`.

    IS weights: `exp(clip(log_ratio, -20, 20))` per token or `exp(clip(sum_t log_ratio))` per
    sequence, times the mask, truncated above at `rollout_is_threshold`, stop-gradient, then
    optionally divided by their batch mean (so they may exceed the threshold afterwards).
    """
    mask, log_ratio = _masked_log_ratio(train_log_prob, rollout_log_prob, response_mask)
    metrics: dict[str, Array] = {}
    weights = None
    if rollout_is is not None:
        if rollout_is not in IS_LEVELS:
            raise ValueError(f"Unknown rollout_is {rollout_is!r}; valid names: {list(IS_LEVELS)}")
        if rollout_is_threshold is None or rollout_is_threshold <= 0:
            raise ValueError(f"rollout_is_threshold must be > 0, got {rollout_is_threshold}")
        weights, is_metrics = _is_weights(log_ratio, mask, rollout_is, rollout_is_threshold,
                                          rollout_is_batch_normalize)
        metrics.update(is_metrics)
    new_mask = mask
    if rollout_rs is not None:
        accept = jnp.ones_like(mask)
        for rule in parse_rejection_rules(rollout_rs, rollout_rs_threshold):
            accept = accept * _accept_mask(rule, log_ratio, mask)
        new_mask = mask * accept
        rejected = mask - new_mask
        metrics["rollout_rs_masked_fraction"] = masked_mean(rejected, mask)
        metrics["rollout_rs_seq_masked_fraction"] = jnp.mean((jnp.sum(rejected, -1) > 0).astype(jnp.float32))
    metrics.update(_offpolicy_metrics(jnp.asarray(train_log_prob, jnp.float32),
                                      jnp.asarray(rollout_log_prob, jnp.float32), mask))
    metrics = {f"rollout_corr/{k}": jax.lax.stop_gradient(v) for k, v in metrics.items()}
    return weights, jax.lax.stop_gradient(new_mask), metrics


def _masked_log_ratio(train_log_prob: Array, rollout_log_prob: Array, response_mask: Array) -> tuple[Array, Array]:
    """(fp32 mask, log(pi_train / pi_rollout) where the mask is set, else 0)."""
    mask = jnp.asarray(response_mask, jnp.float32)
    lr_raw = jnp.asarray(train_log_prob, jnp.float32) - jnp.asarray(rollout_log_prob, jnp.float32)
    return mask, jnp.where(mask > 0, lr_raw, 0.0)  # junk in padding never reaches a statistic


def rollout_is_weights(train_log_prob: Array, rollout_log_prob: Array, response_mask: Array, *, rollout_is: str,
                       rollout_is_threshold: float, batch_normalize: bool = False) -> Array:
    """The truncated, stop-gradient IS weights of `compute_rollout_correction`: each row's own tokens
    decide them, so a micro-batch can take them in the loss (RunSpec.rollout_is_in_update). With
    `batch_normalize` (bypass mode's reinforce loss) they are normalised to mean 1 over the rows given:
    in the loss, the micro-batch (all of its devices' rows), as veRL's bypass loss sees its micro-batch."""
    mask, log_ratio = _masked_log_ratio(train_log_prob, rollout_log_prob, response_mask)
    return _is_weights(log_ratio, mask, rollout_is, rollout_is_threshold, batch_normalize)[0]


def _is_weights(log_ratio, mask, level, threshold, batch_normalize):
    if level == "token":
        w = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * mask
        frac_high = masked_mean((w > threshold).astype(jnp.float32), mask)
        frac_low = masked_mean((w < 1.0 / threshold).astype(jnp.float32), mask)
    else:
        seq_lr = masked_sum(log_ratio, mask, axis=-1)
        w = jnp.exp(jnp.clip(seq_lr, -SAFETY_BOUND, SAFETY_BOUND))[:, None] * mask
        frac_high = jnp.mean((seq_lr > math.log(threshold)).astype(jnp.float32))
        frac_low = jnp.mean((seq_lr < -math.log(threshold)).astype(jnp.float32))
    valid = mask > 0
    w_clamped = jnp.clip(w, 1.0 / threshold, threshold)
    mean_c = masked_mean(w_clamped, mask)
    var_c = masked_mean(jnp.square(w_clamped), mask) - jnp.square(mean_c)
    metrics = {
        "rollout_is_mean": masked_mean(w, mask),
        "rollout_is_max": jnp.max(jnp.where(valid, w, -jnp.inf)),
        "rollout_is_min": jnp.min(jnp.where(valid, w, jnp.inf)),
        "rollout_is_std": jnp.where(jnp.sum(mask) > 1, jnp.sqrt(jnp.maximum(var_c, 0.0)), 0.0),
        "rollout_is_ratio_fraction_high": frac_high,  # fraction truncated
        "rollout_is_ratio_fraction_low": frac_low,
        "rollout_is_eff_sample_size": 1.0 / masked_mean(jnp.square(w_clamped / (mean_c + 1e-8)), mask),
    }
    w = jax.lax.stop_gradient(jnp.minimum(w, threshold))
    if batch_normalize:
        if level == "token":
            mean = masked_mean(w, mask)
        else:
            row_nonempty = (jnp.sum(mask, -1) > 0).astype(jnp.float32)
            mean = jnp.sum(masked_mean(w, mask, axis=-1) * row_nonempty) / jnp.maximum(jnp.sum(row_nonempty), 1e-8)
        factor = jnp.where(mean > 1e-8, mean, 1.0)
        w = w / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return w, metrics


def mismatch_metrics(train_lp: Array, rollout_lp: Array, mask: Array) -> dict[str, Array]:
    """The exactness of the rollout's log-probs against the trainer's (model.batch_invariant makes them
    equal bit for bit): max |train - rollout| over the response tokens, and the fraction of tokens equal."""
    tokens = mask > 0
    diff = jnp.where(tokens, jnp.abs(train_lp - rollout_lp), 0.0)
    return {"max_abs_log_ratio": jnp.max(diff),
            "exact_token_frac": masked_mean((train_lp == rollout_lp).astype(jnp.float32), mask)}


def _offpolicy_metrics(train_lp: Array, rollout_lp: Array, mask: Array) -> dict[str, Array]:
    """Training vs rollout perplexity, KL(rollout||train) (k1 and k3), chi^2 (token and sequence)."""
    mean_train = masked_mean(train_lp, mask, axis=-1)
    mean_rollout = masked_mean(rollout_lp, mask, axis=-1)
    log_ratio = jnp.where(mask > 0, train_lp - rollout_lp, 0.0)
    log_ppl_diff = mean_rollout - mean_train
    rho = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    seq_lr = jnp.clip(masked_sum(log_ratio, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": jnp.mean(jnp.exp(-mean_train)),
        "training_log_ppl": jnp.mean(-mean_train),
        "rollout_ppl": jnp.mean(jnp.exp(-mean_rollout)),
        "rollout_log_ppl": jnp.mean(-mean_rollout),
        "kl": masked_mean(rollout_lp - train_lp, mask),
        "k3_kl": masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, mask),
        "log_ppl_diff": jnp.mean(log_ppl_diff),
        "log_ppl_abs_diff": jnp.mean(jnp.abs(log_ppl_diff)),
        "ppl_ratio": jnp.mean(jnp.exp(log_ppl_diff)),
        "chi2_token": masked_mean(jnp.square(rho), mask) - 1.0,
        "chi2_seq": jnp.mean(jnp.exp(2.0 * seq_lr)) - 1.0,
        **mismatch_metrics(train_lp, rollout_lp, mask),
    }
