"""The environment protocol for multi-turn tasks without tools (veRL's "interactions"), and a built-in.

    env = GuessNumberEnv(config={"low": 1, "high": 100})    # one fresh object per trajectory
    first = env.reset(row)            # str: appended to the row's prompt as a user message; None: none
    reply, reward, done = env.step("I guess 50")     # ("higher", 0.0, False) ... (None, 1.0, True)

The driver calls `step` after each assistant turn that has no tool call; `reply` goes back to the
model as a user message unless `done`. The trajectory's interaction reward is the sum of the step
rewards. A row picks its environment by `extra_info.interaction_kwargs.name` (veRL's field) when
several are configured; the same mapping is passed to `reset` as the row.
"""
from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

_INT = re.compile(r"-?\d+")


class Environment:
    """Base class (and protocol) of environments: subclasses implement `reset` and `step`."""

    default_name: str | None = None

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    def reset(self, prompt_row: Mapping[str, Any]) -> str | None:
        raise NotImplementedError(f"{type(self).__name__}.reset")

    def step(self, assistant_message: str) -> tuple[str | None, float, bool]:
        raise NotImplementedError(f"{type(self).__name__}.step")


def interaction_kwargs(row: Mapping[str, Any]) -> dict:
    """veRL's `extra_info.interaction_kwargs` of a dataset row ({} when absent)."""
    extra = row.get("extra_info") or {}
    return dict(extra.get("interaction_kwargs") or {}) if isinstance(extra, Mapping) else {}


class GuessNumberEnv(Environment):
    """Guess an integer in [low, high]: each reply is "higher" or "lower" until the guess is right.

    Config: `low` (1), `high` (100), `max_guesses` (7; then done with reward 0), `correct_reward`
    (1.0). The target is `interaction_kwargs.target` of the row, else drawn from a RNG seeded by
    `interaction_kwargs.seed` (0). The last integer in the assistant's message is its guess; a
    message without one counts as a guess and gets a reminder.
    """

    default_name = "guess_number"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        unknown = sorted(set(self.config) - {"low", "high", "max_guesses", "correct_reward"})
        if unknown:
            raise ValueError(f"GuessNumberEnv config: unknown keys {unknown}")
        self.low, self.high = int(self.config.get("low", 1)), int(self.config.get("high", 100))
        self.max_guesses = int(self.config.get("max_guesses", 7))
        self.correct_reward = float(self.config.get("correct_reward", 1.0))
        if self.low > self.high or self.max_guesses < 1:
            raise ValueError(f"GuessNumberEnv config: need low <= high and max_guesses >= 1, got "
                             f"low={self.low} high={self.high} max_guesses={self.max_guesses}")
        self.target: int | None = None
        self.guesses = 0

    def reset(self, prompt_row: Mapping[str, Any]) -> str:
        kwargs = interaction_kwargs(prompt_row)
        target = kwargs.get("target")
        if target is None:
            target = random.Random(int(kwargs.get("seed", 0))).randint(self.low, self.high)
        self.target, self.guesses = int(target), 0
        if not self.low <= self.target <= self.high:
            raise ValueError(f"GuessNumberEnv: target {self.target} outside [{self.low}, {self.high}]")
        return (f"I am thinking of an integer between {self.low} and {self.high}. Guess it: after each guess "
                "I say higher or lower. Reply with just the number.")

    def step(self, assistant_message: str) -> tuple[str | None, float, bool]:
        if self.target is None:
            raise RuntimeError("GuessNumberEnv.step before reset")
        self.guesses += 1
        found = _INT.findall(assistant_message)
        if found and int(found[-1]) == self.target:
            return None, self.correct_reward, True
        if self.guesses >= self.max_guesses:
            return None, 0.0, True
        if not found:
            return f"Reply with a single integer between {self.low} and {self.high}.", 0.0, False
        return ("higher" if int(found[-1]) < self.target else "lower"), 0.0, False


__all__ = ["Environment", "GuessNumberEnv", "interaction_kwargs"]
