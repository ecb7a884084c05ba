"""Derived config values (veRL's `${oc.select:...}` interpolations and runtime fills); the batch
arithmetic built from them is `jaxrl_llm.batching.batch_plan`.

All functions take a normalized, type-checked ConfigDict and write the derived values in place.
"""
from __future__ import annotations

import os

import ml_collections

from jaxrl_llm import storage
from jaxrl_llm.config import names
from jaxrl_llm.config.schema import AUTO, ConfigError

# the micro-batch keys that accept AUTO
AUTO_KEYS = ("actor_rollout_ref.actor.ppo_micro_batch_size_per_device",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device",
             "critic.ppo_micro_batch_size_per_device", "critic.forward_micro_batch_size_per_device")



def _fill(section: ml_collections.ConfigDict, key: str, value) -> None:
    if section[key] is None:
        section[key] = value


def synthetic_data_files(cfg: ml_collections.ConfigDict) -> tuple[str, str]:
    """Where the trainer writes the synthetic task (jaxrl_llm.data.synthetic.write_synthetic into
    <default_local_dir>/data): (train.parquet, test.parquet)."""
    root = synthetic_data_dir(cfg)
    return storage.join(root, "train.parquet"), storage.join(root, "test.parquet")


def synthetic_data_dir(cfg: ml_collections.ConfigDict) -> str:
    return storage.join(cfg.trainer.default_local_dir, "data")


def resolve_defaults(cfg: ml_collections.ConfigDict, dp_size: int) -> None:
    """Fills every derived (None) value that does not depend on the dataset size."""
    data, arr, alg = cfg.data, cfg.actor_rollout_ref, cfg.algorithm
    actor, rollout, ref, critic, rm = arr.actor, arr.rollout, arr.ref, cfg.critic, cfg.reward_model
    trainer = cfg.trainer

    _fill(trainer, "default_local_dir", os.path.join("checkpoints", trainer.project_name, trainer.experiment_name))
    if data.synthetic.task is not None:
        train, val = synthetic_data_files(cfg)
        _fill(data, "train_files", train)
        _fill(data, "val_files", val)
    if data.tokenizer is None and arr.model.path is not None and not arr.model.path.startswith("tiny:"):
        data.tokenizer = checkpoint_tokenizer(arr.model.path) or arr.model.path

    if rollout.response_length is None:
        rollout.response_length = data.max_response_length
    elif rollout.response_length != data.max_response_length:
        raise ConfigError(
            f"actor_rollout_ref.rollout.response_length={rollout.response_length} differs from "
            f"data.max_response_length={data.max_response_length}: set data.max_response_length only")

    _fill(actor, "clip_ratio_low", actor.clip_ratio)
    _fill(actor, "clip_ratio_high", actor.clip_ratio)
    sequences_per_mini = (actor.ppo_mini_batch_size * rollout.n if actor.num_mini_batches is None
                          else data.train_batch_size * rollout.n // actor.num_mini_batches)
    if actor.ppo_micro_batch_size_per_device is None and sequences_per_mini % dp_size == 0:
        actor.ppo_micro_batch_size_per_device = sequences_per_mini // dp_size
    for section in (ref, rollout):
        _fill(section, "log_prob_micro_batch_size_per_device", actor.ppo_micro_batch_size_per_device)
        _fill(section, "log_prob_use_dynamic_bsz", actor.use_dynamic_bsz)
        _fill(section, "log_prob_max_token_len_per_device", actor.ppo_max_token_len_per_device)

    _fill(ref, "param_dtype", arr.model.dtype)
    teacher = alg.distillation.teacher
    _fill(teacher, "dtype", arr.model.dtype)
    _fill(actor, "remat_policy", "full" if arr.model.enable_gradient_checkpointing else "none")
    _fill(critic, "remat_policy", "full" if critic.model.enable_gradient_checkpointing else "none")

    _fill(critic, "enable", alg.adv_estimator in names.adv_estimators(needs_values=True))
    _fill(critic.model, "path", arr.model.path)
    _fill(critic, "ppo_mini_batch_size", actor.ppo_mini_batch_size)
    _fill(critic, "ppo_micro_batch_size_per_device", actor.ppo_micro_batch_size_per_device)
    _fill(critic, "forward_micro_batch_size_per_device", critic.ppo_micro_batch_size_per_device)
    _fill(critic, "use_dynamic_bsz", actor.use_dynamic_bsz)
    _fill(critic, "forward_max_token_len_per_device", critic.ppo_max_token_len_per_device)
    _fill(critic, "ppo_epochs", actor.ppo_epochs)
    _fill(critic, "shuffle", actor.shuffle)
    _fill(critic, "loss_agg_mode", actor.loss_agg_mode)

    _fill(rm.reward_kwargs, "max_resp_len", data.max_response_length)
    _fill(rm.model, "input_tokenizer", data.tokenizer)
    _fill(rm, "max_length", data.max_prompt_length + data.max_response_length)
    # the reward model has no memory-planned program: an 'auto' actor size gives it the whole per-device mini-batch
    _fill(rm, "micro_batch_size_per_device", sequences_per_mini // dp_size if actor.ppo_micro_batch_size_per_device
          == AUTO else actor.ppo_micro_batch_size_per_device)

    if data.synthetic.task is not None:
        resolve_total_steps(cfg, data.synthetic.n_train)
    elif trainer.total_training_steps is not None:
        _resolve_optim_steps(cfg, trainer.total_training_steps)


def num_train_batches(cfg: ml_collections.ConfigDict, num_train_samples: int) -> int:
    """Batches per epoch (veRL drops the last partial batch)."""
    n = num_train_samples
    if cfg.data.train_max_samples > 0:
        n = min(n, cfg.data.train_max_samples)
    return n // cfg.data.train_batch_size


def resolve_total_steps(cfg: ml_collections.ConfigDict, num_train_samples: int) -> ml_collections.ConfigDict:
    """Sets trainer.total_training_steps (if unset) and the optimizers' total / warmup steps.

    The trainer calls this once the dataset is loaded (validate_config does it for synthetic data).
    """
    batches = num_train_batches(cfg, num_train_samples)
    if batches == 0:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} is larger than the {num_train_samples} "
            "training prompts: not one full batch per epoch")
    if cfg.trainer.total_training_steps is None:
        cfg.trainer.total_training_steps = batches * cfg.trainer.total_epochs
    _resolve_optim_steps(cfg, cfg.trainer.total_training_steps)
    return cfg


def _resolve_optim_steps(cfg: ml_collections.ConfigDict, total: int) -> None:
    for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        if optim.total_training_steps <= 0:
            optim.total_training_steps = total
        if optim.lr_warmup_steps is None or optim.lr_warmup_steps < 0:  # veRL: < 0 means "use the ratio"
            optim.lr_warmup_steps = int(optim.lr_warmup_steps_ratio * optim.total_training_steps)


def without_rl_step(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`cfg` (changed in place) for a run that takes no RL step (SFT, DPO, batch generation): one mini-batch
    of data.train_batch_size sequences, no critic, and algorithm keys that ask nothing of the batch (no
    groups, no KL), so the RL checks pass whatever the RL keys held."""
    arr = cfg.actor_rollout_ref
    arr.actor.ppo_mini_batch_size = cfg.data.train_batch_size
    arr.actor.ppo_epochs = 1
    cfg.critic.enable = False
    cfg.data.val_batch_size = None
    cfg.data.filter_overlong_prompts = False
    cfg.algorithm.adv_estimator = "reinforce_plus_plus"
    cfg.algorithm.use_kl_in_reward = False
    cfg.algorithm.filter_groups.enable = False
    arr.actor.use_kl_loss = False
    return cfg


def checkpoint_tokenizer(path: str) -> str | None:
    """The tokenizer a checkpoint's run used (its meta's `tokenizer`) when `path` is one of our checkpoints
    (an SFT / RL run's `checkpoints` folder or a step of it), else None: a policy started from a
    checkpoint tokenizes as the run that wrote it did."""
    from jaxrl_llm.checkpoint import is_checkpoint, read_checkpoint_meta

    local = os.path.expanduser(path)
    if storage.is_url(local) or not is_checkpoint(local) or os.path.isfile(os.path.join(local, "config.json")):
        return None
    named = read_checkpoint_meta(local).get("tokenizer")
    return None if not named or named == "None" else str(named)
