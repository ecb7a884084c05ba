"""Plot a run's metrics into one PNG.

    python launch/plot.py RUN_DIR [--out FILE]

Reads RUN_DIR/metrics.jsonl (written by the `jsonl` logger) and draws reward, validation reward,
KL, entropy, response length, throughput and learning rate against the step into FILE (default
RUN_DIR/plot.png; the trainer writes that one itself at the end of every run).
"""
from __future__ import annotations

import argparse
import sys

from jaxrl_llm.bookkeeping.plot import collect_panels, plot_run, read_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run folder holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output PNG (default: RUN_DIR/plot.png)")
    args = parser.parse_args(argv)
    try:
        records = read_metrics(f"{args.run_dir}/metrics.jsonl")
    except FileNotFoundError:
        print(f"no metrics at {args.run_dir}/metrics.jsonl (log with trainer.logger including 'jsonl')",
              file=sys.stderr)
        return 1
    out = plot_run(args.run_dir, args.out, records=records)
    panels = collect_panels(records)
    empty = [name for name, series in panels.items() if not series]
    print(f"wrote {out}" + (f" (no data: {', '.join(empty)})" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
