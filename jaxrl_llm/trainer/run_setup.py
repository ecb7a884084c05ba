"""Set-up steps of a run that `Trainer.__init__` calls in order, each a function of what it reads: the
memory plan (which resolves 'auto' micro-batch sizes before a model loads), a synthetic task's data
files, and a generative reward model's judge."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh

from jaxrl_llm import storage
from jaxrl_llm.config.spec import RunSpec, SyntheticSpec

if TYPE_CHECKING:
    from jaxrl_llm.rewards.judge import Judge
    from jaxrl_llm.trainer.memory_plan import MemoryPlan


def plan_run_memory(spec: RunSpec, mesh: Mesh, tokenizer: Any, *, is_main: bool) -> tuple[RunSpec, MemoryPlan | None]:
    """`spec` with its 'auto' micro-batch sizes resolved, and the memory plan (printed on the main
    process) when `trainer.memory_plan` is on or a size is 'auto'; else `spec` as it is and None. A step
    that would not fit raises here (trainer/memory_plan.py)."""
    from jaxrl_llm.trainer.memory_plan import check_plan_topology, plan_memory

    if spec.trainer.plan_topology is not None:
        check_plan_topology(spec, mesh)
    if not (spec.trainer.memory_plan or spec.plan.auto_passes):
        return spec, None
    plan = plan_memory(spec, mesh, tokenizer)
    if is_main:
        print(plan.table(), flush=True)
    assert plan.spec is not None  # plan_memory sets it
    return plan.spec, plan


def write_synthetic_data(syn: SyntheticSpec | None, *, is_main: bool) -> None:
    """A synthetic task's train / val files, written once by the main process (kept when both exist);
    every process waits for them."""
    if syn is None:
        return
    from jaxrl_llm.data.synthetic import write_synthetic_files

    if is_main and not (storage.exists(syn.train_path) and storage.exists(syn.val_path)):
        write_synthetic_files(syn.train_path, syn.val_path, syn.task, syn.n_train, syn.n_val,
                              difficulty=syn.difficulty, answer_format=syn.answer_format, seed=syn.seed)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("synthetic data written")


def load_run_judge(spec: RunSpec, mesh: Mesh, rollout_mesh: Mesh | None, tokenizer: Any) -> Judge:
    """The judge of `reward_model.style=generative`, on the rollout devices of a split mesh when
    `judge.on_rollout_devices`, else on the training mesh."""
    from jaxrl_llm.trainer.roles import load_judge

    rm = spec.reward_model
    assert rm is not None and rm.judge is not None
    on = rollout_mesh if rollout_mesh is not None and rm.judge.on_rollout_devices else mesh
    return load_judge(rm.path, rm.judge, policy_model=spec.model, tokenizer=tokenizer, mesh=on,
                      engine=spec.rollout_engine, dtype=rm.dtype, seed=spec.trainer.seed + 2)
