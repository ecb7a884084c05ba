"""Multi-turn rollouts streamed through the continuous-batching engine: a trajectory whose tools (or
environment) are still running waits alone while the others keep decoding.

    serve = lambda source: engine.serve(params, source, rng, knobs, settings)   # sampler/engine
    result = run_multi_turn_streaming(trajectories, serve, limits=TurnLimits(max_response_length=512),
                                      tools=load_tools(path), max_parallel_calls=8, tool_timeout_s=30)

`TrajectorySource` is the engine's `RequestSource`. Each generation of trajectory k is one engine
request: its whole token prefix (the prompt, or the conversation so far: earlier turns are never
re-tokenized), key (k, turn) and the trajectory's own token budget. When the engine hands the
generation back (`finished`, between two decode calls) the turn is recorded with the same per-turn
steps as the round-based `run_multi_turn` (agents/driver.py); its tool calls, or its environment
step, go to a `JobRunner`, and `poll` turns every trajectory whose replies are all in into its
next request. Requests with the same prefix in one poll (the n samples of a prompt) share one
prefill. Nothing waits for a round: a slot freed by a trajectory that called a tool is refilled at
once from the queue, and its continuation joins the queue when the tool answers.

Samples depend only on (rng, trajectory, turn, token index), not on when a tool answered or which
slot a request landed in, so the rollout is the same whatever the tool timings.

Environments step on the runner too (an LLM judge or a simulated user can be slow), with the
tools' timeout: an environment step that times out ends its trajectory ("env_timeout"); one that
raises is a bug in the environment and is raised here. With several processes the trainer uses the
round-based driver instead: the order in which tools answer differs between hosts, and every
process must schedule the engine identically.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.agents.driver import (
    Generated,
    MultiTurnResult,
    ToolJob,
    Tools,
    TurnOutcome,
    add_env_reply,
    add_tool_replies,
    check_call_limits,
    finish_result,
    finish_tools,
    next_turn_budget,
    record_tool_result,
    start_tools,
)
from jaxrl_llm.agents.job_runner import JobRunner
from jaxrl_llm.agents.tool_base import BaseTool
from jaxrl_llm.agents.trajectory import Trajectory, TurnLimits
from jaxrl_llm.sampler import FINISH_REASONS
from jaxrl_llm.sampler.engine import EngineRequest

# a job's name: ("env", trajectory, turn) or ("tool", trajectory, turn, call slot)
JobKey = tuple[Any, ...]


class TrajectorySource:
    """`RequestSource` of multi-turn trajectories (see the module docstring)."""

    def __init__(self, trajs: Sequence[Trajectory], *, limits: TurnLimits, tools: Tools,
                 runner: JobRunner[JobKey], record_routing: bool = False) -> None:
        self.trajs, self.limits, self.tools, self.runner = list(trajs), limits, tools, runner
        self.record_routing = record_routing  # each request replays its trajectory's experts so far
        self.ready: list[int] = list(range(len(self.trajs)))  # trajectories due for their next request
        self.waiting: dict[int, TurnOutcome] = {}  # trajectory -> its turn, while calls are out
        self.outstanding: dict[int, int] = {}  # trajectory -> calls not answered yet
        self.jobs: dict[JobKey, ToolJob] = {}
        self.groups = itertools.count()

    # ------------------------------------------------------------------ RequestSource
    def poll(self) -> list[EngineRequest]:
        self._collect(self.runner.poll())
        out, shared = [], {}
        for k in self.ready:
            t = self.trajs[k]
            budget = next_turn_budget(t, self.limits)
            if budget is None:
                continue
            ids = t.ids
            routing = t.prefix_routing() if self.record_routing else None
            images = t.prefix_images()
            # one prefill per prefix: the same ids and, when replaying, the same experts; with images, the same
            # pictures too (their tokens' ids do not tell two pictures of one size apart)
            same = (tuple(ids), None if routing is None else routing.tobytes(),
                    None if images is None else id(t.prompt_images))
            group = shared.setdefault(same, next(self.groups))
            out.append(EngineRequest(ids, (k, t.assistant_turns), group, budget, routing, images))
        self.ready = []
        return out

    def finished(self, request: EngineRequest, token_ids: np.ndarray, log_probs: np.ndarray, finish: int,
                 routing: np.ndarray | None = None) -> None:
        k = request.key[0]
        t = self.trajs[k]
        gen = Generated([int(x) for x in token_ids], [float(x) for x in log_probs], FINISH_REASONS[finish], routing)
        outcome = self.tools.record(t, gen, self.limits)
        if outcome is None:
            return
        turn = t.assistant_turns
        if outcome.env_message is not None:
            self._submit(k, outcome, {("env", k, turn): functools.partial(t.env.step, outcome.env_message)})
        elif outcome.jobs:
            jobs: dict[JobKey, ToolJob] = {("tool", k, turn, job.slot): job for job in outcome.jobs}
            self.jobs.update(jobs)
            self._submit(k, outcome, jobs)
        else:  # only malformed calls: their error replies go back at once
            add_tool_replies(t, outcome, self.limits)
            self._ready(k)

    def more_coming(self) -> bool:
        return bool(self.ready or self.waiting)

    def wait(self) -> None:
        self._collect(self.runner.poll(wait_s=0.05))

    # ------------------------------------------------------------------ replies
    def _submit(self, k: int, outcome: TurnOutcome, fns: Mapping[JobKey, Callable[[], Any]]) -> None:
        self.waiting[k], self.outstanding[k] = outcome, len(fns)
        for key, fn in fns.items():
            self.runner.submit(key, fn)

    def _ready(self, k: int) -> None:
        if not self.trajs[k].done:
            self.ready.append(k)

    def _collect(self, results: list[tuple[JobKey, str, Any]]) -> None:
        for key, status, value in results:
            kind, k = key[0], key[1]
            t, outcome = self.trajs[k], self.waiting[k]
            if kind == "env":
                if status == "error":
                    raise value
                if status == "timeout":
                    t.finish("env_timeout")
                else:
                    add_env_reply(t, value, self.limits)
            else:
                record_tool_result(outcome, self.jobs.pop(key), status, value, self.runner.timeout_s)
            self.outstanding[k] -= 1
            if self.outstanding[k]:
                continue
            del self.waiting[k], self.outstanding[k]
            if kind == "tool":
                add_tool_replies(t, outcome, self.limits)
            self._ready(k)


def run_multi_turn_streaming(trajectories: Sequence[Trajectory], serve: Callable[[TrajectorySource], Any], *,
                             limits: TurnLimits, tools: Mapping[str, BaseTool] | None = None,
                             max_parallel_calls: int = 1, tool_timeout_s: float = 30.0, sanity_check: bool = False,
                             tool_call_format: str = "hermes", record_routing: bool = False) -> MultiTurnResult:
    """Runs every trajectory to its end through `serve(source)` (an engine's `serve` over the source;
    the tool-call stop ids belong in its sampling settings). Same result type as `run_multi_turn`.
    `record_routing`: the engine records a MoE model's routing (settings.record_routing) and each
    continuation's prefill replays the experts its trajectory ran so far."""
    check_call_limits(max_parallel_calls, tool_timeout_s)
    runner = JobRunner(max_parallel_calls, tool_timeout_s)
    trajs, kit = list(trajectories), Tools(tools, tool_call_format)
    try:
        start_tools(trajs, kit.tools)
        source = TrajectorySource(trajs, limits=limits, tools=kit, runner=runner, record_routing=record_routing)
        serve(source)
        running = [i for i, t in enumerate(trajs) if not t.done]
        if running or source.more_coming():
            raise RuntimeError(f"the engine returned with trajectories {running[:8]} still running")
    finally:
        runner.close()
        finish_tools(trajs, kit.tools)
    return finish_result(trajs, sanity_check)


__all__ = ["TrajectorySource", "run_multi_turn_streaming"]
