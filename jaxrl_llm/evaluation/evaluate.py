"""Score a file of responses and report per data source (`launch/evaluate.py`; veRL's main_eval).

Each row's responses (`evaluation.response_key`: a list, or one string) are scored with the row's
`data_source` (`evaluation.data_source_key`) and ground truth (`row[evaluation.reward_model_key]
["ground_truth"]`) by the built-in scorers (veRL's, case for case: rewards/scorers) or
`custom_reward_function.path` / `name` / `reward_kwargs`; a row's `extra_info` goes to the scorer as
veRL passes it. A dict result's `score` is the score. The report (evaluation/metrics.py: mean@n,
pass@k, best@k per data source) is printed as a table and written as JSON.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxrl_llm import storage
from jaxrl_llm.data.sources import DataError, read_files
from jaxrl_llm.evaluation.metrics import summarize, table
from jaxrl_llm.rewards import ScorerSpec


def _responses(row: Mapping[str, Any], key: str, where: object) -> list[str]:
    if key not in row:
        raise DataError(f"{where}: missing column {key!r} (evaluation.response_key); columns are {sorted(row)}")
    value = row[key]
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise DataError(f"{where}: column {key!r} is not a string or a non-empty list of strings; got "
                    f"{type(value).__name__}: {str(value)[:80]!r}")


def _ground_truth(row: Mapping[str, Any], key: str, where: object) -> Any:
    value = row.get(key)
    if isinstance(value, Mapping) and "ground_truth" in value:
        return value["ground_truth"]
    raise DataError(f"{where}: column {key!r} (evaluation.reward_model_key) has no ground_truth; got "
                    f"{str(value)[:80]!r}")


def score_value(result: Any, where: object) -> float:
    """A scorer's result as a number (a dict's `score`)."""
    value: Any = result.get("score") if isinstance(result, Mapping) else result
    try:
        return float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}: the scorer returned {str(result)[:80]!r}, not a number or a dict with a "
                        "score") from None


def score_rows(rows: Sequence[Mapping[str, Any]], refs: Sequence[object], compute_score: Callable[..., Any], *,
               response_key: str, data_source_key: str, reward_model_key: str) -> tuple[list[str], list[list[float]]]:
    """(each row's data source, the scores of its responses)."""
    sources, scores = [], []
    for row, where in tqdm(list(zip(rows, refs)), desc="scoring", unit="row"):
        if data_source_key not in row:
            raise DataError(f"{where}: missing column {data_source_key!r} (evaluation.data_source_key)")
        source = str(row[data_source_key])
        truth = _ground_truth(row, reward_model_key, where)
        extra = row.get("extra_info")
        extra = dict(extra) if isinstance(extra, Mapping) else None
        scores.append([score_value(compute_score(source, r, truth, extra), where)
                       for r in _responses(row, response_key, where)])
        sources.append(source)
    return sources, scores


def evaluate_file(path: str, scorer: ScorerSpec, *, response_key: str = "responses",
                  data_source_key: str = "data_source", reward_model_key: str = "reward_model",
                  threshold: float = 0.0, output_path: str | None = None) -> dict[str, dict[str, float]]:
    """Scores `path` and writes the JSON report (default: `<path without suffix>.eval.json`); returns it."""
    rows, refs = read_files([path])
    if not rows:
        raise DataError(f"{path}: no rows")
    sources, scores = score_rows(rows, refs, scorer.load(), response_key=response_key,
                                 data_source_key=data_source_key, reward_model_key=reward_model_key)
    summary = summarize(sources, scores, threshold=threshold)
    out = output_path or os.path.splitext(path)[0] + ".eval.json"
    storage.write_text(out, json.dumps({"path": path, "metrics": summary}, indent=2) + "\n")
    print(table(summary))
    print(f"report: {out}")
    return summary
