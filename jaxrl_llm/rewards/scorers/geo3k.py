"""Geometry3K scorer (`hiyouga/geometry3k`, veRL's vision-language GRPO recipe) with veRL's weights: 0.9 x the
accuracy of the last `\\boxed{...}` (compared as the MATH scorer compares, math_boxed.is_equiv) + 0.1 x the
format (the whole response is `<think>...</think>` then text holding a `\\boxed{...}`)."""
from __future__ import annotations

import re

from jaxrl_llm.rewards.scorers import math_boxed

SOURCES = ("hiyouga/geometry3k",)
FORMAT_WEIGHT = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_score(response: str) -> float:
    return float(_FORMAT.fullmatch(response.strip()) is not None)


def accuracy_score(response: str, ground_truth: str) -> float:
    boxed = math_boxed.last_boxed(response)
    if boxed is None:
        return 0.0
    try:
        answer = math_boxed.unbox(boxed)
    except ValueError:
        return 0.0
    return float(math_boxed.is_equiv(answer, str(ground_truth)))


def compute_score(response: str, ground_truth: str) -> dict:
    accuracy = accuracy_score(response, ground_truth)
    fmt = format_score(response)
    return {"score": (1.0 - FORMAT_WEIGHT) * accuracy + FORMAT_WEIGHT * fmt, "acc": accuracy, "format": fmt}
