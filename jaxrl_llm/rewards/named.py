"""open-r1's reward functions by name, summed with weights (`custom_reward_function.reward_funcs` /
`reward_weights`, TRL's and open-r1's `reward_funcs` / `reward_weights`).

Each function scores a decoded response with open-r1's formula (src/open_r1/rewards.py); the run's
reward is `sum_i weight_i * f_i(response)`, each `f_i` logged as `reward/<name>/mean`:

  accuracy            the row's scorer (its data_source's built-in, or custom_reward_function.path)
  format              1 if the response is `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`, else 0
  tag_count           0.25 for each of `<think>\\n`, `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` found once
  reasoning_steps     min(1, (count of "Step k:", "k." at a line start, "\\n-", "\\n*", First, Second, Next,
                      Finally,) / 3)
  cosine              by length L (characters) and correctness (the row's scorer > 0):
                      lo + (hi - lo) (1 + cos(pi L / cosine_max_len)) / 2, with (lo, hi) =
                      (min_value_correct, max_value_correct) when correct, else (max_value_wrong, min_value_wrong)
  repetition_penalty  max_penalty * (1 - distinct n-grams / n-grams) over lower-cased words; 0 below n words
  length              Kimi 1.5, over the step's responses: l = 0.5 - (L - min L) / (max L - min L);
                      l when correct, min(0, l) when not; 0 for all when every L is equal
  code                fraction of the row's test cases passed (rewards/scorers/code.py, local sandbox)
  binary_code         1 if that fraction > 0.99, else 0
  code_format         `format`'s pattern with a ```<code_language> block inside the answer

Correctness is the row's scorer: open-r1 parses answers with math_verify; a scorer of ours (or the
user's) decides here. Where open-r1 scores an unparseable gold answer 1 (accuracy, cosine), the
scorer's own rule applies.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.rewards.scorers.text import repetition_penalty_reward

# the functions that read the row's scorer (accuracy itself, and correctness for two others)
NEEDS_SCORER = ("accuracy", "cosine", "length")
NAMES = ("accuracy", "format", "tag_count", "reasoning_steps", "cosine", "repetition_penalty", "length", "code",
         "binary_code", "code_format")
_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
_STEPS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")
BINARY_THRESHOLD = 0.99


@dataclasses.dataclass(frozen=True)
class NamedRewards:
    """`custom_reward_function.reward_funcs` with their weights and open-r1's parameters."""

    funcs: tuple[str, ...]
    weights: tuple[float, ...]
    cosine_min_value_wrong: float = 0.0
    cosine_max_value_wrong: float = -0.5
    cosine_min_value_correct: float = 0.5
    cosine_max_value_correct: float = 1.0
    cosine_max_len: int = 1000
    repetition_n_grams: int = 3
    repetition_max_penalty: float = -1.0
    code_language: str = "python"

    def __post_init__(self) -> None:
        for name in self.funcs:
            if name not in NAMES:
                raise ValueError(f"custom_reward_function.reward_funcs: {name!r} is not one of {', '.join(NAMES)}")
        if len(set(self.funcs)) != len(self.funcs):
            raise ValueError(f"custom_reward_function.reward_funcs={list(self.funcs)}: a function is named twice")
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"custom_reward_function.reward_weights={list(self.weights)}: {len(self.weights)} "
                             f"weights for {len(self.funcs)} reward_funcs")
        if self.repetition_max_penalty > 0:
            raise ValueError(f"custom_reward_function.openr1.repetition_max_penalty={self.repetition_max_penalty}: "
                             "must not be positive (open-r1)")

    @property
    def needs_scorer(self) -> bool:
        return any(f in NEEDS_SCORER for f in self.funcs)


def format_reward(text: str) -> float:
    return 1.0 if _FORMAT.match(text) else 0.0


def tag_count_reward(text: str) -> float:
    return 0.25 * sum(text.count(tag) == 1 for tag in ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>"))


def reasoning_steps_reward(text: str) -> float:
    return min(1.0, len(_STEPS.findall(text)) / 3)


def cosine_reward(text: str, correct: bool, p: NamedRewards) -> float:
    cosine = math.cos(len(text) / p.cosine_max_len * math.pi)
    lo, hi = ((p.cosine_min_value_correct, p.cosine_max_value_correct) if correct
              else (p.cosine_max_value_wrong, p.cosine_min_value_wrong))
    return lo + 0.5 * (hi - lo) * (1.0 + cosine)


def length_rewards(texts: Sequence[str], correct: np.ndarray) -> np.ndarray:
    """Kimi 1.5's length reward over one step's responses (open-r1's `len_reward` over its batch)."""
    lengths = np.asarray([len(t) for t in texts], np.float64)
    if len(lengths) == 0 or lengths.max() == lengths.min():
        return np.zeros(len(texts), np.float32)
    lam = 0.5 - (lengths - lengths.min()) / (lengths.max() - lengths.min())
    return np.where(correct, lam, np.minimum(0.0, lam)).astype(np.float32)


def code_format_reward(text: str, language: str) -> float:
    pattern = rf"^<think>\n.*?\n</think>\n<answer>\n.*?```{language}.*?```.*?\n</answer>$"
    return 1.0 if re.match(pattern, text, re.DOTALL | re.MULTILINE) else 0.0


def code_reward(text: str, ground_truth: Any) -> float:
    from jaxrl_llm.rewards.scorers import code

    return code.compute_score(text, ground_truth)


def _per_response(name: str, p: NamedRewards, code_fraction: Callable[[str, Any], float]
                  ) -> Callable[[str, bool, Any], float]:
    """`(response, correct, ground_truth) -> score` for a function scored one response at a time;
    `code_fraction`: `code_reward`, or a cache of it (code and binary_code run the tests once)."""
    return {
        "format": lambda t, c, g: format_reward(t),
        "tag_count": lambda t, c, g: tag_count_reward(t),
        "reasoning_steps": lambda t, c, g: reasoning_steps_reward(t),
        "cosine": lambda t, c, g: cosine_reward(t, c, p),
        "repetition_penalty": lambda t, c, g: repetition_penalty_reward(t, p.repetition_n_grams,
                                                                        p.repetition_max_penalty),
        "code": lambda t, c, g: code_fraction(t, g),
        "binary_code": lambda t, c, g: float(code_fraction(t, g) > BINARY_THRESHOLD),
        "code_format": lambda t, c, g: code_format_reward(t, p.code_language),
    }[name]


def named_scores(p: NamedRewards, responses: Sequence[str], scorer: np.ndarray, ground_truths: Sequence[Any]
                 ) -> tuple[np.ndarray, dict[str, np.ndarray], list[str]]:
    """(the weighted sum per response, each function's scores, the errors): `scorer` is the row's
    scorer's score (accuracy; correct where > 0). A function that raises on a response scores it 0
    (the error is returned, as the scorer's failures are counted)."""
    correct = np.asarray(scorer) > 0
    total = np.zeros(len(responses), np.float32)
    each: dict[str, np.ndarray] = {}
    errors: list[str] = []
    # the fraction of its row's tests a response passes, per (response, ground truth) of this call
    passed: dict[tuple[str, int], float] = {}

    def code_fraction(text: str, truth: Any) -> float:
        key = (text, id(truth))  # the ground truths live through the call
        if key not in passed:
            passed[key] = code_reward(text, truth)
        return passed[key]

    for name, weight in zip(p.funcs, p.weights):
        if name == "accuracy":
            values = np.asarray(scorer, np.float32)
        elif name == "length":
            values = length_rewards(responses, correct)
        else:
            fn = _per_response(name, p, code_fraction)
            values = np.zeros(len(responses), np.float32)
            for i, (text, ok, truth) in enumerate(zip(responses, correct, ground_truths)):
                try:
                    values[i] = fn(text, bool(ok), truth)
                except Exception as err:  # a bad sample (no test cases, a broken row) must not stop the run
                    errors.append(f"{name}: {type(err).__name__}: {err}")
        each[name] = values
        total += np.float32(weight) * values
    return total, each, errors
