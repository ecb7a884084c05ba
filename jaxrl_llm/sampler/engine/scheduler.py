"""The host-side driver: a queue of (prompt, sample) requests run through a fixed set of slots.

    engine = PagedEngine(cfg, spec, compute_dtype="float32")
    out, stats = engine.run(params, prompts, rng, knobs, settings)   # out: SampleOutput (numpy)

Loop: admit queued requests into free slots (one prefill per prompt, its KV inserted into each of
its n samples' slots; full prompt pages are shared by the samples, the partial last page and the
response pages are their own; with `batch_prefill` the new prompts of a round that share a length
bucket prefill in one program call, within `max_num_batched_tokens`), then one `generate` call of
up to `steps_per_call` decode steps that returns early when a slot finishes while requests wait,
then collect finished slots and free their pages. With cascade rows (`decode_state.cascade_shape`: per
`spec.cascade` and the decode attention's path) each `generate` call gets the groups of slots whose
shared prompt pages are read once per group (sampler/cascade_attention.py).
A request waits while the pool lacks the pages for its whole sequence (prompt + max_new_tokens),
so a running request never runs out of KV.

`run` queues every (prompt, sample) at once; `serve` takes any `RequestSource`, whose requests
may arrive while others decode (agents/streaming.py: the next turn of a multi-turn trajectory once
its tools have answered). Each request carries its own token budget, and its pages cover only
prompt + that budget.

On a mesh whose batch axes split `spec.slot_shards` ways (engine/slot_shards.py), each shard has its
block of the slots and its own page pool (local page ids); a request runs in a shard with a free slot
and its pages, preferably one where its prompt's pages already are, and a slot stays in its shard when
the slot set shrinks or grows.

Every decision is taken from host data (prompt lengths) and small device values every process reads
whole (`active`, `num_gen`; `to_host` gathers them), so every process of a multi-process run schedules
identically, as long as the source delivers the same requests in the same polls on every process
(`run`'s does).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.decoder import unstack_layers
from jaxrl_llm.models.moe import NOT_RECORDED
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.core import SampleOutput
from jaxrl_llm.sampler.engine import decode_layout, decode_state, programs, slot_shards
from jaxrl_llm.sampler.engine.pages import PagePool, pages_for
from jaxrl_llm.sampler.engine.requests import (
    BatchSource,
    EngineRequest,
    EngineStats,
    RequestImages,
    RequestSource,
    sample_output,
)
from jaxrl_llm.sampler.host import bucket_length
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.speculative import SpeculativeSpec
from jaxrl_llm.sharding import to_host


@dataclasses.dataclass
class _Group:
    # (prefix, its row of a batched prefill or None, the draft model's prefix or None), dropped once
    # every member is in a slot
    prefix: tuple[decode_state.Prefix, int | None, decode_state.Prefix | None] | None
    pending: int  # members not inserted yet
    left: int  # members not finished yet
    prompt_routing: np.ndarray | None = None  # [len(ids), L, k] when recording
    # slot shard -> the full prompt pages its running members there share (engine/slot_shards.py: one shard
    # without slot shards), and how many members run there; dropped with the shard's last member
    shared: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    running: collections.Counter = dataclasses.field(default_factory=collections.Counter)


# The slot sets of the drain, as fractions of max_num_seqs: one more `generate` program each. A
# three-quarter step between the top halvings matters most, since the large sets waste the most
# slot-steps (bench/rollout.py's full size: 88% utilisation with 1/2, 1/4, 1/8; a host simulation of
# its length mix gives ~94% with these six, 89% with six plain halvings down to 1/64).
DRAIN_FRACTIONS = (3 / 4, 1 / 2, 3 / 8, 1 / 4, 1 / 8, 1 / 16)


def speculative_refusal(cfg: ModelConfig, speculative: SpeculativeSpec | None) -> str | None:
    """Why the engine cannot verify drafts for `cfg`, or None: a hybrid model's rejected draft would have to take
    back the slot's delta-net state, which it does not hold per token."""
    if not (cfg.hybrid and speculative is not None):
        return None
    return (f"actor_rollout_ref.rollout.speculative.method={speculative.method!r}: {cfg.architecture}'s gated "
            "delta-net layers keep a recurrent state that verification cannot roll back to the kept draft tokens "
            "yet; set it to 'none'")


class PagedEngine:
    """Continuous batching over `spec.max_num_seqs` slots and a paged KV pool (see module doc)."""

    def __init__(self, cfg: ModelConfig, spec: decode_state.EngineSpec, *, compute_dtype: str = "float32",
                 steps_per_call: int = 16, max_num_batched_tokens: int | None = None, mesh: Mesh | None = None,
                 prefill_chunk: int | None = None, batch_prefill: bool = False, unroll_layers: bool = False,
                 precompile_drain: bool = True):
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call={steps_per_call} must be >= 1")
        refusal = speculative_refusal(cfg, spec.speculative)
        if refusal is not None:
            raise ValueError(refusal)
        self.cfg, self.spec, self.compute_dtype = cfg, spec, compute_dtype
        self.steps_per_call = steps_per_call
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mesh = mesh
        self.slot_axes = slot_shards.slot_axes(mesh, spec.slot_shards)  # () where the slots are replicated
        # chunked prefill: prompts whose bucket is longer run this many tokens at a time (a power of two)
        if prefill_chunk is not None and (prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1)):
            raise ValueError(f"prefill_chunk={prefill_chunk} must be a power of two")
        self.prefill_chunk = prefill_chunk
        self.batch_prefill = batch_prefill  # new groups' short prompts of one bucket share a prefill call
        # decode over per-layer weight arrays, layer after layer, instead of a scan over the stack (XLA:CPU
        # copies a layer's weights out of the stack every step; rollout.unroll_layers, docs/performance-history.md)
        self.unroll_layers = unroll_layers
        self._init_state: dict[tuple[int, bool], Any] = {}  # (max_new_tokens, recording) -> jitted initialiser
        self._state_r = None
        # rollout.precompile_drain: every drain set's decode program compiled before the first round (else
        # each when a drain first reaches it)
        self.precompile_drain = precompile_drain
        self._warm: set = set()  # (settings, max_new_tokens) whose drain sizes are compiled

    def max_model_len(self) -> int:
        return self.spec.pages_per_slot * self.spec.page_size

    def _fresh_state(self, max_new_tokens: int, record_routing: bool = False) -> decode_state.DecodeState:
        """A new pool and slot arrays for a run (the pool lives for the run only: `serve`)."""
        key = (max_new_tokens, record_routing)
        if key not in self._init_state:
            make = functools.partial(decode_state.init_state, self.cfg, self.spec, max_new_tokens, self.compute_dtype,
                                     record_routing)
            # with a mesh: the pool's kv heads over 'tensor' (when divisible), its pages and the slot arrays over
            # the slot shards' axes (replicated without); built by a jitted program so every process holds its
            # part of the same global arrays
            out_shardings = (None if self.mesh is None else decode_state.state_sharding(
                jax.eval_shape(make), self.cfg, self.mesh, self.slot_axes))
            self._init_state[key] = jax.jit(make, out_shardings=out_shardings)
        self._state_r = max_new_tokens
        return self._init_state[key]()

    def _resize(self, state: decode_state.DecodeState, keep: Sequence[int], slots: int) -> decode_state.DecodeState:
        """`slots` slots, new slot i holding old slot keep[i] (-1 or past the list: empty)."""
        order = np.full((self.spec.max_num_seqs,), -1, np.int32)
        order[:len(keep)] = keep
        return decode_state.resize_slots(state, order, slots=slots, mesh=self.mesh, slot_axes=self.slot_axes)

    def drain_sizes(self) -> list[int]:
        """The smaller slot sets of the drain (DRAIN_FRACTIONS of max_num_seqs, multiples of the slot
        shards), largest first."""
        full, shards = self.spec.max_num_seqs, self.spec.slot_shards
        return sorted({max(shards, int(full * f) // shards * shards) for f in DRAIN_FRACTIONS} - {full}, reverse=True)

    def _warm_drain_sizes(self, params: dict, state: decode_state.DecodeState, rng: jax.Array, knobs: SampleKnobs,
                          settings: SampleSettings, draft_params: dict | None = None) -> decode_state.DecodeState:
        """Compiles `generate` for every drain size now (zero steps on empty slots), so which sizes
        a run's drain reaches never adds a program in a later run."""
        key = (settings, self._state_r)
        if key in self._warm:
            return state
        for size in self.drain_sizes():
            empty = self._resize(state, [], size)
            out = programs.generate(params, self.cfg, empty, rng, knobs, np.int32(0), np.bool_(False), np.int32(0),
                                    self._cascade({}, {}, size, settings), draft_params, settings=settings,
                                    attn_impl=self.spec.attn_impl, mesh=self.mesh, speculative=self.spec.speculative,
                                    slot_axes=self.slot_axes)
            # the pool and counters went through (donated) and back; the full set's slots are as they were
            state = out._replace(**{f: getattr(state, f) for f in decode_state.SLOT_FIELDS})
        self._warm.add(key)
        return state

    def run(self, params: dict, prompts: Sequence[Sequence[int]], rng: jax.Array, knobs: SampleKnobs,
            settings: SampleSettings, *, order: Sequence[tuple[int, int]] | None = None,
            prompt_routing: Sequence[np.ndarray | None] | None = None, draft_params: dict | None = None,
            max_new_tokens: Sequence[int] | None = None, images: Sequence[RequestImages | None] | None = None
            ) -> tuple[SampleOutput, EngineStats]:
        """`settings.n` samples of every prompt; rows prompt-major (row i*n + j = sample j of prompt i).

        order: the queue as (prompt, sample) pairs (default prompt-major); results do not depend on it.
        prompt_routing: per prompt, experts its prefill replays (see `EngineRequest.routing`).
        draft_params: the draft model's params (speculative method 'draft').
        max_new_tokens: per prompt, its own budget (at most settings.max_new_tokens, which stays the
        programs' and the output's width; a request stops at its budget with finish 'length'); None:
        settings.max_new_tokens for all. Multi-turn rounds pass each conversation's remaining budget,
        so a long prefix does not need room for the longest budget of the round.
        images: per prompt, a vision-language prompt's images (`RequestImages`) or None.
        """
        n, r = settings.n, settings.max_new_tokens
        for i, p in enumerate(prompts):
            if len(p) < 1:
                raise ValueError(f"prompt {i} is empty")
        if max_new_tokens is not None and len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens: {len(max_new_tokens)} budgets for {len(prompts)} prompts")
        every = [(i, j) for i in range(len(prompts)) for j in range(n)]
        if order is not None and sorted(order) != every:
            raise ValueError("order must list every (prompt, sample) pair exactly once")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images: {len(images)} entries for {len(prompts)} prompts")
        source = BatchSource(prompts, n, r, every if order is None else order, prompt_routing, max_new_tokens,
                              images)
        stats = self.serve(params, source, rng, knobs, settings, draft_params)
        out = sample_output(prompts, n, source.tokens, source.log_probs, source.lengths, source.finish,
                            int(knobs.pad_id))
        routing = source.routing_rows(np.asarray(out.prompt_mask).sum(axis=1), out.prompt_ids.shape[1])
        return out._replace(routing=routing), stats

    def _prefill_groups(self, params: dict, fresh: list[tuple[_Group, EngineRequest]], record: bool,
                        draft_params: dict | None = None) -> int:
        """Prefills the first request of each new group in `fresh`, setting `entry.prefix` to
        (prefix, row in it or None, the draft model's prefix or None); returns the program calls.
        Prompts of one bucket share a call (`prefill_batch`, the batch padded to a power of two so a
        handful of shapes compile); a recording (MoE routing) or chunked prompt runs alone
        (`prefill`). With `draft_params` the draft model prefills the same prompts the same way."""
        draft_cfg = None if draft_params is None else self._draft_cfg()
        cfg, calls = self.cfg, 0
        batchable: dict[int, list[tuple[_Group, EngineRequest]]] = collections.defaultdict(list)
        for entry, req in fresh:
            length = len(req.ids)
            width = bucket_length(length)
            chunked = self.prefill_chunk is not None and self.prefill_chunk < width
            if self.batch_prefill and not record and not chunked and req.images is None:
                batchable[width].append((entry, req))
                continue
            ids = np.full((width,), 0, np.int32)
            ids[:length] = req.ids
            replay = None
            if record and req.routing is not None:  # the conversation's earlier turns keep their experts
                replay = np.full((len(ids), *req.routing.shape[1:]), NOT_RECORDED, req.routing.dtype)
                replay[:length] = req.routing
            images = None if req.images is None else req.images.padded(width)
            prefix = programs.prefill(params, cfg, ids, np.int32(length), compute_dtype=self.compute_dtype,
                                      record_routing=record, mesh=self.mesh, replay=replay, chunk=self.prefill_chunk,
                                      images=images, slot_axes=self.slot_axes)
            draft = None
            if draft_params is not None:
                draft = programs.prefill(draft_params, draft_cfg, ids, np.int32(length),
                                         compute_dtype=self.compute_dtype, mesh=self.mesh, chunk=self.prefill_chunk,
                                         slot_axes=self.slot_axes)
            entry.prefix = (prefix, None, draft)
            if prefix.routing is not None:
                entry.prompt_routing = np.asarray(to_host(prefix.routing))[:length]
            calls += 1
        for width, members in batchable.items():
            rows = 1 << (len(members) - 1).bit_length()  # padded to a power of two: few compiled shapes
            ids = np.zeros((rows, width), np.int32)
            lengths = np.ones((rows,), np.int32)  # padding rows: one token, never read
            for i, (_, req) in enumerate(members):
                ids[i, :len(req.ids)] = req.ids
                lengths[i] = len(req.ids)
            prefix = programs.prefill_batch(params, cfg, ids, lengths, compute_dtype=self.compute_dtype,
                                            mesh=self.mesh, slot_axes=self.slot_axes)
            draft = None
            if draft_params is not None:
                draft = programs.prefill_batch(draft_params, draft_cfg, ids, lengths, compute_dtype=self.compute_dtype,
                                               mesh=self.mesh, slot_axes=self.slot_axes)
            for i, (entry, _) in enumerate(members):
                entry.prefix = (prefix, i, draft)
            calls += 1
        return calls

    def _cascade(self, slot_req: dict[int, tuple[EngineRequest, list[int]]], groups: dict[int, _Group], size: int,
                 settings: SampleSettings) -> Cascade | None:
        """The groups of the slots that read their prompt's shared full pages once per decode step
        (sampler/cascade_attention.py): one row per group with two or more members in slots, at most
        size // 2 rows of settings.n members (a larger group's extra members read the plain way).
        None when the spec turns cascade attention off or one sample per prompt shares nothing; the
        shapes depend on the slot count and n only (no program per group layout)."""
        shape = decode_state.cascade_shape(self.spec, size, settings.n)
        if shape is None:
            return None
        rows, width = shape
        shards = self.spec.slot_shards
        per_shard, shard_rows = size // shards, rows // shards  # a shard's rows list its own (local) slots
        group_slots = np.full((rows, width), -1, np.int32)
        prefix_pages = np.zeros((rows,), np.int32)
        members: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        for slot in sorted(slot_req):
            shard = slot // per_shard
            members[(shard, slot_req[slot][0].group)].append(slot - shard * per_shard)
        used = [0] * shards
        for shard, group in sorted(members):
            slots, shared = members[(shard, group)], len(groups[group].shared.get(shard, ()))
            if len(slots) < 2 or shared == 0 or used[shard] == shard_rows:
                continue
            row = shard * shard_rows + used[shard]
            group_slots[row, :min(width, len(slots))] = slots[:width]
            prefix_pages[row] = shared
            used[shard] += 1
        return Cascade(group_slots, prefix_pages)

    @staticmethod
    def _pause(state: decode_state.DecodeState, slot_req: dict[int, tuple[EngineRequest, list[int]]],
               queue: collections.deque[EngineRequest], source: RequestSource) -> None:
        """Hands every running request's tokens so far, then every queued request, back to `source`
        (the pool goes with the run: no page needs releasing)."""
        tok, lp, num_gen = (np.asarray(a) for a in to_host((state.tokens, state.log_probs, state.num_gen)))
        paused = getattr(source, "paused")  # a source that asks to stop takes its requests back
        for s in sorted(slot_req):
            k = int(num_gen[s])
            paused(slot_req[s][0], tok[s, :k].copy(), lp[s, :k].copy())
        for req in queue:
            paused(req, np.zeros((0,), np.int32), np.zeros((0,), np.float32))

    def _check(self, req: EngineRequest, r: int) -> None:
        if len(req.ids) < 1:
            raise ValueError(f"request {req.key}: the prompt is empty")
        if not 1 <= req.max_new_tokens <= r:
            raise ValueError(f"request {req.key}: max_new_tokens={req.max_new_tokens} must be in [1, {r}] "
                             "(the engine's settings.max_new_tokens)")
        if len(req.ids) + req.max_new_tokens - 1 > self.max_model_len():
            raise ValueError(f"request {req.key}: prompt ({len(req.ids)} tokens) + max_new_tokens "
                             f"{req.max_new_tokens} exceeds the engine's max_model_len {self.max_model_len()}")
        if req.routing is not None and len(req.routing) != len(req.ids):
            raise ValueError(f"request {req.key}: routing for {len(req.routing)} tokens, the prompt has "
                             f"{len(req.ids)}")

    def _draft_cfg(self) -> ModelConfig:
        speculative = self.spec.speculative
        assert speculative is not None and speculative.draft_cfg is not None
        return speculative.draft_cfg

    def serve(self, params: dict, source: RequestSource, rng: jax.Array, knobs: SampleKnobs,
              settings: SampleSettings, draft_params: dict | None = None) -> EngineStats:
        """Runs `source`'s requests until it has no more (see the module doc); returns the counters.
        `draft_params`: the draft model's (speculative method 'draft', and only then)."""
        spec, cfg, r = self.spec, self.cfg, settings.max_new_tokens
        if settings.batch_invariant != cfg.batch_invariant:  # the log-probs follow the model's numerics
            settings = dataclasses.replace(settings, batch_invariant=cfg.batch_invariant)
        ps = spec.page_size
        if settings.compute_dtype != self.compute_dtype:
            raise ValueError(f"settings.compute_dtype={settings.compute_dtype} differs from the engine's "
                             f"{self.compute_dtype}")
        shards = spec.slot_shards
        pools = [PagePool(spec.shard_pages) for _ in range(shards)]  # one per slot shard, local page ids
        uses_draft = spec.speculative is not None and spec.speculative.uses_draft_model
        if uses_draft != (draft_params is not None):
            raise ValueError("draft_params: the draft model's params are needed exactly when rollout.speculative."
                             f"method='draft' (the engine's is {spec.speculative and spec.speculative.method!r})")
        # decode reads every weight per token: read a compute-dtype copy made once here (freed on return)
        params = decode_layout.decode_weights(params, self.compute_dtype, self.mesh, self.slot_axes,
                                              by_columns=cfg.batch_invariant)
        if draft_params is not None:
            draft_params = decode_layout.decode_weights(draft_params, self.compute_dtype, self.mesh, self.slot_axes,
                                                        by_columns=self._draft_cfg().batch_invariant)
        # the decode loop's own layout of them (rollout.unroll_layers: per-layer arrays, a copy while the run
        # lasts); prefill keeps the stacked ones
        step_params, step_draft = params, draft_params
        if self.unroll_layers:
            step_params = unstack_layers(params, cfg)
            step_draft = None if draft_params is None else unstack_layers(draft_params, self._draft_cfg())
        record = settings.record_routing and cfg.is_moe
        if record and spec.speculative is not None:
            raise ValueError("rollout.speculative: recording a MoE model's routing (routing replay) needs one token "
                             "per decode step; set rollout.speculative.method='none'")
        state = self._fresh_state(r, record)
        stats = EngineStats(speculative=spec.speculative is not None)
        size = spec.max_num_seqs  # slots of the state now (shrunk while the queue drains)
        sizes = self.drain_sizes()
        if self.precompile_drain:  # else each drain set's program compiles when the drain first reaches it
            state = self._warm_drain_sizes(step_params, state, rng, knobs, settings, step_draft)
        queue: collections.deque[EngineRequest] = collections.deque()
        groups: dict[int, _Group] = {}
        slot_req: dict[int, tuple[EngineRequest, list[int]]] = {}  # slot -> (request, own pages)
        free = slot_shards.free_by_shard(range(spec.max_num_seqs), spec.max_num_seqs, shards)  # each shard's free slots
        budget = self.max_num_batched_tokens

        def take_new() -> None:
            new = list(source.poll())
            counts = collections.Counter(req.group for req in new)
            for req in new:
                self._check(req, r)
                if req.group in groups:
                    raise ValueError(f"request {req.key}: group {req.group} is already running (a source "
                                     "delivers a group's requests in one poll)")
            for g, count in counts.items():
                groups[g] = _Group(None, count, count)
            queue.extend(new)

        take_new()
        stoppable = hasattr(source, "stop_requested")
        stop_requested = getattr(source, "stop_requested", lambda: False)
        while True:
            if stop_requested():
                self._pause(state, slot_req, queue, source)
                break
            if not queue and not slot_req:
                if not source.more_coming():
                    break
                source.wait()
                take_new()
                continue
            # draining (nothing queued or to come): the running sequences move to the smallest drain
            # set they fit; anything to admit: all slots
            draining = not queue and not source.more_coming()
            target = spec.max_num_seqs
            if draining:  # every shard's running slots fit its share of the set
                fullest = max(collections.Counter(slot // (size // shards) for slot in slot_req).values(), default=0)
                target = min([s for s in sizes if s >= fullest * shards and s <= size], default=size)
            if target != size:
                keep = slot_shards.kept_in_shards(sorted(slot_req), size, target, shards)
                state = self._resize(state, keep, target)
                moved = {old: new for new, old in enumerate(keep) if old >= 0}
                slot_req = {moved[old]: req for old, req in slot_req.items()}
                free = slot_shards.free_by_shard([i for i, old in enumerate(keep) if old < 0], target, shards)
                size = target
                stats.resizes += 1
            # admit what fits (slots, pages, the prefill token budget), then prefill the new groups
            # (several short prompts of one bucket in one call) and insert every admitted request
            prefilled = 0
            admitted: list[tuple[EngineRequest, _Group, np.ndarray, int]] = []
            fresh: list[tuple[_Group, EngineRequest]] = []  # groups prefilled this round, in order
            while queue and any(free):
                req = queue[0]
                length, entry = len(req.ids), groups[req.group]
                total = pages_for(length + req.max_new_tokens - 1, ps)
                shared_n = min(length // ps, total)
                new_group = entry.prefix is None and entry.pending == entry.left
                shard = slot_shards.choose_shard(entry.shared, free, pools, total, shared_n)
                if shard is None:
                    stats.waits_for_pages += 1
                    if not slot_req:
                        where = " per slot shard" if shards > 1 else ""
                        raise ValueError(f"the KV pool ({spec.shard_pages - 1} pages of {ps} tokens{where}) cannot "
                                         f"hold request {req.key} ({total} pages)")
                    break
                if new_group:
                    if budget is not None and prefilled and prefilled + length > budget:
                        break  # rollout.max_num_batched_tokens: prefill more after the next decode call
                    fresh.append((entry, req))
                    prefilled += length
                    stats.prefill_tokens += length
                if shard in entry.shared:  # the group's prompt pages in this shard: one more reader
                    pools[shard].retain(entry.shared[shard])
                else:
                    entry.shared[shard] = pools[shard].alloc(shared_n)
                entry.running[shard] += 1
                own = pools[shard].alloc(total - shared_n)
                row = np.zeros((spec.pages_per_slot,), np.int32)
                row[:total] = entry.shared[shard] + own
                slot = free[shard].pop(0)
                queue.popleft()
                slot_req[slot] = (req, own)
                entry.pending -= 1
                admitted.append((req, entry, row, slot))
                stats.peak_pages_used = max(stats.peak_pages_used, sum(p.num_pages - 1 - p.num_free for p in pools))
            stats.prefill_calls += self._prefill_groups(params, fresh, record, draft_params)
            placement = dict(settings=settings, mesh=self.mesh, slot_axes=self.slot_axes)
            for req, entry, row, slot in admitted:
                assert entry.prefix is not None
                prefix, index, draft = entry.prefix
                args = (state, np.int32(slot), row, np.asarray(req.key, np.int32), np.int32(req.max_new_tokens), rng,
                        knobs, draft)
                state = (programs.insert(prefix, *args, **placement) if index is None else
                         programs.insert_at(prefix, np.int32(index), *args, **placement))
            for _, entry, _, _ in admitted:
                if entry.pending == 0:
                    entry.prefix = None  # drop the prefix KV, keep the page list
            stats.max_prefill_tokens_per_round = max(stats.max_prefill_tokens_per_round, prefilled)

            # stop at the first finish while requests wait or may still come, to refill its slot
            # (slots whose token 0 already ended them make the loop exit at once)
            refill = bool(queue) or source.more_coming()
            # a source that may stop the run checks its stop after every finish, draining or not
            stop_on_finish = refill or stoppable
            steps = self.steps_per_call if refill else r
            # draining: return once the running sequences fit the next smaller set, to move them there
            smaller = max([s for s in sizes if s < size], default=0) if not refill else 0
            cascade = self._cascade(slot_req, groups, size, settings)
            if cascade is not None:
                stats.peak_cascade_groups = max(stats.peak_cascade_groups, int(np.sum(cascade.prefix_pages > 0)))
            state = programs.generate(step_params, cfg, state, rng, knobs, np.int32(steps), np.bool_(stop_on_finish),
                                      np.int32(smaller), cascade, step_draft, settings=settings,
                                      attn_impl=spec.attn_impl, mesh=self.mesh, speculative=spec.speculative,
                                      slot_axes=self.slot_axes)
            stats.generate_calls += 1
            active, total_steps = (np.asarray(a) for a in to_host((state.active, state.steps)))
            stats.slot_steps += (int(total_steps) - stats.decode_steps) * size
            stats.decode_steps = int(total_steps)
            done = [s for s in slot_req if not active[s]]
            if done:
                tok, lp, num_gen, fin = (np.asarray(a) for a in to_host(
                    (state.tokens, state.log_probs, state.num_gen, state.finish)))
                routing = None if state.routing is None else np.asarray(to_host(state.routing))
                for s in sorted(done):
                    req, own = slot_req.pop(s)
                    entry, shard = groups[req.group], s // (size // shards)
                    pools[shard].release(own + entry.shared[shard])
                    entry.running[shard] -= 1
                    if not entry.running[shard]:  # its last member here: the pages went back to the pool
                        del entry.shared[shard], entry.running[shard]
                    entry.left -= 1
                    if entry.left == 0:
                        del groups[req.group]
                    free[shard].append(s)
                    k = int(num_gen[s])
                    result = (req, tok[s, :k].copy(), lp[s, :k].copy(), int(fin[s]))
                    if routing is not None and entry.prompt_routing is not None:  # only recording runs pass it
                        source.finished(*result, np.concatenate([entry.prompt_routing, routing[s, :k]]))
                    else:
                        source.finished(*result)
                for slots in free:
                    slots.sort()
            take_new()

        stats.useful_token_steps = int(to_host(state.useful))
        if state.spec_counts is not None:
            stats.spec_emitted, stats.spec_proposed, stats.spec_accepted = (int(c) for c in to_host(state.spec_counts))
        # the pool is not kept: the update that follows has the memory (the memory plan counts a pool
        # only where generation overlaps training, planning/programs.py); the next run makes a
        # new one with the cached initialiser
        del state
        return stats
