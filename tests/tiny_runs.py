"""Shared pieces of tiny end-to-end runs: `configs/tiny.py` with dotted-key overrides, and a toy
update batch / loss for exercising `trainer.update.run_update_epochs` without a model."""
from __future__ import annotations

import importlib.util
import json
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the guess-the-number environment as a multi-turn interaction config (multi_turn.interaction_config_path)
GUESS_YAML = """interaction:
  - name: guess_number
    class_name: jaxrl_llm.agents.environment.GuessNumberEnv
    config: {low: 1, high: 10, max_guesses: 7}
"""


def tiny_config(run_dir: Any, config: str = "tiny.py", **overrides: Any) -> Any:
    """configs/tiny.py (a random 2-layer Llama, synthetic task; or another configs/ file) writing to
    `run_dir`, with `{"a.b.c": value}` overrides applied."""
    spec = importlib.util.spec_from_file_location(f"tiny_config_{pathlib.Path(config).stem}", ROOT / "configs" / config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.trainer.default_local_dir = str(run_dir)
    for key, value in overrides.items():
        section = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            section = section[p]
        section[leaf] = value
    return cfg


def train_example(run_dir: pathlib.Path, config: str, *overrides: str, timeout: int = 1500) -> list[dict]:
    """launch/train.py `config` on one CPU device in a subprocess, as a user runs it; the
    metrics.jsonl rows it wrote (the example tests under tests/examples)."""
    import os
    import subprocess
    import sys

    # one device and XLA's default optimisation, as `python launch/train.py` runs (tests/conftest.py)
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}
    cmd = [sys.executable, "launch/train.py", f"--config={config}", f"--config.trainer.default_local_dir={run_dir}",
           *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(run_dir)


def read_metrics(run_dir: Any) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in open(pathlib.Path(run_dir) / "metrics.jsonl")]


def step_numbers(rows: list[dict], step: int) -> dict:
    """One step's metrics without the wall-clock ones (timing_s/*, perf/*)."""
    row = next(r for r in rows if r["step"] == step)
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))}


def load_convert_to_hf() -> Any:
    """launch/convert_to_hf.py as a module."""
    spec = importlib.util.spec_from_file_location("convert_to_hf", ROOT / "launch" / "convert_to_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_resume_equals_uninterrupted(run: Any, full_dir: Any, resumed_dir: Any, steps: int = 3) -> None:
    """`run(run_dir, steps, **overrides) -> Trainer`: a run resumed from `full_dir`'s checkpoint 1 logs
    the same metrics at steps 2..steps as the uninterrupted run in `full_dir` (saved every step)."""
    run(resumed_dir, steps, **{"trainer.resume_mode": "resume_path",
                               "trainer.resume_from_path": str(pathlib.Path(full_dir) / "checkpoints" / "1")}).fit()
    a, b = read_metrics(full_dir), read_metrics(resumed_dir)
    assert [r["step"] for r in b] == list(range(2, steps + 1))
    for step in range(2, steps + 1):
        want, got = step_numbers(a, step), step_numbers(b, step)
        assert want.keys() == got.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"step {step} {k}")


class ToyBatch(NamedTuple):
    """A linear-regression 'experience': rows with a response mask, like `Experience`."""

    x: jax.Array
    y: jax.Array
    response_mask: jax.Array


def toy_loss(params: dict, mb: ToyBatch, denoms: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    err = (mb.x @ params["w"] + params["b"] - mb.y) * mb.response_mask
    loss = jnp.sum(err ** 2) / denoms.num_tokens
    return loss, {"toy/loss": loss}


def assert_host_rows_match(rollout) -> None:
    """The step rows the trainer plans from (host lengths and group ids, no device read) say what the
    rollout's device arrays say: the same attention mask, and rows of one group id share their prompt."""
    from jaxrl_llm.batching import StepBatching, prompt_groups

    rows = StepBatching.rows_of(rollout)
    mask, ids = np.asarray(rollout.attention_mask), np.asarray(rollout.input_ids)
    np.testing.assert_array_equal(rows.attention_mask(), mask)
    by_tokens = prompt_groups(ids, mask, int(rollout.response_mask.shape[1]))
    for g in np.unique(rows.prompt_groups):
        assert len(set(by_tokens[rows.prompt_groups == g].tolist())) == 1, f"group {g} holds different prompts"


class TwoProcesses:
    """`jax` as a module sees it in a two-process run (patch it over the module's `jax`): only
    `process_count` changes, e.g. multi-turn rollouts take the rounds path (rollout/multi_turn.py)."""

    def __getattr__(self, name: str):
        return getattr(jax, name)

    @staticmethod
    def process_count() -> int:
        return 2


# a reward the random tiny policy can learn (the e2e, LoRA, Gemma and partial-rollout runs use it)
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # learnable by a random tiny model: responses that start with a space-prefixed word
    return {"score": 1.0 if solution_str.startswith(" ") else 0.0, "length": float(len(solution_str))}
'''


def with_reward_file(cfg, tmp_path):
    path = tmp_path / "toy_reward.py"
    path.write_text(REWARD_FILE)
    cfg.custom_reward_function.path = str(path)
    return cfg


def assert_step_runs_the_planned_programs(trainer, metrics: dict) -> None:
    """The memory plan's program list (planning/programs.py PROGRAM_BUILDERS) names the passes this
    step timed (`timing_s/*` of `metrics`), no more and no fewer: a pass added to `Trainer.train_step`
    without a program to plan, or a program planned for a pass the step no longer runs, fails here."""
    from jaxrl_llm.planning.context import make_context
    from jaxrl_llm.planning.programs import PROGRAM_BUILDERS, STEP_SPANS, UNPLANNED_SPANS

    ctx = make_context(trainer.spec, trainer.mesh, trainer.tokenizer)
    planned = {STEP_SPANS[p.name] for p in (build(ctx) for build in PROGRAM_BUILDERS) if p is not None}
    timed = {k.removeprefix("timing_s/") for k in metrics if k.startswith("timing_s/")} - UNPLANNED_SPANS
    if not trainer.spec.recompute_old_log_probs:  # the span stays (veRL's metric), timing no pass
        timed.discard("old_log_prob")
    assert timed == planned, f"the step timed {sorted(timed)}, the plan holds {sorted(planned)}"
