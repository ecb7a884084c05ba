"""Speculative decoding: n-gram drafts, and the acceptance rule that keeps the target's distribution.

Each verification step of the paged engine (engine/verify.py) feeds every slot its last token and
k drafted tokens, and keeps the longest run of drafts the target agrees with plus one token of its
own, so a slot emits 1 to k + 1 tokens per step. This module holds the two parts that do not touch
the KV pool:

- `ngram_drafts`: prompt-lookup drafts (vLLM's `ngram` method): the tokens that followed the most
  recent earlier occurrence of the sequence's last n tokens (n from `ngram_max` down to
  `ngram_min`), in the prompt or the response so far.
- `accept_drafts`: given the target model's logits at the k + 1 positions of a verification
  forward (the slot's last token followed by its k drafts), how many drafts to keep and the token
  that follows them, so that the emitted tokens are distributed exactly as plain sampling from the
  target (Leviathan et al. 2023, Chen et al. 2023), at any temperature and with top-k / top-p
  (the target distribution is the filtered one plain sampling draws from).

    tokens, log_probs, accepted = accept_drafts(logits, drafts, draft_probs, keys, knobs, settings)

logits [S, k + 1, V] fp32; drafts [S, k] int32; draft_probs [S, k, V] (a draft model's filtered
distribution) or None (n-gram drafts: a point mass on the draft token); keys [S, k + 1]: the key of
token index num_gen + i, from `engine.draws.request_keys` (a token's random numbers depend on the
request and its index only, as in plain decoding). Returns tokens [S, k + 1] (the first
accepted + 1 are emitted), their log-probs under the full softmax of logits / temperature (what
the trainer scores) and accepted [S] in [0, k].

Greedy: a draft is kept iff it is the target's argmax, and the next token is the argmax: output
token-identical to plain greedy decoding.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.models import invariant
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.sampling import draw_from, filtered_logits

Array = jax.Array
SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeSpec:
    """How the paged engine drafts (hashable: a static argument of `generate`).

    method: 'ngram' (prompt lookup) or 'draft' (a smaller model of the same vocabulary drafts
    autoregressively over its own paged KV). num_tokens: drafts verified per slot and step (k).
    ngram_max / ngram_min: the longest and shortest suffix looked up. draft_path: where the draft
    model is (rollout.speculative.draft_model.path); draft_cfg: its config once read (the engine
    needs it; the trainer fills it in before building the engine)."""

    method: str = "ngram"
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    draft_path: str | None = None
    draft_cfg: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS[1:]:
            raise ValueError(f"rollout.speculative.method={self.method!r}: expected one of {SPECULATIVE_METHODS}")
        if self.num_tokens < 1:
            raise ValueError(f"rollout.speculative.num_tokens={self.num_tokens} must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"rollout.speculative: need 1 <= ngram_min ({self.ngram_min}) <= ngram_max "
                             f"({self.ngram_max})")
        if self.method == "draft" and self.draft_path is None and self.draft_cfg is None:
            raise ValueError("rollout.speculative.method='draft' needs rollout.speculative.draft_model.path")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft"


def ngram_drafts(history: Array, length: Array, k: int, ngram_max: int, ngram_min: int) -> tuple[Array, Array]:
    """(drafts [S, k] int32, found [S] bool) from each row's tokens history [S, H] (its first
    length[S] entries real; the last of them is the token fed next).

    For n = ngram_max .. ngram_min, the most recent earlier end j < length - 1 of the last n tokens;
    the drafts are the tokens after it, continued periodically past the end of the history (a
    repeat j + 1 .. length - 1 of period d = length - 1 - j: token length + i is token
    j + 1 + i mod d). Rows with no match draft their last token k times (right for a run of one
    token, and a verification step then emits at least one token as plain decoding would)."""
    s, h = history.shape
    length = length.astype(jnp.int32)
    rows = jnp.arange(s)
    ends = jnp.arange(h)[None]
    # same[n - 1][r, j]: tokens j - n + 1 .. j equal the last n tokens (one comparison per offset m,
    # shared by every n > m)
    same, agree = [], jnp.ones((s, h), bool)
    for m in range(ngram_max):  # token j - m equals the suffix's token length - 1 - m
        want = history[rows, jnp.clip(length - 1 - m, 0, h - 1)]
        agree = agree & (jnp.pad(history, ((0, 0), (m, 0)), constant_values=-1)[:, :h] == want[:, None])
        same.append(agree)
    best = jnp.full((s,), -1, jnp.int32)
    for n in range(ngram_max, ngram_min - 1, -1):
        match = same[n - 1] & (ends >= n - 1) & (ends <= length[:, None] - 2) & (length[:, None] > n)
        found_n = jnp.max(jnp.where(match, ends, -1), axis=1).astype(jnp.int32)
        best = jnp.where(best >= 0, best, found_n)
    found = best >= 0
    period = jnp.maximum(length - 1 - best, 1)
    index = best[:, None] + 1 + jnp.arange(k)[None] % period[:, None]
    last = history[rows, jnp.clip(length - 1, 0, h - 1)]
    drafts = jnp.where(found[:, None], history[rows[:, None], jnp.clip(index, 0, h - 1)], last[:, None])
    return drafts.astype(jnp.int32), found


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
    nxt = jnp.argmax(p_next, axis=-1).astype(jnp.int32) if settings.greedy else draw_from(residual, u_next)
    tokens = jnp.concatenate([drafts, jnp.zeros((s, 1), jnp.int32)], axis=1)
    tokens = tokens.at[rows, accepted].set(nxt)
    if settings.batch_invariant:  # the trainer's batch-invariant log-prob (models/invariant.py), row by row
        log_probs = invariant.token_log_prob(logits.reshape(s * k1, -1), tokens.reshape(-1), knobs.temperature)
        return tokens, log_probs.reshape(s, k1), accepted
    scaled = logits.astype(jnp.float32) / knobs.temperature
    chosen = jnp.take_along_axis(scaled, tokens[..., None], axis=-1)[..., 0]
    return tokens, chosen - jax.nn.logsumexp(scaled, axis=-1), accepted
