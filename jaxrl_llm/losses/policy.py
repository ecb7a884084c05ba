"""Policy-gradient losses registered under veRL's `actor.policy_loss.loss_mode` names.

Each loss returns `(loss, metrics)` with `actor/pg_clipfrac`, `actor/ppo_kl` and
`actor/pg_clipfrac_lower`. Metrics follow the loss's denominators: with the global `num_tokens`
passed they are partial sums over the global token count, so adding the metrics of all
micro-batches gives the full-batch value (the same rule as the loss). Formulas, config keys and
defaults: docs/algorithms.md, "Policy losses".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.agg import agg_loss
from jaxrl_llm.losses.masked import masked_sum
from jaxrl_llm.losses.registry import Registry

Array = jax.Array
# `fixed_agg_mode`: the aggregation a loss always uses, whatever `loss_agg_mode` says (None: it
# follows `loss_agg_mode`); "seq-mean" is geo_mean's plain mean of a per-sequence loss over rows.
# `extra_params`: the loss's own keyword arguments, read from the actor config section.
POLICY_LOSSES: Registry[Callable] = Registry("policy loss", {"fixed_agg_mode": None, "extra_params": ()})
register_policy_loss = POLICY_LOSSES.register
sg = jax.lax.stop_gradient


@dataclass(frozen=True)
class PolicyLossInputs:
    """Shared arguments of every policy loss (after defaults are resolved)."""

    old_log_prob: Array
    log_prob: Array
    advantages: Array
    mask: Array
    loss_agg_mode: str
    clip_low: float
    clip_high: float
    clip_ratio_c: float
    is_weights: Array | None
    num_tokens: Array | float | None
    num_seqs: Array | float | None
    loss_scale_factor: float | None

    def agg(self, loss_mat: Array, mode: str | None = None) -> Array:
        return agg_loss(loss_mat, self.mask, mode or self.loss_agg_mode, num_tokens=self.num_tokens,
                        num_seqs=self.num_seqs, loss_scale_factor=self.loss_scale_factor)

    def mmean(self, x: Array) -> Array:
        """Masked token mean for metrics: global count when given, else sum(m) + 1e-8 (veRL)."""
        denom = jnp.sum(self.mask) + 1e-8 if self.num_tokens is None else self.num_tokens
        return masked_sum(x.astype(jnp.float32), self.mask) / denom

    def weighted(self, loss_mat: Array) -> Array:
        return loss_mat if self.is_weights is None else loss_mat * self.is_weights


def compute_policy_loss(
    name: str,
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Array | None = None,
    num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
    loss_scale_factor: float | None = None,
    **kw,
) -> tuple[Array, dict[str, Array]]:
    """Dispatch to the policy loss registered as `name`; extra `kw` (its `extra_params`) go to it."""
    fn = POLICY_LOSSES.get(name)
    unknown = set(kw) - set(POLICY_LOSSES.capability(name, "extra_params"))
    if unknown:
        raise TypeError(f"policy loss {name!r} takes no {sorted(unknown)}; its own parameters: "
                        f"{list(POLICY_LOSSES.capability(name, 'extra_params'))}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    inputs = PolicyLossInputs(
        old_log_prob=jnp.asarray(old_log_prob, jnp.float32), log_prob=jnp.asarray(log_prob, jnp.float32),
        advantages=jnp.asarray(advantages, jnp.float32), mask=jnp.asarray(response_mask, jnp.float32),
        loss_agg_mode=loss_agg_mode,
        clip_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        is_weights=None if rollout_is_weights is None else sg(jnp.asarray(rollout_is_weights, jnp.float32)),
        num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    return fn(inputs, **kw)


def _metrics(clipfrac, ppo_kl, clipfrac_lower) -> dict[str, Array]:
    f = lambda x: sg(jnp.asarray(x, jnp.float32))  # noqa: E731
    return {"actor/pg_clipfrac": f(clipfrac), "actor/ppo_kl": f(ppo_kl), "actor/pg_clipfrac_lower": f(clipfrac_lower)}


def _log_ratio(p: PolicyLossInputs) -> Array:
    return jnp.clip(p.log_prob - p.old_log_prob, -20.0, 20.0)


@register_policy_loss("vanilla")
def vanilla(p: PolicyLossInputs):
    """PPO clip with dual clip where A < 0; IS weights multiply after clipping."""
    log_ratio = _log_ratio(p)
    ratio = jnp.exp(log_ratio)
    adv = p.advantages
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1 - p.clip_low, 1 + p.clip_high)
    clipped1 = jnp.maximum(loss1, loss2)
    loss3 = -adv * p.clip_ratio_c
    clipped2 = jnp.minimum(loss3, clipped1)
    losses = p.weighted(jnp.where(adv < 0, clipped2, clipped1))
    return p.agg(losses), _metrics(
        p.mmean(loss2 > loss1), p.mmean(-log_ratio), p.mmean((clipped1 > loss3) & (adv < 0)))


@register_policy_loss("gspo", fixed_agg_mode="seq-mean-token-mean")
def gspo(p: PolicyLossInputs):
    """Sequence-level ratio with token gradient; PPO clip (no dual clip); seq-mean-token-mean."""
    log_ratio = p.log_prob - p.old_log_prob
    seq_len = jnp.maximum(jnp.sum(p.mask, -1), 1.0)
    seq_log_ratio = masked_sum(log_ratio, p.mask, axis=-1) / seq_len
    token_log_ratio = p.log_prob - sg(p.log_prob) + sg(seq_log_ratio)[:, None]
    ratio = jnp.exp(jnp.minimum(token_log_ratio, 10.0))
    loss1 = -p.advantages * ratio
    loss2 = -p.advantages * jnp.clip(ratio, 1 - p.clip_low, 1 + p.clip_high)
    losses = p.weighted(jnp.maximum(loss1, loss2))
    return p.agg(losses, "seq-mean-token-mean"), _metrics(p.mmean(loss2 > loss1), p.mmean(-log_ratio), 0.0)


@register_policy_loss("sapo", fixed_agg_mode="seq-mean-token-mean",
                      extra_params=("tau_pos", "tau_neg"))
def sapo(p: PolicyLossInputs, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """Soft gate -A * sigmoid(tau (r - 1)) * 4 / tau, tau by the sign of A; seq-mean-token-mean."""
    log_ratio = _log_ratio(p)
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(p.advantages > 0, tau_pos, tau_neg)
    losses = p.weighted(-p.advantages * jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau))
    return p.agg(losses, "seq-mean-token-mean"), _metrics(0.0, p.mmean(-log_ratio), 0.0)


@register_policy_loss("gpg")
def gpg(p: PolicyLossInputs):
    """-log_prob * A (no ratio)."""
    losses = p.weighted(-p.log_prob * p.advantages)
    return p.agg(losses), _metrics(0.0, p.mmean(-(p.log_prob - p.old_log_prob)), 0.0)


@register_policy_loss("reinforce")
def reinforce(p: PolicyLossInputs):
    """-A * log_prob (* IS); `old_log_prob` is the rollout log-prob; ppo_kl = mmean(rollout - lp)."""
    losses = p.weighted(-p.advantages * p.log_prob)
    return p.agg(losses), _metrics(0.0, p.mmean(p.old_log_prob - p.log_prob), 0.0)


@register_policy_loss("cispo")
def cispo(p: PolicyLossInputs):
    """-sg(clip(r, 1-lo, 1+hi)) * A * log_prob; clipfrac = mmean(r != clip(r))."""
    log_ratio = _log_ratio(p)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1 - p.clip_low, 1 + p.clip_high)
    losses = p.weighted(-sg(clipped) * p.advantages * p.log_prob)
    return p.agg(losses), _metrics(p.mmean(ratio != clipped), p.mmean(-log_ratio), 0.0)


@register_policy_loss("geo_mean", fixed_agg_mode="seq-mean")
def geo_mean(p: PolicyLossInputs):
    """GMPO: sign(A)-dependent log-space clip, sequence ratio = exp(masked mean), plain row mean.

    The row mean uses `num_seqs` (all rows of the full batch, empty ones included) when given.
    """
    log_ratio = p.log_prob - p.old_log_prob
    sign = jnp.sign(p.advantages)
    log_ratio_clip = jnp.clip(log_ratio, -p.clip_low, p.clip_high)
    log_ratio_min = sign * jnp.minimum(sign * log_ratio, sign * log_ratio_clip)
    length = jnp.sum(p.mask, -1)
    ratio = jnp.exp(masked_sum(log_ratio_min, p.mask, axis=-1) / (length + 1e-8))
    seq_adv = masked_sum(p.advantages, p.mask, axis=-1) / (length + 1e-8)
    losses = -seq_adv * ratio
    if p.is_weights is not None:
        log_w = jnp.log(p.is_weights + 1e-10)
        losses = losses * jnp.exp(masked_sum(log_w, p.mask, axis=-1) / (length + 1e-8))
    rows = losses.shape[0] if p.num_seqs is None else p.num_seqs
    clipped = log_ratio != log_ratio_clip
    return jnp.sum(losses) / rows, _metrics(
        p.mmean(clipped & (p.advantages > 0)), p.mmean(-log_ratio), p.mmean(clipped & (p.advantages < 0)))
