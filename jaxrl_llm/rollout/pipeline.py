"""Off-policy pipelining: the `synchronizer` schedule (Trinity-RFT's `fixed` style) and the split mesh.

    take(k):  sync   when k % sync_interval == 0, the rollout weights := a copy of the actor's
              launch the generation jobs up to step k + sync_offset (data loading, sampling,
              text decoding, reward scoring), each on the rollout weights of its launch
              wait   for step k's job (launched sync_offset steps earlier)
    ...then the trainer updates on step k's rollout while the job of step k + offset runs.

A rollout launched at step k for step j = k + offset carries the weights of step k - k % interval,
so its staleness j - version is at most offset + interval - 1 (`SyncSpec.max_staleness`),
logged per step as `rollout/staleness`.

Why copies: `update_actor` donates the actor's params, so a rollout that outlives an update reads
its own buffers (`copy_tree`), or, with a split mesh (`mesh.rollout_devices`), the arrays moved
device to device onto the rollout mesh (`sharding.split.transfer`). `sync_offset=0,
sync_interval=1` on one device set keeps the synchronous path: no copy, no thread, the same
programs in the same order, so its numbers equal a synchronous run's; that schedule runs as
rollout/sources.py's `SynchronousSource`, not through this pipeline.

Threads: one worker runs the jobs in launch order (the data order and every step's rng stay as in
a synchronous run); JAX dispatch is thread-safe, so its device work interleaves with the
trainer's and its host work (decoding, scoring, loading) overlaps the trainer's device work.
With several processes every process must issue the same programs in the same order, which two
threads cannot promise: there the jobs run inline (same schedule and staleness, no overlap). A
split mesh spanning several processes moves weights and rollouts with `sharding.split.move`
(`jax.device_put` alone refuses meshes of different device sets across processes outside Pathways).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import jax
from jax.sharding import Mesh

from jaxrl_llm.config.spec import SyncSpec
from jaxrl_llm.rollout.batch import BatchLoader, Rollout
from jaxrl_llm.rollout.weights import PolicyWeights
from jaxrl_llm.sharding import rows_sharding
from jaxrl_llm.sharding.split import copy_tree, move, transfer

log = logging.getLogger("jaxrl_llm")

# generate(batch, params, rng, on_rollout_mesh) -> (rollout, generation metrics)
Generate = Callable[[dict, dict, jax.Array, bool], tuple[Rollout, dict[str, float]]]
DEVICE_FIELDS = ("input_ids", "attention_mask", "response_mask", "rollout_log_probs", "token_level_scores")


@dataclasses.dataclass
class Prepared:
    """One step's inputs: its batch and rollout, and where they came from."""

    batch: dict
    rollout: Rollout
    metrics: dict[str, float]
    version: int  # the actor step whose weights generated the rollout
    loader_state: dict[str, Any]  # the data loader's state before this job read its batch (checkpoints resume here)
    gen_s: float  # the job's own wall time (sampling + scoring + loading)


class RolloutPipeline:
    """Prepares each training step's rollout on the `synchronizer` schedule (module docstring): the
    `RolloutSource` of off-policy and split-mesh runs (rollout/sources.py)."""

    synchronous = False

    def __init__(self, sync: SyncSpec, *, policy: PolicyWeights, loader: BatchLoader, generate: Generate,
                 rng_for: Callable[[int], jax.Array], train_mesh: Mesh, rollout_mesh: Mesh | None,
                 total_steps: int):
        self.sync, self.policy, self.loader, self.generate, self.rng_for = sync, policy, loader, generate, rng_for
        self.train_mesh, self.rollout_mesh, self.total_steps = train_mesh, rollout_mesh, total_steps
        self.threaded = sync.sync_offset > 0 and jax.process_count() == 1
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout") if self.threaded else None
        self._pending: dict[int, Future | Prepared] = {}
        self._next_launch: int | None = None
        self._params: dict | None = None
        self._version = -1
        self._exhausted_at: int | None = None
        # checkpoints: the weights of every version a pending job (or the next launch) reads, as
        # (params the jobs read, what a checkpoint stores: the copy, or the adapters with LoRA)
        self._weights: dict[int, tuple[dict, Any]] = {}
        self._launched: dict[int, int] = {}  # pending step -> the version it was launched with
        self._resumed: dict[int, int] = {}  # after a resume: in-flight step -> its version

    @property
    def rollout_params(self) -> dict | None:
        """The weights the next launch generates with (None before the first sync)."""
        return self._params

    def describe(self) -> str:
        s = self.sync
        where = (f"rollout mesh {dict(self.rollout_mesh.shape)} on devices "
                 f"{[d.id for d in self.rollout_mesh.devices.flat]}" if self.rollout_mesh is not None
                 else "the training devices")
        mode = "background thread" if self.threaded else "inline"
        return (f"synchronizer: sync_interval={s.sync_interval}, sync_offset={s.sync_offset} (staleness <= "
                f"{s.max_staleness}); generation on {where}, {mode}")

    # ------------------------------------------------------------------ the schedule
    def sample(self, batch: dict, rng: jax.Array) -> tuple[Rollout, dict[str, float]]:
        """`batch` sampled now on the policy's current params, on the training mesh (outside the schedule)."""
        return self.generate(batch, self.policy.sampling(), rng, False)

    def take(self, step: int) -> tuple[dict, Rollout, dict[str, float]]:
        """(batch, rollout, metrics) of training step `step`, called before its update. Raises
        StopIteration when the data ran out before this step."""
        if self._next_launch is None or self._next_launch < step:  # the first call (or after a resume)
            self._next_launch = step
        sync_s = 0.0
        if self._version < 0 or step % self.sync.sync_interval == 0:
            start = time.perf_counter()
            self._sync(step)
            sync_s = time.perf_counter() - start
        last = max(step, min(step + self.sync.sync_offset, self.total_steps - 1))  # none past the last step
        while self._next_launch <= last and self._exhausted_at is None:
            self._launch(self._next_launch)
            self._next_launch += 1
        if step not in self._pending and step < self._next_launch and self._exhausted_at is None:
            # a retried step (its first try raised after taking its rollout, e.g. a non-finite stop the
            # caller caught): a fresh job on the current weights, as the synchronous loop reads the next batch
            self._launch(step)
        item = self._result(step)
        staleness = step - item.version
        if staleness > self.sync.max_staleness:  # the schedule's invariant; a bug if it ever fails
            raise AssertionError(f"rollout staleness {staleness} > bound {self.sync.max_staleness}")
        metrics = {**item.metrics, "rollout/staleness": float(staleness), "timing_s/gen_job": item.gen_s,
                   "timing_s/weight_sync": sync_s}
        return item.batch, item.rollout, metrics

    def _sync(self, step: int) -> None:
        """The rollout weights := the actor's (of `step`, before its update)."""
        if self.rollout_mesh is not None:  # device to device onto the rollout mesh's shardings
            params = payload = jax.block_until_ready(transfer(self.policy.sampling(), self.rollout_mesh))
        else:  # a copy of what the update donates (LoRA: the adapters only; the base is shared)
            payload = jax.block_until_ready(copy_tree(self.policy.donated()))
            params = self.policy.rebuild(payload)
        self._params, self._version = params, step
        self._weights[step] = (params, payload)

    def _launch(self, step: int) -> None:
        version = self._resumed.pop(step, self._version)  # a resumed in-flight step: its original weights
        params = self._weights[version][0]
        self._launched[step] = version
        job = lambda: self._job(step, params, version)  # noqa: E731 (binds this launch's weights)
        self._pending[step] = self._executor.submit(job) if self._executor is not None else self._run_inline(job)

    def _run_inline(self, job: Callable[[], Prepared]) -> Future | Prepared:
        try:
            return job()
        except StopIteration as stop:  # surfaces when (and if) that step is taken
            future: Future = Future()
            future.set_exception(stop)
            return future

    def _job(self, step: int, params: dict, version: int) -> Prepared:
        start = time.perf_counter()
        state = copy.deepcopy(self.loader.get_state())
        batch = next(self.loader)
        rollout, metrics = self.generate(batch, params, self.rng_for(step), self.rollout_mesh is not None)
        if self.rollout_mesh is not None:
            rollout = to_mesh(rollout, self.train_mesh)
        jax.block_until_ready([getattr(rollout, f) for f in DEVICE_FIELDS])
        return Prepared(batch, rollout, metrics, version, state, time.perf_counter() - start)

    def _result(self, step: int) -> Prepared:
        entry = self._pending.pop(step, None)
        self._launched.pop(step, None)
        keep = set(self._launched.values()) | set(self._resumed.values()) | {self._version}
        self._weights = {v: w for v, w in self._weights.items() if v in keep}
        if entry is None:
            raise StopIteration
        if isinstance(entry, Future):
            try:
                entry = entry.result()
            except StopIteration:
                self._exhausted_at = step
                self._drop_pending()
                raise
            except RuntimeError as err:  # a StopIteration raised in a worker arrives as this
                if isinstance(err.__cause__, StopIteration):
                    self._exhausted_at = step
                    self._drop_pending()
                    raise StopIteration from None
                raise
        return entry

    def _drop_pending(self) -> None:
        for f in self._pending.values():
            if isinstance(f, Future):
                f.cancel()
        self._pending.clear()
        self._launched.clear()

    # ------------------------------------------------------------------ checkpoints, shutdown
    def loader_state(self, next_step: int) -> dict[str, Any]:
        """The data loader's state to checkpoint after `next_step - 1`: before the batch of the first
        step not yet trained, so a resume generates the in-flight batches again."""
        entry = self._pending.get(next_step)
        if entry is None:
            return self.loader.get_state()
        if isinstance(entry, Future):
            try:
                entry = entry.result()
            except Exception:  # (the error surfaces when the step is taken)
                return self.loader.get_state()
            self._pending[next_step] = entry
        return entry.loader_state

    def checkpoint_weights(self, next_step: int) -> tuple[dict, dict | None]:
        """(JSON record, rollout weights by version) a checkpoint after `next_step - 1` needs for its
        resume to equal the uninterrupted run: the weights of every in-flight job, and the current
        rollout weights when the next step does not sync."""
        in_flight = {step: v for step, v in self._launched.items() if step >= next_step}
        current = self._version if self._version >= 0 and next_step % self.sync.sync_interval else None
        versions = sorted(set(in_flight.values()) | ({current} if current is not None else set()))
        record = {"in_flight": {str(k): v for k, v in sorted(in_flight.items())}, "current": current,
                  "versions": versions}
        return {"pipeline": record}, {str(v): self._weights[v][1] for v in versions} or None

    def _abstract_weights(self, record: dict) -> dict:
        """The layout to restore `checkpoint_weights`' trees onto (the training devices)."""
        if self.rollout_mesh is not None:
            one = self.policy.sampling()
        else:
            one = self.policy.donated()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), one)
        return {str(v): abstract for v in record["versions"]}

    def resume(self, record: dict | None, load_weights: Callable[[dict], dict]) -> None:
        """Restores what `checkpoint_weights` saved: the in-flight steps are launched again on their
        own weights, and the next launches on the current ones until the next sync."""
        if record is None:
            log.warning("the checkpoint holds no rollout weights (a synchronous run's): the in-flight rollouts "
                        "are generated again on the restored weights")
            return
        weights = load_weights(self._abstract_weights(record)) if record["versions"] else {}
        for key, payload in weights.items():
            if self.rollout_mesh is not None:
                params = jax.block_until_ready(transfer(payload, self.rollout_mesh))
            else:
                params = self.policy.rebuild(payload)
            self._weights[int(key)] = (params, payload)
        self._resumed = {int(k): int(v) for k, v in record.get("in_flight", {}).items()}
        if record.get("current") is not None:
            self._version = int(record["current"])
            self._params = self._weights[self._version][0]

    def close(self) -> None:
        """Stops the worker (queued jobs are cancelled; a running one finishes)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._pending.clear()
        self._launched.clear()
        self._weights.clear()


def to_mesh(rollout: Rollout, mesh: Mesh) -> Rollout:
    """The rollout's device arrays moved onto `mesh`, rows split over its batch axes (replicated when
    the rows do not divide them)."""
    fields = DEVICE_FIELDS + (("routing",) if rollout.routing is not None else ())
    moved = {f: move(getattr(rollout, f), rows_sharding(mesh, getattr(rollout, f).shape)) for f in fields}
    return dataclasses.replace(rollout, **moved)
