"""`run_multi_turn`: generate -> parse tool calls -> run tools / environment -> append -> repeat.

    result = run_multi_turn(trajectories, continue_fn, limits=TurnLimits(max_response_length=512),
                            tools=load_tools(path), max_parallel_calls=8, tool_timeout_s=30)
    result.trajectories[i].response_ids / loss_mask / response_log_probs;  result.metrics

`continue_fn(prefixes, max_new_tokens, stop_token_ids) -> [Generated(token_ids, log_probs,
finish_reason)]` is the seam to the rollout engine: it continues every given token-id prefix by at
most its `max_new_tokens` tokens, stopping at the model's EOS ("eos"), at one of `stop_token_ids`
("stop", e.g. a single-token `</tool_call>`), or at the limit ("length"). It is called once per
round with the ACTIVE trajectories only. `sampler_continue.StaticSamplerContinue` implements it
over `jaxrl_llm.sampler.sample`.

Per round, after the generation: a turn cut at its token limit ends the trajectory ("length");
a turn with hermes tool calls (`tool_parser`) gets one tool message per call, the calls of all
trajectories running together on a thread pool of `max_parallel_calls` workers, each with
`tool_timeout_s` from the moment it starts (a timed-out call is reported to the model and counted;
its daemon thread cannot be killed and finishes in the background, so a tool that can hang must
bound itself, as the sandbox does); a turn without calls goes to the trajectory's environment when it
has one, else ends the trajectory. Rows' tools are created at the start (`create(None,
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
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.agents.tool_base import BaseTool, ToolResult, as_tool_result, call_tool_method
from jaxrl_llm.agents.tool_parser import ToolCall, ToolCallError, get_tool_parser
from jaxrl_llm.agents.trajectory import Trajectory, TurnLimits, truncate_text

FINISH_REASONS = ("eos", "stop", "length")


class Generated(NamedTuple):
    """One continuation from `continue_fn`."""

    token_ids: Sequence[int]
    log_probs: Sequence[float]
    finish_reason: str  # FINISH_REASONS


ContinueFn = Callable[[list[list[int]], list[int], tuple[int, ...]], Sequence[Generated]]


@dataclasses.dataclass
class MultiTurnResult:
    trajectories: list[Trajectory]
    metrics: dict[str, float]
    mismatches: list[str | None]  # per trajectory, with sanity_check (else all None)


@dataclasses.dataclass
class _Job:
    traj: Trajectory
    slot: int  # position of the call in its assistant turn
    tool: BaseTool
    arguments: dict
    started: float | None = None


def _tools_kwargs(row: Mapping[str, Any], name: str) -> dict:
    extra = row.get("extra_info") or {}
    entry = ((extra.get("tools_kwargs") or {}) if isinstance(extra, Mapping) else {}).get(name) or {}
    return dict(entry.get("create_kwargs") or {})


def _run_job(job: _Job) -> ToolResult:
    job.started = time.monotonic()
    iid = job.traj.tool_instances[job.tool.name]
    return as_tool_result(call_tool_method(job.tool.execute, iid, job.arguments), job.tool.name)


def _run_tool_calls(jobs: list[_Job], max_parallel_calls: int, timeout_s: float
                    ) -> list[tuple[str, ToolResult | None]]:
    """("ok" | "error" | "timeout", result or None) per job; never raises for a tool's failure.

    Daemon worker threads (at most `max_parallel_calls`) take jobs from a queue. A job running
    longer than `timeout_s` is abandoned (its thread finishes in the background and, being a
    daemon, never holds up interpreter exit); when every worker is stuck that way, the jobs not
    started yet time out too.
    """
    out: list[tuple[str, ToolResult | None]] = [("timeout", None)] * len(jobs)
    if not jobs:
        return out
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(jobs)):
        todo.put(i)
    finished: queue.SimpleQueue = queue.SimpleQueue()
    abandon = threading.Event()

    def worker() -> None:
        while not abandon.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                finished.put((i, "ok", _run_job(jobs[i])))
            except Exception as err:  # noqa: BLE001 - a tool's exception is fed back, never raised
                finished.put((i, "error", ToolResult(f"Error: tool {jobs[i].tool.name!r} failed: "
                                                     f"{type(err).__name__}: {err}", 0.0, {})))

    workers = min(max_parallel_calls, len(jobs))
    for _ in range(workers):
        threading.Thread(target=worker, name="tool-call", daemon=True).start()
    waiting, stuck = set(range(len(jobs))), set()
    while waiting - stuck:
        try:
            i, status, res = finished.get(timeout=0.02)
            if i not in stuck:
                out[i] = (status, res)
            waiting.discard(i)
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        stuck |= {i for i in waiting if jobs[i].started is not None and now - jobs[i].started > timeout_s}
        if len(stuck) >= workers:  # no worker left for the jobs not started yet
            break
    abandon.set()
    return out


def _tool_message(text: str, limits: TurnLimits) -> dict:
    return {"role": "tool", "content": truncate_text(text, limits.max_tool_response_length,
                                                     limits.tool_response_truncate_side)}


def _start_tools(trajs: Sequence[Trajectory], tools: Mapping[str, BaseTool]) -> None:
    for t in trajs:
        for name, tool in tools.items():
            if name not in t.tool_instances:
                t.tool_instances[name] = call_tool_method(tool.create, None, **_tools_kwargs(t.row, name))


def _finish_tools(trajs: Sequence[Trajectory], tools: Mapping[str, BaseTool]) -> None:
    """calc_reward then release every instance; all are released even when one raises (the first
    error is raised afterwards: a tool's own bug, not the model's)."""
    first: BaseException | None = None
    for t in trajs:
        for name, iid in list(t.tool_instances.items()):
            try:
                t.tool_final_rewards[name] = float(call_tool_method(tools[name].calc_reward, iid))
            except Exception as err:  # noqa: BLE001 - re-raised below, after the releases
                first = first or err
            try:
                call_tool_method(tools[name].release, iid)
            except Exception as err:  # noqa: BLE001
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


def run_multi_turn(trajectories: Sequence[Trajectory], continue_fn: ContinueFn, *, limits: TurnLimits,
                   tools: Mapping[str, BaseTool] | None = None, max_parallel_calls: int = 1,
                   tool_timeout_s: float = 30.0, stop_token_ids: Sequence[int] = (),
                   sanity_check: bool = False, tool_call_format: str = "hermes") -> MultiTurnResult:
    """Runs every trajectory to its end (see the module docstring); returns them with metrics.
    `tool_call_format`: veRL's multi_turn.format (`tool_parser.TOOL_CALL_FORMATS`)."""
    if max_parallel_calls < 1 or tool_timeout_s <= 0:
        raise ValueError(f"max_parallel_calls={max_parallel_calls} must be >= 1 and tool_timeout_s="
                         f"{tool_timeout_s} > 0")
    parse = get_tool_parser(tool_call_format)
    trajs, tools = list(trajectories), dict(tools or {})
    schemas = {name: tool.tool_schema["function"] for name, tool in tools.items()}
    stops = tuple(int(s) for s in stop_token_ids)
    try:
        _start_tools(trajs, tools)
        while True:
            for t in trajs:
                if t.done:
                    continue
                if limits.max_assistant_turns is not None and t.assistant_turns >= limits.max_assistant_turns:
                    t.finish("max_assistant_turns")
                elif t.token_budget(limits) < 1:
                    t.finish("length")
            active = [t for t in trajs if not t.done]
            if not active:
                break
            per_turn = limits.max_tokens_per_turn
            budgets = [min(t.token_budget(limits), per_turn or t.token_budget(limits)) for t in active]
            outs = list(continue_fn([t.ids for t in active], budgets, stops))
            _check_outputs(outs, budgets)
            jobs: list[_Job] = []
            replies: dict[int, list[str | None]] = {}
            for t, o in zip(active, outs):
                content = t.add_model_turn(o.token_ids, o.log_probs, o.finish_reason)
                calls = _after_turn(t, content, o.finish_reason, limits, schemas, parse)
                if t.done:
                    continue
                if calls is None:  # the environment answers
                    reply, reward, env_done = t.env.step(content)
                    t.env_rewards.append(float(reward))
                    if env_done or reply is None:
                        t.finish("env_done")
                    elif not t.add_context_turn([{"role": "user", "content": reply}], limits):
                        t.finish("length")
                    continue
                replies[id(t)] = [None] * len(calls)
                t.tool_calls += len(calls)
                for slot, call in enumerate(calls):
                    if isinstance(call, ToolCallError):
                        t.tool_errors += 1
                        replies[id(t)][slot] = call.message
                    else:
                        jobs.append(_Job(t, slot, tools[call.name], call.arguments))
            for job, (status, res) in zip(jobs, _run_tool_calls(jobs, max_parallel_calls, tool_timeout_s)):
                t = job.traj
                if status == "timeout":
                    t.tool_timeouts += 1
                    text = f"Error: tool {job.tool.name!r} timed out after {tool_timeout_s:g}s"
                else:
                    t.tool_errors += int(status == "error" or bool(res.metrics.get("error", 0)))
                    t.tool_rewards.append(res.reward)
                    t.tool_metrics.append(dict(res.metrics, tool=job.tool.name))
                    text = res.text
                replies[id(t)][job.slot] = text
            for t in active:
                if id(t) in replies and not t.done:
                    msgs = [_tool_message(text or "", limits) for text in replies[id(t)]]
                    if not t.add_context_turn(msgs, limits):
                        t.finish("length")
    finally:
        _finish_tools(trajs, tools)
    mismatches = [t.tokenization_mismatch() for t in trajs] if sanity_check else [None] * len(trajs)
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
