"""Type-checks jaxrl_llm with basedpyright (settings: pyrightconfig.json; stubs for untyped libraries:
typings/) and holds every file to its count of known errors in scripts/typecheck_baseline.json.

    python scripts/typecheck.py            # fails when a file has more errors than its baseline
    python scripts/typecheck.py --update   # writes the current counts as the new baseline

A file not in the baseline must have none. The baseline only goes down: fixing errors in a file and
running --update keeps them fixed. The goal is an empty baseline (zero findings).
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASELINE = ROOT / "scripts" / "typecheck_baseline.json"


def error_counts() -> dict[str, int]:
    """{file relative to the repo: errors} from one basedpyright run over the package."""
    run = subprocess.run([sys.executable, "-m", "basedpyright", "--outputjson"], cwd=ROOT, capture_output=True,
                         text=True)
    try:
        report = json.loads(run.stdout)
    except json.JSONDecodeError:
        sys.exit(f"basedpyright did not report (exit {run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    counts: collections.Counter[str] = collections.Counter()
    for diag in report["generalDiagnostics"]:
        if diag["severity"] == "error":
            counts[str(pathlib.Path(diag["file"]).resolve().relative_to(ROOT))] += 1
    print(f"basedpyright: {sum(counts.values())} errors in {report['summary']['filesAnalyzed']} files")
    return dict(sorted(counts.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="write the current counts as the baseline")
    args = parser.parse_args()
    counts = error_counts()
    if args.update:
        BASELINE.write_text(json.dumps(counts, indent=1) + "\n")
        print(f"baseline written: {BASELINE.relative_to(ROOT)}")
        return 0
    baseline = json.loads(BASELINE.read_text())
    worse = {f: (n, baseline.get(f, 0)) for f, n in counts.items() if n > baseline.get(f, 0)}
    better = {f: (counts.get(f, 0), n) for f, n in baseline.items() if counts.get(f, 0) < n}
    for f, (now, before) in sorted(worse.items()):
        print(f"  {f}: {now} errors, baseline {before}")
    if worse:
        print("new type errors: `basedpyright <file>` lists them; fix them (the baseline never goes up)")
        return 1
    if better:
        print(f"{len(better)} file(s) below their baseline: run `python scripts/typecheck.py --update` to keep it so")
    return 0


if __name__ == "__main__":
    sys.exit(main())
