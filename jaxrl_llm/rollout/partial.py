"""Partial rollouts (`actor_rollout_ref.rollout.partial`): a step stops generating once it has its
batch of finished prompt groups; the samples still running are paused and resume first at the next
step, on the newer policy, so one step's long tail overlaps the next step's work instead of idling
the engine's slots (slime's and veRL's partial rollouts).

Schedule (B = prompts per step, n samples each; `PartialRollouts` is the step's `Generate`):
- The first step reads one loader batch ahead: the groups in flight are then always the ones
  carried from the previous step (B of them) plus one fresh batch.
- The paged engine runs every unfinished sample (the carried ones queued first) and stops once B
  groups have all n samples finished and every group admitted `max_staleness` steps ago has finished
  (`stop_requested`). The step trains on B finished groups, the oldest first; the others wait: a
  running sample hands back its tokens so far (`paused`).
- A paused sample resumes as a request whose prompt is its prompt and the tokens it has (one
  prefill), with the budget it has left. Its tokens keep the log-probs they were sampled with
  (rollout_log_probs: each segment's behaviour policy), so rollout correction (token IS, turned on
  when rollout_is / rollout_rs are unset, as for the synchronizer's off-policy data) weighs the stale
  segments.
- A token's staleness = the step it is trained in - the step it was sampled in; never above
  max_staleness (groups are admitted whole and trained within max_staleness steps).
  `rollout/staleness` (mean over the step's response tokens), `rollout/staleness_max`,
  `rollout/partial/paused` (samples handed back this step) and `rollout/partial/resumed`.
- max_staleness = 0: nothing may wait, so nothing is read ahead: the plain synchronous rollout.

Random numbers: a fresh group (row i of the step's fresh rows) draws sample j's token t with the
step's key and (i, j, t), as a plain rollout does; a carried sample continues with the step's key
and (2B + its group's index in the carry, j, t'): all fixed by the carry, which checkpoints save
(`state` / `restore`, JSON: dataset rows by index, tokens, log-probs, steps), so a resumed run
continues exactly. The data loader's position includes the batch read ahead.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np

from jaxrl_llm.config.spec import PartialSpec
from jaxrl_llm.data.loader import collate
from jaxrl_llm.models.vision.tower_lora import tower_params
from jaxrl_llm.rollout.batch import BatchLoader, Rollout
from jaxrl_llm.rollout.generator import RolloutGenerator, rows_on_mesh
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.core import SampleOutput
from jaxrl_llm.sampler.engine import EngineRequest
from jaxrl_llm.sampler.engine.requests import RequestImages, sample_output
from jaxrl_llm.sampler.engine.setup import prompt_room, sized_engine
from jaxrl_llm.sampler.host import left_pad
from jaxrl_llm.sharding import to_host

Array = jax.Array


@dataclasses.dataclass
class Sample:
    """One response so far: its tokens, their log-probs and the step each was sampled in."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    steps: list[int] = dataclasses.field(default_factory=list)
    finish: int | None = None  # the finish code once finished

    def extend(self, tokens: np.ndarray, log_probs: np.ndarray, step: int) -> None:
        self.tokens += [int(t) for t in tokens]
        self.log_probs += [float(x) for x in log_probs]
        self.steps += [step] * len(tokens)


@dataclasses.dataclass
class Group:
    """A prompt's n samples in flight: its batch row (one-row arrays), the step it was admitted in."""

    row: dict[str, np.ndarray]
    born: int
    order: int  # admission order (ties of `born`)
    samples: list[Sample]

    @property
    def prompt(self) -> list[int]:
        return [int(t) for t in self.row["raw_prompt_ids"][0]]

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.samples)


class _StepSource:
    """The engine's `RequestSource` for one step: every unfinished sample of `groups`, the carried
    first; stops once `want` groups are finished and every group born at or before `due` is."""

    def __init__(self, groups: list[Group], step: int, *, want: int, due: int, fresh_keys: dict[int, int],
                 carry_base: int, max_new_tokens: int, images: list[Any] | None = None) -> None:
        self.groups, self.step, self.want, self.due = groups, step, want, due
        self.requests: list[EngineRequest] = []
        self.owner: dict[tuple[int, int], tuple[Group, Sample]] = {}
        self.paused_count = self.resumed_count = 0
        engine_groups = itertools.count()  # requests of one engine group share one prefill
        for g_index, group in enumerate(groups):
            key = fresh_keys.get(g_index, carry_base + g_index)
            # a group none of whose samples started shares its prompt's prefill; a resumed sample's
            # prompt (its prompt + its tokens) is its own
            shared = next(engine_groups) if all(not s.tokens for s in group.samples) else None
            for j, sample in enumerate(group.samples):
                if sample.finish is not None:
                    continue
                self.resumed_count += bool(sample.tokens)
                engine_group = shared if shared is not None else next(engine_groups)
                ids = group.prompt + sample.tokens
                # a vision-language prompt's images: a resumed sample's tokens so far are text after them
                own = None if images is None or images[g_index] is None else images[g_index].extended(len(ids))
                self.requests.append(EngineRequest(ids, (key, j), engine_group, max_new_tokens - len(sample.tokens),
                                                   images=own))
                self.owner[(key, j)] = (group, sample)
        self.finished_groups = sum(g.finished for g in groups)

    def poll(self) -> list[EngineRequest]:
        out, self.requests = self.requests, []
        return out

    def finished(self, request: EngineRequest, token_ids: np.ndarray, log_probs: np.ndarray, finish: int,
                 routing: np.ndarray | None = None) -> None:
        group, sample = self.owner[request.key]
        sample.extend(token_ids, log_probs, self.step)
        sample.finish = finish
        self.finished_groups += group.finished

    def paused(self, request: EngineRequest, token_ids: np.ndarray, log_probs: np.ndarray) -> None:
        self.paused_count += len(token_ids) > 0
        self.owner[request.key][1].extend(token_ids, log_probs, self.step)

    def stop_requested(self) -> bool:
        if self.finished_groups < self.want:
            return False
        return all(g.finished for g in self.groups if g.born <= self.due)

    def more_coming(self) -> bool:
        """Never: every request is polled at once (the engine still checks the stop after each
        finish, and moves the last running ones to smaller slot sets)."""
        return False

    def wait(self) -> None:
        return None


class StepLoader:
    """The training loader as a partial-rollout run's steps read it: its batches, then, once it runs
    out, empty batches while the carry still holds a step's groups, so the batch read ahead is
    trained on and the run has as many steps as a plain one. State and dataset are the loader's."""

    def __init__(self, loader: BatchLoader, partial: PartialRollouts) -> None:
        self.loader, self.partial = loader, partial
        self.dataset = loader.dataset

    def __iter__(self) -> StepLoader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        try:
            return next(self.loader)
        except StopIteration:
            if not self.partial.can_step_without_data():
                raise
            return {k: v[:0] for k, v in self.partial.carry[0].row.items()}

    def get_state(self) -> dict[str, Any]:
        return self.loader.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.loader.set_state(state)


class PartialRollouts:
    """The training step's `Generate` with partial rollouts (see the module doc)."""

    def __init__(self, generator: RolloutGenerator, sampling: SamplingParams, loader: BatchLoader, spec: PartialSpec, *,
                 prompts: int) -> None:
        self.generator, self.sampling, self.loader, self.spec, self.prompts = generator, sampling, loader, spec, prompts
        self.carry: list[Group] = []
        self.step = 0  # calls so far (= the training step being generated, from 1)
        self.order = 0

    def _admit(self, batch: dict[str, np.ndarray]) -> list[Group]:
        rows = len(batch["raw_prompt_ids"])
        out = []
        for i in range(rows):
            row = {k: v[i:i + 1] for k, v in batch.items()}
            out.append(Group(row, self.step, self.order, [Sample() for _ in range(self.sampling.n)]))
            self.order += 1
        return out

    def __call__(self, batch: dict[str, np.ndarray], params: dict, rng: Array, on_rollout_mesh: bool
                 ) -> tuple[Rollout, dict[str, float]]:
        self.step += 1
        gen = self.generator
        if self.spec.max_staleness == 0:  # nothing may wait: the plain rollout
            return gen.generate(batch, params, self.sampling, rng), {}
        fresh = self._admit(batch)
        if self.step == 1:  # one batch ahead, from the first step on
            try:
                fresh += self._admit(next(self.loader))
            except StopIteration:
                pass
        groups = self.carry + fresh
        fresh_keys = {len(self.carry) + i: i for i in range(len(fresh))}
        r = self.sampling.max_new_tokens
        source = _StepSource(groups, self.step, want=self.prompts, due=self.step - self.spec.max_staleness,
                             fresh_keys=fresh_keys, carry_base=2 * self.prompts, max_new_tokens=r,
                             images=self._group_images(groups, params))
        requests = source.requests
        settings, knobs = gen.compile_args(self.sampling)
        # sized by the run's prompt bound, as the plain rollout's engine: a resumed request (its prompt
        # + its tokens so far, with what is left of the budget) needs no more room than its prompt did
        # with the whole budget, so carried requests neither grow the page table nor rebuild the engine
        longest = max(len(q.ids) + q.max_new_tokens for q in requests) - r
        engine = sized_engine(gen.model_cfg, gen.engine_for(r), num_requests=len(requests),
                              max_prompt_len=prompt_room(longest, gen.max_prompt_length), settings=settings,
                              mesh=gen.mesh)
        gen.last_engine_stats = engine.serve(params, source, rng, knobs, settings, gen.draft_params)
        done = sorted((g for g in groups if g.finished), key=lambda g: (g.born, g.order))[:self.prompts]
        chosen = {id(g) for g in done}
        self.carry = [g for g in groups if id(g) not in chosen]
        out, picked = self._output(done)
        images = None
        if self._with_images(done):  # the trained groups' images, as the rows' prompts are laid out
            ids, mask = (np.asarray(to_host(x))[::self.sampling.n] for x in (out.prompt_ids, out.prompt_mask))
            images = self._image_prompt(done, ids, mask, params)
        rollout = gen.scored(picked, out, self.sampling.n, r, rng, images=images)
        lags = np.concatenate([self.step - np.asarray(s.steps) for g in done for s in g.samples])
        metrics = {"rollout/staleness": float(lags.mean()) if lags.size else 0.0,
                   "rollout/staleness_max": float(lags.max(initial=0)),
                   "rollout/partial/paused": float(source.paused_count),
                   "rollout/partial/resumed": float(source.resumed_count)}
        return rollout, metrics

    def _with_images(self, groups: list[Group]) -> bool:
        return self.generator.vision is not None and any(
            "images" in g.row and len(g.row["images"][0]) for g in groups)

    def _image_prompt(self, groups: list[Group], ids: np.ndarray, mask: np.ndarray, params: dict) -> Any:
        """The `ImagePrompt` of `groups`' prompts laid out as `ids` / `mask`, through the policy's tower (a trained
        tower's current params: a carried sample's later tokens read this step's features)."""
        vision = self.generator.vision
        assert vision is not None
        return vision.prompt(ids, mask, [list(g.row["images"][0]) for g in groups],
                             params=tower_params(params) if vision.trained else None)

    def _group_images(self, groups: list[Group], params: dict) -> list[Any] | None:
        """Each group's prompt images as its requests prefill them (`RequestImages`; None for a text prompt), or
        None without images."""
        if not self._with_images(groups):
            return None
        ids, mask = left_pad([g.prompt for g in groups], self.generator.pad_id)
        requests = RequestImages.of_batch(self._image_prompt(groups, ids, mask, params), mask)
        return [r if len(g.row["images"][0]) else None for g, r in zip(groups, requests)]

    def _output(self, groups: list[Group]) -> tuple[SampleOutput, dict[str, np.ndarray]]:
        """The finished `groups` as the engine's `SampleOutput` (rows group-major, on the mesh) and their batch."""
        gen, r = self.generator, self.sampling.max_new_tokens
        samples = [s for g in groups for s in g.samples]  # group-major
        tokens = np.zeros((len(samples), r), np.int32)
        log_probs = np.zeros((len(samples), r), np.float32)
        for row, s in enumerate(samples):
            tokens[row, :len(s.tokens)], log_probs[row, :len(s.tokens)] = s.tokens, s.log_probs
        lengths = np.asarray([len(s.tokens) for s in samples], np.int32)
        finish = np.asarray([int(s.finish or 0) for s in samples], np.int32)
        host = sample_output([g.prompt for g in groups], self.sampling.n, tokens, log_probs, lengths, finish,
                             gen.pad_id)
        batch = {k: np.concatenate([g.row[k] for g in groups]) for k in groups[0].row}
        return rows_on_mesh(host, gen.mesh), batch

    def step_loader(self) -> StepLoader:
        """The loader the step source reads (see `StepLoader`)."""
        return StepLoader(self.loader, self)

    def can_step_without_data(self) -> bool:
        """The carry alone holds a step's groups (the batch read ahead, once the data ran out)."""
        return len(self.carry) >= self.prompts

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The carry and counters, JSON-able (the batch rows by dataset index)."""
        return {"step": self.step, "order": self.order, "return_raw_chat": bool(
            self.carry and "raw_prompt" in self.carry[0].row),
            "carry": [{"index": int(g.row["index"][0]), "born": g.born, "order": g.order,
                       "samples": [dataclasses.asdict(s) for s in g.samples]} for g in self.carry]}

    def restore(self, state: dict[str, Any]) -> None:
        """Back to what `state` saved: rows re-read from the loader's dataset by index."""
        self.step, self.order = int(state["step"]), int(state["order"])
        self.carry = []
        for g in state["carry"]:
            row = collate([self.loader.dataset[int(g["index"])]], bool(state["return_raw_chat"]))
            self.carry.append(Group(row, int(g["born"]), int(g["order"]), [Sample(**s) for s in g["samples"]]))
