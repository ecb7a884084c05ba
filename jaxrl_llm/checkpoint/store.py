"""Checkpoints with orbax: `state` (params, optimizer, critic, step as one pytree), `data` (the
prompt iterator's state), `meta` (JSON: config, KL coefficient, rng, last metrics), and with an
off-policy `synchronizer` `rollout` (the weights the in-flight rollouts were launched with, by
version: rollout/pipeline.py), so that a resumed pipelined run equals the uninterrupted one.

Saving is asynchronous and atomic (orbax writes to a temporary folder and renames it when the save
is complete; on a bucket it writes a commit marker last), so a run killed mid-save leaves the
previous checkpoint as the latest; the leftover temporary folder is removed when the next run
opens the store. Resume modes follow veRL's `trainer.resume_mode`: `auto` (latest in the run
directory, if any), `disable` (a fresh run: an error if the run directory already holds
checkpoints), `resume_path` (the checkpoint given by `trainer.resume_from_path`). A latest
checkpoint that cannot be read falls back to the previous one with a warning. Paths may be local
or `gs://` URLs (jaxrl_llm/storage.py).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
from typing import Any, Callable, Iterator, Mapping

import jax
import orbax.checkpoint as ocp

from jaxrl_llm import storage
from jaxrl_llm.arrays import ArrayTree
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.storage import PathLike

ITEMS = ("state", "data", "meta", "rollout")
RESUME_MODES = ("auto", "disable", "resume_path")  # veRL's trainer.resume_mode
log = logging.getLogger("jaxrl_llm")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no checkpoint of a resume could be read."""


class CheckpointSaveError(CheckpointError):
    """An asynchronous save failed in orbax's background threads (a full disk, a bucket refusing writes):
    the run cannot commit checkpoints. The message names the step, the folder and the storage's error."""


# launch/train.py's exit status for a save that failed: storage's (sysexits.h EX_IOERR; a crash is 1, preemption 75)
CHECKPOINT_ERROR_EXIT_CODE = storage.STORAGE_ERROR_EXIT_CODE


class _SaveThreadErrors(logging.Filter):
    """Drops orbax's own ERROR records that carry a traceback (a failed background save logs one per thread:
    the writer, the metadata writer, the commit, the finalize): orbax raises the same error again at its next
    call, which the store turns into one `CheckpointSaveError` line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname
                    and (record.exc_info is not None or "raised an exception" in record.getMessage()))


logging.getLogger("absl").addFilter(_SaveThreadErrors())


def _jsonable(value: Any) -> Any:
    """grain iterator states may hold bytes; JSON cannot, so they travel base64-encoded."""
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _from_jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {k: _from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_jsonable(v) for v in value]
    return value


class CheckpointStore:
    """A thin wrapper over `ocp.CheckpointManager` with the three items the trainer saves.

    read_only: only list and restore (no folder is created, nothing is cleaned); the caller does
    not save through it.
    """

    def __init__(self, directory: str, *, max_to_keep: int | None = None, async_save: bool = True,
                 read_only: bool = False):
        self.directory = storage.normalize(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep if (max_to_keep or 0) > 0 else None,
            enable_async_checkpointing=async_save,
            create=not read_only,
            # a run killed mid-save leaves a temporary step folder; remove it when the store opens
            cleanup_tmp_directories=not read_only,
        )
        self._manager = ocp.CheckpointManager(storage.as_path(self.directory), options=options, item_names=ITEMS)
        self._pending: int | None = None  # the step of the last save started and not yet known committed
        self._failed: CheckpointSaveError | None = None

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: ArrayTree, data_state: Any, meta: Mapping[str, Any], rollout: Any = None) -> None:
        """Starts an (async) save of `step` (`rollout`: the pipeline's rollout weights, if any).
        Raises `CheckpointError` when orbax declines it: it never saves a step at or below the
        latest one it holds, and a skipped save is lost work."""
        items = dict(state=ocp.args.StandardSave(state),
                     data=ocp.args.JsonSave(_jsonable({"iterator": data_state})),
                     meta=ocp.args.JsonSave(_jsonable(dict(meta))))
        if rollout is not None:
            items["rollout"] = ocp.args.StandardSave(rollout)
        self.check()
        with self._reporting():
            saved = self._manager.save(step, args=ocp.args.Composite(**items))
        self._pending = step
        if not saved:
            latest = self._manager.latest_step()
            raise CheckpointError(
                f"checkpoint of step {step} was not written: {self.directory} already holds step {latest} "
                "(orbax saves only steps after the latest). Use a new trainer.default_local_dir, or resume "
                "that run with trainer.resume_mode=auto")

    def restore(self, step: int, abstract_state: ArrayTree) -> tuple[Any, Any, dict]:
        """Restore onto the shardings/dtypes of `abstract_state` (a tree of ShapeDtypeStruct)."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        data = _from_jsonable(restored["data"])["iterator"]
        return restored["state"], data, _from_jsonable(restored["meta"])

    def restore_rollout(self, step: int, abstract: ArrayTree) -> ArrayTree:
        """The `rollout` item of `step`, onto `abstract`'s layout."""
        restored = self._manager.restore(step, args=ocp.args.Composite(rollout=ocp.args.StandardRestore(abstract)))
        return restored["rollout"]

    def delete(self, step: int) -> None:
        self._manager.delete(step)

    def check(self) -> None:
        """Raises `CheckpointSaveError` if an earlier async save failed (without waiting for one in flight):
        the trainer calls it every step, so a failed save stops the run at once rather than at the next save."""
        if self._failed is not None:
            raise self._failed
        with self._reporting():
            self._manager.check_for_errors()

    def wait(self) -> None:
        """Blocks until the last async save is committed (raises `CheckpointSaveError` if it failed)."""
        if self._failed is not None:
            raise self._failed
        with self._reporting():
            self._manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        """Waits for the last save, then closes orbax's threads, after a failed save too (no thread is left
        writing at interpreter exit). Raises `CheckpointSaveError` if the last save failed unnoticed so far;
        a failure already raised (by `check`, `save` or `wait`) is not raised again."""
        try:
            if self._failed is None:
                self.wait()
        finally:
            try:
                self._manager.close()
            except Exception as err:  # the failed save's error once more: already raised to the caller
                if self._failed is None:
                    raise
                log.debug("closing the checkpoint manager after a failed save: %s", err)

    @contextlib.contextmanager
    def _reporting(self) -> Iterator[None]:
        """Turns the error of a failed background save (raised by orbax's next call) into `CheckpointSaveError`."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as err:  # orbax re-raises the writer thread's error: tensorstore's ValueError, OSError...
            step = "" if self._pending is None else f" of step {self._pending}"
            self._failed = CheckpointSaveError(f"the save{step} to {self.directory} failed: {storage.reason(err)}; "
                                               f"the last committed checkpoint is step {self._committed()}")
            raise self._failed from None

    def _committed(self) -> str:
        steps = [s for s in self._manager.all_steps() if s != self._pending]
        return str(max(steps)) if steps else "none"


def abstract_like(tree: ArrayTree) -> ArrayTree:
    """ShapeDtypeStructs (with shardings) describing `tree`, for a restore onto the same layout."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


def list_steps(directory: str) -> list[int]:
    """Complete checkpoint steps in a checkpoints folder (ascending); [] when there is none. A listing of
    the folder (orbax's test of a committed step), not a `CheckpointManager`: a manager's constructor
    synchronises every process, and with several processes one may see the folder (another process just
    created it for this run) where one that came earlier did not; their barriers then no longer pair up."""
    if not storage.is_dir(directory):
        return []
    return sorted(ocp.utils.checkpoint_steps(storage.as_path(directory)))


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run resumes: a checkpoints folder and the steps to try, newest first (the chosen
    step, then older ones to fall back on when it cannot be read)."""

    directory: str
    steps: tuple[int, ...]

    @property
    def step(self) -> int:
        return self.steps[0]


def _is_step_folder(path: str) -> bool:
    name = storage.split(path)[1]
    return name.isdigit() and all(storage.is_dir(storage.join(path, item)) for item in ("state", "meta"))


def find_resume(mode: str, run_dir: str, resume_from_path: str | None) -> ResumePoint | None:
    """Where to resume from (None: a fresh start), after checking that the run dir can take this
    run's checkpoints. User errors are one `ConfigError` naming the key and how to proceed.

    `resume_path` accepts a step folder (`.../checkpoints/40`: that step exactly, no fallback) or a
    checkpoints folder (its latest step, falling back to older ones).
    """
    if mode not in RESUME_MODES:
        raise ValueError(f"trainer.resume_mode={mode!r} is not one of {RESUME_MODES}")
    own_dir = storage.join(storage.normalize(run_dir), "checkpoints") if run_dir else None
    own_steps = list_steps(own_dir) if own_dir else []
    if mode == "disable":
        if own_steps:
            raise ConfigError(
                f"trainer.resume_mode='disable': {own_dir} already holds checkpoints (steps {_steps(own_steps)}) "
                "of an earlier run. To continue that run set trainer.resume_mode=auto; to start a new run set "
                f"trainer.default_local_dir to a new folder (or delete {own_dir})")
        return None
    if mode == "auto":
        return ResumePoint(own_dir, tuple(reversed(own_steps))) if own_dir and own_steps else None
    if not resume_from_path:
        raise ConfigError("trainer.resume_from_path=None: required when trainer.resume_mode='resume_path'")
    path = storage.normalize(resume_from_path)
    if not storage.is_dir(path):
        raise FileNotFoundError(f"trainer.resume_from_path: no checkpoint folder at {path}")
    if _is_step_folder(path):
        directory, base = storage.split(path)
        point = ResumePoint(directory, (int(base),))
    else:
        steps = list_steps(path)
        if not steps:
            raise FileNotFoundError(f"trainer.resume_from_path: {path} holds no complete checkpoint")
        point = ResumePoint(path, tuple(reversed(steps)))
    if own_dir is not None and own_steps:
        if point.directory != own_dir:
            raise ConfigError(
                f"trainer.resume_from_path={resume_from_path!r}: the run dir's {own_dir} already holds checkpoints "
                f"(steps {_steps(own_steps)}) of another run, and saving this run there would mix the two. Set "
                "trainer.default_local_dir to a new folder, or continue that run with trainer.resume_mode=auto")
        later = [s for s in own_steps if s > point.step]
        if later:
            raise ConfigError(
                f"trainer.resume_from_path={resume_from_path!r}: {own_dir} also holds later steps "
                f"{_steps(later)}, so this run's saves would be refused. Delete those step folders to roll back "
                f"to step {point.step}, or set trainer.default_local_dir to a new folder")
    return point


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, ..., {steps[-1]}"


def resolve_resume(mode: str, run_dir: str, resume_from_path: str | None) -> tuple[str, int] | None:
    """(checkpoint folder, step) of `find_resume`, or None for a fresh start."""
    point = find_resume(mode, run_dir, resume_from_path)
    return None if point is None else (point.directory, point.step)


def restore_rollout_weights(store: CheckpointStore, directory: str, step: int, abstract: ArrayTree) -> ArrayTree:
    """`CheckpointStore.restore_rollout` of `directory`'s `step` (a read-only store when it is not `store`'s)."""
    source = store if storage.normalize(directory) == store.directory else CheckpointStore(directory, read_only=True)
    try:
        return source.restore_rollout(step, abstract)
    finally:
        if source is not store:
            source.close()


def restore_first_readable(store: CheckpointStore, steps: tuple[int, ...],
                           load: Callable[[int], Any]) -> tuple[int, Any]:
    """`load(step)` for the first of `steps` that can be read; an unreadable (corrupt or partial)
    checkpoint is skipped with a warning naming it. Raises `CheckpointError` when none can be read."""
    errors = []
    for i, step in enumerate(steps):
        try:
            return step, load(step)
        except Exception as err:  # orbax / tensorstore / JSON raise many types for a damaged folder
            errors.append(f"step {step}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            nxt = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "no older checkpoint left"
            log.warning("checkpoint %s/%d cannot be read (%s); %s", store.directory, step, errors[-1], nxt)
    raise CheckpointError(f"no checkpoint in {store.directory} could be read: " + "; ".join(errors))


def restore_resume_point(store: CheckpointStore, point: ResumePoint,
                         abstract_state: ArrayTree) -> tuple[int, Any, Any, dict]:
    """(step, state, data state, meta) of the newest readable step of `point` (restored onto
    `abstract_state`'s layout), opening a read-only store when it lies outside `store`'s folder."""
    source = store if point.directory == store.directory else CheckpointStore(point.directory, read_only=True)

    def load(step: int) -> tuple[Any, Any, dict]:
        state, data_state, meta = source.restore(step, abstract_state)
        # a meta without these is as unreadable as a missing array
        int(meta["global_step"])
        if "kind" not in meta:  # an RL run's KL controller (an SFT / DPO run's meta has a kind and none)
            float(meta["kl_coef"])
        return state, data_state, meta

    try:
        step, (state, data_state, meta) = restore_first_readable(source, point.steps, load)
    finally:
        if source is not store:
            source.close()
    if source is store:
        # orbax saves only steps after its latest: unreadable newer steps would refuse every save
        for bad in [s for s in point.steps if s > step]:
            log.warning("removing unreadable checkpoint %s/%d (resumed from step %d instead)",
                        store.directory, bad, step)
            store.delete(bad)
    return step, state, data_state, meta


def warn_config_changes(saved: Mapping[str, Any] | None, current: Mapping[str, Any], *, where: str) -> list[str]:
    """Warns (one message, one line per key) when the config that wrote a checkpoint differs from
    the current one in keys that alter the run; returns those lines."""
    if not saved:
        return []
    changed = changed_run_keys(saved, current)
    if changed:
        log.warning("resuming %s with a config that differs in %d key(s) that alter the run:\n  %s",
                    where, len(changed), "\n  ".join(changed))
    return changed


# Keys that say where and how a run is recorded or laid out, not what it computes: changing them on
# resume is expected and not reported.
RECORD_KEYS = (
    "trainer.logger", "trainer.project_name", "trainer.experiment_name", "trainer.default_local_dir",
    "trainer.resume_mode", "trainer.resume_from_path", "trainer.save_freq", "trainer.test_freq",
    "trainer.val_before_train", "trainer.val_only", "trainer.log_val_generations", "trainer.rollout_data_dir",
    "trainer.validation_data_dir", "trainer.export_hf", "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep", "mesh", "data.dataloader_num_workers", "data.filter_overlong_prompts_workers",
)


def _flatten(tree: ArrayTree, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def changed_run_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`key: old -> new` for every config key whose change alters the run (seed, batch sizes, data,
    model, algorithm, optimizer, ...) between a checkpoint's config and the current one."""
    old, new = _flatten(saved), _flatten(current)
    ignored = RECORD_KEYS
    if old.get("data.synthetic.task") is not None and new.get("data.synthetic.task") is not None:
        # synthetic files live in the run dir; data.synthetic.* says what they hold
        ignored = ignored + ("data.train_files", "data.val_files")
    for section in ("critic", "reward_model"):  # a section switched off in both runs computes nothing
        if old.get(f"{section}.enable") is False and new.get(f"{section}.enable") is False:
            ignored = ignored + (section,)
    out = []
    for key in sorted(set(old) | set(new)):
        if any(key == k or key.startswith(k + ".") for k in ignored):
            continue
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if a != b:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


# ---------------------------------------------------------------- finding a checkpoint by path
def _step_dirs(path: str) -> list[str]:
    return [p.name for p in storage.as_path(path).iterdir()
            if p.name.isdigit() and storage.is_dir(storage.join(path, p.name, "state"))]


def is_checkpoint(path: PathLike) -> bool:
    """A step folder (`.../checkpoints/40`), a checkpoints folder, or a run folder holding one."""
    path = storage.normalize(path)
    if not storage.is_dir(path):
        return False
    if storage.is_dir(storage.join(path, "state")) and storage.is_dir(storage.join(path, "meta")):
        return True
    if storage.is_dir(storage.join(path, "checkpoints")):
        path = storage.join(path, "checkpoints")
    return bool(_step_dirs(path))


def locate_checkpoint(path: PathLike) -> tuple[str, int]:
    """(checkpoints folder, step) of a step folder, a checkpoints folder or a run folder (its latest step)."""
    path = storage.normalize(path)
    if storage.is_dir(storage.join(path, "checkpoints")) and not storage.is_dir(storage.join(path, "state")):
        path = storage.join(path, "checkpoints")
    found = resolve_resume("resume_path", "", path)
    assert found is not None
    return found


def read_checkpoint_meta(path: PathLike) -> dict:
    """The `meta` item (config, KL coefficient, model config, ...) of a checkpoint."""
    directory, step = locate_checkpoint(path)
    return _from_jsonable(json.loads(storage.read_text(storage.join(directory, str(step), "meta", "metadata"))))
