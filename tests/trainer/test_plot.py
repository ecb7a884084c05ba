"""`plot_run`: one PNG of a run's metrics (from metrics.jsonl or in-memory records), empty panels
labelled instead of failing; `launch/plot.py` on the command line."""
from __future__ import annotations

import json
import logging
import math
import pathlib
import struct
import subprocess
import sys

import numpy as np

from jaxrl_llm.bookkeeping.plot import DPI, FIGSIZE, collect_panels, plot_finished_run, plot_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)


def png_size(path) -> tuple[int, int]:
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def synthetic_run(run_dir: pathlib.Path, steps: int = 6) -> None:
    """A metrics.jsonl as the jsonl sink writes it: validation at step 0 and every 3 steps, a
    generations table line, a non-finite value as a string, a torn last line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "val-core/synthetic/add/reward/mean@1": 0.1, "val-core/gsm8k/reward/mean@4": 0.0}]
    for s in range(1, steps + 1):
        row = {"step": s, "critic/score/mean": s / steps, "actor/ppo_kl": 1e-3 * s, "actor/entropy": 2.0 - 0.1 * s,
               "response_length/mean": 8.0, "perf/throughput": 100.0 + s, "actor/lr": 5e-5,
               "actor/pg_loss": "nan" if s == 2 else 0.1, "training/global_step": float(s)}
        if s % 3 == 0:
            row["val-core/synthetic/add/reward/mean@1"] = 0.1 + s / 10
        lines.append(row)
    lines.append({"step": 3, "val/generations": [{"input": "q", "output": "a", "score": 1.0}]})
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "critic/sco'
    (run_dir / "metrics.jsonl").write_text(text)


def test_plot_run_from_metrics_jsonl(tmp_path, caplog):
    run = tmp_path / "run"
    synthetic_run(run)
    with caplog.at_level(logging.INFO, logger="jaxrl_llm"):
        out = plot_run(run)
    assert out == run / "plot.png" and png_size(out) == (WIDTH, HEIGHT)
    assert "panels with data: reward, validation reward, KL, entropy, response length, throughput, " \
           "learning rate; without: -" in caplog.text
    panels = collect_panels(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1])
    assert sorted(panels["validation reward"]) == ["val-core/gsm8k/reward/mean@4",
                                                   "val-core/synthetic/add/reward/mean@1"]
    assert panels["validation reward"]["val-core/synthetic/add/reward/mean@1"] == ([0, 3, 6], [0.1, 0.4, 0.7])
    steps, rewards = panels["reward"]["critic/score/mean"]
    assert steps == [1, 2, 3, 4, 5, 6] and math.isclose(rewards[-1], 1.0)
    assert list(panels["KL"]) == ["actor/ppo_kl"]


def test_empty_panels_say_so_and_records_replace_the_file(tmp_path, caplog):
    # in-memory records (Trainer.history): no "step" key, numpy scalars; only reward and lr present
    history = [{"training/global_step": float(s), "critic/score/mean": np.float32(0.25 * s), "actor/lr": 1e-5}
               for s in (1, 2)]
    with caplog.at_level(logging.INFO, logger="jaxrl_llm"):
        out = plot_run(tmp_path / "nofile", tmp_path / "elsewhere" / "p.png", records=history)
    assert out == tmp_path / "elsewhere" / "p.png" and png_size(out) == (WIDTH, HEIGHT)
    assert ("panels with data: reward, learning rate; without: validation reward, KL, entropy, "
            "response length, throughput") in caplog.text
    assert collect_panels(history)["reward"]["critic/score/mean"] == ([1, 2], [0.25, 0.5])
    assert png_size(plot_run(tmp_path / "empty", records=[])) == (WIDTH, HEIGHT)  # nothing at all
    # the trainer's end-of-run call: from history when no jsonl file was written, never raising
    assert plot_finished_run(tmp_path / "hist", history, from_file=False) == tmp_path / "hist" / "plot.png"
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        assert plot_finished_run(tmp_path / "missing", history, from_file=True) is None
    assert "could not write" in caplog.text


def test_launch_plot_cli(tmp_path):
    run = tmp_path / "run"
    synthetic_run(run, steps=3)
    out = tmp_path / "cli.png"
    done = subprocess.run([sys.executable, str(ROOT / "launch" / "plot.py"), str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert png_size(out) == (WIDTH, HEIGHT) and str(out) in done.stdout
    missing = subprocess.run([sys.executable, str(ROOT / "launch" / "plot.py"), str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "no metrics" in missing.stderr
