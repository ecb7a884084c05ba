"""Helpers of the preemption / kill -9 tests: tiny training runs of `launch/train.py` as real
subprocesses (one or two JAX processes), one uninterrupted reference run per pytest session, and
exact comparisons of checkpoints (params, optimizer state) and metrics.jsonl records.

Every launch pays for Python + JAX imports and tracing; a session-wide persistent compilation cache
(JAX_COMPILATION_CACHE_DIR) removes the XLA compile from all but the first, and the runs use the
char-level test tokenizer (vocabulary 104: small checkpoints, fast steps; the SmolLM2 GGUF
tokenizer takes seconds to parse in every process).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import portpicker
from compile_flags import UNOPTIMIZED, cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = ROOT / "launch" / "train.py"
FAULT_TRAIN = pathlib.Path(__file__).resolve().parent / "fault_train.py"
TOTAL_STEPS = 24
# varies across a random tiny model's samples, so advantages and gradients are not all zero and a
# resumed run that drifted from the uninterrupted one shows in the params
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''

_SESSION: dict[str, Any] = {}


def session_dir(tmp_path_factory: Any) -> pathlib.Path:
    """One folder per pytest session: tokenizer, reward file, compile cache, reference runs."""
    if "dir" not in _SESSION:
        root = tmp_path_factory.mktemp("preempt_session")
        from tiny_models import make_char_tokenizer

        make_char_tokenizer().save_pretrained(root / "tokenizer")
        (root / "reward.py").write_text(REWARD_FILE)
        (root / "jax_cache").mkdir()
        _SESSION["dir"] = root
    return _SESSION["dir"]


def train_args(session: pathlib.Path, run_dir: pathlib.Path | str, *extra: str, steps: int = TOTAL_STEPS) -> list[str]:
    """launch/train.py arguments of the tiny run every test here uses."""
    return [f"--config={ROOT / 'configs' / 'tiny.py'}", "--",
            f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
            f"data.synthetic.n_train={4 * steps}", f"data.tokenizer={session / 'tokenizer'}",
            "data.max_prompt_length=160",  # a char per token: the chat-formatted prompts are ~60
            f"custom_reward_function.path={session / 'reward.py'}", "trainer.logger=[jsonl]",
            "trainer.save_freq=1", *extra]


def base_env(session: pathlib.Path, devices: int = 1) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update({
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": cpu_devices_flags(devices), UNOPTIMIZED: "1",  # compiled as the suite compiles
        "JAX_COMPILATION_CACHE_DIR": str(session / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    return env


class Launch:
    """A started `launch/train.py` (or tests/reliability/fault_train.py) process, output to files."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], log_dir: pathlib.Path, name: str,
                 script: pathlib.Path = TRAIN):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(script), *args], env=dict(env), stdout=out,
                                         stderr=err, cwd=str(ROOT))

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"timed out after {timeout} s\n{self.tail()}") from None

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    def tail(self, n: int = 3000) -> str:
        return f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.err_path.read_text()[-n:]}"


def launch_processes(args: Sequence[str], session: pathlib.Path, log_dir: pathlib.Path, name: str,
                     num_processes: int, script: pathlib.Path = TRAIN,
                     extra_env: Mapping[str, str] | None = None) -> list[Launch]:
    """`num_processes` cooperating JAX processes (1 CPU device each, gloo) running the same command."""
    env = base_env(session)
    env.update({"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{portpicker.pick_unused_port()}",
                "JAX_NUM_PROCESSES": str(num_processes)})
    env.update(extra_env or {})
    return [Launch(args, {**env, "JAX_PROCESS_ID": str(pid)}, log_dir, f"{name}.p{pid}", script)
            for pid in range(num_processes)]


def reference_run(tmp_path_factory: Any, devices: int = 1, steps: int = TOTAL_STEPS) -> pathlib.Path:
    """The uninterrupted run, one process with `devices` CPU devices (once per session and shape).
    With 2 devices it is also the reference of 2 processes with one device each: the same mesh and
    per-device programs, and a 2-way sum or gather is exact in any order, so the numbers are equal
    bit for bit (checked by test_preemption's two-process test) at half the cost of 2 processes."""
    key = f"reference_{devices}dev_{steps}steps"
    if key not in _SESSION:
        session = session_dir(tmp_path_factory)
        run = session / key
        proc = Launch(train_args(session, run, steps=steps), base_env(session, devices), session / "logs", key)
        assert proc.wait() == 0, proc.tail()
        _SESSION[key] = run
    return _SESSION[key]


# ---------------------------------------------------------------- looking at a run directory
def committed_steps(run_dir: pathlib.Path) -> list[int]:
    """Steps whose checkpoint is complete (orbax renames `<step>.orbax-checkpoint-tmp` to `<step>`)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(d.name) for d in folder.iterdir() if d.name.isdigit())


def wait_for(predicate, timeout: float, proc: Launch | None = None, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"process ended early (rc {proc.proc.returncode})\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s" + (f"\n{proc.tail()}" if proc else ""))
        time.sleep(poll)


def metric_records(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    """metrics.jsonl records, timings left out (they differ run to run). A line cut by a kill -9
    does not parse and is skipped: the step it belonged to is run again after the resume."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows.append({k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))})
    return rows


def assert_same_metrics(run_dir: pathlib.Path, reference: pathlib.Path, steps: int = TOTAL_STEPS) -> None:
    """Every step 1..steps has a record, and every record (a step run twice around a kill
    included) is exactly the reference's record of that step."""
    want = {r["step"]: r for r in metric_records(reference)}
    assert sorted(want) == list(range(1, steps + 1))
    got = metric_records(run_dir)
    assert {r["step"] for r in got} == set(want)
    for row in got:
        assert row == want[row["step"]], f"step {row['step']} differs from the uninterrupted run"


def read_checkpoint(run_dir: pathlib.Path, step: int) -> tuple[dict[str, np.ndarray], dict, dict]:
    """(flat {path: array} of the `state` item, the `data` item, the `meta` item) of one step, read
    onto this process's first device whatever the topology it was saved from."""
    import jax
    import orbax.checkpoint as ocp

    folder = run_dir / "checkpoints" / str(step)
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    tree = checkpointer.metadata(folder / "state").item_metadata
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    state = checkpointer.restore(folder / "state", abstract)
    checkpointer.close()
    flat = {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    data, meta = (json.loads((folder / item / "metadata").read_text()) for item in ("data", "meta"))
    return flat, data, meta


def assert_same_checkpoint(run_dir: pathlib.Path, reference: pathlib.Path, step: int) -> None:
    """Params and optimizer state bit for bit; data iterator, KL coefficient, step and rng equal."""
    got, got_data, got_meta = read_checkpoint(run_dir, step)
    want, want_data, want_meta = read_checkpoint(reference, step)
    assert got.keys() == want.keys()
    assert any("opt_state" in k for k in want) and any("params" in k for k in want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert got[key].tobytes() == want[key].tobytes(), f"{key} differs at step {step}"
    assert got_data == want_data
    for key in ("global_step", "kl_coef", "rng"):
        assert got_meta[key] == want_meta[key], key
