"""Preemption (jaxrl_llm/bookkeeping/preemption.py): SIGTERM mid-step makes `launch/train.py` finish the
step, commit a checkpoint at it, print `preempted at step N; checkpoint saved` and exit 75; the
same command then resumes and ends bit-identical to the uninterrupted run. With 2 JAX processes,
a SIGTERM to one of them stops both at the same step with the same checkpoint. The guard itself:
SIGINT too, a second signal aborts, handlers restored, agreement with and without jax's
preemption service."""
import os
import pathlib
import re
import signal
import time

import pytest
from multiprocess_util import run_processes
from preempt_runs import (
    TOTAL_STEPS,
    Launch,
    assert_same_checkpoint,
    assert_same_metrics,
    base_env,
    committed_steps,
    launch_processes,
    metric_records,
    reference_run,
    session_dir,
    train_args,
    wait_for,
)

from jaxrl_llm.bookkeeping.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionGuard

GUARD_WORKER = pathlib.Path(__file__).resolve().parent / "mp_guard_worker.py"


def _steps_logged(run_dir: pathlib.Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(metric_records(run_dir)) if path.exists() else 0


def _preempted_step(stdout: str) -> int:
    found = re.findall(r"^preempted at step (\d+); checkpoint saved$", stdout, flags=re.M)
    assert len(found) == 1, stdout[-2000:]
    return int(found[0])


def test_exit_code_and_preempted_is_a_system_exit():
    assert PREEMPTED_EXIT_CODE == 75
    err = Preempted(7, "SIGTERM received")
    assert isinstance(err, SystemExit) and not isinstance(err, Exception)
    assert err.code == 75 and err.step == 7
    assert str(err) == "preempted at step 7 (SIGTERM received); checkpoint saved"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_guard_one_process(sig, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionGuard() as guard:
        assert not guard.stop_requested(1)
        os.kill(os.getpid(), sig)
        assert guard.stop_requested(2) and guard.stop_requested(3)
        assert guard.reason == f"{sig.name} received"
        # the second signal acts as before the guard (here: pytest's own SIGINT handling / the default)
        assert signal.getsignal(sig) == before[sig]
    assert {s: signal.getsignal(s) for s in before} == before
    assert f"received {sig.name}: finishing the current step" in capsys.readouterr().out


@pytest.mark.parametrize("sig, service", [("SIGTERM", "true"), ("SIGTERM", "false"), ("SIGINT", "true")])
def test_guard_processes_agree_on_the_step(sig, service):
    """Only process 1 gets the signal; both stop at the same step. With jax's preemption service
    (the default) SIGTERM goes through jax's notifier; without it, and for SIGINT, through the
    guard's handler; the per-step allgather makes the step identical in every case."""
    results = run_processes(GUARD_WORKER, num_processes=2, devices_per_process=1, timeout=120, args=(sig,),
                            env={"JAX_ENABLE_PREEMPTION_SERVICE": service})
    out = [r.json for r in results]
    assert [o["jax_service"] for o in out] == [service == "true"] * 2
    assert out[0]["stopped"] == out[1]["stopped"] is not None
    if service == "false" or sig == "SIGINT":  # caught by the guard: stops right after the step it came in
        assert out[0]["stopped"] == 3
        assert out[1]["reason"] == f"{sig} received" and out[0]["reason"] == "process 1 stopping"
    else:  # jax's notifier polls once a second; its sync point is then agreed by every process
        assert out[0]["stopped"] > 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory)


def test_sigterm_mid_step_checkpoints_exits_75_and_resumes_identically(tmp_path, tmp_path_factory, reference):
    session = session_dir(tmp_path_factory)
    run, logs = tmp_path / "run", tmp_path / "logs"
    # save_freq beyond the run: the only checkpoint before the end is the preemption's own
    args = train_args(session, run, "trainer.save_freq=100")
    proc = Launch(args, base_env(session), logs, "preempted")
    wait_for(lambda: _steps_logged(run) >= 3, timeout=240, proc=proc)
    time.sleep(0.05)  # into the next step
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait() == PREEMPTED_EXIT_CODE, proc.tail()
    step = _preempted_step(proc.stdout)
    assert 3 <= step < TOTAL_STEPS
    assert "received SIGTERM: finishing the current step" in proc.stdout
    assert committed_steps(run) == [step]
    assert not [p for p in (run / "checkpoints").iterdir() if "tmp" in p.name]
    assert [r["step"] for r in metric_records(run)] == list(range(1, step + 1))
    assert_same_checkpoint(run, reference, step)

    resumed = Launch(args, base_env(session), logs, "resumed")
    assert resumed.wait() == 0, resumed.tail()
    assert f"resumed from {run / 'checkpoints'} step {step}" in resumed.stdout
    assert committed_steps(run) == [step, TOTAL_STEPS]
    assert_same_checkpoint(run, reference, TOTAL_STEPS)
    assert_same_metrics(run, reference)


def test_two_processes_sigterm_to_one_both_stop_at_the_same_step(tmp_path, tmp_path_factory):
    steps = 8
    session = session_dir(tmp_path_factory)
    reference = reference_run(tmp_path_factory, devices=2, steps=steps)
    run, logs = tmp_path / "run", tmp_path / "logs"
    args = train_args(session, run, steps=steps)  # a checkpoint every step: the stop step's is save_freq's
    procs = launch_processes(args, session, logs, "preempted", num_processes=2)
    wait_for(lambda: _steps_logged(run) >= 2, timeout=300, proc=procs[0])
    procs[1].proc.send_signal(signal.SIGTERM)  # the non-main process only
    codes = [p.wait() for p in procs]
    assert codes == [PREEMPTED_EXIT_CODE] * 2, "\n".join(p.tail() for p in procs)
    stopped = [_preempted_step(p.stdout) for p in procs]
    assert stopped[0] == stopped[1] and 2 <= stopped[0] < steps
    step = stopped[0]
    assert max(committed_steps(run)) == step
    assert [r["step"] for r in metric_records(run)] == list(range(1, step + 1))
    assert_same_checkpoint(run, reference, step)

    resumed = launch_processes(args, session, logs, "resumed", num_processes=2)
    for p in resumed:
        assert p.wait() == 0, p.tail()
    assert max(committed_steps(run)) == steps
    assert_same_checkpoint(run, reference, steps)
    assert_same_metrics(run, reference, steps)
