"""Training checkpoints: the orbax store, resume resolution and a checkpoint as a model source.

`store.py`: `CheckpointStore` (async, atomic saves of `state` / `data` / `meta` / `rollout`),
resume modes (`find_resume`, veRL's `trainer.resume_mode`), config-change warnings, and finding a
checkpoint by path (`is_checkpoint`, `read_checkpoint_meta`). `policy.py`: a checkpoint's policy as
model params (`load_policy_checkpoint`, `load_lora_checkpoint`) and `register_checkpoint_loader`.
Its own package, below config and trainer (which both use it), so neither imports the other.
"""
from jaxrl_llm.checkpoint.policy import (
    load_lora_checkpoint,
    load_policy_checkpoint,
    lora_base_params,
    register_checkpoint_loader,
)
from jaxrl_llm.checkpoint.store import (
    CHECKPOINT_ERROR_EXIT_CODE,
    ITEMS,
    RESUME_MODES,
    CheckpointError,
    CheckpointSaveError,
    CheckpointStore,
    ResumePoint,
    abstract_like,
    changed_run_keys,
    find_resume,
    is_checkpoint,
    list_steps,
    locate_checkpoint,
    read_checkpoint_meta,
    resolve_resume,
    restore_first_readable,
    restore_resume_point,
    restore_rollout_weights,
    warn_config_changes,
)

__all__ = [
    "CHECKPOINT_ERROR_EXIT_CODE", "ITEMS", "RESUME_MODES", "CheckpointError", "CheckpointSaveError", "CheckpointStore",
    "ResumePoint", "abstract_like", "changed_run_keys",
    "find_resume", "is_checkpoint", "list_steps", "load_lora_checkpoint", "load_policy_checkpoint", "locate_checkpoint",
    "lora_base_params", "read_checkpoint_meta", "register_checkpoint_loader", "resolve_resume",
    "restore_first_readable", "restore_resume_point", "restore_rollout_weights", "warn_config_changes",
]
