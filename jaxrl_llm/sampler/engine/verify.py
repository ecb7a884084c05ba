"""One speculative decode step of the paged engine: draft k tokens per slot, verify them in one forward.

Each slot feeds its last token and its k drafts (sampler/speculative.py: n-gram lookup over the
slot's token history) at positions p .. p + k. The k + 1 tokens of a slot run through the decoder
as k + 1 rows of one batch ("virtual slots"): they share the slot's page table, each writes its
K/V at its own position before the layer's attention, and each attends up to its own position, so
row i sees the slot's KV plus the rows before it, exactly the causal attention of a k + 1 token
forward. The logits of all rows then go through `accept_drafts`, and a slot emits the kept drafts
and one more token (1 to k + 1 tokens), cut at an EOS / stop token and at its budget.

K/V written for rejected drafts stays in the slot's pages past its length: nothing reads past a
slot's length, and the next step overwrites it. Rows past a slot's budget (a token whose logits
would only matter for a token the slot may not emit) are inactive: they write to the scratch page.

Cascade groups (shared prompt pages read once per group) cover the virtual rows too: group row g's
member slot s becomes members s * (k + 1) .. s * (k + 1) + k.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.engine.draws import finish_codes, request_keys
from jaxrl_llm.sampler.engine.forward import decode_logits
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.speculative import SpeculativeSpec, accept_drafts, ngram_drafts

Array = jax.Array


def virtual_cascade(cascade: Cascade | None, k1: int) -> Cascade | None:
    """The cascade rows over the k1 verification rows of every member slot."""
    if cascade is None:
        return None
    gs = jnp.asarray(cascade.group_slots, jnp.int32)
    rows = jnp.where(gs[..., None] >= 0, gs[..., None] * k1 + jnp.arange(k1, dtype=jnp.int32), -1)
    return Cascade(rows.reshape(gs.shape[0], -1), cascade.prefix_pages)


def verify_step(params: dict, cfg: ModelConfig, s: Any, rng: Array, knobs: SampleKnobs, cascade: Cascade | None, *,
                settings: SampleSettings, speculative: SpeculativeSpec, compute_dtype: Any, attn_impl: str,
                mesh: Mesh | None) -> tuple[dict[str, Array], Array]:
    """One step on the decode state `s` (programs.DecodeState with its `history`): (the fields it
    changes, whether some slot finished)."""
    k = speculative.num_tokens
    k1 = k + 1
    slots, r = s.active.shape[0], settings.max_new_tokens
    rows = jnp.arange(slots)
    offsets = jnp.arange(k1, dtype=jnp.int32)[None]
    drafts, _ = ngram_drafts(s.history, s.positions + 1, k, speculative.ngram_max, speculative.ngram_min)
    fed = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [S, k + 1]
    positions = s.positions[:, None] + offsets
    # row i's logits choose response token num_gen + i: only worth computing inside the budget
    live = s.active[:, None] & (s.num_gen[:, None] + offsets < s.budget[:, None])
    logits, pool, _ = decode_logits(params, cfg, s.pool, fed.reshape(-1), positions.reshape(-1),
                                    jnp.repeat(s.page_table, k1, axis=0), live.reshape(-1),
                                    compute_dtype=compute_dtype, attn_impl=attn_impl, mesh=mesh,
                                    cascade=virtual_cascade(cascade, k1))
    keys = jax.vmap(lambda i: request_keys(rng, s.request, s.num_gen + i), out_axes=1)(jnp.arange(k1))
    tokens, log_probs, accepted = accept_drafts(logits.reshape(slots, k1, -1), drafts, None, keys, knobs, settings)
    # emit the kept drafts and the token after them, cut at the budget and after an EOS / stop token
    room = jnp.maximum(s.budget - s.num_gen, 1)
    emit = jnp.minimum(accepted + 1, room)
    ends_at, _ = finish_codes(tokens.reshape(-1), jnp.zeros((slots * k1,), jnp.int32), knobs,
                              jnp.full((slots * k1,), r + 1, jnp.int32))  # EOS / stop only
    stop_first = jnp.argmax(ends_at.reshape(slots, k1) & (offsets < emit[:, None]), axis=1)
    has_stop = jnp.any(ends_at.reshape(slots, k1) & (offsets < emit[:, None]), axis=1)
    emit = jnp.where(has_stop, stop_first + 1, emit)
    emit = jnp.where(s.active, emit, 0)
    keep = offsets < emit[:, None]  # [S, k + 1]
    last_tok = tokens[rows, jnp.maximum(emit - 1, 0)]
    num_gen = s.num_gen + emit
    ends, reason = finish_codes(last_tok, num_gen, knobs, s.budget)
    ends &= s.active
    cols = jnp.where(keep, s.num_gen[:, None] + offsets, r)  # r: out of range, dropped
    hist_cols = jnp.where(keep, s.positions[:, None] + 1 + offsets, s.history.shape[1])
    # drafts inside the budget, and those of them the target kept (before any EOS cut)
    proposed = jnp.sum(jnp.where(s.active, jnp.minimum(k, room - 1), 0))
    accepted_in_budget = jnp.sum(jnp.where(s.active, jnp.minimum(accepted, room - 1), 0))
    changes = dict(
        pool=pool, positions=s.positions + emit, last=jnp.where(s.active, last_tok, s.last), num_gen=num_gen,
        active=s.active & ~ends, finish=jnp.where(ends, reason, s.finish),
        tokens=s.tokens.at[rows[:, None], cols].set(tokens, mode="drop"),
        log_probs=s.log_probs.at[rows[:, None], cols].set(log_probs, mode="drop"),
        history=s.history.at[rows[:, None], hist_cols].set(tokens, mode="drop"),
        steps=s.steps + 1, useful=s.useful + jnp.sum(s.active.astype(jnp.int32)),
        spec_counts=s.spec_counts + jnp.stack([jnp.sum(emit), proposed, accepted_in_budget]))
    return changes, jnp.any(ends)
