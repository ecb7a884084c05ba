"""configs/distill_context.py learns on the CPU (launch/train.py in a subprocess, one CPU device, as a
user runs it), in CI: trained on the reverse KL to a teacher that alone sees two worked examples,
SmolLM2-135M-Instruct's greedy answers become bare numbers (the format score, measured and never
trained on, 0.0 -> 1.0 within six steps) and `distill/reverse_kl` falls. (A file of its own, as the
judge example: each minutes long, so the two CI workers run them side by side.)"""
from __future__ import annotations

import numpy as np
import pytest
from tiny_runs import train_example

# the real SmolLM2, 6 steps
pytestmark = pytest.mark.slow


def test_context_distillation_example_learns(tmp_path, smollm2_gguf):
    # validated on 16 of the config's 32 questions (before step 1 and after step 6): each validation is
    # greedy decoding of the whole set, the run's costliest part after the steps
    rows = train_example(tmp_path / "run", "configs/distill_context.py", "--config.trainer.total_training_steps=6",
                         "--config.trainer.test_freq=6", "--config.data.synthetic.n_val=16")
    key = "val-core/synthetic/add/reward/mean@1"
    val = [r[key] for r in rows if key in r]
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    # measured (12 steps): greedy bare-number answers 0.0 -> 1.0 at step 6; reverse KL 0.61 / 0.74 / 0.79
    # over steps 1-3 -> 0.36 / 0.37 / 0.34 over steps 5-7; as run here (2026-12-06, 16 questions): 0.0 -> 1.0,
    # reverse KL 0.78 0.79 0.82 0.31 0.52 0.19
    assert len(val) == 2 and val[0] <= 0.2 and val[1] >= 0.75, val
    assert len(kl) == 6 and np.mean(kl[-2:]) < 0.75 * np.mean(kl[:3]), kl
    assert all(r["timing_s/teacher"] > 0 for r in rows if "distill/reverse_kl" in r)
