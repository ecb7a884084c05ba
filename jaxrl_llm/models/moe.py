"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, GPT-OSS, DeepSeek-V3): a router, dropless routed
experts and the shared experts (Qwen2-MoE's gated, DeepSeek's not), as pure functions over one layer's `moe`
params (models/param_init.py).

Routing: router logits = x @ W_router (compute-dtype operands, fp32 result); softmax and top-k in fp32;
the top-k probabilities renormalised when `norm_topk_prob` (Mixtral always). DeepSeek-V3 (`router_sigmoid`):
sigmoid scores, the choice group-limited and moved by a correction bias, the weights the chosen scores
(renormalised) times `routed_scaling_factor` (`deepseek_choice`). A replayed routing (the
sampler's recorded expert ids, `replay`) replaces the top-k choice; the weights are still the
router's probabilities of those experts, so the router gets gradients either way.

The routed experts themselves (the dropless layout, the grouped-matmul kernels, the expert FFNs) are
models/moe_experts.py; under expert parallelism they run inside models/expert_parallel.py's shard_map.

Per-layer statistics for the losses and metrics (`RouterStats`): the top-k counts and the summed
router probabilities per expert over the valid tokens (HF's `load_balancing_loss_func` pools these
over layers: `load_balancing_loss`), the summed squared log-sum-exp of the router logits (router
z-loss), and how many tokens' recomputed top-k equals the replayed one (`moe/routing_agreement`).

Batch-invariant mode (`model.batch_invariant`, models/invariant.py): the router's softmax and renormalisation
sum by a fixed tree (the experts' side: models/moe_experts.py).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.arrays import Params
from jaxrl_llm.models import invariant
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.numerics import matmul_f32

Array = jax.Array


class Routing(NamedTuple):
    ids: Array          # [N, k] int32: the experts each token's MLP runs (replayed ones when replaying)
    weights: Array      # [N, k] fp32: their mixing weights (router probabilities, renormalised or not)
    natural_ids: Array  # [N, k] int32: the router's own top-k (what agreement compares `ids` with)
    probs: Array        # [N, E] fp32 softmax of the router logits
    logits: Array       # [N, E] fp32


class RouterStats(NamedTuple):
    """Sums over one layer's valid tokens (stacked over layers by the decoder's scan)."""

    counts: Array       # [E] fp32: top-k assignments per expert
    prob_sum: Array     # [E] fp32: router probabilities per expert
    z_sum: Array        # [] fp32: sum of logsumexp(logits)^2
    agree: Array        # [] fp32: tokens whose router top-k (as a set) equals the experts used
    tokens: Array       # [] fp32: valid tokens


NOT_RECORDED = -1  # a replayed routing's id where the sampler recorded none: the router's own choice


def routing_dtype(num_experts: int) -> jnp.dtype:
    """The compact integer type a recorded routing is stored in (ids and NOT_RECORDED fit)."""
    return jnp.dtype(jnp.int8 if num_experts <= 127 else jnp.int16)


def route(cfg: ModelConfig, router_kernel: Array, tokens: Array, replay: Array | None = None,
          router_bias: Array | None = None, score_bias: Array | None = None) -> Routing:
    """Routing of tokens [N, H] (compute dtype) through router_kernel [H, E] (+ router_bias [E], GPT-OSS);
    `replay` [N, k] ids (a token whose ids are NOT_RECORDED keeps the router's own top-k). With
    `router_topk_softmax` (GPT-OSS) the mixing weights are the softmax of the chosen experts' logits
    (the same numbers as renormalised top-k probabilities, computed as transformers does). With
    `router_sigmoid` (DeepSeek-V3: `deepseek_choice`) the weights are the chosen experts' sigmoid scores."""
    logits = matmul_f32(tokens, router_kernel.astype(tokens.dtype))
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    probs = _softmax(logits)
    scores = jax.nn.sigmoid(logits) if cfg.router_sigmoid else probs  # what the mixing weights are taken from
    if cfg.router_sigmoid or cfg.router_group_max:  # DeepSeek-V3's / V2's group-limited choice
        natural = deepseek_choice(cfg, scores, score_bias)
        top_probs = jnp.take_along_axis(scores, natural, axis=-1)
    else:
        top_probs, natural = lax.top_k(probs, cfg.num_experts_per_tok)
    if replay is None:
        ids, weights = natural, top_probs
    else:
        recorded = jnp.all(replay >= 0, axis=-1, keepdims=True)
        ids = jnp.where(recorded, replay.astype(jnp.int32), natural)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.router_topk_softmax:
        weights = _softmax(jnp.take_along_axis(logits, ids, axis=-1))
    elif cfg.router_sigmoid:
        if cfg.norm_topk_prob:
            weights = weights / (_row_sum(weights) + 1e-20)
    elif cfg.norm_topk_prob or cfg.model_type == "mixtral":
        weights = weights / _row_sum(weights)
    if cfg.routed_scaling_factor != 1.0:  # DeepSeek's (V3: after renormalising; V2: not renormalised)
        weights = weights * cfg.routed_scaling_factor
    return Routing(ids, weights, natural.astype(jnp.int32), probs, logits)


def _row_sum(x: Array) -> Array:
    """Sums over the last axis (kept): batch-invariant mode's fixed tree (models/invariant.py) where it is on."""
    return invariant.tree_sum(x)[..., None] if invariant.enabled() else jnp.sum(x, axis=-1, keepdims=True)


def _softmax(logits: Array) -> Array:
    """Softmax over the last axis; its denominator by `_row_sum` in batch-invariant mode."""
    if not invariant.enabled():
        return jax.nn.softmax(logits, axis=-1)
    unnormalized = jnp.exp(logits - lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    return unnormalized / _row_sum(unnormalized)


def deepseek_choice(cfg: ModelConfig, scores: Array, score_bias: Array | None) -> Array:
    """DeepSeek-V3's expert choice [N, k] from sigmoid scores [N, E]: score + the correction bias (aux-loss-free
    balancing: it moves choices, never weights, and gets no gradient), only within the `topk_group` groups (of
    `n_group` contiguous experts) whose two best biased scores sum highest. DeepSeek-V2 (`router_group_max`, softmax
    scores, no bias): the groups whose best expert scores highest."""
    choice = lax.stop_gradient(scores if score_bias is None else scores + score_bias.astype(jnp.float32))
    n, e = choice.shape
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
        if cfg.router_group_max:
            group_score = jnp.max(grouped, axis=-1)  # [N, G]
        else:
            group_score = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)
        _, open_groups = lax.top_k(group_score, cfg.topk_group)
        is_open = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], open_groups].set(True)
        choice = jnp.where(jnp.repeat(is_open, e // cfg.n_group, axis=1), choice, -jnp.inf)
    return lax.top_k(choice, cfg.num_experts_per_tok)[1]


def router_stats(routing: Routing, valid: Array) -> RouterStats:
    """Per-layer sums over tokens where valid [N] is true."""
    w = valid.astype(jnp.float32)
    num_experts = routing.probs.shape[-1]
    counts = jnp.zeros((num_experts,), jnp.float32).at[routing.natural_ids].add(
        jnp.broadcast_to(w[:, None], routing.natural_ids.shape))
    z = jax.nn.logsumexp(routing.logits, axis=-1)
    same = jnp.all(jnp.sort(routing.natural_ids, axis=-1) == jnp.sort(routing.ids, axis=-1), axis=-1)
    return RouterStats(counts, jnp.sum(routing.probs * w[:, None], axis=0), jnp.sum(z * z * w),
                       jnp.sum(same * w), jnp.sum(w))


def _over_layers(per_expert: Array) -> Array:
    """[E] sums of a per-layer statistic [..., E] (stacked over layers or one layer's)."""
    return jnp.sum(per_expert.reshape(-1, per_expert.shape[-1]), axis=0)


def load_balancing_loss(stats: RouterStats) -> Array:
    """HF's `load_balancing_loss_func` (Switch Transformer eq. 4-6) from `router_stats` stacked over
    layers: E * sum_e f_e * P_e, with f_e the share of (layer, token) rows routed to e (summing to k)
    and P_e the mean router probability of e, both pooled over layers and valid tokens."""
    rows = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    f, p = _over_layers(stats.counts) / rows, _over_layers(stats.prob_sum) / rows
    return f.shape[0] * jnp.sum(f * p)


def router_z_loss(stats: RouterStats) -> Array:
    """ST-MoE's router z-loss: the mean over layers and valid tokens of logsumexp(router logits)^2."""
    return jnp.sum(stats.z_sum) / jnp.maximum(jnp.sum(stats.tokens), 1.0)


def expert_load_max(stats: RouterStats) -> Array:
    """The busiest expert's share of the top-k assignments over the uniform share (1 = balanced),
    pooled over layers."""
    counts = _over_layers(stats.counts)
    return jnp.max(counts) * counts.shape[0] / jnp.maximum(jnp.sum(counts), 1.0)


def active_params(cfg: ModelConfig, num_params: int) -> int:
    """Of a model's `num_params`, those one token runs through (the top-k of each sparse layer's experts)."""
    idle = cfg.num_experts - cfg.num_experts_per_tok
    return num_params - len(cfg.moe_layer_ids) * idle * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def active_params_of(cfg: ModelConfig, params: Params) -> int:
    """`active_params` of the model whose weights are the pytree `params`."""
    return active_params(cfg, sum(int(x.size) for x in jax.tree.leaves(params)))


class MoeOut(NamedTuple):
    """What the decoder's MoE layers report, stacked over layers."""

    stats: RouterStats
    routing: Array | None  # [L, B, T, k] int32: the router's own top-k, when recorded
