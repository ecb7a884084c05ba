"""Metric sinks: console, jsonl file, TensorBoard, Weights & Biases (optional install).

`trainer.logger` is a list of sink names (veRL's key); every sink receives the same flat dict of
veRL-named metrics (`actor/pg_loss`, `timing_s/gen`, ...) once per step or validation.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

SINKS = ("console", "jsonl", "tensorboard", "wandb")
log = logging.getLogger("jaxrl_llm")


def _to_float(value: Any) -> float | None:
    try:
        out = float(np.asarray(value))
    except (TypeError, ValueError):
        return None
    return out


class Tracking:
    """Fans metrics out to the configured sinks. Call `close()` at the end of a run."""

    def __init__(
        self,
        sinks: Iterable[str],
        run_dir: str,
        *,
        project_name: str = "jaxrl_llm",
        experiment_name: str = "run",
        config: Mapping[str, Any] | None = None,
        is_main_process: bool = True,
    ):
        self.sinks = [s for s in sinks]
        unknown = [s for s in self.sinks if s not in SINKS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown sink(s) {unknown}; valid sinks are {list(SINKS)}")
        self.enabled = is_main_process
        self.run_dir = run_dir
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if "jsonl" in self.sinks:
            self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if "tensorboard" in self.sinks:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if "wandb" in self.sinks:
            try:
                import wandb
            except ImportError as err:  # optional dependency
                raise ImportError(
                    "trainer.logger includes 'wandb' but wandb is not installed: pip install 'jaxrl_llm[wandb]'"
                ) from err
            self._wandb = wandb.init(
                project=project_name, name=experiment_name, config=dict(config or {}), dir=run_dir
            )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.enabled:
            return
        scalars = {k: v for k, v in ((k, _to_float(v)) for k, v in metrics.items()) if v is not None}
        if "console" in self.sinks:
            shown = " | ".join(f"{k}:{_fmt(v)}" for k, v in sorted(scalars.items()))
            print(f"step:{step} - {shown}", flush=True)
        if self._jsonl is not None:
            record = {"step": int(step)}
            record.update({k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()})
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_generations(self, name: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """A table of sample generations (input, output, score) for the sinks that can show one."""
        if not self.enabled or not rows:
            return
        if "console" in self.sinks:
            for row in rows[:3]:
                print(f"[{name} @ step {step}] " + json.dumps(row, ensure_ascii=False)[:400], flush=True)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": int(step), name: list(rows)}, ensure_ascii=False) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            text = "\n\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
            self._tb.add_text(name, text, step)
        if self._wandb is not None:
            import wandb

            columns = sorted({k for r in rows for k in r})
            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
            self._wandb.log({name: table}, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _fmt(value: float) -> str:
    if value == 0 or not math.isfinite(value):
        return str(value)
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4f}"


def dump_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append rows to a jsonl file (rollout_data_dir / validation_data_dir dumps)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)
