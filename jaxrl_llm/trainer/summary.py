"""The summary `Trainer` prints at the start of a run: one line per part of the step."""
from __future__ import annotations

import jax
from jax.sharding import Mesh

from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.models.lora import module_groups
from jaxrl_llm.roles.reference import ReferenceRole
from jaxrl_llm.roles.trained import TrainedRole


def run_summary(spec: RunSpec, *, actor: TrainedRole, critic: TrainedRole | None, reference: ReferenceRole | None,
                mesh: Mesh, engine: str, total_steps: int, schedule: str | None = None,
                teacher: str | None = None, reward: str | None = None, vision: str | None = None) -> str:
    """Model (and LoRA), mesh, batch plan, algorithm and reference, rollout engine (`engine`: the
    generator's own line), run dir, the teacher and a judge reward when there are, and the
    synchronizer `schedule` when it is not the synchronous one, and a vision-language policy's tower (`vision`)."""
    m = actor.model_cfg
    lines = [
        f"model: {m.architecture} ({spec.model.path}), "
        f"{actor.num_params / 1e6:.1f}M parameters, {m.num_hidden_layers} layers, hidden {m.hidden_size}"
        + _lora(spec, actor),
        f"mesh: {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"{jax.process_count()} process(es)",
        spec.plan.summary(total_steps, spec.trainer.total_epochs),
        f"estimator: {spec.advantage.adv_estimator}; policy loss: {spec.actor.loss_mode} "
        f"({spec.actor.loss_agg_mode}); critic: {'on' if critic else 'off'}; "
        f"reference: {'off' if reference is None else reference.describe()}",
        engine,
        f"run dir: {spec.trainer.run_dir}; {total_steps} steps",
    ]
    if vision is not None:
        lines.insert(1, vision)
    if teacher is not None:
        lines.append(f"distillation: {teacher}")
    if reward is not None:
        lines.append(f"reward: {reward}")
    if schedule is not None:
        lines.append(schedule)
    return "\n".join(lines)


def _lora(spec: RunSpec, actor: TrainedRole) -> str:
    lora = spec.model.lora
    if lora is None:
        return ""
    present = [m for m in lora.targets if m in module_groups(actor.model_cfg)]  # 'all-linear': this model's
    return (f"; LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(present)}: "
            f"{actor.num_trainable_params / 1e6:.2f}M trainable")
