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
# `fixed_agg_mode`: the aggregation veRL's loss always uses, whatever `loss_agg_mode` says (None: it
# follows `loss_agg_mode`); `policy_loss.loss_agg_mode` (policy_agg_mode here), when set, replaces it
# (Trinity's losses take their own). "seq-mean" is geo_mean's plain mean of a per-sequence loss over rows.
# `extra_params`: the loss's own keyword arguments, read from the actor config section.
# `needs_token_mask`: the loss reads a keep-mask computed over the whole mini-batch before any gradient
# (M2PO's; roles/actor.py computes it in the update's pre-pass and passes it as `token_mask`).
# `dual_clip`: whether the loss applies PPO's dual clip by default (`policy_loss.dual_clip` None); None: the
# loss has no dual clip to switch.
# `needs_scores`: the loss reads each row's sequence score (`scores`, TOPR's split of the rows by sign).
POLICY_LOSSES: Registry[Callable] = Registry("policy loss", {"fixed_agg_mode": None, "extra_params": (),
                                                           "needs_token_mask": False, "dual_clip": None,
                                                           "needs_scores": False})
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
    agg_chosen: bool = False  # loss_agg_mode is the policy loss's own (policy_agg_mode): no fixed mode applies
    token_mask: Array | None = None  # a loss's mini-batch-wide keep-mask (needs_token_mask), 1 = kept
    dual_clip: bool = False  # PPO's dual clip where A < 0 (vanilla and gspo)
    scores: Array | None = None  # [B] the rows' sequence scores (needs_scores)

    def agg(self, loss_mat: Array, fixed: str | None = None) -> Array:
        """Aggregated with `loss_agg_mode`; with `fixed` (veRL's mode for this loss) unless one was chosen."""
        mode = fixed if fixed is not None and not self.agg_chosen else self.loss_agg_mode
        return agg_loss(loss_mat, self.mask, mode, num_tokens=self.num_tokens,
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
    policy_agg_mode: str | None = None,
    token_mask: Array | None = None,
    dual_clip: bool | None = None,
    scores: Array | None = None,
    **kw,
) -> tuple[Array, dict[str, Array]]:
    """Dispatch to the policy loss registered as `name`; extra `kw` (its `extra_params`) go to it.

    policy_agg_mode: the policy loss's own aggregation (`policy_loss.loss_agg_mode`), for every loss
    including those veRL fixes (gspo, sapo); None: `loss_agg_mode`, or the loss's fixed mode.
    token_mask: the keep-mask a `needs_token_mask` loss computed over the whole mini-batch (the update's
    pre-pass); None: the loss computes it over the rows it is given.
    dual_clip: PPO's dual clip on or off for the losses that have one (vanilla: on, gspo: off by default).
    scores: [B] the rows' sequence scores, for a `needs_scores` loss (topr)."""
    fn = POLICY_LOSSES.get(name)
    unknown = set(kw) - set(POLICY_LOSSES.capability(name, "extra_params"))
    if unknown:
        raise TypeError(f"policy loss {name!r} takes no {sorted(unknown)}; its own parameters: "
                        f"{list(POLICY_LOSSES.capability(name, 'extra_params'))}")
    if policy_agg_mode is not None and POLICY_LOSSES.capability(name, "fixed_agg_mode") == "seq-mean":
        raise ValueError(f"policy loss {name!r} is one number per sequence (its mean over rows): it takes no "
                         f"aggregation of its own, got {policy_agg_mode!r}")
    default_dual = POLICY_LOSSES.capability(name, "dual_clip")
    if dual_clip is not None and default_dual is None:
        raise ValueError(f"policy loss {name!r} has no dual clip to switch (vanilla and gspo have one), got "
                         f"dual_clip={dual_clip}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    inputs = PolicyLossInputs(
        old_log_prob=jnp.asarray(old_log_prob, jnp.float32), log_prob=jnp.asarray(log_prob, jnp.float32),
        advantages=jnp.asarray(advantages, jnp.float32), mask=jnp.asarray(response_mask, jnp.float32),
        loss_agg_mode=policy_agg_mode or loss_agg_mode, agg_chosen=policy_agg_mode is not None,
        clip_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        is_weights=None if rollout_is_weights is None else sg(jnp.asarray(rollout_is_weights, jnp.float32)),
        num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor,
        token_mask=None if token_mask is None else sg(jnp.asarray(token_mask, jnp.float32)),
        dual_clip=bool(default_dual if dual_clip is None else dual_clip),
        scores=None if scores is None else sg(jnp.asarray(scores, jnp.float32)))
    return fn(inputs, **kw)


def _metrics(clipfrac, ppo_kl, clipfrac_lower) -> dict[str, Array]:
    f = lambda x: sg(jnp.asarray(x, jnp.float32))  # noqa: E731
    return {"actor/pg_clipfrac": f(clipfrac), "actor/ppo_kl": f(ppo_kl), "actor/pg_clipfrac_lower": f(clipfrac_lower)}


def _log_ratio(p: PolicyLossInputs) -> Array:
    return jnp.clip(p.log_prob - p.old_log_prob, -20.0, 20.0)


def _dual_clipped(p: PolicyLossInputs, clipped: Array) -> tuple[Array, Array]:
    """PPO's dual clip (Ye et al. 2020): where A < 0, min(L, -A c); and where it acted (the lower clipfrac's
    tokens). Off (`dual_clip` False): L and nowhere."""
    if not p.dual_clip:
        return clipped, jnp.zeros_like(clipped, dtype=bool)
    bound = -p.advantages * p.clip_ratio_c
    return (jnp.where(p.advantages < 0, jnp.minimum(bound, clipped), clipped),
            (clipped > bound) & (p.advantages < 0))


@register_policy_loss("vanilla", dual_clip=True)
def vanilla(p: PolicyLossInputs):
    """PPO clip with dual clip where A < 0; IS weights multiply after clipping."""
    log_ratio = _log_ratio(p)
    ratio = jnp.exp(log_ratio)
    adv = p.advantages
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1 - p.clip_low, 1 + p.clip_high)
    losses, lower = _dual_clipped(p, jnp.maximum(loss1, loss2))
    return p.agg(p.weighted(losses)), _metrics(p.mmean(loss2 > loss1), p.mmean(-log_ratio), p.mmean(lower))


@register_policy_loss("gspo", fixed_agg_mode="seq-mean-token-mean", dual_clip=False)
def gspo(p: PolicyLossInputs):
    """Sequence-level ratio with token gradient; PPO clip (dual clip off, as veRL; on: ROLL's
    importance_sampling seq with dual_clip_loss); seq-mean-token-mean (veRL)."""
    log_ratio = p.log_prob - p.old_log_prob
    seq_len = jnp.maximum(jnp.sum(p.mask, -1), 1.0)
    seq_log_ratio = masked_sum(log_ratio, p.mask, axis=-1) / seq_len
    token_log_ratio = p.log_prob - sg(p.log_prob) + sg(seq_log_ratio)[:, None]
    ratio = jnp.exp(jnp.minimum(token_log_ratio, 10.0))
    loss1 = -p.advantages * ratio
    loss2 = -p.advantages * jnp.clip(ratio, 1 - p.clip_low, 1 + p.clip_high)
    losses, lower = _dual_clipped(p, jnp.maximum(loss1, loss2))
    return p.agg(p.weighted(losses), fixed="seq-mean-token-mean"), _metrics(
        p.mmean(loss2 > loss1), p.mmean(-log_ratio), p.mmean(lower))


@register_policy_loss("sapo", fixed_agg_mode="seq-mean-token-mean",
                      extra_params=("tau_pos", "tau_neg"))
def sapo(p: PolicyLossInputs, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """Soft gate -A * sigmoid(tau (r - 1)) * 4 / tau, tau by the sign of A; seq-mean-token-mean (veRL)."""
    log_ratio = _log_ratio(p)
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(p.advantages > 0, tau_pos, tau_neg)
    losses = p.weighted(-p.advantages * jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau))
    return p.agg(losses, fixed="seq-mean-token-mean"), _metrics(0.0, p.mmean(-log_ratio), 0.0)


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


@register_policy_loss("topr", extra_params=("topr_positive_weight", "topr_negative_weight"), needs_scores=True)
def topr(p: PolicyLossInputs, topr_positive_weight: float = 1.0, topr_negative_weight: float = 1.0):
    """TOPR (tapered off-policy REINFORCE, Le Roux et al. 2025, as ROLL's pg_variant topr): rows whose sequence
    score is > 0 take -A log pi (no ratio), the others -sg(clip(r, 0, 1)) A log pi, each side times its weight;
    pg_clipfrac is the fraction of the other rows' tokens whose ratio is above 1."""
    if p.scores is None:
        raise ValueError("policy loss 'topr' needs the rows' sequence scores (scores=)")
    log_ratio = _log_ratio(p)
    ratio = jnp.exp(log_ratio)
    positive = (p.scores > 0)[:, None]
    tapered = sg(jnp.clip(ratio, 0.0, 1.0))
    losses = jnp.where(positive, topr_positive_weight, topr_negative_weight * tapered) * -p.advantages * p.log_prob
    return p.agg(p.weighted(losses)), _metrics(p.mmean(~positive & (ratio > 1.0)), p.mmean(-log_ratio), 0.0)


def m2po_keep_mask(log_ratio: Array, mask: Array, advantages: Array, m2_threshold: float) -> Array:
    """M2PO's token mask (Algorithm 1, as Trinity-RFT computes it): among the tokens where PPO's clip
    would act (A > 0 with log r > 0, or A < 0 with log r < 0), drop the largest squared log-ratios
    until the mean of those left is <= `m2_threshold`. Over all the rows given at once: the selection
    is not separable, so the update computes it over the whole mini-batch. 1 = kept (every other valid
    token is kept), float32 like `mask`."""
    log_ratio = sg(jnp.asarray(log_ratio, jnp.float32))
    valid = jnp.asarray(mask) > 0
    adv = jnp.asarray(advantages)
    trust = valid & (((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0)))
    flat_trust = trust.reshape(-1)
    m2 = jnp.square(log_ratio).reshape(-1)
    # ascending second moments of the trust-region tokens, the others after them (a stable sort keeps
    # equal values in token order, as torch.sort(stable=True))
    order = jnp.argsort(jnp.where(flat_trust, m2, jnp.inf), stable=True)
    count = jnp.sum(flat_trust)
    sorted_m2 = jnp.where(flat_trust[order], m2[order], 0.0)
    rank = jnp.arange(1, m2.shape[0] + 1, dtype=jnp.float32)
    # prefix means of an ascending list rise, so the kept tokens are the longest prefix within the bound
    within = (jnp.cumsum(sorted_m2) / rank <= m2_threshold) & (rank <= count)
    m2_before = jnp.sum(jnp.where(flat_trust, m2, 0.0)) / jnp.maximum(count, 1)
    keep_count = jnp.where(m2_before > m2_threshold, jnp.sum(within), count)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    dropped = flat_trust & (position >= keep_count)
    return (valid & ~dropped.reshape(valid.shape)).astype(jnp.float32)


@register_policy_loss("m2po", extra_params=("m2_threshold",), needs_token_mask=True)
def m2po(p: PolicyLossInputs, m2_threshold: float = 0.04):
    """M2PO (second-moment trust region): -A * r on the tokens `m2po_keep_mask` keeps, 0 on the dropped
    ones, which still count in the denominator (the paper's footnote 2). The log-ratio is clamped to
    +-20 in value only (the gradient is r's own); pg_clipfrac is the dropped fraction."""
    log_ratio = p.log_prob - p.old_log_prob
    stable = log_ratio + sg(jnp.clip(log_ratio, -20.0, 20.0) - log_ratio)
    keep = p.token_mask if p.token_mask is not None else m2po_keep_mask(log_ratio, p.mask, p.advantages,
                                                                         m2_threshold)
    losses = p.weighted(jnp.where(keep > 0, -p.advantages * jnp.exp(stable), 0.0))
    return p.agg(losses), _metrics(p.mmean(1.0 - keep), p.mmean(-stable), 0.0)
