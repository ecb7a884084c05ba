"""Where each training step's rollout comes from: a `RolloutSource`.

    SynchronousSource  the next batch, sampled now on the actor's own params: no copy, no thread
    RolloutPipeline    the synchronizer's off-policy schedule on weight copies or a split mesh
                       (rollout/pipeline.py)

Both call a `Generate` function: sample and score one batch (`generate_with`), or DAPO's group filter
wrapped around it (`GroupFilter`), which keeps sampling batches until enough prompt groups vary.
`make_rollout_source` picks the source from the `synchronizer` keys; `make_rollouts` builds the whole
chain, and the Trainer only calls `take` (the schedule's batch) or `sample` (a batch it chose).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.config.spec import FilterGroupsSpec, RunSpec
from jaxrl_llm.rollout.batch import BatchLoader, Rollout, concat_rollouts, filter_metric, select_rows
from jaxrl_llm.rollout.generator import RolloutGenerator
from jaxrl_llm.rollout.partial import PartialRollouts
from jaxrl_llm.rollout.pipeline import DEVICE_FIELDS, Generate, RolloutPipeline
from jaxrl_llm.rollout.weights import PolicyWeights
from jaxrl_llm.sampler import SamplingParams

log = logging.getLogger("jaxrl_llm")


class RolloutSource(Protocol):
    """What the Trainer reads a step's rollout from, and checkpoints / resumes."""

    synchronous: bool  # True: every rollout is generated on the actor's current params (on-policy)

    def take(self, step: int) -> tuple[dict, Rollout, dict[str, float]]:
        """(batch, rollout, generation metrics) of training step `step`; StopIteration when the data ran out."""
        ...

    def sample(self, batch: dict, rng: jax.Array) -> tuple[Rollout, dict[str, float]]:
        """`batch` (one the caller chose, not the schedule's) sampled and scored now on the policy's
        current params, as the source's own steps are (group filter, partial rollouts)."""
        ...

    def loader_state(self, next_step: int) -> dict[str, Any]:
        """The data loader's state a checkpoint after `next_step - 1` saves."""
        ...

    def checkpoint_weights(self, next_step: int) -> tuple[dict, dict | None]:
        """(JSON record, rollout weights by version) a checkpoint needs to resume the in-flight rollouts."""
        ...

    def resume(self, record: dict | None, load_weights: Callable[[dict], dict]) -> None:
        """Restores what `checkpoint_weights` saved (`record`: None when the checkpoint has none);
        `load_weights(abstract)` reads the saved weight trees onto the `abstract` layout."""
        ...

    def describe(self) -> str:
        """One line for the run summary."""
        ...

    def close(self) -> None:
        """Stops any worker."""
        ...


class SynchronousSource:
    """Each step reads the next batch and samples it on the actor's own arrays (the ones the update
    then donates): generated and consumed before the update, so no copy is needed."""

    synchronous = True

    def __init__(self, *, policy: PolicyWeights, loader: BatchLoader, generate: Generate,
                 rng_for: Callable[[int], jax.Array]):
        self.policy, self.loader, self.generate, self.rng_for = policy, loader, generate, rng_for

    def take(self, step: int) -> tuple[dict, Rollout, dict[str, float]]:
        start = time.perf_counter()
        batch = next(self.loader)
        rollout, metrics = self.generate(batch, self.policy.sampling(), self.rng_for(step), False)
        jax.block_until_ready([getattr(rollout, f) for f in DEVICE_FIELDS])
        # on-policy unless partial rollouts resumed samples of earlier steps (they report their own)
        return batch, rollout, {"rollout/staleness": 0.0, **metrics, "timing_s/gen_job": time.perf_counter() - start}

    def sample(self, batch: dict, rng: jax.Array) -> tuple[Rollout, dict[str, float]]:
        return self.generate(batch, self.policy.sampling(), rng, False)

    def loader_state(self, next_step: int) -> dict[str, Any]:
        return self.loader.get_state()

    def checkpoint_weights(self, next_step: int) -> tuple[dict, dict | None]:
        if isinstance(self.generate, PartialRollouts):  # the paused samples (JSON), no weights
            return {"pipeline": {"partial": self.generate.state()}}, None
        return {}, None  # nothing in flight

    def resume(self, record: dict | None, load_weights: Callable[[dict], dict]) -> None:
        """A synchronous run resumes from the loader state alone (a pipelined checkpoint's in-flight
        rollouts are generated again, on the restored weights), and with partial rollouts from the
        paused samples the checkpoint kept."""
        if isinstance(self.generate, PartialRollouts) and record and "partial" in record:
            self.generate.restore(record["partial"])

    def describe(self) -> str:
        return "synchronizer: synchronous (each rollout sampled on the policy's own params, then trained on)"

    def close(self) -> None:
        pass


def generate_with(generator: RolloutGenerator, sampling: SamplingParams,
                  rollout_generator: RolloutGenerator | None = None) -> Generate:
    """A `Generate` that samples and scores one batch with `generator` (or `rollout_generator`, the
    split mesh's, when asked to generate on the rollout mesh)."""
    def generate(batch: dict, params: dict, rng: jax.Array, on_rollout_mesh: bool) -> tuple[Rollout, dict]:
        chosen = rollout_generator if on_rollout_mesh and rollout_generator is not None else generator
        return chosen.generate(batch, params, sampling, rng), {}

    return generate


class GroupFilter:
    """DAPO's dynamic sampling (`algorithm.filter_groups`) around a `Generate`: keeps only the prompt
    groups whose `metric` varies, and samples further batches from `loader` until `prompts` groups
    are kept (at most `max_num_gen_batches`, then a clear error)."""

    def __init__(self, generate: Generate, loader: BatchLoader, spec: FilterGroupsSpec, *, prompts: int, mesh: Mesh):
        self.generate, self.loader, self.spec, self.prompts, self.mesh = generate, loader, spec, prompts, mesh

    def __call__(self, batch: dict, params: dict, rng: jax.Array, on_rollout_mesh: bool
                 ) -> tuple[Rollout, dict[str, float]]:
        fg, want = self.spec, self.prompts
        kept: list[Rollout] = []
        num_kept, num_gen = 0, 0
        while num_kept < want:
            if fg.max_num_gen_batches > 0 and num_gen >= fg.max_num_gen_batches:
                raise RuntimeError(
                    f"algorithm.filter_groups: only {num_kept} of {want} prompt groups had varying "
                    f"'{fg.metric}' after {num_gen} generation batches (max_num_gen_batches); "
                    "the task may be too easy or too hard for the policy")
            if num_gen > 0:
                batch = next(self.loader)
            r, _ = self.generate(batch, params, jax.random.fold_in(rng, num_gen), on_rollout_mesh)
            num_gen += 1
            metric = filter_metric(r, fg.metric)
            groups = np.unique(r.group_ids)
            varied = [g for g in groups if np.std(metric[r.group_ids == g]) > 0]
            varied = varied[: want - num_kept]
            if varied:
                kept.append(select_rows(r, np.flatnonzero(np.isin(r.group_ids, varied))))
                num_kept += len(varied)
        return concat_rollouts(kept, self.mesh), {"train/num_gen_batches": float(num_gen)}


def make_rollouts(spec: RunSpec, generator: RolloutGenerator, *, policy: PolicyWeights, loader: BatchLoader,
                  rng_for: Callable[[int], jax.Array], train_mesh: Mesh, rollout_mesh: Mesh | None,
                  rollout_generator: RolloutGenerator | None, total_steps: int) -> RolloutSource:
    """The run's one way to its rollouts: the `Generate` of one batch (sample and score with
    `generator`, on the split mesh's `rollout_generator` where the source asks), wrapped in DAPO's
    group filter (`algorithm.filter_groups`) or in partial rollouts (samples still running at a step's
    end resume at the next: rollout/partial.py), read by the source `make_rollout_source` picks."""
    generate: Generate = generate_with(generator, spec.train_sampling, rollout_generator)
    if spec.filter_groups.enable:
        generate = GroupFilter(generate, loader, spec.filter_groups, prompts=spec.plan.prompts, mesh=train_mesh)
    if spec.partial.active:
        generate = PartialRollouts(generator, spec.train_sampling, loader, spec.partial, prompts=spec.plan.prompts)
        loader = generate.step_loader()
    return make_rollout_source(spec, policy=policy, loader=loader, generate=generate, rng_for=rng_for,
                               train_mesh=train_mesh, rollout_mesh=rollout_mesh, total_steps=total_steps)


def make_rollout_source(spec: RunSpec, *, policy: PolicyWeights, loader: BatchLoader, generate: Generate,
                        rng_for: Callable[[int], jax.Array], train_mesh: Mesh, rollout_mesh: Mesh | None,
                        total_steps: int) -> RolloutSource:
    """The synchronous source, or the pipeline when the `synchronizer` schedule is off-policy or
    generation runs on a split mesh. Warns when the schedule makes the data off-policy."""
    sync = spec.sync
    if sync.auto_correction:
        log.warning("synchronizer: sync_offset=%d, sync_interval=%d make the data off-policy (staleness <= %d): "
                    "algorithm.rollout_correction.rollout_is=token turned on (old log-probs are recomputed on "
                    "the trained policy); set rollout_is / rollout_rs to choose another correction",
                    sync.sync_offset, sync.sync_interval, sync.max_staleness)
    elif sync.off_policy and spec.rollout_correction.bypass_mode:
        log.warning("synchronizer: off-policy data with algorithm.rollout_correction.bypass_mode: the PPO old "
                    "log-probs are the stale rollout policy's")
    if not sync.off_policy and rollout_mesh is None:
        return SynchronousSource(policy=policy, loader=loader, generate=generate, rng_for=rng_for)
    return RolloutPipeline(sync, policy=policy, loader=loader, generate=generate, rng_for=rng_for,
                           train_mesh=train_mesh, rollout_mesh=rollout_mesh, total_steps=total_steps)
