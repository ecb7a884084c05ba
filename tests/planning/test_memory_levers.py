"""What the memory plan changes by itself when a step does not fit at any micro-batch size
(`trainer.memory_levers`, planning/levers.py): the cheapest lever that shrinks what does not fit
is pulled, one that does not help is dropped, the run trains with the keys the plan set, and without
the levers the same step is refused naming them. Device memory limits are set between real compiled
byte counts of the tiny model (8 CPU devices), so each test fails without its lever."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_memory_plan import AUTO, PEAK, _spec, program_totals

from jaxrl_llm.planning.levers import LEVERS, fit_with_levers
from jaxrl_llm.planning.memory import plan_memory
from jaxrl_llm.planning.report import GiB, MemoryPlanError
from jaxrl_llm.trainer.build import plan_run_memory

TWO_LAYERS = {**AUTO, "actor_rollout_ref.model.tiny.num_hidden_layers": 2}  # AUTO: remat_policy none


def _with_limit(spec, limit: float, levers=None):
    trainer = dataclasses.replace(spec.trainer, device_memory_gb=limit / GiB,
                                  **({} if levers is None else {"memory_levers": tuple(levers)}))
    return dataclasses.replace(spec, trainer=trainer)


def test_an_update_that_fits_no_micro_batch_turns_remat_on(tmp_path):
    spec, mesh, tok = _spec(tmp_path, **TWO_LAYERS)
    assert spec.actor.remat == "none" and spec.trainer.memory_levers[-1] == "remat"
    kept = program_totals(spec, mesh, tok)
    remat = program_totals(dataclasses.replace(spec, actor=dataclasses.replace(spec.actor, remat="full")), mesh, tok)
    assert remat["update_actor"] < kept["update_actor"]  # two layers' activations recomputed, not kept
    limit = (remat["update_actor"] + kept["update_actor"]) // 2
    assert kept["sample"] < limit  # only the update is over: host offload of the optimizer state cannot help

    run_spec, plan = plan_run_memory(_with_limit(spec, limit), mesh, tok, is_main=False)
    assert plan is not None and plan.levers == ("actor_rollout_ref.actor.remat_policy=full",)
    # optimizer_offload, tried first, shrank nothing over the limit: dropped
    assert run_spec.actor.remat == "full" and not run_spec.actor_optim.offload
    assert run_spec.plan.actor.micro.per_device == 1 and not run_spec.plan.auto_passes
    assert "auto: actor_rollout_ref.actor.remat_policy=full (trainer.memory_levers" in plan.table()
    # what loggers and checkpoints record as the run's config (a resume compares it)
    assert json.loads(run_spec.config_json)["actor_rollout_ref"]["actor"]["remat_policy"] == "full"

    with pytest.raises(MemoryPlanError) as err:  # the same step with no lever to pull
        plan_memory(_with_limit(spec, limit, levers=()), mesh, tok, peak_flops=PEAK)
    message = str(err.value)
    assert "program 'update_actor'" in message and "ppo_micro_batch_size_per_device=1 does not fit" in message
    assert "levers trainer.memory_levers does not list: " in message and "remat: each decoder block" in message


def test_a_sampler_over_by_the_optimizer_state_offloads_it(tmp_path):
    # 16 samples a prompt: the sampler (all 32 rows per device at once) outgrows the update at micro 1
    spec, mesh, tok = _spec(tmp_path, **{**TWO_LAYERS, "actor_rollout_ref.actor.remat_policy": "full",
                                         "actor_rollout_ref.rollout.n": 16})
    on_device = program_totals(spec, mesh, tok)
    offload = dataclasses.replace(spec, actor_optim=dataclasses.replace(spec.actor_optim, offload=True))
    offloaded = program_totals(offload, mesh, tok)
    assert on_device["update_actor"] < offloaded["sample"] < on_device["sample"]  # by the optimizer state
    limit = (offloaded["sample"] + on_device["sample"]) // 2

    plan = plan_memory(_with_limit(spec, limit), mesh, tok, peak_flops=PEAK)
    assert plan.levers == ("actor_rollout_ref.actor.optim.offload=True",)
    assert plan.spec is not None and plan.spec.actor_optim.offload and plan.program("sample").total_bytes <= limit
    with pytest.raises(MemoryPlanError, match="program 'sample'.*optimizer_offload"):
        plan_memory(_with_limit(spec, limit, levers=("remat",)), mesh, tok, peak_flops=PEAK)


def test_levers_are_tried_cheapest_first_and_kept_only_when_they_help(tmp_path):
    """`fit_with_levers` on made-up excess figures: each lever's effect known, no compile."""
    spec, _, _ = _spec(tmp_path, **{**TWO_LAYERS, "actor_rollout_ref.actor.use_kl_loss": True})
    effect = {"ref_offload": 0, "optimizer_offload": 30, "remat": 50, "bf16_moments": 40}  # bytes each one saves

    def excess(s) -> int:
        saved = (effect["ref_offload"] * s.ref.param_offload + effect["optimizer_offload"] * s.actor_optim.offload
                 + effect["remat"] * (s.actor.remat == "full") + effect["bf16_moments"] * (
                     s.actor_optim.moment_dtype == "bfloat16"))
        return max(100 - saved, 0)

    fitted = fit_with_levers(spec, ("ref_offload", "teacher_offload", "optimizer_offload", "remat", "bf16_moments"),
                             lambda s: s, excess)
    # ref_offload saved nothing: dropped; teacher_offload: no teacher; then offload, remat, and bf16 moments
    # for the last 20 bytes
    assert fitted.pulled == ("actor_rollout_ref.actor.optim.offload=True", "actor_rollout_ref.actor.remat_policy=full",
                             "actor_rollout_ref.actor.optim.moment_dtype=bfloat16")
    assert not fitted.spec.ref.param_offload and excess(fitted.spec) == 0
    optim = json.loads(fitted.spec.config_json)["actor_rollout_ref"]["actor"]["optim"]
    assert optim["offload"] is True and optim["moment_dtype"] == "bfloat16"
    effect["remat"] = 80  # enough with the offload: bf16 moments (which change the numbers) stay off
    fitted = fit_with_levers(spec, tuple(LEVERS), lambda s: s, excess)
    assert fitted.spec.actor_optim.moment_dtype == "float32" and fitted.left == ()
    # the default list leaves bf16 moments to the user: the error names it
    fitted = fit_with_levers(spec, spec.trainer.memory_levers, lambda s: s, lambda s: 1)
    assert [text.split(":")[0] for text in fitted.left] == ["bf16_moments"]
