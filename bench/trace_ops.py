"""Where a traced run's time goes: the ops of a `jax.profiler` trace, summed by op family.

    python bench/trace_ops.py TRACE_DIR [--per N] [--top 30] [--exact]

TRACE_DIR is what `jax.profiler.trace(TRACE_DIR, create_perfetto_trace=True)` wrote; the newest
`perfetto_trace.json.gz` under it is read. An op family is the op's name without its numeric suffix
(`ynn_fusion.3` and `ynn_fusion` are one family, `loop_gather_fusion_12` is `loop_gather_fusion`),
summed per process (the CPU runs ops on the host process's XLA threads, a GPU on its device's
streams). The executor's spans, the Python thread's (which contain the ops or wait for them) and a device
thread's waits on the others (collectives' rendezvous on CPU) are
left out. `--per N`
divides the times by N (the run's decode steps: ms per step).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re

# spans that contain the ops (the host's view of a call), not ops themselves
_WRAPPERS = re.compile(r"^(\$|ThunkExecutor|PjitFunction|CommonPjRt|PjRt|SlinkyThreadPool|TfrtCpu|"
                       r"ExecuteHelper|Thunk::|end: |while(\.\d+)?$|conditional(\.\d+)?$|call(\.\d+)?$|"
                       r"Wait[: ]|Rendezvous|InvokeRendezvous)")  # the last: a device thread waiting on another
_SUFFIX = re.compile(r"([._]\d+)+$")


def newest_trace(trace_dir: str | pathlib.Path) -> pathlib.Path:
    """The newest perfetto trace file under `trace_dir`."""
    found = sorted(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz (trace with create_perfetto_trace=True)")
    return found[-1]


def op_families(trace_dir: str | pathlib.Path, exact: bool = False) -> list[dict]:
    """[{process, op, ms, count}] of the trace's ops by family (`exact`: by full name), longest first
    (see the module doc)."""
    data = json.loads(gzip.open(newest_trace(trace_dir)).read())
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    python_threads = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
                      and e["args"].get("name") == "python"}
    rows = [{"process": processes.get(e.get("pid"), str(e.get("pid"))), "op": e["name"], "ms": e.get("dur", 0) / 1e3,
             "count": 1} for e in events
            if e.get("ph") == "X" and not _WRAPPERS.match(e.get("name", ""))
            and (e.get("pid"), e.get("tid")) not in python_threads]
    return _summed(rows, lambda op: op) if exact else by_family(rows)


def by_family(rows: list[dict]) -> list[dict]:
    """`rows` (op_families' by full name, or single events) summed by op family, longest first."""
    return _summed(rows, lambda op: _SUFFIX.sub("", op))


def _summed(rows: list[dict], key) -> list[dict]:
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for row in rows:
        k = (row["process"], key(row["op"]))
        totals[k] += row["ms"]
        counts[k] += row["count"]
    return [{"process": p, "op": op, "ms": ms, "count": counts[(p, op)]} for (p, op), ms in totals.most_common()]


def ops_only_trace(trace_dir: str | pathlib.Path):
    """`jax.profiler.trace` into `trace_dir` with a perfetto trace and XLA's ops only (no Python call
    events: the profiler keeps a bounded number of events)."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options)


def traced_steps(exact_rows: list[dict], layers: int, steps: int) -> int:
    """How many of a run's `steps` decode steps the trace holds (the profiler keeps a bounded number
    of events, the run's first ones): the call count of `op_families(..., exact=True)` that carries
    the most op time among counts of at least `layers` (the layers' matmuls, once per layer and
    step), divided by `layers`; at most `steps`."""
    time_by_count: collections.Counter = collections.Counter()
    for row in exact_rows:
        if row["count"] >= layers:
            time_by_count[row["count"]] += row["ms"]
    per_layer = time_by_count.most_common(1)[0][0] if time_by_count else layers
    return min(steps, max(1, round(per_layer / layers)))


def table(rows: list[dict], per: float = 1.0, top: int = 30) -> str:
    """The families as text lines: ms (divided by `per`), share of the process's total, count, name."""
    by_process: dict[str, float] = collections.defaultdict(float)
    for row in rows:
        by_process[row["process"]] += row["ms"]
    lines = []
    for process, total in sorted(by_process.items(), key=lambda kv: -kv[1]):
        lines.append(f"{process}: {total / per:.2f} ms in ops" + (f" (times / {per:g})" if per != 1 else ""))
        for row in [r for r in rows if r["process"] == process][:top]:
            lines.append(f"  {row['ms'] / per:10.3f} ms {row['ms'] / total:6.1%} {row['count']:8d}  {row['op'][:90]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--per", type=float, default=1.0, help="divide times by this (e.g. the decode steps)")
    parser.add_argument("--top", type=int, default=30, help="families shown per process")
    parser.add_argument("--exact", action="store_true", help="by full op name (ynn_fusion.3 apart from ynn_fusion)")
    args = parser.parse_args(argv)
    print(table(op_families(args.trace_dir, args.exact), args.per, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
