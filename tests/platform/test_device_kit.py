"""The device kit rehearsed on CPU: `bench/device_check.py --tiny` runs every section (kernels
interpreted) and each reports ok with real numbers; the device scripts parse."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from compile_flags import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]


# Every section in one rehearsal (the kit starts jax, builds its tiny models and compiles once); on the
# device the on-request sections (decode, cascade, profile) are calls of their own.
SECTIONS = ("env", "kernels", "step", "tests", "decode", "cascade", "profile")


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> tuple[pathlib.Path, str]:
    """`bench/device_check.py --tiny` over every section once: (its output folder, its stdout)."""
    out = tmp_path_factory.mktemp("device_kit")
    # one device, as the lent GPU is (the suite's process has 8)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(1))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--tiny", "--out", str(out),
                           "--sections", ",".join(SECTIONS), "--budget_s", "3900"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=4000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def _section(kit: tuple[pathlib.Path, str], section: str) -> dict:
    """One section's JSON from the rehearsal, checked ok."""
    result = json.loads((kit[0] / f"{section}.json").read_text())
    assert result["status"] == "ok", result
    return result


def test_device_check_tiny_runs_every_section(kit):
    results = {name: _section(kit, name) for name in ("env", "kernels", "step", "tests")}
    assert results["env"]["bf16_matmul_tflops"] > 0 and results["env"]["copy_gbps"] > 0
    for case in results["kernels"]["logprob"]:
        tol = 1e-4 if case["dtype"] == "float32" else 5e-2
        assert case["max_abs_err_logprob"] < tol and case["max_abs_err_grad_w"] < tol, case
    for case in results["kernels"]["paged_attention"]:
        assert case["max_abs_err"] < 3e-2, case  # bf16 outputs
    assert [c["latent"] for c in results["kernels"]["paged_attention"]] == [False, False, True]  # + MLA's pool
    assert 0 < results["step"]["perf/mfu"] < 1 and results["step"]["planned_peak_bytes"] > 0
    assert [line for line in kit[1].splitlines() if line.startswith("[")]
    assert "passed" in results["tests"]["summary"]


def test_device_check_tiny_decode_rows(kit):
    """The decode section (#30's GPU rows, a call of its own on the device) rehearsed: every row runs,
    the cascade row takes shared-prefix groups, the speculative rows report their drafts."""
    result = _section(kit, "decode")
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "cascade", "ngram", "draft"}
    for row in rows.values():  # 4 prompts x n=2, 8 new tokens each (random weights: EOS is rare)
        assert 0 < row["useful_tokens"] <= 64 and row["tokens_per_s"] > 0 and row["read_gbps"] > 0, row
    assert rows["plain"]["peak_cascade_groups"] == 0 < rows["cascade"]["peak_cascade_groups"]
    for name in ("ngram", "draft"):
        assert 0 <= rows[name]["rollout/spec_accept_rate"] <= 1 and rows[name]["rollout/tokens_per_step"] >= 1
    assert "plain@2" in result["summary"]


def test_device_check_tiny_cascade_rows(kit):
    """The cascade section (long shared prompts, cascade off and on) rehearsed: both rows decode the
    same number of tokens, only the cascade row takes shared-prefix groups."""
    result = _section(kit, "cascade")
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "cascade"} and len(result["rows"]) == 2
    assert rows["plain"]["decode_steps"] == rows["cascade"]["decode_steps"] > 0
    assert 0 < rows["plain"]["useful_tokens"] <= 4 * 2 * 8  # the decode section's 4 prompts x n=2, 8 new tokens
    assert rows["plain"]["peak_cascade_groups"] == 0 < rows["cascade"]["peak_cascade_groups"]
    assert "plain@40p" in result["summary"] and "cascade@40p" in result["summary"]


def test_device_check_tiny_profile_rows(kit):
    """The profile section (where a decode step's and the update's time goes, traced) rehearsed: both decode
    rows carry op families in ms per decode step whose sum is below the traced run's time per step; the
    traced update its op families and the roofline estimate."""
    result = _section(kit, "profile")
    out = kit[0]
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "ngram"}
    for row in rows.values():
        ops = row["ops_ms_per_step"]
        assert ops and all(op["ms"] > 0 and op["count"] > 0 for op in ops), row
        assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
        in_ops = sum(op["ms"] for op in ops if op["process"] == ops[0]["process"])
        assert 0 < in_ops <= 2 * row["step_ms"]  # CPU ops run on up to 2 threads at once
        assert sum(op["count"] for op in row["ops_exact_ms_per_step"]) >= 1
        assert row["traced_steps"] == row["decode_steps"]  # a tiny run's trace holds every step
        assert (out / f"trace_{row['name']}").is_dir()  # tiny traces are kept
    assert "plain (traced)" in result["summary"]
    # the update: its second call traced, op families in ms per update within its wall time, the estimate
    update = result["update"]
    assert update["update_s"] > 0 and update["ops_ms"] and (out / "trace_update").is_dir()
    in_ops = sum(op["ms"] for op in update["ops_ms"] if op["process"] == update["ops_ms"][0]["process"])
    assert 0 < in_ops <= 8 * 1000 * update["update_s"]  # the ops of the 8 test devices' threads, summed
    assert update["estimate"]["seconds"] > 0 and update["estimate"]["bound"] in ("compute", "hbm", "link")
    assert "update" in result["summary"]


def test_trace_ops_sums_a_trace_by_op_family(tmp_path):
    """bench/trace_ops.py on a trace of known ops: families without numeric suffixes, the executor's
    and the Python thread's spans left out, times per step."""
    import gzip

    sys.path.insert(0, str(ROOT / "bench"))
    from trace_ops import op_families, table, traced_steps

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 5, "args": {"name": "python"}},
              {"ph": "X", "name": "np.asarray(jax.Array)", "pid": 1, "tid": 5, "dur": 7000},
              {"ph": "X", "name": "ThunkExecutor::Execute", "pid": 1, "dur": 9000},
              {"ph": "X", "name": "ynn_fusion.3", "pid": 1, "dur": 2000},
              {"ph": "X", "name": "ynn_fusion", "pid": 1, "dur": 1000},
              {"ph": "X", "name": "loop_gather_fusion_12", "pid": 1, "dur": 500},
              {"ph": "X", "name": "while.7", "pid": 1, "dur": 4000}]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = op_families(tmp_path)
    assert [(r["op"], r["ms"], r["count"]) for r in rows] == [("ynn_fusion", 3.0, 2), ("loop_gather_fusion", 0.5, 1)]
    assert {r["op"] for r in op_families(tmp_path, exact=True)} == {"ynn_fusion.3", "ynn_fusion",
                                                                  "loop_gather_fusion_12"}
    assert "1.75 ms in ops (times / 2)" in table(rows, per=2) and "1.500 ms  85.7%" in table(rows, per=2)
    # each op ran once: one step of a one-layer model; with 30 layers, the 60-call ops are 2 steps
    assert traced_steps(op_families(tmp_path, exact=True), layers=1, steps=10) == 1
    per_layer = [{"count": 60, "ms": 5.0}, {"count": 60, "ms": 4.0}, {"count": 20, "ms": 6.0}, {"count": 2, "ms": 9.0}]
    assert traced_steps(per_layer, layers=30, steps=500) == 2 and traced_steps(per_layer, layers=30, steps=1) == 1


def test_device_scripts_parse():
    for script in ("fetch_wheels.sh", "run.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / "device" / script)], check=True)
