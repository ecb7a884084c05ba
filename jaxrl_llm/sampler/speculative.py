"""Speculative decoding's acceptance rule (work in progress: not wired into the engine yet).

Given the target model's logits at the k + 1 positions of a verification forward (the slot's last
token followed by its k draft tokens) and the drafts, decide per slot how many drafts to keep and
draw the token that follows them, so that the emitted tokens are distributed exactly as plain
sampling from the target (Leviathan et al. 2023, Chen et al. 2023), at any temperature and with
top-k / top-p (the target distribution is the filtered one plain sampling draws from).

    tokens, log_probs, accepted = accept_drafts(logits, drafts, draft_probs, keys, knobs, settings)

logits [S, k + 1, V] fp32; drafts [S, k] int32; draft_probs [S, k, V] (a draft model's filtered
distribution) or None (n-gram drafts: a point mass on the draft token); keys [S, k + 1]: the key of
token index num_gen + i, from `programs.request_keys` (a token's random numbers depend on the
request and its index only, as in plain decoding). Returns tokens [S, k + 1] (the first
accepted + 1 are emitted), their log-probs under the full softmax of logits / temperature (what
the trainer scores) and accepted [S] in [0, k].

Greedy: a draft is kept iff it is the target's argmax, and the next token is the argmax: output
token-identical to plain greedy decoding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.sampling import filtered_logits

Array = jax.Array


def target_distribution(logits: Array, knobs: SampleKnobs, settings: SampleSettings) -> Array:
    """The distribution plain sampling draws from, over the whole vocabulary: [..., V] fp32
    (greedy: one-hot on the argmax)."""
    logits = logits.astype(jnp.float32)
    if settings.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    flat = logits.reshape(-1, logits.shape[-1]) / knobs.temperature
    cand, cand_ids = filtered_logits(flat, settings.top_k, settings.use_top_p, knobs.top_p)
    probs = jax.nn.softmax(cand, axis=-1)
    if cand_ids is not None:
        probs = jnp.zeros_like(flat).at[jnp.arange(flat.shape[0])[:, None], cand_ids].set(probs)
    return probs.reshape(logits.shape)


def _draw(probs: Array, u: Array) -> Array:
    """Inverse-CDF draw from unnormalised probs [S, V] with uniforms u [S] (a zero-mass row gives 0)."""
    cdf = jnp.cumsum(probs, axis=-1)
    pick = jnp.sum((cdf <= (u * cdf[:, -1])[:, None]).astype(jnp.int32), axis=-1)
    last_nz = probs.shape[-1] - 1 - jnp.argmax((probs > 0)[:, ::-1], axis=-1)
    return jnp.minimum(pick, last_nz).astype(jnp.int32)


def accept_drafts(logits: Array, drafts: Array, draft_probs: Array | None, keys: Array, knobs: SampleKnobs,
                  settings: SampleSettings) -> tuple[Array, Array, Array]:
    """See the module doc."""
    s, k1, _ = logits.shape
    k = k1 - 1
    p = target_distribution(logits, knobs, settings)  # [S, k + 1, V]
    # two uniforms per token index: one for the accept test, one for the draw that replaces it
    u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key, (2,), jnp.float32)))(keys)  # [S, k + 1, 2]
    p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # p_i(x_i)
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        q = jax.nn.one_hot(drafts, p.shape[-1], dtype=jnp.float32)
    else:
        q = draft_probs.astype(jnp.float32)
        q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    if settings.greedy:
        keep = p_draft > 0.5
    else:
        keep = u[:, :k, 0] * q_draft < p_draft  # u < p / q without dividing by a zero q
    accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)  # leading run of kept drafts
    # the token after the kept drafts: from max(p - q, 0) where a draft was rejected, from p after all k
    rows = jnp.arange(s)
    p_next = p[rows, accepted]
    q_next = jnp.where((accepted < k)[:, None], q[rows, jnp.minimum(accepted, k - 1)], 0.0) if k else 0.0
    residual = jnp.maximum(p_next - q_next, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)
    u_next = u[rows, accepted, 1]
    nxt = jnp.argmax(p_next, axis=-1).astype(jnp.int32) if settings.greedy else _draw(residual, u_next)
    tokens = jnp.concatenate([drafts, jnp.zeros((s, 1), jnp.int32)], axis=1)
    tokens = tokens.at[rows, accepted].set(nxt)
    scaled = logits.astype(jnp.float32) / knobs.temperature
    chosen = jnp.take_along_axis(scaled, tokens[..., None], axis=-1)[..., 0]
    return tokens, chosen - jax.nn.logsumexp(scaled, axis=-1), accepted
