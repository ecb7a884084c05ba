"""Verdict parsers of a generative reward model (`reward_model.judge.parser`): a judge's text -> a
score, or None when the verdict cannot be read (the caller counts it and uses `default_score`).

    number     the last number in the verdict, clipped to [min_score, max_score], scaled to [0, 1]
    boxed      the last \\boxed{...} holding a number, as `number`
    yes_no     1.0 / 0.0 by the first standalone "yes" or "no" (case-insensitive)
    contains_yes  1.0 if "yes" appears anywhere (case-insensitive, inside words too), else 0.0 if "no"
               does: ROLL's LLMJudgeRewardWorker (`_extract_score_v2`)
    score_tag  "Score: 7/10" -> 0.7; "Score: 7" -> as `number`
    json_rating  the first ```json (else ```) block's JSON object, its "rating" within [min_score, max_score],
               scaled to [0, 1]; out of range or unreadable: no score (Trinity's rubric judge)
    file.py:fn a user function fn(verdict, prompt=..., response=..., ground_truth=...) -> float | None
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
from typing import Any, Callable, cast

JUDGE_PARSERS = ("number", "boxed", "yes_no", "contains_yes", "score_tag", "json_rating")
# what reward_model.judge.template may name ({rubric}: the row's rubric, with reward_model.judge.rubric_key)
JUDGE_FIELDS = frozenset({"prompt", "response", "ground_truth", "rubric"})

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?)\s*\}")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_SCORE_TAG = re.compile(r"score\s*[:=]\s*([-+]?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?", re.IGNORECASE)

Parser = Callable[..., "float | None"]


@dataclasses.dataclass(frozen=True)
class ScoreRange:
    """The scale a template asks the judge for (`number`, `boxed`, `score_tag` without a denominator)."""

    low: float = 0.0
    high: float = 10.0

    def scaled(self, value: float) -> float:
        clipped = min(max(value, self.low), self.high)
        return (clipped - self.low) / (self.high - self.low)


def parse_number(verdict: str, scale: ScoreRange) -> float | None:
    found = _NUMBER.findall(verdict)
    return scale.scaled(float(found[-1])) if found else None


def parse_boxed(verdict: str, scale: ScoreRange) -> float | None:
    found = _BOXED.findall(verdict)
    return scale.scaled(float(found[-1])) if found else None


def parse_yes_no(verdict: str, scale: ScoreRange) -> float | None:
    del scale
    found = _YES_NO.search(verdict)
    return None if found is None else float(found.group(1).lower() == "yes")


def parse_contains_yes(verdict: str, scale: ScoreRange) -> float | None:
    del scale
    text = verdict.lower()
    return 1.0 if "yes" in text else 0.0 if "no" in text else None


def parse_score_tag(verdict: str, scale: ScoreRange) -> float | None:
    found = _SCORE_TAG.findall(verdict)
    if not found:
        return None
    value, out_of = found[-1]
    if out_of:
        denominator = float(out_of)
        return None if denominator <= 0 else min(max(float(value) / denominator, 0.0), 1.0)
    return scale.scaled(float(value))


def parse_json_rating(verdict: str, scale: ScoreRange) -> float | None:
    """Trinity's RubricJudgeWorkflow reading: the text between the first ```json (else ```) and the next ```,
    as JSON; its "rating", a number within the scale, scaled."""
    start = verdict.find("```json")
    if start < 0:
        start = verdict.find("```")
    end = verdict.find("```", start + 3) if start >= 0 else -1
    if end < 0:
        return None
    block = verdict[start:end].strip()
    block = block.replace("```json", "", 1) if "```json" in block else block.replace("```", "", 1)
    try:
        parsed = json.loads(block.strip())
    except ValueError:
        return None
    rating = parsed.get("rating") if isinstance(parsed, dict) else None
    if isinstance(rating, bool) or not isinstance(rating, (int, float)) or not scale.low <= rating <= scale.high:
        return None
    return scale.scaled(float(rating))


_BUILTIN = {"number": parse_number, "boxed": parse_boxed, "yes_no": parse_yes_no, "contains_yes": parse_contains_yes,
            "score_tag": parse_score_tag, "json_rating": parse_json_rating}


def parser_file(name: str) -> tuple[str, str] | None:
    """(file, function) of a user parser named 'file.py:function'; None for any other name."""
    path, _, function = name.rpartition(":")
    return (path, function) if path.endswith(".py") and function else None


def load_parser(name: str, scale: ScoreRange) -> Parser:
    """`parser(verdict, **row) -> float | None` for a built-in name or 'file.py:function'."""
    if name in _BUILTIN:
        builtin = _BUILTIN[name]
        return lambda verdict, **row: builtin(verdict, scale)
    user = parser_file(name)
    if user is None:
        raise ValueError(f"reward_model.judge.parser={name!r}: one of {', '.join(JUDGE_PARSERS)} or 'file.py:function'")
    path, function = os.path.abspath(os.path.expanduser(user[0])), user[1]
    if not os.path.isfile(path):
        raise ValueError(f"reward_model.judge.parser={name!r}: no such file {path}")
    spec = importlib.util.spec_from_file_location(f"jaxrl_llm_judge_parser_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ValueError(f"reward_model.judge.parser={name!r}: {path} defines no function {function!r}")
    return cast(Parser, fn)  # the user's function: read_verdict checks what it returns


def read_verdict(parser: Parser, verdict: str, row: dict[str, Any]) -> float | None:
    """The parser's score of one verdict; None when it cannot be read (no score, a non-finite one, or
    a user parser that raised)."""
    try:
        value = parser(verdict, **row)
    except Exception:  # a user parser's bad verdict is a parse failure, not a crashed step
        return None
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None
