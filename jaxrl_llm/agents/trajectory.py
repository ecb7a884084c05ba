"""Token-in / token-out conversation state of one multi-turn rollout.

A `Trajectory` holds the exact token ids the model saw and produced, segment by segment:

    prompt   the rendered chat prompt (context)
    model    one generation: its ids and per-token rollout log-probs (trained on: loss_mask 1)
    context  a tool / user turn rendered as a token delta (`ChatRenderer.delta_text`): loss_mask 0

Earlier segments are never re-tokenized; `response_ids` / `loss_mask` / `response_log_probs` are
the concatenation the trainer receives. `tokenization_mismatch()` (veRL's
enable_tokenization_sanity_check) re-renders the whole conversation through the chat template,
tokenizes it once, and reports the first position where the ids differ.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.agents.chat import ChatRenderer
from jaxrl_llm.models.moe import NOT_RECORDED

TRUNCATE_SIDES = ("left", "middle", "right")
SEGMENT_KINDS = ("prompt", "model", "context")


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    """Multi-turn limits (veRL's `multi_turn.*` names).

    max_assistant_turns / max_user_turns: None = unbounded (user turns count tool replies and
    environment replies, as veRL). max_response_length: tokens after the prompt, model and context
    together (veRL's rollout.response_length). max_total_length: prompt + response tokens (None:
    no bound beyond the response's). max_tokens_per_turn: tokens per generation (None: what is left).
    max_tool_response_length: characters of one tool reply; tool_response_truncate_side (veRL's
    meaning): "left" keeps the start, "right" keeps the end, "middle" keeps both ends.
    """

    max_response_length: int
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_total_length: int | None = None
    max_tokens_per_turn: int | None = None
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"

    def __post_init__(self) -> None:
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"TurnLimits.tool_response_truncate_side={self.tool_response_truncate_side!r}: "
                             f"expected one of {TRUNCATE_SIDES}")
        for name in ("max_response_length", "max_tool_response_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"TurnLimits.{name}={getattr(self, name)}: must be >= 1")
        for name in ("max_assistant_turns", "max_user_turns", "max_total_length", "max_tokens_per_turn"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"TurnLimits.{name}={value}: must be >= 1 or None")


def truncate_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters (plus a marker) as veRL's tool_response_truncate_side."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    if side == "middle":
        head = limit // 2
        return text[:head] + "...(truncated)..." + text[len(text) - (limit - head):]
    raise ValueError(f"truncate side {side!r}: expected one of {TRUNCATE_SIDES}")


@dataclasses.dataclass
class Segment:
    kind: str  # SEGMENT_KINDS
    ids: list[int]
    log_probs: list[float] | None = None  # model segments only


@dataclasses.dataclass
class Trajectory:
    """One conversation. Build with `Trajectory.start`; the driver appends turns."""

    renderer: ChatRenderer
    messages: list[dict]
    segments: list[Segment]
    row: dict = dataclasses.field(default_factory=dict)
    env: Any = None  # an Environment, or None
    done: bool = False
    stop_reason: str | None = None  # "eos" | "no_tool_call" | "env_done" | "max_assistant_turns" | ...
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    turn_lengths: list[int] = dataclasses.field(default_factory=list)
    tool_rewards: list[float] = dataclasses.field(default_factory=list)
    env_rewards: list[float] = dataclasses.field(default_factory=list)
    tool_instances: dict[str, str] = dataclasses.field(default_factory=dict)  # tool name -> instance id
    tool_final_rewards: dict[str, float] = dataclasses.field(default_factory=dict)  # calc_reward per tool
    tool_metrics: list[dict] = dataclasses.field(default_factory=list)
    # routing replay: the experts the sampler ran for the first len(routing) ids [n, L, k] (the last
    # generation's record: its prefix replayed the earlier turns' experts); None when not recording
    routing: Any = None
    # a vision-language prompt's images (its `<image>` placeholders in order): its prompt ids hold their tokens,
    # and every continuation of the conversation reads them (rollout/multi_turn.py)
    images: list = dataclasses.field(default_factory=list)
    # the prompt's images as the sampler reads them (sampler.engine.requests.RequestImages), set by the rollout
    prompt_images: Any = None
    _tail: str = ""  # what the last model turn emitted after its content (its EOS text or "")

    @classmethod
    def start(cls, renderer: ChatRenderer, messages: Sequence[dict], *, row: dict | None = None,
              env: Any = None, prompt_ids: Sequence[int] | None = None, images: Sequence[Any] = ()
              ) -> "Trajectory":
        """A trajectory at its prompt. With `env`, `env.reset(row)`'s first message is appended to
        `messages` as a user turn. `prompt_ids`: already tokenized prompt (default: rendered here, with `images`'
        tokens where its placeholders are)."""
        messages = [dict(m) for m in messages]
        row = dict(row or {})
        if env is not None:
            first = env.reset(row)
            if first is not None:
                messages.append({"role": "user", "content": first})
        if not messages:
            raise ValueError("Trajectory.start: no prompt messages (and no environment first message)")
        ids = list(prompt_ids) if prompt_ids is not None else renderer.prompt_ids(messages, images)
        return cls(renderer=renderer, messages=messages, segments=[Segment("prompt", ids)], row=row, env=env,
                   images=list(images))

    # ------------------------------------------------------------------ views for the trainer
    @property
    def prompt_ids(self) -> list[int]:
        return list(self.segments[0].ids)

    def prefix_images(self) -> Any:
        """The sampler's image inputs for the conversation so far (its prompt's, the later tokens text), or None."""
        return None if self.prompt_images is None else self.prompt_images.extended(len(self.ids))

    @property
    def ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments[1:] for t in s.ids]

    @property
    def loss_mask(self) -> list[int]:
        """1 on model tokens, 0 on tool / user / template tokens (aligned with `response_ids`)."""
        return [int(s.kind == "model") for s in self.segments[1:] for _ in s.ids]

    @property
    def response_log_probs(self) -> list[float]:
        """Rollout log-probs of model tokens, 0.0 on context tokens (aligned with `response_ids`)."""
        return [lp for s in self.segments[1:]
                for lp in (s.log_probs if s.kind == "model" and s.log_probs is not None else [0.0] * len(s.ids))]

    @property
    def response_length(self) -> int:
        return sum(len(s.ids) for s in self.segments[1:])

    def token_budget(self, limits: TurnLimits) -> int:
        """How many more tokens fit (response and total length bounds)."""
        left = limits.max_response_length - self.response_length
        if limits.max_total_length is not None:
            left = min(left, limits.max_total_length - len(self.ids))
        return left

    @property
    def last_model_text(self) -> str:
        return self.messages[-1]["content"] if self.messages[-1]["role"] == "assistant" else ""

    def prefix_routing(self) -> np.ndarray | None:
        """The recorded experts of every id [len(ids), L, k] (NOT_RECORDED for ids never fed: the last
        generated token and the context after it), or None before any recording."""
        if self.routing is None:
            return None
        out = np.full((len(self.ids), *self.routing.shape[1:]), NOT_RECORDED, self.routing.dtype)
        out[:len(self.routing)] = self.routing
        return out

    # ------------------------------------------------------------------ appending turns
    def add_model_turn(self, ids: Sequence[int], log_probs: Sequence[float], finish_reason: str, *,
                       routing: Any = None) -> str:
        """Appends one generation (as produced; never re-tokenized); returns its text content.
        `routing`: the sampler's experts of the prefix and this generation [len(ids) after, L, k]."""
        ids, log_probs = [int(t) for t in ids], [float(x) for x in log_probs]
        if len(ids) != len(log_probs):
            raise ValueError(f"model turn: {len(ids)} ids but {len(log_probs)} log-probs")
        if routing is not None:
            if len(routing) != len(self.ids) + len(ids):
                raise ValueError(f"model turn: routing for {len(routing)} tokens, the prefix and the turn have "
                                 f"{len(self.ids) + len(ids)}")
            self.routing = np.asarray(routing)
        self.segments.append(Segment("model", ids, log_probs))
        content, self._tail = self.renderer.split_model_text(self.renderer.decode(ids), finish_reason)
        self.messages.append({"role": "assistant", "content": content})
        self.assistant_turns += 1
        self.turn_lengths.append(len(ids))
        return content

    def add_context_turn(self, new_messages: Sequence[dict], limits: TurnLimits) -> bool:
        """Appends tool / user messages as a token delta (with the generation prompt). Returns False,
        appending nothing, when the delta plus one generated token would not fit the limits."""
        new_messages = [dict(m) for m in new_messages]
        delta = self.renderer.encode(self.renderer.delta_text(self.messages, new_messages, self._tail))
        if len(delta) + 1 > self.token_budget(limits):
            return False
        self.segments.append(Segment("context", delta))
        self.messages.extend(new_messages)
        self.user_turns += 1
        self._tail = ""
        return True

    def finish(self, reason: str) -> None:
        self.done, self.stop_reason = True, reason

    # ------------------------------------------------------------------ checks and rewards
    def tokenization_mismatch(self) -> str | None:
        """None when the ids equal (a prefix of) the tokenized rendering of the whole conversation,
        else a message with the first mismatching position (veRL's tokenization sanity check)."""
        last_model = self.segments[-1].kind == "model"
        expected = self.renderer.encode_with_images(self.messages, self.images, add_generation_prompt=not last_model)
        ids = self.ids
        first = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), None)
        if first is None and len(ids) > len(expected):
            first = len(expected)
        if first is None:
            return None
        seg, start = 0, 0
        for seg, s in enumerate(self.segments):
            if first < start + len(s.ids):
                break
            start += len(s.ids)
        got = ids[first:first + 8]
        want = expected[first:first + 8]
        return (f"tokenization mismatch at token {first} (segment {seg}, {self.segments[seg].kind}): ids "
                f"{got} {self.renderer.decode(got)!r} but the rendered conversation tokenizes to {want} "
                f"{self.renderer.decode(want)!r}")

    @property
    def reward_parts(self) -> dict[str, float]:
        """Rewards collected on the way: tool step rewards, tools' calc_reward, environment rewards."""
        return {"tool_step": float(sum(self.tool_rewards)), "tool_final": float(sum(self.tool_final_rewards.values())),
                "interaction": float(sum(self.env_rewards))}


__all__ = ["SEGMENT_KINDS", "TRUNCATE_SIDES", "Segment", "Trajectory", "TurnLimits", "truncate_text"]
