"""Rule-based scorers and `default_compute_score`, the veRL-compatible dispatch on `data_source`.

    default_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

  openai/gsm8k                                   gsm8k.compute_score (strict `#### N`; 1 / 0)
  lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
                                                 math_boxed.compute_score (last \\boxed{}; 1 / 0)
  math_dapo, math, math_dapo_reasoning, aime*    math_dapo.compute_score (`Answer:`; dict, 1 / -1;
                                                 kwargs strict_box_verify, lenient)
  synthetic/<task>                               synthetic.compute_score (1 / 0)
  code, codecontests, apps, codeforces, taco     code.compute_score (the row's test cases run in the
                                                 sandbox; fraction passed)
  crossthinkqa                                   crossthinkqa.compute_score (a choice letter; ROLL's rewards,
                                                 kwarg reward_type loose / soft / strict)
  ifeval                                         ifeval.compute_score (the JSON ground truth's IF check; 1 / 0)
  hiyouga/geometry3k                             geo3k.compute_score (dict: 0.9 x the boxed answer + 0.1 x
                                                 the <think> / \boxed format, veRL's weights)

Another data source raises `UnknownDataSourceError` (a config problem, not a bad sample: the
reward managers let it through instead of scoring 0).
"""
from __future__ import annotations

from typing import Any

from jaxrl_llm.rewards.scorers import code, crossthinkqa, geo3k, gsm8k, ifeval, math_boxed, math_dapo, synthetic

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")


class UnknownDataSourceError(NotImplementedError):
    """default_compute_score has no scorer for this data_source."""


def has_builtin_scorer(data_source: str) -> bool:
    """Whether `default_compute_score` scores `data_source` (the dispatch below)."""
    return (data_source == "openai/gsm8k" or data_source in MATH_SOURCES or data_source in DAPO_SOURCES
            or data_source in code.SOURCES or data_source in crossthinkqa.SOURCES or data_source in ifeval.SOURCES
            or data_source in geo3k.SOURCES or data_source.startswith(("aime", "synthetic/")))


BUILTIN_SOURCES = ("openai/gsm8k", *MATH_SOURCES, *DAPO_SOURCES, "aime*", "synthetic/<task>", *code.SOURCES,
                   *crossthinkqa.SOURCES, *ifeval.SOURCES, *geo3k.SOURCES)


# the data sources whose scorer parses a structured ground truth (a ValueError / TypeError names the problem)
GROUND_TRUTH_PARSERS = {**dict.fromkeys(code.SOURCES, code.parse_tests), **dict.fromkeys(ifeval.SOURCES,
                                                                                        ifeval.parse_constraint)}


def ground_truth_problem(data_source: str, ground_truth: Any) -> str | None:
    """Why `default_compute_score` could not read this row's ground truth (None: it can): the math and
    synthetic scorers compare against a string (numbers read from a file are strings by then), the code
    scorer parses its test cases. Checked when the rows are loaded, as the prompts are."""
    if data_source in GROUND_TRUTH_PARSERS:
        try:
            GROUND_TRUTH_PARSERS[data_source](ground_truth)
        except (ValueError, TypeError) as err:
            return str(err)
        return None
    if has_builtin_scorer(data_source) and not isinstance(ground_truth, str):
        return (f"the {data_source!r} scorer compares the answer with a string ground truth; this row's is a "
                f"{type(ground_truth).__name__} ({str(ground_truth)[:80]!r})")
    return None


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict:
    """veRL's default scorer dispatch; a dict result keeps its extra keys (they become metrics)."""
    if data_source == "openai/gsm8k":
        result: Any = gsm8k.compute_score(solution_str, ground_truth, method=kwargs.get("method", "strict"))
    elif data_source in MATH_SOURCES:
        result = math_boxed.compute_score(solution_str, ground_truth)
    elif data_source in DAPO_SOURCES or data_source.startswith("aime"):
        result = math_dapo.compute_score(solution_str, ground_truth,
                                         strict_box_verify=bool(kwargs.get("strict_box_verify", False)),
                                         lenient=bool(kwargs.get("lenient", False)))
    elif data_source.startswith("synthetic/"):
        result = synthetic.compute_score(solution_str, ground_truth, extra_info)
    elif data_source in code.SOURCES:
        result = code.compute_score(solution_str, ground_truth)
    elif data_source in crossthinkqa.SOURCES:
        result = crossthinkqa.compute_score(solution_str, ground_truth, str(kwargs.get("reward_type", "soft")))
    elif data_source in ifeval.SOURCES:
        result = ifeval.compute_score(solution_str, ground_truth)
    elif data_source in geo3k.SOURCES:
        result = geo3k.compute_score(solution_str, ground_truth)
    else:
        raise UnknownDataSourceError(
            f"no built-in scorer for data_source={data_source!r}; set custom_reward_function.path"
        )
    return result if isinstance(result, dict) else float(result)


__all__ = ["BUILTIN_SOURCES", "DAPO_SOURCES", "MATH_SOURCES", "UnknownDataSourceError", "default_compute_score",
           "ground_truth_problem", "has_builtin_scorer"]
