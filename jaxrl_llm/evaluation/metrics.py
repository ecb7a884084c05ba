"""Offline metrics of n scored responses per prompt, per data source.

- mean@n: the mean over prompts of each prompt's mean score (veRL main_eval's `test_score/<data_source>`).
- pass@k: the probability that at least one of k responses drawn without replacement from a prompt's n
  is correct (score > threshold), 1 - C(n - c, k) / C(n, k) with c correct (the unbiased estimator of
  Chen et al. 2021), averaged over prompts.
- best@k: the expected best score of k responses drawn without replacement from a prompt's n: with the
  scores sorted ascending s_1..s_n, sum_i s_i C(i - 1, k - 1) / C(n, k) (exact, no sampling), averaged.

k runs over 1, 2, 4, ... up to n, and n itself; prompts with fewer responses than k are left out of @k.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np


def pass_at_k(correct: int, n: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): some of k draws (without replacement) from n with c correct is correct."""
    if k > n:
        raise ValueError(f"pass@{k} of {n} responses")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def best_at_k(scores: Sequence[float], k: int) -> float:
    """The expected maximum of k of `scores` drawn without replacement (exact)."""
    n = len(scores)
    if k > n:
        raise ValueError(f"best@{k} of {n} responses")
    ordered = np.sort(np.asarray(scores, np.float64))
    weights = np.asarray([math.comb(i, k - 1) for i in range(n)], np.float64) / math.comb(n, k)
    return float(np.dot(ordered, weights))


def ks_of(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n."""
    ks = [1 << j for j in range(max(n, 1).bit_length()) if (1 << j) < n]
    return ks + [n]


def summarize(sources: Sequence[str], scores: Sequence[Sequence[float]], *, threshold: float = 0.0
              ) -> dict[str, dict[str, float]]:
    """{data_source: {"prompts", "responses", "mean@n", "pass@k", "best@k", ...}} over rows of
    (data source, the scores of its responses); "all" over every row when there are several sources."""
    by_source: dict[str, list[Sequence[float]]] = defaultdict(list)
    for source, row in zip(sources, scores):
        by_source[str(source)].append(row)
    if len(by_source) > 1:
        by_source["all"] = list(scores)
    return {source: _summary(rows, threshold) for source, rows in by_source.items()}


def _summary(rows: list[Sequence[float]], threshold: float) -> dict[str, float]:
    n = max(len(r) for r in rows)
    out: dict[str, float] = {"prompts": float(len(rows)), "responses": float(sum(len(r) for r in rows)),
                             f"mean@{n}": float(np.mean([np.mean(r) for r in rows]))}
    for k in ks_of(n):
        eligible = [r for r in rows if len(r) >= k]
        out[f"pass@{k}"] = float(np.mean([pass_at_k(sum(s > threshold for s in r), len(r), k) for r in eligible]))
        out[f"best@{k}"] = float(np.mean([best_at_k(r, k) for r in eligible]))
    return out


def table(summary: dict[str, dict[str, float]]) -> str:
    """The summary as a plain-text table (one row per data source)."""
    columns = list(dict.fromkeys(key for row in summary.values() for key in row))
    lines = ["data_source".ljust(28) + "".join(c.rjust(11) for c in columns)]
    for source, row in summary.items():
        cells = "".join((f"{row[c]:.0f}" if c in ("prompts", "responses") else f"{row[c]:.4f}").rjust(11)
                        if c in row else "-".rjust(11) for c in columns)
        lines.append(source[:27].ljust(28) + cells)
    return "\n".join(lines)
