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

Draft model (method 'draft'): k + 1 decode steps of the draft model over its own pool (the same
pages and tables as the target's, its own dims) feed the last token and then each draft it drew, so
that after any outcome its KV holds every token up to the next one fed (the (k + 1)-th step only
writes the last draft's KV). Drafts are drawn from the draft's distribution filtered as plain
sampling filters the target's (temperature, top-k, top-p; greedy: its argmax), with keys of their
own from (seed, prompt, sample, token index), and that distribution goes to the acceptance rule.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxrl_llm.arrays import DType
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.engine.draws import ends_sequence, finish_codes, request_keys
from jaxrl_llm.sampler.engine.forward import decode_logits
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.sampling import draw_from, row_uniforms
from jaxrl_llm.sampler.speculative import SpeculativeSpec, accept_drafts, ngram_drafts, target_distribution

Array = jax.Array
_DRAFT_STREAM = 0x5EED  # the draft model's draws: keys of their own, apart from the target's


def virtual_cascade(cascade: Cascade | None, k1: int) -> Cascade | None:
    """The cascade rows over the k1 verification rows of every member slot."""
    if cascade is None:
        return None
    gs = jnp.asarray(cascade.group_slots, jnp.int32)
    rows = jnp.where(gs[..., None] >= 0, gs[..., None] * k1 + jnp.arange(k1, dtype=jnp.int32), -1)
    return Cascade(rows.reshape(gs.shape[0], -1), cascade.prefix_pages)


def model_drafts(draft_params: dict, draft_cfg: ModelConfig, s: Any, rng: Array, knobs: SampleKnobs,
                 cascade: Cascade | None, k: int, *, settings: SampleSettings, compute_dtype: DType, attn_impl: str,
                 mesh: Mesh | None, slot_axes: tuple[str, ...] = ()) -> tuple[Array, Array, dict]:
    """(drafts [S, k], their filtered distributions [S, k, V], the draft pool) from k + 1 draft-model
    decode steps (see the module doc)."""
    draft_rng = jax.random.fold_in(rng, _DRAFT_STREAM)

    def step(carry: tuple[dict, Array], j: Array) -> tuple[tuple[dict, Array], tuple[Array, Array]]:
        pool, fed = carry
        live = s.active & (s.num_gen + j < s.budget)  # as the verification rows: inside the budget
        logits, pool, _ = decode_logits(draft_params, draft_cfg, pool, fed, s.positions + j, s.page_table, live,
                                        compute_dtype=compute_dtype, attn_impl=attn_impl, mesh=mesh, cascade=cascade,
                                        slot_axes=slot_axes)
        q = target_distribution(logits, knobs, settings)
        if settings.greedy:
            nxt = jnp.argmax(q, axis=-1).astype(jnp.int32)
        else:
            keys = request_keys(draft_rng, s.request, s.num_gen + j)
            nxt = draw_from(q, row_uniforms(keys))
        return (pool, nxt), (nxt, q)

    (pool, _), (drafts, probs) = lax.scan(step, (s.draft_pool, s.last), jnp.arange(k + 1, dtype=jnp.int32))
    return drafts[:k].T, jnp.moveaxis(probs[:k], 0, 1), pool


def verify_step(params: dict, cfg: ModelConfig, s: Any, rng: Array, knobs: SampleKnobs, cascade: Cascade | None,
                draft_params: dict | None = None, *, settings: SampleSettings, speculative: SpeculativeSpec,
                compute_dtype: DType, attn_impl: str, mesh: Mesh | None,
                slot_axes: tuple[str, ...] = ()) -> tuple[dict[str, Any], Array]:
    """One step on the decode state `s` (decode_state.DecodeState with its `history`, and with a draft
    model its `draft_pool`): (the fields it changes, whether some slot finished). `slot_axes`: the slot
    shards' (engine/slot_shards.py); a slot's k + 1 rows stay next to each other, so in its shard."""
    k = speculative.num_tokens
    k1 = k + 1
    slots, r = s.active.shape[0], settings.max_new_tokens
    rows = jnp.arange(slots)
    offsets = jnp.arange(k1, dtype=jnp.int32)[None]
    changes: dict[str, Any] = {}
    if speculative.uses_draft_model:
        assert draft_params is not None and speculative.draft_cfg is not None
        drafts, draft_probs, changes["draft_pool"] = model_drafts(
            draft_params, speculative.draft_cfg, s, rng, knobs, cascade, k, settings=settings,
            compute_dtype=compute_dtype, attn_impl=attn_impl, mesh=mesh, slot_axes=slot_axes)
    else:
        drafts, _ = ngram_drafts(s.history, s.positions + 1, k, speculative.ngram_max, speculative.ngram_min)
        draft_probs = None
    fed = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [S, k + 1]
    positions = s.positions[:, None] + offsets
    # row i's logits choose response token num_gen + i: only worth computing inside the budget
    live = s.active[:, None] & (s.num_gen[:, None] + offsets < s.budget[:, None])
    # a vision-language slot's M-RoPE delta turns each of its k + 1 tokens' rotary positions, as in plain decode
    rope_offset = None if s.rope_offset is None else jnp.repeat(s.rope_offset, k1)
    logits, pool, _ = decode_logits(params, cfg, s.pool, fed.reshape(-1), positions.reshape(-1),
                                    jnp.repeat(s.page_table, k1, axis=0), live.reshape(-1),
                                    compute_dtype=compute_dtype, attn_impl=attn_impl, mesh=mesh,
                                    cascade=virtual_cascade(cascade, k1), rope_offset=rope_offset,
                                    slot_axes=slot_axes)
    keys = jax.vmap(lambda i: request_keys(rng, s.request, s.num_gen + i), out_axes=1)(jnp.arange(k1))
    tokens, log_probs, accepted = accept_drafts(logits.reshape(slots, k1, -1), drafts, draft_probs, keys, knobs,
                                                settings)
    # emit the kept drafts and the token after them, cut at the budget and after an EOS / stop token
    room = jnp.maximum(s.budget - s.num_gen, 1)
    emit = jnp.minimum(accepted + 1, room)
    stops = ends_sequence(tokens, knobs) & (offsets < emit[:, None])  # [S, k + 1]: EOS / stop ids emitted
    emit = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1, emit)
    emit = jnp.where(s.active, emit, 0)
    keep = offsets < emit[:, None]  # [S, k + 1]
    last_tok = tokens[rows, jnp.maximum(emit - 1, 0)]
    num_gen = s.num_gen + emit
    ends, reason = finish_codes(last_tok, num_gen, knobs, s.budget)
    ends &= s.active
    cols = jnp.where(keep, s.num_gen[:, None] + offsets, r)  # r: out of range, dropped
    if s.history is not None:  # the n-gram drafter's history: prompt and response tokens
        hist_cols = jnp.where(keep, s.positions[:, None] + 1 + offsets, s.history.shape[1])
        changes["history"] = s.history.at[rows[:, None], hist_cols].set(tokens, mode="drop")
    # drafts inside the budget, and those of them the target kept (before any EOS cut)
    proposed = jnp.sum(jnp.where(s.active, jnp.minimum(k, room - 1), 0))
    accepted_in_budget = jnp.sum(jnp.where(s.active, jnp.minimum(accepted, room - 1), 0))
    changes.update(
        pool=pool, positions=s.positions + emit, last=jnp.where(s.active, last_tok, s.last), num_gen=num_gen,
        active=s.active & ~ends, finish=jnp.where(ends, reason, s.finish),
        tokens=s.tokens.at[rows[:, None], cols].set(tokens, mode="drop"),
        log_probs=s.log_probs.at[rows[:, None], cols].set(log_probs, mode="drop"),
        steps=s.steps + 1, useful=s.useful + jnp.sum(s.active.astype(jnp.int32)),
        spec_counts=s.spec_counts + jnp.stack([jnp.sum(emit), proposed, accepted_in_budget]))
    return changes, jnp.any(ends)
