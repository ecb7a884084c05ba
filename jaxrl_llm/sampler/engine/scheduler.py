"""The host-side driver: a queue of (prompt, sample) requests run through a fixed set of slots.

    engine = PagedEngine(cfg, spec, compute_dtype="float32")
    out, stats = engine.run(params, prompts, rng, knobs, settings)   # out: SampleOutput (numpy)

Loop: admit queued requests into free slots (one prefill per prompt, its KV inserted into each of
its n samples' slots; full prompt pages are shared by the samples, the partial last page and the
response pages are their own), then one `generate` call of up to `steps_per_call` decode steps
that returns early when a slot finishes while requests wait, then collect finished slots and
free their pages. A request waits while the pool lacks the pages for its whole sequence
(prompt + max_new_tokens), so a running request never runs out of KV.

Every decision is taken from host data (prompt lengths) and small replicated device values
(`active`, `num_gen`), so every process of a multi-process run schedules identically.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler.core import SampleOutput
from jaxrl_llm.sampler.engine import programs
from jaxrl_llm.sampler.engine.pages import PagePool, pages_for
from jaxrl_llm.sampler.host import bucket_length, left_pad
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sharding import to_host


@dataclasses.dataclass
class EngineStats:
    """Counters of one `run` (slot utilisation = useful_token_steps / slot_steps)."""

    decode_steps: int = 0
    slot_steps: int = 0
    useful_token_steps: int = 0
    prefill_tokens: int = 0  # real prompt tokens prefilled (once per prompt)
    prefill_calls: int = 0
    max_prefill_tokens_per_round: int = 0  # bounded by max_num_batched_tokens (or one prompt)
    generate_calls: int = 0
    peak_pages_used: int = 0
    waits_for_pages: int = 0

    @property
    def utilisation(self) -> float:
        return self.useful_token_steps / max(1, self.slot_steps)


@dataclasses.dataclass
class _Prompt:
    prefix: programs.Prefix
    shared: list[int]
    pending: int  # samples not inserted yet


class PagedEngine:
    """Continuous batching over `spec.max_num_seqs` slots and a paged KV pool (see module doc)."""

    def __init__(self, cfg: ModelConfig, spec: programs.EngineSpec, *, compute_dtype: str = "float32",
                 steps_per_call: int = 16, max_num_batched_tokens: int | None = None, mesh: Mesh | None = None):
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call={steps_per_call} must be >= 1")
        self.cfg, self.spec, self.compute_dtype = cfg, spec, compute_dtype
        self.steps_per_call = steps_per_call
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mesh = mesh
        self._state: programs.DecodeState | None = None
        self._state_r = None

    def max_model_len(self) -> int:
        return self.spec.pages_per_slot * self.spec.page_size

    def _fresh_state(self, max_new_tokens: int) -> programs.DecodeState:
        # the pool is reused across runs (its contents are dead once a run ends); only the small
        # per-slot arrays are reset
        if self._state is None or self._state_r != max_new_tokens:
            make = functools.partial(programs.init_state, self.cfg, self.spec, max_new_tokens, self.compute_dtype)
            # with a mesh: the pool's kv heads over 'tensor' (when divisible), slot arrays replicated;
            # built by a jitted program so every process holds its part of the same global arrays
            out_shardings = (None if self.mesh is None else
                             programs.state_sharding(jax.eval_shape(make), self.cfg, self.mesh))
            self._state = jax.jit(make, out_shardings=out_shardings)()
            self._state_r = max_new_tokens
        state, self._state = self._state, None
        return programs.clear_slots(state)

    def run(self, params: dict, prompts: Sequence[Sequence[int]], rng: jax.Array, knobs: SampleKnobs,
            settings: SampleSettings, *, order: Sequence[tuple[int, int]] | None = None
            ) -> tuple[SampleOutput, EngineStats]:
        """`settings.n` samples of every prompt; rows prompt-major (row i*n + j = sample j of prompt i).

        order: the queue as (prompt, sample) pairs (default prompt-major); results do not depend on it.
        """
        spec, cfg, n, r = self.spec, self.cfg, settings.n, settings.max_new_tokens
        ps = spec.page_size
        if settings.compute_dtype != self.compute_dtype:
            raise ValueError(f"settings.compute_dtype={settings.compute_dtype} differs from the engine's "
                             f"{self.compute_dtype}")
        lens = [len(p) for p in prompts]
        for i, length in enumerate(lens):
            if length < 1:
                raise ValueError(f"prompt {i} is empty")
            if length + r - 1 > self.max_model_len():
                raise ValueError(f"prompt {i} ({length} tokens) + max_new_tokens {r} exceeds the engine's "
                                 f"max_model_len {self.max_model_len()}")
        queue = collections.deque(order if order is not None else [(i, j) for i in range(len(prompts))
                                                                    for j in range(n)])
        if sorted(queue) != [(i, j) for i in range(len(prompts)) for j in range(n)]:
            raise ValueError("order must list every (prompt, sample) pair exactly once")
        pool = PagePool(spec.num_pages)
        state = self._fresh_state(r)
        stats = EngineStats()
        open_prompts: dict[int, _Prompt] = {}
        slot_req: dict[int, tuple[int, int, list[int]]] = {}  # slot -> (prompt, sample, own pages)
        free_slots = list(range(spec.max_num_seqs))
        n_rows = len(prompts) * n
        out_tok = np.zeros((n_rows, r), np.int32)
        out_lp = np.zeros((n_rows, r), np.float32)
        out_len = np.zeros((n_rows,), np.int32)
        out_fin = np.zeros((n_rows,), np.int32)
        samples_left = collections.Counter(i for i, _ in queue)
        budget = self.max_num_batched_tokens

        while queue or slot_req:
            prefilled = 0
            while queue and free_slots:
                i, j = queue[0]
                total = pages_for(lens[i] + r - 1, ps)
                shared_n = lens[i] // ps
                new_prompt = i not in open_prompts
                need = total - shared_n + (shared_n if new_prompt else 0)
                if need > pool.num_free:
                    stats.waits_for_pages += 1
                    if not slot_req:
                        raise ValueError(f"the KV pool ({spec.num_pages - 1} pages of {ps} tokens) cannot hold "
                                         f"request {(i, j)} ({need} pages)")
                    break
                if new_prompt:
                    if budget is not None and prefilled and prefilled + lens[i] > budget:
                        break  # rollout.max_num_batched_tokens: prefill more after the next decode call
                    ids = np.full((bucket_length(lens[i]),), 0, np.int32)
                    ids[:lens[i]] = prompts[i]
                    prefix = programs.prefill(params, cfg, ids, np.int32(lens[i]),
                                              compute_dtype=self.compute_dtype)
                    shared = pool.alloc(shared_n, refs=samples_left[i])
                    open_prompts[i] = _Prompt(prefix, shared, samples_left[i])
                    prefilled += lens[i]
                    stats.prefill_tokens += lens[i]
                    stats.prefill_calls += 1
                entry = open_prompts[i]
                own = pool.alloc(total - shared_n)
                row = np.zeros((spec.pages_per_slot,), np.int32)
                row[:total] = entry.shared + own
                slot = free_slots.pop(0)
                state = programs.insert(entry.prefix, state, np.int32(slot), row, np.asarray([i, j], np.int32), rng,
                                        knobs, settings=settings)
                queue.popleft()
                slot_req[slot] = (i, j, own)
                entry.pending -= 1
                if entry.pending == 0:
                    open_prompts[i] = _Prompt(None, entry.shared, 0)  # drop the prefix KV, keep the page list
                stats.peak_pages_used = max(stats.peak_pages_used, spec.num_pages - 1 - pool.num_free)
            stats.max_prefill_tokens_per_round = max(stats.max_prefill_tokens_per_round, prefilled)

            # (slots whose token 0 already ended them make the loop exit at once)
            steps = self.steps_per_call if queue else r
            state = programs.generate(params, cfg, state, rng, knobs, np.int32(steps), np.bool_(bool(queue)),
                                      settings=settings, attn_impl=spec.attn_impl)
            stats.generate_calls += 1
            active = np.asarray(to_host(state.active))
            done = [s for s in slot_req if not active[s]]
            if done:
                tok, lp, num_gen, fin = (np.asarray(a) for a in to_host(
                    (state.tokens, state.log_probs, state.num_gen, state.finish)))
                for s in sorted(done):
                    i, j, own = slot_req.pop(s)
                    row = i * n + j
                    out_tok[row], out_lp[row], out_len[row], out_fin[row] = tok[s], lp[s], num_gen[s], fin[s]
                    pool.release(own + open_prompts[i].shared)
                    samples_left[i] -= 1
                    if samples_left[i] == 0:
                        del open_prompts[i]
                    free_slots.append(s)
                free_slots.sort()

        steps, useful = (int(x) for x in to_host((state.steps, state.useful)))
        stats.decode_steps, stats.useful_token_steps = steps, useful
        stats.slot_steps = steps * spec.max_num_seqs
        self._state = state  # keep the pool buffers for the next run
        out_tok = np.where(np.arange(r)[None] < out_len[:, None], out_tok, int(knobs.pad_id))
        out_lp = np.where(np.arange(r)[None] < out_len[:, None], out_lp, 0.0).astype(np.float32)
        pad = int(knobs.pad_id)
        p_ids, p_mask = left_pad([prompts[i] for i in range(len(prompts)) for _ in range(n)], pad)
        mask = (np.arange(r)[None] < out_len[:, None]).astype(np.int32)
        out = SampleOutput(tokens=out_tok, response_mask=mask, log_probs=out_lp, lengths=out_len,
                           finish_reason=out_fin, prompt_ids=p_ids, prompt_mask=p_mask,
                           num_steps=np.int32(out_len.max(initial=0)))
        return out, stats
