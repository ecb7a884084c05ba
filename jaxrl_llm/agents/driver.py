"""`run_multi_turn`: generate -> parse tool calls -> run tools / environment -> append -> repeat.

    result = run_multi_turn(trajectories, continue_fn, limits=TurnLimits(max_response_length=512),
                            tools=load_tools(path), max_parallel_calls=8, tool_timeout_s=30)
    result.trajectories[i].response_ids / loss_mask / response_log_probs;  result.metrics

`continue_fn(prefixes, max_new_tokens, stop_token_ids) -> [Generated(token_ids, log_probs,
finish_reason)]` is the seam to the rollout engine: it continues every given token-id prefix by at
most its `max_new_tokens` tokens, stopping at the model's EOS ("eos"), at one of `stop_token_ids`
("stop", e.g. a single-token `</tool_call>`), or at the limit ("length"). It is called once per
round with the ACTIVE trajectories only. `sampler_continue.StaticSamplerContinue` implements it
over `jaxrl_llm.sampler.sample`. Rounds make every trajectory wait for the slowest generation and
the slowest tool of the round; `agents/streaming.py` drives the same per-turn steps (below:
`next_turn_budget`, `record_model_turn`, `record_tool_result`, `add_tool_replies`, `add_env_reply`)
from the continuous-batching engine instead, one trajectory at a time.

Per round, after the generation: a turn cut at its token limit ends the trajectory ("length");
a turn with hermes tool calls (`tool_parser`) gets one tool message per call, the calls of all
trajectories running together on a `JobRunner` of `max_parallel_calls` workers, each with
`tool_timeout_s` from the moment it starts (a timed-out call is reported to the model and counted;
see agents/job_runner.py for what happens to its thread); a turn without calls goes to the
trajectory's environment when it has one, else ends the trajectory. Rows' tools are created at the start (`create(None,
**extra_info.tools_kwargs[name].create_kwargs)`, veRL's row field) and scored (`calc_reward`) and
released at the end.

Metrics: multi_turn/num_turns/mean|max|min (assistant + user turns + 1 for the prompt, as veRL's
agent loop counts), multi_turn/tool_calls/mean (per trajectory), multi_turn/tool_errors (malformed,
unknown or badly typed calls, exceptions, results with metrics error=1), multi_turn/tool_timeouts,
multi_turn/response_length/turn_<k>/mean (model tokens of the k-th generation), multi_turn/
stop_reason/<reason> (fraction of trajectories), multi_turn/tokenization_mismatches (with the check).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.agents.job_runner import JobRunner
from jaxrl_llm.agents.tool_base import BaseTool, ToolResult, as_tool_result, call_tool_method
from jaxrl_llm.agents.tool_parser import ToolCall, ToolCallError, get_tool_parser
from jaxrl_llm.agents.trajectory import Trajectory, TurnLimits, truncate_text

FINISH_REASONS = ("eos", "stop", "length")


class Generated(NamedTuple):
    """One continuation from `continue_fn`. routing: when recording a MoE model's routing, the experts
    of the prefix and the generated tokens [len(prefix) + len(token_ids), L, k] (routing replay)."""

    token_ids: Sequence[int]
    log_probs: Sequence[float]
    finish_reason: str  # FINISH_REASONS
    routing: Any = None


ContinueFn = Callable[[list[list[int]], list[int], tuple[int, ...]], Sequence[Generated]]


@dataclasses.dataclass
class MultiTurnResult:
    trajectories: list[Trajectory]
    metrics: dict[str, float]
    mismatches: list[str | None]  # per trajectory, with sanity_check (else all None)


@dataclasses.dataclass
class ToolJob:
    """One tool call of an assistant turn (`slot`: its position among the turn's calls)."""

    traj: Trajectory
    slot: int
    tool: BaseTool
    arguments: dict

    def __call__(self) -> ToolResult:
        """Runs on a `JobRunner` worker; a tool's exception becomes an error reply, never a crash."""
        iid = self.traj.tool_instances[self.tool.name]
        try:
            return as_tool_result(call_tool_method(self.tool.execute, iid, self.arguments), self.tool.name)
        except Exception as err:  # fed back to the model
            return ToolResult(f"Error: tool {self.tool.name!r} failed: {type(err).__name__}: {err}", 0.0,
                              {"error": 1})


def _tools_kwargs(row: Mapping[str, Any], name: str) -> dict:
    extra = row.get("extra_info") or {}
    entry = ((extra.get("tools_kwargs") or {}) if isinstance(extra, Mapping) else {}).get(name) or {}
    return dict(entry.get("create_kwargs") or {})


def _tool_message(text: str, limits: TurnLimits) -> dict:
    return {"role": "tool", "content": truncate_text(text, limits.max_tool_response_length,
                                                     limits.tool_response_truncate_side)}


def start_tools(trajs: Sequence[Trajectory], tools: Mapping[str, BaseTool]) -> None:
    for t in trajs:
        for name, tool in tools.items():
            if name not in t.tool_instances:
                t.tool_instances[name] = call_tool_method(tool.create, None, **_tools_kwargs(t.row, name))


def finish_tools(trajs: Sequence[Trajectory], tools: Mapping[str, BaseTool]) -> None:
    """calc_reward then release every instance; all are released even when one raises (the first
    error is raised afterwards: a tool's own bug, not the model's)."""
    first: BaseException | None = None
    for t in trajs:
        for name, iid in list(t.tool_instances.items()):
            try:
                t.tool_final_rewards[name] = float(call_tool_method(tools[name].calc_reward, iid))
            except Exception as err:  # re-raised below, after the releases
                first = first or err
            try:
                call_tool_method(tools[name].release, iid)
            except Exception as err:
                first = first or err
            del t.tool_instances[name]
    if first is not None:
        raise first


def _check_outputs(outs: Sequence[Generated], budgets: list[int]) -> None:
    if len(outs) != len(budgets):
        raise ValueError(f"continue_fn returned {len(outs)} continuations for {len(budgets)} prefixes")
    for i, (o, b) in enumerate(zip(outs, budgets)):
        if o.finish_reason not in FINISH_REASONS or len(o.token_ids) > b or len(o.token_ids) != len(o.log_probs):
            raise ValueError(f"continue_fn row {i}: {len(o.token_ids)} ids / {len(o.log_probs)} log-probs / "
                             f"finish {o.finish_reason!r} for a budget of {b} (finish in {FINISH_REASONS})")


def _after_turn(t: Trajectory, content: str, finish: str, limits: TurnLimits, schemas: Mapping[str, dict],
                parse: Callable) -> list[ToolCall | ToolCallError] | None:
    """The tool calls to run for this turn, or None (the trajectory ended or goes to its env)."""
    if finish == "length":
        t.finish("length")
        return None
    calls = parse(content, schemas) if schemas else []
    if not calls and t.env is None:
        t.finish(finish)
        return None
    if limits.max_user_turns is not None and t.user_turns >= limits.max_user_turns:
        t.finish("max_user_turns")
        return None
    return calls or None


def next_turn_budget(t: Trajectory, limits: TurnLimits) -> int | None:
    """Tokens the trajectory's next generation may take, or None when it has ended (finishing it
    at max_assistant_turns or when no token fits)."""
    if t.done:
        return None
    if limits.max_assistant_turns is not None and t.assistant_turns >= limits.max_assistant_turns:
        t.finish("max_assistant_turns")
        return None
    left = t.token_budget(limits)
    if left < 1:
        t.finish("length")
        return None
    return min(left, limits.max_tokens_per_turn or left)


@dataclasses.dataclass
class TurnOutcome:
    """What a model turn asks for next: nothing (ended), tool calls, or an environment step."""

    jobs: list[ToolJob]
    replies: list[str | None]  # one per call; malformed calls already hold their error text
    env_message: str | None = None  # the assistant message for the trajectory's environment


def record_model_turn(t: Trajectory, out: Generated, *, limits: TurnLimits, tools: Mapping[str, BaseTool],
                      schemas: Mapping[str, dict], parse: Callable) -> TurnOutcome | None:
    """Appends one generation and returns what comes next, or None when the trajectory ended."""
    content = t.add_model_turn(out.token_ids, out.log_probs, out.finish_reason, routing=out.routing)
    calls = _after_turn(t, content, out.finish_reason, limits, schemas, parse)
    if t.done:
        return None
    if calls is None:
        return TurnOutcome([], [], env_message=content)
    outcome = TurnOutcome([], [None] * len(calls))
    t.tool_calls += len(calls)
    for slot, call in enumerate(calls):
        if isinstance(call, ToolCallError):
            t.tool_errors += 1
            outcome.replies[slot] = call.message
        else:
            outcome.jobs.append(ToolJob(t, slot, tools[call.name], call.arguments))
    return outcome


def record_tool_result(outcome: TurnOutcome, job: ToolJob, status: str, res: Any, timeout_s: float) -> None:
    """A finished (or timed-out) call's reply and counters (`JobRunner` statuses)."""
    t = job.traj
    if status == "error":  # ToolJob turns exceptions into replies; this is a BaseException's
        status, res = "ok", ToolResult(f"Error: tool {job.tool.name!r} failed: {res!r}", 0.0, {"error": 1})
    if status == "ok":
        t.tool_errors += int(bool(res.metrics.get("error", 0)))
        t.tool_rewards.append(res.reward)
        t.tool_metrics.append(dict(res.metrics, tool=job.tool.name))
        outcome.replies[job.slot] = res.text
    else:  # "timeout"
        t.tool_timeouts += 1
        outcome.replies[job.slot] = f"Error: tool {job.tool.name!r} timed out after {timeout_s:g}s"


def add_tool_replies(t: Trajectory, outcome: TurnOutcome, limits: TurnLimits) -> None:
    msgs = [_tool_message(text or "", limits) for text in outcome.replies]
    if not t.add_context_turn(msgs, limits):
        t.finish("length")


def add_env_reply(t: Trajectory, step: tuple[str | None, float, bool], limits: TurnLimits) -> None:
    """An environment's `step` result: its reward, then its reply as a user turn, or the end."""
    reply, reward, env_done = step
    t.env_rewards.append(float(reward))
    if env_done or reply is None:
        t.finish("env_done")
    elif not t.add_context_turn([{"role": "user", "content": reply}], limits):
        t.finish("length")


class Tools:
    """The tools of a rollout: schemas, the call parser, creation and final scoring of instances."""

    def __init__(self, tools: Mapping[str, BaseTool] | None, tool_call_format: str = "hermes") -> None:
        self.tools = dict(tools or {})
        self.schemas = {name: tool.tool_schema["function"] for name, tool in self.tools.items()}
        self.parse = get_tool_parser(tool_call_format)

    def record(self, t: Trajectory, out: Generated, limits: TurnLimits) -> TurnOutcome | None:
        return record_model_turn(t, out, limits=limits, tools=self.tools, schemas=self.schemas, parse=self.parse)


def check_call_limits(max_parallel_calls: int, tool_timeout_s: float) -> None:
    if max_parallel_calls < 1 or tool_timeout_s <= 0:
        raise ValueError(f"max_parallel_calls={max_parallel_calls} must be >= 1 and tool_timeout_s="
                         f"{tool_timeout_s} > 0")


def run_multi_turn(trajectories: Sequence[Trajectory], continue_fn: ContinueFn, *, limits: TurnLimits,
                   tools: Mapping[str, BaseTool] | None = None, max_parallel_calls: int = 1,
                   tool_timeout_s: float = 30.0, stop_token_ids: Sequence[int] = (),
                   sanity_check: bool = False, tool_call_format: str = "hermes",
                   record_routing: bool = False) -> MultiTurnResult:
    """Runs every trajectory to its end in rounds (see the module docstring); returns them with
    metrics. `tool_call_format`: veRL's multi_turn.format (`tool_parser.TOOL_CALL_FORMATS`).
    `record_routing`: a MoE model's routing is recorded: `continue_fn` also gets `routings=`, each
    prefix's experts so far (`Trajectory.prefix_routing`), and returns the whole record."""
    check_call_limits(max_parallel_calls, tool_timeout_s)
    runner = JobRunner(max_parallel_calls, tool_timeout_s)
    trajs, kit = list(trajectories), Tools(tools, tool_call_format)
    stops = tuple(int(s) for s in stop_token_ids)
    try:
        start_tools(trajs, kit.tools)
        while True:
            budgets = [(t, next_turn_budget(t, limits)) for t in trajs]
            active = [(t, budget) for t, budget in budgets if budget is not None]
            if not active:
                break
            active_budgets = [budget for _, budget in active]
            prefixes = [t.ids for t, _ in active]
            extra: dict[str, Any] = {}
            if record_routing:
                extra["routings"] = [t.prefix_routing() for t, _ in active]
            if any(t.prompt_images is not None for t, _ in active):  # a vision-language prompt's images
                extra["images"] = [t.prefix_images() for t, _ in active]
            outs = list(continue_fn(prefixes, active_budgets, stops, **extra))  # pyright: ignore[reportCallIssue]
            _check_outputs(outs, active_budgets)
            outcomes: list[tuple[Trajectory, TurnOutcome]] = []
            for (t, _), o in zip(active, outs):
                outcome = kit.record(t, o, limits)
                if outcome is None:
                    continue
                if outcome.env_message is not None:  # the environment answers (on this thread)
                    add_env_reply(t, t.env.step(outcome.env_message), limits)
                else:
                    outcomes.append((t, outcome))
            jobs = {(i, job.slot): (outcome, job) for i, (_, outcome) in enumerate(outcomes) for job in outcome.jobs}
            results = runner.run_all({key: job for key, (_, job) in jobs.items()})
            for key, (outcome, job) in jobs.items():
                record_tool_result(outcome, job, *results[key], tool_timeout_s)
            for t, outcome in outcomes:
                add_tool_replies(t, outcome, limits)
    finally:
        runner.close()
        finish_tools(trajs, kit.tools)
    return finish_result(trajs, sanity_check)


def finish_result(trajs: list[Trajectory], sanity_check: bool) -> MultiTurnResult:
    mismatches: list[str | None] = ([t.tokenization_mismatch() for t in trajs] if sanity_check
                                    else [None] * len(trajs))
    return MultiTurnResult(trajs, multi_turn_metrics(trajs, mismatches if sanity_check else None), mismatches)


def multi_turn_metrics(trajs: Sequence[Trajectory], mismatches: Sequence[str | None] | None = None
                       ) -> dict[str, float]:
    """The multi_turn/* metrics of finished trajectories (see the module docstring)."""
    if not trajs:
        return {}
    turns = np.array([t.assistant_turns + t.user_turns + 1 for t in trajs], np.float64)
    metrics = {"multi_turn/num_turns/mean": float(turns.mean()), "multi_turn/num_turns/max": float(turns.max()),
               "multi_turn/num_turns/min": float(turns.min()),
               "multi_turn/tool_calls/mean": float(np.mean([t.tool_calls for t in trajs])),
               "multi_turn/tool_errors": float(sum(t.tool_errors for t in trajs)),
               "multi_turn/tool_timeouts": float(sum(t.tool_timeouts for t in trajs))}
    for k in range(max(len(t.turn_lengths) for t in trajs)):
        lengths = [t.turn_lengths[k] for t in trajs if len(t.turn_lengths) > k]
        metrics[f"multi_turn/response_length/turn_{k + 1}/mean"] = float(np.mean(lengths))
    for reason in sorted({t.stop_reason or "running" for t in trajs}):
        metrics[f"multi_turn/stop_reason/{reason}"] = float(np.mean([(t.stop_reason or "running") == reason
                                                                      for t in trajs]))
    if mismatches is not None:
        metrics["multi_turn/tokenization_mismatches"] = float(sum(m is not None for m in mismatches))
    return metrics


__all__ = ["FINISH_REASONS", "ContinueFn", "Generated", "MultiTurnResult", "multi_turn_metrics", "run_multi_turn"]
