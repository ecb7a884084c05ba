"""One PNG per run: reward, validation reward, KL, entropy, response length, throughput and learning
rate against the step, read from `<run_dir>/metrics.jsonl` (the run's record) or from records
given in memory (`Trainer.history`).

    from jaxrl_llm.bookkeeping.plot import plot_run
    plot_run("runs/quickstart")                  # -> runs/quickstart/plot.png
    python launch/plot.py runs/quickstart [--out FILE]

Drawn with matplotlib's Agg canvas (a `Figure`, not pyplot), so it works headless and leaves a
notebook's backend alone. A panel whose metrics never appear says "no data" instead of failing.
"""
from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from etils import epath

log = logging.getLogger("jaxrl_llm")

# (title, y label, exact metric names or one regular expression)
PANELS: tuple[tuple[str, str, Any], ...] = (
    ("reward", "critic/score/mean", ("critic/score/mean",)),
    ("validation reward", "val-core/*/reward/mean@*", re.compile(r"^val-core/.+/reward/mean@\d+$")),
    ("KL", "kl", ("actor/kl_loss", "actor/ppo_kl", "actor/reward_kl_penalty")),
    ("entropy", "actor/entropy", ("actor/entropy",)),
    ("response length", "tokens", ("response_length/mean",)),
    ("throughput", "tokens / s / device", ("perf/throughput",)),
    ("learning rate", "actor/lr", ("actor/lr",)),
)
FIGSIZE = (12.0, 12.0)  # inches; at DPI this is 1200 x 1200 pixels
DPI = 100

Series = dict[str, tuple[list[int], list[float]]]


def _path(path: str | os.PathLike) -> pathlib.Path | epath.Path:
    """A local `pathlib.Path`, or an `epath.Path` for a bucket URL (jaxrl_llm/storage.py)."""
    from jaxrl_llm import storage

    return storage.as_path(path) if storage.is_url(path) else pathlib.Path(path)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file; lines that are not JSON objects (a torn last line) are
    skipped."""
    records = []
    with _path(path).open("r", encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)  # the jsonl sink writes non-finite values as strings
    try:  # numpy scalars (records from Trainer.history)
        import numpy as np

        if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
            return float(value)
    except ImportError:  # pragma: no cover
        pass
    return None


def _step(record: Mapping[str, Any], index: int) -> int:
    for key in ("step", "training/global_step"):
        value = _number(record.get(key))
        if value is not None and math.isfinite(value):
            return int(value)
    return index


def _matches(key: str, spec: Any) -> bool:
    return bool(spec.match(key)) if isinstance(spec, re.Pattern) else key in spec


def collect_panels(records: Iterable[Mapping[str, Any]]) -> dict[str, Series]:
    """Per panel title, `{metric: (steps, values)}` sorted by step (the last record wins for a step
    logged twice, e.g. after a resume); a panel without data maps to `{}`."""
    by_key: dict[str, dict[int, float]] = {}
    for index, record in enumerate(records):
        step = _step(record, index)
        for key, raw in record.items():
            value = _number(raw)
            if value is not None and any(_matches(key, spec) for _, _, spec in PANELS):
                by_key.setdefault(key, {})[step] = value
    out: dict[str, Series] = {}
    for title, _, spec in PANELS:
        keys = [k for k in spec if k in by_key] if not isinstance(spec, re.Pattern) else sorted(
            k for k in by_key if spec.match(k))
        out[title] = {}
        for key in keys:
            steps = sorted(by_key[key])
            out[title][key] = (steps, [by_key[key][s] for s in steps])
    return out


def plot_run(run_dir: str | os.PathLike, out_path: str | os.PathLike | None = None, *,
             records: Sequence[Mapping[str, Any]] | None = None,
             title: str | None = None) -> pathlib.Path | epath.Path:
    """Draw the run's metrics into one PNG (default `<run_dir>/plot.png`) and return its path.

    Reads `<run_dir>/metrics.jsonl` unless `records` (e.g. `Trainer.history`) are given. Which
    panels had data is logged (logger `jaxrl_llm`, INFO); `collect_panels(records)` returns it.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run_dir = _path(run_dir)
    if records is None:
        source = run_dir / "metrics.jsonl"
        if not source.exists():
            raise FileNotFoundError(f"no metrics at {str(source)!r} (every training run writes it); "
                                    "or pass records= (e.g. Trainer.history)")
        records = read_metrics(source)
    out = _path(out_path) if out_path is not None else run_dir / "plot.png"
    panels = collect_panels(records)

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 2).ravel()
    for ax, (name, ylabel, _) in zip(axes, PANELS):
        series = panels[name]
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for key, (steps, values) in series.items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        if len(series) > 1 or name in ("validation reward", "KL"):
            ax.legend(fontsize=7)
    axes[-1].axis("off")
    with_data = [name for name, series in panels.items() if series]
    without = [name for name, series in panels.items() if not series]
    steps = [s for series in panels.values() for xs, _ in series.values() for s in xs]
    summary = f"run: {run_dir.name or run_dir}\nlast step: {max(steps) if steps else '-'}\nno data: "
    summary += "".join(f"\n  {name}" for name in without) if without else "-"
    axes[-1].text(0.05, 0.95, summary, va="top", fontsize=10, transform=axes[-1].transAxes)
    fig.suptitle(title or f"{run_dir.name or run_dir}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as handle:  # a file object: matplotlib would open a URL as a local path
        fig.savefig(handle, format="png")
    log.info("%s: panels with data: %s; without: %s", out, ", ".join(with_data) or "-", ", ".join(without) or "-")
    return out


def plot_finished_run(run_dir: str | os.PathLike, history: Sequence[Mapping[str, Any]], *,
                      from_file: bool) -> pathlib.Path | epath.Path | None:
    """The trainer's end-of-run plot, `<run_dir>/plot.png`: from metrics.jsonl when the jsonl
    logger wrote it (`from_file`), else from `history`. Never fails a run: problems are logged."""
    try:
        return plot_run(run_dir, records=None if from_file else list(history))
    except Exception as err:  # (a plot must not fail a finished run)
        log.warning("could not write %s/plot.png: %s", run_dir, err)
        return None
