"""perf/* of an RL step: FLOPs of every pass the step ran (generation, scoring passes, updates, a
teacher's and a judge's passes) at each model's active size, over the step's time and the chips' peak."""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import jax
import numpy as np

from jaxrl_llm.bookkeeping.metrics import forward_pass_flops, per_token_forward_flops, perf_metrics, rollout_step_flops
from jaxrl_llm.models.moe import active_params, active_params_of

if TYPE_CHECKING:
    from jaxrl_llm.config.spec import RunSpec
    from jaxrl_llm.roles.judge import Judge
    from jaxrl_llm.roles.teacher import TeacherRole
    from jaxrl_llm.roles.trained import TrainedRole
    from jaxrl_llm.rollout.batch import Rollout


def step_perf_metrics(spec: RunSpec, rollout: Rollout, times: Mapping[str, float], *, actor: TrainedRole,
                      teacher: TeacherRole | None, teacher_rollout: Rollout | None, judge: Judge | None,
                      peak_flops: float) -> dict[str, float]:
    """perf/* of a step (`perf_metrics`) over `rollout`: the policy's generation, scoring passes
    (reference, recomputed old log-probs, critic values) and updates at its active parameters (a MoE
    policy's top-k experts), plus a distillation teacher's pass over `teacher_rollout` (the rows it
    read: `TeacherRole.rollout_for`) and a generative reward model's (judge's) generation, each at its
    own size (the judge's tokens: the rollout's `reward/num_judge_*_tokens`)."""
    m = actor.model_cfg
    paged = spec.rollout_engine.resolved(spec.plan.response_length,
                                         multi_turn=spec.multi_turn is not None).engine == "paged"
    shared = spec.model.use_remove_padding and spec.model.share_packed_prompts
    passes = int(spec.need_ref) + int(spec.recompute_old_log_probs) + int(spec.critic is not None)
    flops, tokens = rollout_step_flops(
        _lengths_of(rollout), num_params=active_params(m, actor.num_params), num_layers=m.num_hidden_layers,
        hidden_size=m.attention_width, forward_passes=passes,
        training_passes=spec.actor.ppo_epochs + (spec.critic.ppo_epochs if spec.critic else 0),
        paged_prefill=paged, shared_prompts=shared)
    if teacher is not None:
        assert teacher_rollout is not None, "a teacher's pass reads its own view of the rollout"
        t = teacher.model_cfg
        flops += forward_pass_flops(_lengths_of(teacher_rollout), num_params=active_params_of(t, teacher.params),
                                    num_layers=t.num_hidden_layers, hidden_size=t.attention_width,
                                    shared_prompts=shared)
    if judge is not None:
        j, judged = judge.model_cfg, rollout.reward_metrics
        tokens_judged = judged.get("reward/num_judge_prompt_tokens", 0.0) + judged.get(
            "reward/num_judge_response_tokens", 0.0)
        # `rollout_context` of rows of the mean length: a lower bound of the rows' (sum(T^2) >= sum(T)^2 / rows)
        context = (tokens_judged / max(1.0, judged.get("reward/num_judge_rows", 1.0)) + 1.0) / 2.0
        flops += tokens_judged * per_token_forward_flops(active_params_of(j, judge.params), j.num_hidden_layers,
                                                    j.attention_width, context)
    return perf_metrics(times, total_tokens=tokens, flops=flops, num_devices=jax.device_count(),
                        peak_flops=peak_flops)


def _lengths_of(rollout: Rollout) -> dict[str, np.ndarray]:
    """The rows' lengths and groups that `rollout_step_flops` / `forward_pass_flops` read."""
    return {"prompt_lengths": np.asarray(rollout.prompt_lengths),
            "response_lengths": np.asarray(rollout.response_lengths), "group_ids": np.asarray(rollout.group_ids)}
