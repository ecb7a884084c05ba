"""Checkpoints with orbax: `state` (params, optimizer, critic, step as one pytree), `data` (the
prompt iterator's state), `meta` (JSON: config, KL coefficient, rng, last metrics).

Saving is asynchronous and atomic (orbax writes to a temporary folder and renames it when the save
is complete), so a run killed mid-save leaves the previous checkpoint as the latest. Resume modes
follow veRL's `trainer.resume_mode`: `auto` (latest in the run directory, if any), `disable`,
`resume_path` (the checkpoint given by `trainer.resume_from_path`).
"""
from __future__ import annotations

import base64
import json
import logging
import os
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp

RESUME_MODES = ("auto", "disable", "resume_path")
ITEMS = ("state", "data", "meta")
log = logging.getLogger("jaxrl_llm")


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
    """A thin wrapper over `ocp.CheckpointManager` with the three items the trainer saves."""

    def __init__(self, directory: str, *, max_to_keep: int | None = None, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep if (max_to_keep or 0) > 0 else None,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: Any, meta: Mapping[str, Any]) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(_jsonable({"iterator": data_state})),
                meta=ocp.args.JsonSave(_jsonable(dict(meta))),
            ),
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any, dict]:
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

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) describing `tree`, for a restore onto the same layout."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


def resolve_resume(mode: str, run_dir: str, resume_from_path: str | None) -> tuple[str, int] | None:
    """Which (checkpoint folder, step) to resume from, or None for a fresh start.

    `resume_path` accepts either a step folder (`.../checkpoints/40`) or a checkpoints folder (its
    latest step is taken).
    """
    if mode not in RESUME_MODES:
        raise ValueError(f"trainer.resume_mode={mode!r} is not one of {RESUME_MODES}")
    if mode == "disable":
        return None
    if mode == "auto":
        directory = os.path.join(run_dir, "checkpoints")
        if not os.path.isdir(directory):
            return None
        store = CheckpointStore(directory, async_save=False)
        step = store.latest_step()
        store.close()
        return None if step is None else (directory, step)
    if not resume_from_path:
        raise ValueError("trainer.resume_mode='resume_path' needs trainer.resume_from_path")
    path = os.path.abspath(resume_from_path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"trainer.resume_from_path: no checkpoint folder at {path}")
    base = os.path.basename(path.rstrip("/"))
    if base.isdigit() and all(os.path.isdir(os.path.join(path, item)) for item in ("state", "meta")):
        return os.path.dirname(path), int(base)
    store = CheckpointStore(path, async_save=False)
    step = store.latest_step()
    store.close()
    if step is None:
        raise FileNotFoundError(f"trainer.resume_from_path: {path} holds no complete checkpoint")
    return path, step


# ---------------------------------------------------------------- checkpoints as a model source
def _step_dirs(path: str) -> list[str]:
    return [d for d in os.listdir(path) if d.isdigit() and os.path.isdir(os.path.join(path, d, "state"))]


def is_checkpoint(path: Any) -> bool:
    """A step folder (`.../checkpoints/40`), a checkpoints folder, or a run folder holding one."""
    path = str(path)
    if not os.path.isdir(path):
        return False
    if os.path.isdir(os.path.join(path, "state")) and os.path.isdir(os.path.join(path, "meta")):
        return True
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    return bool(_step_dirs(path))


def _locate(path: Any) -> tuple[str, int]:
    path = os.path.abspath(str(path))
    if os.path.isdir(os.path.join(path, "checkpoints")) and not os.path.isdir(os.path.join(path, "state")):
        path = os.path.join(path, "checkpoints")
    found = resolve_resume("resume_path", "", path)
    assert found is not None
    return found


def read_checkpoint_meta(path: Any) -> dict:
    """The `meta` item (config, KL coefficient, model config, ...) of a checkpoint."""
    directory, step = _locate(path)
    with open(os.path.join(directory, str(step), "meta", "metadata"), encoding="utf-8") as handle:
        return _from_jsonable(json.load(handle))


def load_policy_checkpoint(path: Any, *, dtype: Any = None, **_: Any) -> tuple[Any, dict]:
    """(ModelConfig, policy params on the default device) from a training checkpoint; after
    `register_checkpoint_loader()`, `jaxrl_llm.hf.load_any` (and so `launch/convert_to_hf.py` and
    `jrl.load_model`) accepts it."""
    import jax.numpy as jnp

    from jaxrl_llm.models import ModelConfig

    meta = read_checkpoint_meta(path)
    if "model_config" not in meta:
        raise ValueError(f"checkpoint {path}: its meta has no model_config (written by an older jaxrl_llm)")
    directory, step = _locate(path)
    manager = ocp.CheckpointManager(directory, item_names=ITEMS,
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    tree_meta = manager.item_metadata(step)["state"]
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree_meta)
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    manager.close()
    params = state["actor"]["params"]
    if dtype is not None:
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return ModelConfig.from_hf_config(meta["model_config"]), params


def register_checkpoint_loader() -> None:
    """Let `jaxrl_llm.hf.load_any` read training checkpoints (tried before HF folders). Idempotent:
    callers that may get a checkpoint path call it before `load_any`."""
    from jaxrl_llm.hf import register_loader

    register_loader("checkpoint", is_checkpoint, load_policy_checkpoint)
