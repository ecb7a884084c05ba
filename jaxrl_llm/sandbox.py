"""Run untrusted Python in a child process with CPU-time, memory, output, wall-clock and network limits.

    result = run_python(code, stdin="1 2\n", limits=SandboxLimits(cpu_s=2, memory_mb=256, wall_s=5))
    result.status  # "ok" | "error" | "timeout" | "cpu_time" | "memory" | "output_limit"

How each limit is enforced (all in the child; the calling process is never at risk):

- CPU time: RLIMIT_CPU (soft = `cpu_s`: SIGXCPU kills the child; hard = soft + 1: SIGKILL).
- Memory: RLIMIT_AS = `memory_mb` of address space: an allocation past it raises MemoryError.
- Output: stdout / stderr go to files in the work dir under RLIMIT_FSIZE (SIGXFSZ past
  `max_file_bytes`), and at most `max_output_chars` of each is read back (a marker shows the cut):
  the start of stdout, the end of stderr (where a traceback says what went wrong).
- Wall clock: the child leads its own session (process group); past `wall_s` the whole group gets
  SIGKILL (a sleeping or blocked program uses no CPU time, so RLIMIT_CPU alone would not stop it).
  If the calling process dies first, the child gets SIGKILL too (PR_SET_PDEATHSIG), and an alarm
  at `wall_s` + 2 s backs the kill up.
- Network, two layers: (1) when `unshare --map-root-user --net` works unprivileged on this host
  (a user namespace; `unshare_available()`), the child runs in a fresh network namespace that has
  no interface but a down loopback, so every connect fails, in native code too; (2) always, a boot
  script installs a `sys.addaudithook` hook before the program runs that rejects every `socket.*`
  audit event, process creation (`subprocess.Popen`, `os.system`, `os.exec*`, `os.fork`, ...) and
  `resource.setrlimit` (so the program cannot lift its own limits, even as root). The audit hook is
  a guard against Python code, not against native code loaded through ctypes: use the namespace
  (the default wherever it is available) when the programs are adversarial.
- Files: a fresh temp dir is the working directory and HOME, removed afterwards; the interpreter
  runs isolated (`-I`: no PYTHON* variables, no user site, no script dir on sys.path) with an
  environment of PATH / LANG / HOME only. The filesystem itself is NOT isolated: the program can
  read and write whatever the calling user can (run the trainer as an unprivileged user, or in a
  container, when that matters).

Limits are per run; `run_python` is thread-safe (no preexec_fn; the child sets its own limits).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# The boot script runs in the child: limits first, then the audit hook, then the program as __main__.
_BOOT = r'''
import ctypes, os, resource, runpy, signal, sys
cpu, mem, fsize, wall, parent = (int(a) for a in sys.argv[1:6])
try:  # die with the process that runs us (PR_SET_PDEATHSIG): no orphan outlives a killed trainer
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:  # it died before prctl took effect
    os._exit(137)
signal.alarm(wall)  # a backstop to the caller's wall-clock kill
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
_BLOCKED = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.spawn", "resource.setrlimit", "resource.prlimit")
def _hook(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
program = sys.argv[6]
sys.argv = [program]
runpy.run_path(program, run_name="__main__")
'''

STATUSES = ("ok", "error", "timeout", "cpu_time", "memory", "output_limit")
_TRUNCATED = "\n...(output truncated)"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. `memory_mb` bounds the address space (the interpreter itself needs ~30 MB)."""

    cpu_s: int = 5
    memory_mb: int = 512
    wall_s: float = 10.0
    max_output_chars: int = 4096
    max_file_bytes: int = 16 << 20
    use_namespace: bool = True  # the network namespace layer where available (the audit hook always)

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "wall_s", "max_output_chars", "max_file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r}: must be > 0")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    status: str  # one of STATUSES
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed on the wall clock
    wall_s: float
    isolated_network: bool  # True when the namespace layer was used

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@functools.lru_cache(maxsize=1)
def unshare_available() -> bool:
    """Whether `unshare --map-root-user --net` works here (unprivileged user namespaces allowed)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        done = subprocess.run([exe, "--map-root-user", "--net", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _read(path: pathlib.Path, limit: int, tail: bool = False) -> str:
    """At most `limit` characters of a file: its start (stdout), or its end (stderr: the traceback's
    last lines say what went wrong)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if tail:
            f.seek(max(0, size - 4 * limit - 4))
        data = f.read(4 * limit + 4)  # utf-8 is at most 4 bytes a character
    text = data.decode("utf-8", errors="replace")
    if tail:
        cut = len(text) > limit or size > len(data)
        return "(output truncated)...\n" + text[-limit:] if cut else text
    return text[:limit] + _TRUNCATED if len(text) > limit else text


def _status(code: int | None, stderr: str, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGKILL here: the hard CPU limit (wall kills set timed_out)
        return "cpu_time"
    tail = stderr.rsplit("Traceback", 1)[-1]
    if code == -signal.SIGXFSZ or "File too large" in tail:  # Python ignores SIGXFSZ: write() raises EFBIG
        return "output_limit"
    if "MemoryError" in tail:
        return "memory"
    return "error"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               python: str = sys.executable) -> SandboxResult:
    """Runs `code` as a program (`__main__`) under `limits`; never raises for anything the program does."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="jaxrl_sandbox_"))
    try:
        (work / "boot.py").write_text(_BOOT)
        (work / "main.py").write_text(code)
        (work / "stdin.txt").write_text(stdin)
        cmd = [python, "-I", str(work / "boot.py"), str(limits.cpu_s), str(limits.memory_mb << 20),
               str(limits.max_file_bytes), str(int(limits.wall_s) + 2), str(os.getpid()), str(work / "main.py")]
        isolated = limits.use_namespace and unshare_available()
        if isolated:
            cmd = [shutil.which("unshare") or "unshare", "--map-root-user", "--net", *cmd]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(work)}
        start = time.monotonic()
        with open(work / "stdin.txt", "rb") as fin, open(work / "stdout.txt", "wb") as fout, \
                open(work / "stderr.txt", "wb") as ferr:
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=env,
                                    start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
            except BaseException:  # e.g. a caller's SIGALRM timeout or KeyboardInterrupt: no orphan
                _kill_group(proc)
                raise
        wall = time.monotonic() - start
        stdout = _read(work / "stdout.txt", limits.max_output_chars)
        stderr = _read(work / "stderr.txt", limits.max_output_chars, tail=True)
        code_ = None if timed_out else proc.returncode
        return SandboxResult(status=_status(code_, stderr, timed_out), stdout=stdout, stderr=stderr,
                             exit_code=code_, wall_s=wall, isolated_network=isolated)
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["STATUSES", "SandboxLimits", "SandboxResult", "run_python", "unshare_available"]
