"""What an RL run's checkpoint holds and how a resume puts it back (the trainer's `save_checkpoint` and
resume call these; jaxrl_llm/checkpoint.py stores and reads the files).

A checkpoint holds each trained role's params and optimizer state, the prompt loader's position, the
in-flight rollouts' weights of an off-policy pipeline, and a meta record: the step, the adaptive KL
coefficient, the model's HF config, the tokenizer, the base PRNG key, the config (a resume warns about
what changed) and, for LoRA, the adapters' shape and base. The reference policy is not saved: it is the
initial policy, loaded again from model.path.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import jax
import numpy as np

from jaxrl_llm import checkpoint as ckpt
from jaxrl_llm.trainer.build import Run


def trained_state(run: Run) -> dict[str, Any]:
    """The trained state a checkpoint holds: each trained role's params and optimizer state."""
    state = {"actor": {"params": run.actor.params, "opt_state": run.actor.opt_state}}
    if run.critic is not None:
        state["critic"] = {"params": run.critic.params, "opt_state": run.critic.opt_state}
    return state


def checkpoint_meta(run: Run, global_step: int) -> dict[str, Any]:
    """The meta record of the checkpoint of step `global_step` (module doc)."""
    meta = {"global_step": global_step, "kl_coef": float(run.kl_ctrl.value),
            "model_config": run.actor.model_cfg.to_hf_config(),
            "tokenizer": str(run.spec.data.tokenizer),
            "rng": np.asarray(jax.random.key_data(run.base_rng)).tolist(),
            "config": json.loads(run.spec.config_json)}
    lora = run.spec.model.lora
    if lora is not None:  # the state holds only the adapters: they apply to this base
        meta["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.targets),
                        "dropout": lora.dropout, "base_path": run.spec.model.path}
    return meta


def restore_trained(run: Run, point: ckpt.ResumePoint) -> tuple[int, int]:
    """Puts the newest readable checkpoint of `point` (a damaged one falls back, with a warning) back into
    `run`: the trained roles, the loader, the in-flight rollouts and the KL coefficient; warns about config
    changes. (the checkpoint's step, the global step it records)."""
    step, state, data_state, meta = ckpt.restore_resume_point(run.store, point, ckpt.abstract_like(trained_state(run)))
    run.actor.params, run.actor.opt_state = state["actor"]["params"], state["actor"]["opt_state"]
    if run.critic is not None:
        run.critic.params, run.critic.opt_state = state["critic"]["params"], state["critic"]["opt_state"]
    run.train_loader.set_state(data_state)
    # an off-policy pipeline's in-flight rollouts restart on their own saved weights
    run.rollout_source.resume(meta.get("pipeline"), functools.partial(
        ckpt.restore_rollout_weights, run.store, point.directory, step))
    run.kl_ctrl.value = float(meta["kl_coef"])
    ckpt.warn_config_changes(meta.get("config"), json.loads(run.spec.config_json), where=f"{point.directory}/{step}")
    return step, int(meta["global_step"])
