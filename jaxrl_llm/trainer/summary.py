"""The summary `Trainer` prints at the start of a run: one line per part of the step."""
from __future__ import annotations

from typing import Any

import jax

from jaxrl_llm.trainer.reference import is_offloaded


def run_summary(trainer: Any) -> str:
    """Model (and LoRA), mesh, batch plan, algorithm and reference, rollout engine, run dir, and the
    synchronizer schedule when it is not the synchronous one."""
    spec, m = trainer.spec, trainer.actor.model_cfg
    lines = [
        f"model: {m.architecture} ({spec.model.path}), "
        f"{trainer.actor.num_params / 1e6:.1f}M parameters, {m.num_hidden_layers} layers, hidden {m.hidden_size}"
        + _lora(trainer),
        f"mesh: {dict(trainer.mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"{jax.process_count()} process(es)",
        spec.plan.summary(trainer.total_steps, spec.trainer.total_epochs),
        f"estimator: {spec.advantage.adv_estimator}; policy loss: {spec.actor.loss_mode} "
        f"({spec.actor.loss_agg_mode}); critic: {'on' if trainer.critic else 'off'}; "
        f"reference: {_reference(trainer)}",
        trainer.generator.describe_engine(spec.plan.prompts * spec.plan.n, spec.plan.max_prompt_length,
                                          spec.plan.response_length),
        f"run dir: {trainer.run_dir}; {trainer.total_steps} steps",
    ]
    if not trainer.pipeline.passthrough:
        lines.append(trainer.pipeline.describe())
    return "\n".join(lines)


def _lora(trainer: Any) -> str:
    lora = trainer.spec.model.lora
    if lora is None:
        return ""
    return (f"; LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}: "
            f"{trainer.actor.num_trainable_params / 1e6:.2f}M trainable")


def _reference(trainer: Any) -> str:
    if trainer.ref_params is None:
        return "off"
    if trainer.actor.frozen is not None:
        return "on (the LoRA base, adapters off; no copy)"
    where = "pinned host" if is_offloaded(trainer.ref_params) else "device"
    return f"on ({trainer.spec.ref.param_dtype}, {where} memory)"
