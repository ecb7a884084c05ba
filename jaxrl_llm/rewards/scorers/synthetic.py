"""Scorer for the synthetic tasks of `jaxrl_llm.data.synthetic` (data sources `synthetic/<task>`).

`extra_info["answer_format"]` picks the rule (default "strict"):
  strict   the whole response, stripped of surrounding whitespace, equals the ground truth;
  lenient  numeric answers: the last integer in the response equals it; text answers: it appears
           as whole words, case-insensitively;
  first    the answer comes first: numeric answers: the first integer in the response equals it
           ("13", "The answer is 13."; not "6 + 7 = 13"); text answers: the response starts with
           it, case-insensitively.
Scores are 1.0 / 0.0. The `guess` task is scored by its interaction (GuessNumberEnv): 0.0 here.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ANSWER_FORMATS = ("strict", "lenient", "first")
_INTEGER = re.compile(r"-?\d+")


def compute_score(response: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    if (extra_info or {}).get("task") == "guess":
        return 0.0  # the interaction's reward is the score (rollout/multi_turn.py adds it)
    answer_format = (extra_info or {}).get("answer_format", "strict")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"extra_info['answer_format']={answer_format!r} is not one of {ANSWER_FORMATS}")
    truth = str(ground_truth).strip()
    if answer_format == "strict":
        return float(response.strip() == truth)
    if _INTEGER.fullmatch(truth):
        numbers = _INTEGER.findall(response)
        pick = 0 if answer_format == "first" else -1
        return float(bool(numbers) and int(numbers[pick]) == int(truth))
    if answer_format == "first":
        return float(response.strip().lower().startswith(truth.lower()))
    pattern = r"(?<!\w)" + r"\s+".join(re.escape(w) for w in truth.split()) + r"(?!\w)"
    return float(re.search(pattern, response, flags=re.IGNORECASE) is not None)
