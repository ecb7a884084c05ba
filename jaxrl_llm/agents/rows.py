"""From dataset rows to trajectories, and from finished trajectories to the trainer's padded arrays.

    trajs = trajectories_from_rows(rows, renderer, interactions=load_interactions(path))
    result = run_multi_turn(trajs, continue_fn, limits=limits, tools=tools)
    batch = pad_trajectories(result.trajectories, prompt_length=P, response_length=R, pad_id=pad)

Rows are veRL's: `prompt` (a list of chat messages, or a string = one user message),
`extra_info.tools_kwargs` (per-tool create kwargs, read by the driver) and
`extra_info.interaction_kwargs.name` (which configured interaction plays the row; may be omitted
when exactly one is configured).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.agents.chat import ChatRenderer
from jaxrl_llm.agents.environment import Environment, interaction_kwargs
from jaxrl_llm.agents.trajectory import Trajectory
from jaxrl_llm.models.moe import NOT_RECORDED


def _messages(row: Mapping[str, Any], key: str, index: int) -> list[dict]:
    value = row.get(key)
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, np.ndarray):  # parquet list columns arrive as arrays
        value = list(value)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(m, Mapping) and "role" in m for m in value):
        raise ValueError(f"row {index}: {key!r} must be a string or a list of chat messages with 'role'")
    return [dict(m) for m in value]


def trajectories_from_rows(rows: Sequence[Mapping[str, Any]], renderer: ChatRenderer, *,
                           interactions: Mapping[str, Callable[[], Environment]] | None = None,
                           prompt_key: str = "prompt", n: int = 1) -> list[Trajectory]:
    """`n` trajectories per row (row-major: trajectory i * n + j is sample j of row i, the order of
    GRPO groups), each with a fresh environment when `interactions` are configured.
    With tools whose schemas the chat template does not render (SmolLM2's template), the hermes
    tool instructions go into the system turn (`ChatRenderer.with_tools_prompt`)."""
    if n < 1:
        raise ValueError(f"trajectories_from_rows: n={n} must be >= 1")
    trajs = []
    for i, row in enumerate(rows):
        name = None
        if interactions:
            name = interaction_kwargs(row).get("name")
            if name is None and len(interactions) == 1:
                name = next(iter(interactions))
            if name not in interactions:
                raise ValueError(f"row {i}: extra_info.interaction_kwargs.name={name!r}; configured interactions: "
                                 f"{sorted(interactions)}")
        messages = renderer.with_tools_prompt(_messages(row, prompt_key, i))
        prompt_ids = None
        for _ in range(n):  # the prompt is tokenized once per row
            env = interactions[name]() if interactions and name is not None else None
            pictures = row.get("images")  # a vision-language row's, its placeholders' in order
            t = Trajectory.start(renderer, messages, row=dict(row), env=env, prompt_ids=prompt_ids,
                                 images=[] if pictures is None else list(pictures))
            prompt_ids = t.prompt_ids if env is None else None  # an env's first message may differ per copy
            trajs.append(t)
    return trajs


@dataclasses.dataclass(frozen=True)
class TrajectoryBatch:
    """Padded arrays for the trainer (B rows; P prompt, R response slots)."""

    prompt_ids: np.ndarray  # int32 [B, P], left-padded
    prompt_mask: np.ndarray  # int32 [B, P]
    response_ids: np.ndarray  # int32 [B, R], right-padded: model and context tokens in order
    response_mask: np.ndarray  # int32 [B, R]: 1 on every response token (attention)
    loss_mask: np.ndarray  # int32 [B, R]: 1 on model tokens only
    rollout_log_probs: np.ndarray  # float32 [B, R]: rollout log-probs on model tokens, 0 elsewhere
    num_turns: np.ndarray  # int32 [B]: assistant + user turns + 1
    # routing replay: the sampler's experts [B, P + R, L, k] in the [prompt | response] layout
    # (NOT_RECORDED where nothing was fed); None unless every trajectory recorded its routing
    routing: np.ndarray | None = None


def pad_trajectories(trajs: Sequence[Trajectory], *, prompt_length: int, response_length: int,
                     pad_id: int) -> TrajectoryBatch:
    """Stacks finished trajectories into fixed shapes; a row longer than its slots is an error."""
    b = len(trajs)
    out = {name: np.full((b, n), fill, dtype) for name, n, fill, dtype in (
        ("prompt_ids", prompt_length, pad_id, np.int32), ("prompt_mask", prompt_length, 0, np.int32),
        ("response_ids", response_length, pad_id, np.int32), ("response_mask", response_length, 0, np.int32),
        ("loss_mask", response_length, 0, np.int32), ("rollout_log_probs", response_length, 0.0, np.float32))}
    for i, t in enumerate(trajs):
        prompt, resp = t.prompt_ids, t.response_ids
        if len(prompt) > prompt_length or len(resp) > response_length:
            raise ValueError(f"trajectory {i}: prompt {len(prompt)} / response {len(resp)} tokens exceed the "
                             f"slots {prompt_length} / {response_length}")
        if prompt:
            out["prompt_ids"][i, prompt_length - len(prompt):] = prompt
            out["prompt_mask"][i, prompt_length - len(prompt):] = 1
        n = len(resp)
        out["response_ids"][i, :n] = resp
        out["response_mask"][i, :n] = 1
        out["loss_mask"][i, :n] = t.loss_mask
        out["rollout_log_probs"][i, :n] = t.response_log_probs
    turns = np.array([t.assistant_turns + t.user_turns + 1 for t in trajs], np.int32)
    return TrajectoryBatch(**out, num_turns=turns, routing=_routing_rows(trajs, prompt_length, response_length))


def _routing_rows(trajs: Sequence[Trajectory], prompt_length: int, response_length: int) -> np.ndarray | None:
    if not trajs or any(t.routing is None for t in trajs):
        return None
    first = trajs[0].routing
    out = np.full((len(trajs), prompt_length + response_length, *first.shape[1:]), NOT_RECORDED, first.dtype)
    for i, t in enumerate(trajs):  # the record covers the ids fed; the rest stays NOT_RECORDED
        start = prompt_length - len(t.prompt_ids)
        out[i, start:start + len(t.routing)] = t.routing
    return out


__all__ = ["TrajectoryBatch", "pad_trajectories", "trajectories_from_rows"]
