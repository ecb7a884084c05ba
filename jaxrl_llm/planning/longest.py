"""The longest sequence each program of a step fits per device (`launch/train.py --plan --longest`).

For long-reasoning RL the question is not "does this batch fit" but "how long may a response get".
Each probe is the run's own config with `data.max_response_length` set to a candidate length and
every micro-batch at one sequence per device, compiled by the memory plan (planning/memory.py;
on a TPU target, by libtpu). Per program, a bisection over multiples of `step` tokens finds the
longest response whose program still fits the device memory, bounded by the model's context
(`ModelConfig.context_length`) minus the prompt. Probes are shared between the programs (one
compile of each program per probed length).

The probes run on the run's mesh, so `mesh.context` (context parallelism: each sequence's tokens over
that many devices) is in them and in the report. A response beyond the reported length needs a larger
`mesh.context`, fewer bytes per token (bf16 compute, remat, int8 KV) or a smaller prompt.
"""
from __future__ import annotations

import copy
import dataclasses

from ml_collections import ConfigDict

from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.config.schema import ConfigError

PASSES = ("actor", "critic", "ref_log_prob", "old_log_prob", "values")


@dataclasses.dataclass(frozen=True)
class LongestSequence:
    """One program's longest response (tokens) at one sequence per device per micro-batch."""

    program: str
    response_tokens: int  # 0: not even `step` tokens fit
    bound: str  # "memory" (the next step does not fit) or "context" (the model's positions end first)
    total_bytes: int  # per device at that length


@dataclasses.dataclass(frozen=True)
class LongestReport:
    prompt_tokens: int
    step: int
    device_memory: int
    context_parallel: int
    rows: tuple[LongestSequence, ...]

    def table(self) -> str:
        lines = [f"longest response per device (1 sequence per micro-batch, prompt {self.prompt_tokens} tokens, "
                 f"context-parallel size {self.context_parallel}, steps of {self.step} tokens, device memory "
                 f"{self.device_memory / (1 << 30):.2f}G):"]
        for r in self.rows:
            lines.append(f"  {r.program:<14}{r.response_tokens:>9} tokens  ({r.bound}; "
                         f"{r.total_bytes / (1 << 30):.3f}G at that length)")
        return "\n".join(lines)


def _one_sequence_per_device(plan: BatchPlan) -> BatchPlan:
    present = {"actor": plan.actor, "critic": plan.critic, "ref_log_prob": plan.ref_log_prob,
               "old_log_prob": plan.old_log_prob, "values": plan.values}
    for name in PASSES:
        if present[name] is not None:
            plan = plan.with_micro(name, 1)
    return plan


def longest_sequences(cfg: ConfigDict, *, topology: str | None = None, num_slices: int | None = None,
                      step: int = 1024, max_tokens: int = 1 << 20) -> LongestReport:
    """The longest response each program of `cfg`'s step fits per device (see the module docstring).
    `cfg`: a validated config. Needs a device memory: the device's own (GPU / TPU), the TPU target's
    HBM, or `trainer.device_memory_gb`."""
    from jaxrl_llm.config import resolve as resolve_spec
    from jaxrl_llm.planning.memory import Planner, device_memory, planning_context, planning_setup
    from jaxrl_llm.sharding import batch_axis_size
    from jaxrl_llm.sharding.mesh import CONTEXT_AXIS

    if step < 1:
        raise ValueError(f"step={step} must be >= 1")
    target, mesh, tokenizer = planning_setup(cfg, topology, num_slices)
    dp = batch_axis_size(mesh)
    context_size = dict(mesh.shape).get(CONTEXT_AXIS, 1)
    prompt = int(cfg.data.max_prompt_length)

    def spec_for(response: int):
        probe = copy.deepcopy(cfg)
        probe.data.max_response_length = response
        probe.actor_rollout_ref.rollout.response_length = response
        spec = resolve_spec(probe, dp_size=dp)
        return dataclasses.replace(spec, plan=_one_sequence_per_device(spec.plan))

    def analysed(planner: Planner, limit: int) -> dict[str, tuple[bool, int]]:
        plan = planner.spec.plan
        return {p.name: (m.fits(limit), m.total_bytes) for p in planner.programs for m in [planner.analyse(p, plan)]}

    def run() -> LongestReport:
        first = Planner(spec_for(step), mesh, tokenizer)
        limit, _ = device_memory(first.spec)  # a TPU target's HBM inside planning_context, as the plan's
        if limit is None:
            raise ConfigError("the longest-sequence report needs a device memory: a GPU / TPU, a TPU target "
                              "(--topology) or trainer.device_memory_gb")
        probes = {step: analysed(first, limit)}  # response length -> per program (fits, bytes)

        def probe(response: int) -> dict[str, tuple[bool, int]]:
            if response not in probes:
                probes[response] = analysed(Planner(spec_for(response), mesh, tokenizer), limit)
            return probes[response]

        context = first.ctx.actor.cfg.context_length - prompt
        top = max(0, min(context, max_tokens)) // step  # candidates: 1..top steps
        rows = []
        for program in first.programs:
            name = program.name
            if top == 0 or not probe(step)[name][0]:
                rows.append(LongestSequence(name, 0, "memory" if top else "context", probe(step)[name][1]))
                continue
            lo, hi = 1, top  # the last count of steps that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if probe(mid * step)[name][0]:
                    lo = mid
                else:
                    hi = mid - 1
            rows.append(LongestSequence(name, lo * step, "context" if lo == top else "memory",
                                        probe(lo * step)[name][1]))
        return LongestReport(prompt, step, limit, context_size, tuple(rows))

    with planning_context(mesh, target):
        return run()
