"""The sandbox kills runaway programs within its limits and blocks the network; the code scorer."""
from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from jaxrl_llm.agents import PythonTool, SandboxLimits, run_python, unshare_available
from jaxrl_llm.rewards import default_compute_score
from jaxrl_llm.rewards.scorers import code

FAST = SandboxLimits(cpu_s=1, memory_mb=256, wall_s=15.0, max_output_chars=200)


def test_runs_a_program_with_stdin_in_a_removed_temp_dir():
    res = run_python("import os\nprint(sum(map(int, input().split())), os.getcwd())", stdin="2 40\n", limits=FAST)
    total, cwd = res.stdout.split()
    assert res.status == "ok" and total == "42" and cwd.startswith("/tmp") and not os.path.exists(cwd)


def test_infinite_loop_is_killed_at_its_cpu_limit():
    res = run_python("while True:\n    pass\n", limits=FAST)
    assert res.status == "cpu_time" and res.wall_s < FAST.wall_s
    assert run_python("print('still fine')", limits=FAST).stdout == "still fine\n"  # and we go on


def test_sleeping_program_is_killed_at_the_wall_clock():
    res = run_python("import time\ntime.sleep(60)\n", limits=SandboxLimits(wall_s=1.0))
    assert res.status == "timeout" and res.exit_code is None and res.wall_s < 10


@pytest.mark.parametrize("bomb", ["x = bytearray(8 * 1024 ** 3)",
                                  "a = []\nwhile True:\n    a.append(bytearray(10 ** 7))"])
def test_memory_bomb_fails_within_its_memory_limit(bomb):
    # A CPU budget well above the bomb's needs (~0.3 s): on a loaded 2-core CI host the page faults of
    # 250 MB of bytearrays once used up FAST's 1 s, and the test is about the memory limit only.
    limits = SandboxLimits(cpu_s=10, memory_mb=256, wall_s=15.0, max_output_chars=200)
    res = run_python(bomb, limits=limits)
    assert res.status == "memory" and "MemoryError" in res.stderr and res.wall_s < limits.wall_s


def test_output_is_truncated_and_runaway_output_is_stopped():
    res = run_python("print('x' * 5000)", limits=FAST)
    assert res.status == "ok" and res.stdout == "x" * 200 + "\n...(output truncated)"
    res = run_python("while True:\n    print('y' * 1000)", limits=SandboxLimits(max_file_bytes=1 << 20, wall_s=15))
    assert res.status == "output_limit" and res.wall_s < 15


def test_limits_cannot_be_lifted_and_no_process_can_be_spawned():
    res = run_python("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", limits=FAST)
    assert res.status == "error" and "resource.setrlimit is not allowed" in res.stderr
    res = run_python("import subprocess\nsubprocess.run(['true'])", limits=FAST)
    assert res.status == "error" and "is not allowed" in res.stderr


@pytest.fixture
def local_server():
    """A TCP server on 127.0.0.1 (this test's own) that counts accepted connections."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn.recv(64))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


PY_CONNECT = ("import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
              "s.sendall(b'hello')\nprint('connected')\n")
# connect(2) through ctypes: invisible to the audit hook, so only the network namespace stops it
C_CONNECT = ("import ctypes, struct, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "fd = libc.socket(2, 1, 0)\naddr = struct.pack('=H', 2) + struct.pack('!H', {port}) + "
             "bytes([127, 0, 0, 1]) + bytes(8)\nrc = libc.connect(fd, addr, 16)\n"
             "print('rc', rc, ctypes.get_errno())\nlibc.send(fd, b'native', 6, 0) if rc == 0 else None\n"
             "time.sleep(0.2)\n")


@pytest.mark.parametrize("use_namespace", [True, False])
def test_network_is_blocked(local_server, use_namespace):
    port, accepted = local_server
    res = run_python(PY_CONNECT.format(port=port), limits=SandboxLimits(wall_s=15, use_namespace=use_namespace))
    assert res.status == "error" and "connected" not in res.stdout
    assert "PermissionError: sandbox: socket." in res.stderr  # the audit hook, in both modes
    assert accepted == []


def test_network_namespace_blocks_native_connects(local_server):
    if not unshare_available():
        pytest.skip("unprivileged user namespaces are not available here (the audit hook alone applies)")
    port, accepted = local_server
    open_res = run_python(C_CONNECT.format(port=port), limits=SandboxLimits(wall_s=15, use_namespace=False))
    assert open_res.stdout.startswith("rc 0") and not open_res.isolated_network  # the server is reachable
    for _ in range(50):
        if accepted:
            break
        threading.Event().wait(0.05)
    assert accepted == [b"native"]
    res = run_python(C_CONNECT.format(port=port), limits=SandboxLimits(wall_s=15))
    assert res.isolated_network and res.stdout.startswith("rc -1") and accepted == [b"native"]


def test_python_tool_reports_output_and_status():
    tool = PythonTool({"cpu_s": 1, "wall_s": 15, "memory_mb": 256})
    iid = tool.create()
    text, reward, metrics = tool.execute(iid, {"code": "print(6 * 7)"})
    assert text == "42\n" and metrics["error"] == 0
    text, _, metrics = tool.execute(iid, {"code": "import sys\nprint('out')\nsys.exit('bad')"})
    assert text == "out\nstderr:\nbad\nstatus: error" and metrics["error"] == 1


SOLUTION = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"


def test_code_scorer_stdin_stdout_fraction():
    truth = json.dumps({"inputs": ["1 2\n", "10 20\n", ["3 4"]], "outputs": ["3\n", "30  \n\n", "8"]})
    assert default_compute_score("apps", SOLUTION, truth) == pytest.approx(2 / 3)
    assert code.extract_program(SOLUTION).startswith("a, b") and code.extract_program("print(1)") == "print(1)"


def test_code_scorer_asserts_and_runaway_solutions():
    truth = {"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]}
    assert code.compute_score("```\ndef add(a, b):\n    return a + b\n```", truth, FAST) == pytest.approx(2 / 3)
    assert code.compute_score("def add(a, b):\n    while True:\n        pass", {"asserts": truth["asserts"][:1]},
                              FAST) == 0.0
    with pytest.raises(ValueError, match="fn_name"):
        code.compute_score("x", {"fn_name": "f", "inputs": [], "outputs": []})


def test_a_killed_caller_leaves_no_sandboxed_child_behind(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    program = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    caller = subprocess.Popen([sys.executable, "-c", "from jaxrl_llm.sandbox import SandboxLimits, run_python\n"
                               f"run_python({program!r}, limits=SandboxLimits(wall_s=60))"],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
        for _ in range(100):  # the child dies with its caller (it would otherwise sleep for 60 s)
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the sandboxed child outlived its killed caller")
    finally:
        caller.kill()
