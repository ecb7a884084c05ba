"""The run's record and the metric sinks: console, TensorBoard, Weights & Biases (optional install).

`<run dir>/metrics.jsonl` is always written: it is the run's record (plots, resume, comparisons
read it). `trainer.logger` (veRL's key) only adds sinks; `jsonl` is accepted and names the record.
Every sink receives the same flat dict of veRL-named metrics (`actor/pg_loss`, `timing_s/gen`,
...) once per step or validation.

On resume the record is rewound to the resumed step first (`Tracking.rewind`): records of steps
after it, which the resumed run computes again, are dropped, so no step appears twice; a torn last
line (a run killed mid-write) is dropped too. A W&B run keeps one id per run dir
(`<run dir>/wandb_run_id`), so a resumed job logs into the same W&B run.

Run dirs may be bucket URLs (jaxrl_llm/storage.py). A bucket object cannot be appended to, so there
the record is rewritten whole, at most every `URL_FLUSH_S` seconds and whenever the trainer calls
`flush()` (before each checkpoint, at the end); TensorBoard event files likewise.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jaxrl_llm import storage

SINKS = ("console", "jsonl", "tensorboard", "wandb")
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
URL_FLUSH_S = 60.0
log = logging.getLogger("jaxrl_llm")


def _to_float(value: Any) -> float | None:
    try:
        out = float(np.asarray(value))
    except (TypeError, ValueError):
        return None
    return out


def parse_records(text: str, *, where: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The JSON-object lines of a metrics.jsonl text. A torn or foreign line is dropped (a warning
    names it unless it is the last line, which a killed run may leave half-written)."""
    records = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif i < len(lines) - 1:
            log.warning("%s line %d is not a JSON object; dropped", where, i + 1)
    return records


class RunRecord:
    """`<run dir>/metrics.jsonl`, one JSON object per line, each with its `step`."""

    def __init__(self, path: str):
        self.path = path
        self._remote = storage.is_url(path)
        self._handle = None
        self._lines: list[str] | None = None  # a URL's whole content, rewritten on flush
        self._dirty = False
        self._last_flush = time.monotonic()

    def rewind(self, step: int | None) -> int:
        """Keeps the records of steps <= `step` (None: none) and drops the rest (and a torn last
        line); returns how many records were dropped."""
        self._close_handle()
        records = parse_records(storage.read_text(self.path), where=self.path) if storage.exists(self.path) else []
        kept = [r for r in records if step is not None and int(r.get("step", 0)) <= step]
        lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in kept]
        storage.write_text(self.path, "".join(lines))
        if self._remote:
            self._lines, self._dirty = lines, False
        return len(records) - len(kept)

    def append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=_json_default) + "\n"
        if self._remote:
            if self._lines is None:
                text = storage.read_text(self.path) if storage.exists(self.path) else ""
                self._lines = [ln + "\n" for ln in text.splitlines() if ln.strip()]
            self._lines.append(line)
            self._dirty = True
            if time.monotonic() - self._last_flush >= URL_FLUSH_S:
                self.flush()
            return
        if self._handle is None:
            storage.makedirs(os.path.dirname(self.path))
            # a killed run may have left a torn last line: start on a fresh one
            torn = os.path.exists(self.path) and os.path.getsize(self.path) > 0 and not _ends_with_newline(self.path)
            self._handle = open(self.path, "a", encoding="utf-8")
            if torn:
                self._handle.write("\n")
        self._handle.write(line)
        self._handle.flush()

    def flush(self) -> None:
        if self._remote and self._dirty and self._lines is not None:
            storage.write_text(self.path, "".join(self._lines))
            self._dirty = False
        self._last_flush = time.monotonic()

    def _close_handle(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def close(self) -> None:
        self.flush()
        self._close_handle()


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


class _EventsObject:
    """A TensorBoard events file on a bucket, through epath: buffered, rewritten whole on flush."""

    def __init__(self, path: str):
        self.path, self._buffer = path, bytearray()

    def write(self, data: bytes) -> None:
        self._buffer += data

    def flush(self) -> None:
        storage.write_bytes(self.path, bytes(self._buffer))

    def close(self) -> None:
        self.flush()


class _EventsFactory:
    def open(self, path: str) -> _EventsObject:
        return _EventsObject(path)

    def directory_check(self, path: str) -> None:
        pass  # buckets have no folders


def _tensorboard_writer(logdir: str) -> Any:
    from tensorboardX import SummaryWriter

    if storage.is_url(logdir):  # tensorboardX writes its events through the file object we give it
        from tensorboardX import record_writer

        record_writer.register_writer_factory(storage.scheme(logdir), _EventsFactory())
    return SummaryWriter(logdir)


def wandb_run_id(run_dir: str) -> str:
    """The W&B run id of this run dir: read from `<run dir>/wandb_run_id`, or made and stored there."""
    path = storage.join(run_dir, WANDB_ID_FILE)
    if storage.exists(path):
        found = storage.read_text(path).strip()
        if found:
            return found
    run_id = uuid.uuid4().hex[:12]
    storage.write_text(path, run_id + "\n")
    return run_id


class Tracking:
    """The run's record (`metrics.jsonl`) plus the configured sinks. Call `close()` at the end."""

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
        self.run_dir = storage.normalize(run_dir)
        self.record: RunRecord | None = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        storage.makedirs(self.run_dir)
        self.record = RunRecord(storage.join(self.run_dir, METRICS_FILE))
        if "tensorboard" in self.sinks:
            self._tb = _tensorboard_writer(storage.join(self.run_dir, "tensorboard"))
        if "wandb" in self.sinks:
            try:
                import wandb  # pyright: ignore[reportMissingImports] (the optional wandb extra)
            except ImportError as err:  # optional dependency
                raise ImportError(
                    "trainer.logger includes 'wandb' but wandb is not installed: pip install 'jaxrl_llm[wandb]'"
                ) from err
            # one W&B run per run dir: a resumed job continues it instead of starting a new one;
            # W&B's own files go to a local folder (it cannot write to a bucket)
            local = None if storage.is_url(self.run_dir) else self.run_dir
            self._wandb = wandb.init(project=project_name, name=experiment_name, config=dict(config or {}),
                                     dir=local, id=wandb_run_id(self.run_dir), resume="allow")

    def rewind(self, step: int | None) -> None:
        """Drops the record's entries after `step` (None: all), before a resumed or restarted run
        logs again, so no step appears twice."""
        if self.record is not None:
            dropped = self.record.rewind(step)
            if dropped:
                log.info("%s: dropped %d record(s) after step %s", self.record.path, dropped, step)

    def flush(self) -> None:
        """Makes everything logged so far durable (on a bucket: rewrites the record now)."""
        if self.record is not None:
            self.record.flush()
        if self._tb is not None:
            self._tb.flush()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.enabled:
            return
        scalars = {k: v for k, v in ((k, _to_float(v)) for k, v in metrics.items()) if v is not None}
        if "console" in self.sinks:
            shown = " | ".join(f"{k}:{_fmt(v)}" for k, v in sorted(scalars.items()))
            print(f"step:{step} - {shown}", flush=True)
        if self.record is not None:
            record: dict[str, Any] = {"step": int(step)}
            record.update({k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()})
            self.record.append(record)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            if not storage.is_url(self.run_dir):  # on a bucket each flush rewrites the events file
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
        if self.record is not None:
            self.record.append({"step": int(step), name: [dict(r) for r in rows]})
        if self._tb is not None:
            text = "\n\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
            self._tb.add_text(name, text, step)
        if self._wandb is not None:
            import wandb  # pyright: ignore[reportMissingImports] (the optional wandb extra)

            columns = sorted({k for r in rows for k in r})
            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
            self._wandb.log({name: table}, step=step)

    def close(self) -> None:
        if self.record is not None:
            self.record.close()
            self.record = None
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
    """Writes rows as one jsonl file (rollout_data_dir / validation_data_dir dumps: one file per
    step), replacing it whole: a resumed run that redoes a step rewrites that step's file instead of
    adding its rows a second time. Local path or bucket URL."""
    storage.write_text(path, "".join(json.dumps(row, ensure_ascii=False, default=_json_default) + "\n"
                                     for row in rows))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)
