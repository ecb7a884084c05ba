"""Run a Python script as N cooperating JAX processes on localhost (CPU, gloo collectives).

Each process gets JAX_PLATFORMS=cpu, `devices_per_process` virtual CPU devices, and the standard
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID env vars, so a script that calls
`jaxrl_llm.sharding.initialize()` joins a global mesh of num_processes x devices_per_process
devices. A script reports results by printing one JSON line last; `run_processes` returns them.

    from tests.multiprocess_util import run_processes   # or: from multiprocess_util import ...
    results = run_processes(SCRIPT, num_processes=2, devices_per_process=4, timeout=120)
    assert results[0].json == results[1].json
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import portpicker

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class ProcessResult:
    process_id: int
    returncode: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        """The last stdout line that parses as JSON (ValueError if there is none)."""
        for line in reversed(self.stdout.strip().splitlines()):
            line = line.strip()
            if line.startswith(("{", "[")):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        raise ValueError(f"process {self.process_id} printed no JSON line; stdout:\n{self.stdout[-2000:]}")


class MultiProcessError(RuntimeError):
    """A process failed or the group timed out; the message holds every process's output."""


def _xla_flags(devices_per_process: int) -> str:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    return f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()


def _report(title: str, results: Sequence[ProcessResult], tail: int = 6000) -> str:
    parts = [title]
    for r in results:
        parts.append(f"--- process {r.process_id} (returncode {r.returncode}) stderr ---\n{r.stderr[-tail:]}")
        parts.append(f"--- process {r.process_id} stdout ---\n{r.stdout[-tail // 3:]}")
    return "\n".join(parts)


def run_processes(script_path_or_code: str | os.PathLike, num_processes: int = 2,
                  devices_per_process: int = 4, timeout: float = 120.0,
                  args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> list[ProcessResult]:
    """Launches `num_processes` copies of a script (a path, or Python source code) and waits.

    Raises MultiProcessError with every process's stderr when one exits non-zero (the others are
    killed) or when `timeout` seconds pass. Returns one ProcessResult per process id, in order.
    """
    with tempfile.TemporaryDirectory(prefix="jaxrl_mp_") as tmp:
        tmp_dir = pathlib.Path(tmp)
        path = pathlib.Path(script_path_or_code) if not isinstance(script_path_or_code, str) or (
            script_path_or_code.endswith(".py") and "\n" not in script_path_or_code) else None
        if path is None:
            path = tmp_dir / "script.py"
            path.write_text(str(script_path_or_code))
        port = portpicker.pick_unused_port()
        # no persistent compilation cache (tests/conftest.py sets one): a process that loads a cached
        # executable while its peer compiles one ran mismatched gloo collectives and aborted. JAX's own
        # switch, which trainer.compilation_cache_dir=auto follows too
        base_env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
        base_env.update(env or {})
        base_env.update({
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": _xla_flags(devices_per_process),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(num_processes),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), base_env.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        })
        procs, files = [], []
        try:
            for pid in range(num_processes):
                out = open(tmp_dir / f"stdout_{pid}.txt", "w+")
                err = open(tmp_dir / f"stderr_{pid}.txt", "w+")
                files.append((out, err))
                procs.append(subprocess.Popen([sys.executable, str(path), *args],
                                              env={**base_env, "JAX_PROCESS_ID": str(pid)},
                                              stdout=out, stderr=err, cwd=str(_REPO_ROOT)))
            deadline = time.monotonic() + timeout
            failure = None
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    failure = "a process failed"
                    break
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout:.0f} s"
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for pid, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            results.append(ProcessResult(pid, p.returncode, out.read(), err.read()))
            out.close()
            err.close()
        if failure is None and any(r.returncode != 0 for r in results):
            failure = "a process failed"
        if failure is not None:
            raise MultiProcessError(_report(f"{num_processes}-process run: {failure}", results))
        return results
