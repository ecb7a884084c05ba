"""Faults a pod meets, each ending with one clear last line, its own exit status and nothing lost (tiny runs of
`launch/train.py` as subprocesses; the faults injected by tests/reliability/fault_train.py):

- a checkpoint save that fails in orbax's background thread (a full disk: ENOSPC) stops the run within one
  step with `checkpoint error: ...` naming the step, the folder and the OS error, exit 74, no traceback;
  the last committed checkpoint is intact and the relaunch gives the uninterrupted run bit for bit;
- SIGTERM while the run sets up (models loaded, before the loop) or during the first validation exits 75
  at once (launch/tpu_pod.sh --run relaunches on 75), with nothing written.

(A ground truth the data source's scorer cannot read is a `data error:` naming file and row:
tests/reliability/test_bad_inputs.py `data_ground_truth_type`.)"""
import pytest
from preempt_runs import (
    FAULT_TRAIN,
    TOTAL_STEPS,
    Launch,
    assert_same_checkpoint,
    assert_same_metrics,
    base_env,
    committed_steps,
    metric_records,
    reference_run,
    session_dir,
    train_args,
)

from jaxrl_llm.bookkeeping.preemption import PREEMPTED_EXIT_CODE
from jaxrl_llm.checkpoint import CHECKPOINT_ERROR_EXIT_CODE


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory)


def _last_line(launch: Launch) -> str:
    return [line for line in launch.err_path.read_text().splitlines() if line.strip()][-1]


def test_a_save_that_fails_on_a_full_disk_stops_the_run_with_one_line(tmp_path, tmp_path_factory, reference):
    session = session_dir(tmp_path_factory)
    run, logs = tmp_path / "run", tmp_path / "logs"
    args = train_args(session, run)
    failing = Launch(args, {**base_env(session), "JAXRL_TEST_FULL_DISK_AT_SAVE": "4"}, logs, "full", FAULT_TRAIN)
    assert failing.wait() == CHECKPOINT_ERROR_EXIT_CODE, failing.tail()
    stderr = failing.err_path.read_text()
    assert _last_line(failing) == (f"checkpoint error: the save of step 4 to {run}/checkpoints failed: No space "
                                   "left on device (errno 28); the last committed checkpoint is step 3"), stderr[-2000:]
    assert "Traceback" not in stderr and "sys.meta_path is None" not in stderr
    assert committed_steps(run) == [1, 2, 3]
    assert max(r["step"] for r in metric_records(run)) <= 5  # stopped at the next step, not at the next save
    relaunch = Launch(args, base_env(session), logs, "relaunch")
    assert relaunch.wait() == 0, relaunch.tail()
    assert "resumed from" in relaunch.stdout and "step 3" in relaunch.stdout
    assert_same_checkpoint(run, reference, TOTAL_STEPS)
    assert_same_metrics(run, reference)


@pytest.mark.parametrize("moment", ["setup", "validation"])
def test_sigterm_before_the_first_step_exits_75_with_nothing_lost(moment, tmp_path, tmp_path_factory):
    session = session_dir(tmp_path_factory)
    run, logs = tmp_path / "run", tmp_path / "logs"
    extra = ("trainer.val_before_train=True",) if moment == "validation" else ()
    args = train_args(session, run, *extra)
    stopped = Launch(args, {**base_env(session), "JAXRL_TEST_SIGTERM_AT": moment}, logs, moment, FAULT_TRAIN)
    assert stopped.wait() == PREEMPTED_EXIT_CODE, stopped.tail()
    out = [line for line in stopped.stdout.splitlines() if line.strip()]
    if moment == "setup":
        assert out[-1] == "received SIGTERM during setup: stopping (nothing to save yet)", stopped.tail()
    else:
        assert out[-1] == "stopped before training step 1 (SIGTERM received); nothing to save", stopped.tail()
    assert "Traceback" not in stopped.err_path.read_text()
    # nothing trained, nothing written: the relaunch starts this run afresh (as test_kill_resume's kills
    # during start-up show, a fresh start of the same command is the uninterrupted run)
    assert committed_steps(run) == []
    # (a validation under way finishes and logs its step-0 record, as a step under way does)
    assert not (run / "metrics.jsonl").exists() or all(r["step"] == 0 for r in metric_records(run))


def test_a_lost_worker_stops_the_others_within_the_timeout_naming_it(tmp_path, tmp_path_factory):
    """kill -9 of process 1 of 2 mid-run: process 0, blocked in the next collective, exits 75 within
    trainer.worker_timeout_s (+ the watchdog's beat) naming process 1 and the last committed checkpoint, which
    is the uninterrupted run's."""
    import signal
    import time

    from preempt_runs import launch_processes, wait_for

    steps, timeout_s = 8, 5.0
    session = session_dir(tmp_path_factory)
    reference = reference_run(tmp_path_factory, devices=2, steps=steps)  # shared with test_preemption
    run, logs = tmp_path / "run", tmp_path / "logs"
    args = train_args(session, run, f"trainer.worker_timeout_s={timeout_s}", steps=steps)
    procs = launch_processes(args, session, logs, "lost", num_processes=2)
    wait_for(lambda: len(committed_steps(run)) >= 2, timeout=300, proc=procs[0])
    procs[1].proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    assert procs[0].wait() == PREEMPTED_EXIT_CODE, procs[0].tail()
    elapsed = time.monotonic() - killed_at
    assert elapsed < timeout_s + 8, elapsed  # the timeout, a beat (2 s at most) and the process's exit
    last = max(committed_steps(run))
    lines = [line for line in procs[0].stdout.splitlines() if line.strip()]
    assert lines[-1].startswith("lost worker: process 1 of 2 (it has not reported for "), procs[0].tail()
    assert lines[-1].endswith(f"trainer.worker_timeout_s=5); the last committed checkpoint is step {last}; "
                              "exiting 75 so that the relaunch resumes from it"), lines[-1]
    assert_same_checkpoint(run, reference, last)
    print(f"lost worker detected {elapsed:.1f} s after the kill (worker_timeout_s={timeout_s:g})")


def test_a_hung_worker_stops_every_process_within_the_timeout_naming_it(tmp_path, tmp_path_factory):
    """Process 1 of 2 hangs alive (its watchdog thread keeps beating) before the update of step 3: it never
    joins the collective process 0 waits in. Both exit 75 within trainer.worker_hang_timeout_s (+ a beat)
    naming process 1 and the phase it stays in; the last committed checkpoint is the uninterrupted run's."""
    import time

    from preempt_runs import launch_processes, wait_for

    steps, hang_timeout_s = 8, 6.0
    session = session_dir(tmp_path_factory)
    reference = reference_run(tmp_path_factory, devices=2, steps=steps)  # shared with test_preemption
    run, logs = tmp_path / "run", tmp_path / "logs"
    args = train_args(session, run, f"trainer.worker_hang_timeout_s={hang_timeout_s}", steps=steps)
    procs = launch_processes(args, session, logs, "hung", num_processes=2, script=FAULT_TRAIN,
                             extra_env={"JAXRL_TEST_HANG_AT": "update_actor of step 3"})
    wait_for(lambda: "hanging before" in procs[1].stdout, timeout=300, proc=procs[1])
    hung_at = time.monotonic()
    codes = [p.wait(timeout=60) for p in procs]
    elapsed = time.monotonic() - hung_at
    assert codes == [PREEMPTED_EXIT_CODE] * 2, "\n".join(p.tail() for p in procs)
    # the timeout, a beat (2 s at most), process 0's grace for the others (2 beats + 0.5 s) and the exits (slow
    # on a loaded machine: 14.3 s in all was seen in CI with 2 test workers)
    assert elapsed < hang_timeout_s + 20, elapsed
    assert committed_steps(run) == [1, 2]
    for pid, proc in enumerate(procs):
        last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
        who = "process 1 of 2" + (" (this process)" if pid == 1 else "")
        assert last.startswith(f"hung worker: {who} has stayed in 'adv of step 3' for "), proc.tail()
        assert last.endswith("since process 0 went on to 'update_actor of step 3' (trainer.worker_hang_timeout_s=6); "
                             "the last committed checkpoint is step 2; exiting 75 so that the relaunch resumes "
                             "from it"), last
        assert "Traceback" not in proc.err_path.read_text()
    assert_same_checkpoint(run, reference, 2)
    print(f"hung worker detected {elapsed:.1f} s after it hung (worker_hang_timeout_s={hang_timeout_s:g})")


def test_the_hang_clock_starts_when_a_peer_goes_past():
    """A long phase every process is in together (a compile, a validation) is not a hang; a process passed by
    another is hung once it has stayed put for the timeout counted from the moment it was passed."""
    from jaxrl_llm.bookkeeping.watchdog import _place, _Places

    places = _Places()
    places.update({0: (5, "gen of step 2"), 1: (5, "gen of step 2")}, now=0.0)
    assert places.hung(now=1000.0, timeout_s=60) is None  # both in it for 1000 s
    places.update({0: (6, "adv of step 2"), 1: _place("812 5 gen of step 2")}, now=1000.0)
    assert places.hung(now=1060.0, timeout_s=60) is None  # passed 60 s ago: not yet over
    assert places.hung(now=1061.0, timeout_s=60) == (1, "gen of step 2", 61.0, 0, "adv of step 2")
    places.update({0: (6, "adv of step 2"), 1: (6, "adv of step 2")}, now=1070.0)  # it caught up
    assert places.hung(now=5000.0, timeout_s=60) is None
    places.update({0: (7, "update_actor of step 2"), 1: None}, now=5000.0)  # 1 published nothing new
    assert places.hung(now=5061.0, timeout_s=60) == (1, "adv of step 2", 61.0, 0, "update_actor of step 2")
    assert _place("3") is None  # a process not yet marking (an older beat format) is not judged


def test_after_a_verdict_the_main_thread_waits_for_the_watchdogs_exit(monkeypatch, capsys):
    """A step's collective failed for a lost peer: `wait_for_verdict` returns only after the watchdog's exit,
    even when its line takes longer than the wait's own bound (here the last committed step is read from a slow
    bucket). Returning earlier sent the main thread into jax's exit handlers, whose `distributed.shutdown` waits
    on the lost peer and aborts (exit -6 instead of 75, seen in CI)."""
    import time

    import jax

    from jaxrl_llm.bookkeeping import watchdog

    class SilentPeer:  # the coordination service's client: process 1 beat once, then nothing
        def key_value_set(self, key: str, value: str, allow_overwrite: bool) -> None:
            pass

        def key_value_try_get(self, key: str) -> str:
            return "7 4 gen of step 3"

    def slow_committed() -> str:
        time.sleep(1.5)
        return "2"

    exits: list[int] = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(watchdog, "_client", lambda: SilentPeer())
    dog = watchdog.WorkerWatchdog(0.3, slow_committed, exit=exits.append).start()
    try:
        dog.wait_for_verdict()
        assert exits == [PREEMPTED_EXIT_CODE]  # the exit came before the wait returned, past its bound
    finally:
        dog.stop()
    assert capsys.readouterr().out.startswith("lost worker: process 1 of 2 (it has not reported for ")


def _download(gcs, bucket: str, prefix: str, into):
    """The fake bucket's objects under `prefix` as a local folder (orbax reads a checkpoint the same from both)."""
    for name in gcs.store.names(bucket):
        if name.startswith(prefix):
            target = into / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(gcs.store.get(bucket, name)[0])
    return into


def test_a_bucket_that_refuses_a_write_stops_the_run_and_retries_carry_the_relaunch(tmp_path, tmp_path_factory):
    """The whole run dir in the fake bucket (arrays through tensorstore, the record, dumps, commit markers and
    listings through epath / gcsfs). The bucket refuses step 3's rollout dump (HTTP 403, lost write access):
    the run stops with one `storage error:` line naming the object, the bucket's words and the last committed
    checkpoint, exit 74. The relaunch, with every fourth request of each client answered 503 (8 times each) and
    two of gcsfs's requests stalled past its read timeout, is carried by the retries to the uninterrupted run's
    numbers, bit for bit."""
    from fake_gcs import FakeGCS

    from jaxrl_llm.storage import STORAGE_ERROR_EXIT_CODE

    steps = 8
    session = session_dir(tmp_path_factory)
    reference = reference_run(tmp_path_factory, devices=2, steps=steps)  # shared with the lost / hung worker tests
    logs = tmp_path / "logs"
    with FakeGCS(("pod-bucket",)) as gcs:
        url = "gs://pod-bucket/run"
        args = train_args(session, url, f"trainer.rollout_data_dir={url}/rollouts", steps=steps)
        env = {**base_env(session, devices=2), **gcs.env(), "JAXRL_LLM_GCS_READ_TIMEOUT_S": "1"}
        gcs.store.faults.refuse = lambda name: name == "run/rollouts/3.jsonl"
        refused = Launch(args, env, logs, "refused")
        assert refused.wait() == STORAGE_ERROR_EXIT_CODE, refused.tail()
        stderr = refused.err_path.read_text()
        assert _last_line(refused) == (
            f"storage error: writing {url}/rollouts/3.jsonl failed: the bucket answered HTTP 403: fake@test.iam does "
            "not have storage.objects.create access to the Google Cloud Storage object; the last committed "
            "checkpoint is step 3"), stderr[-2000:]
        assert "Traceback" not in stderr
        committed = sorted(int(n.split("/")[2]) for n in gcs.store.names("pod-bucket")
                           if n.startswith("run/checkpoints/") and n.endswith("/commit_success.txt")
                           and n.count("/") == 3)  # the step's own marker, not its items'
        assert committed == [1, 2, 3]  # (the dump named 3 is written after step 3's save started; it waited)

        gcs.store.faults.refuse = None
        gcs.store.faults.every, gcs.store.faults.limit = 4, 8
        gcs.store.faults.stalls, gcs.store.faults.stall_s = 2, 3.0
        relaunch = Launch(args, env, logs, "relaunch")
        assert relaunch.wait(timeout=600) == 0, relaunch.tail()
        assert "resumed from" in relaunch.stdout and "step 3" in relaunch.stdout
        faults = gcs.store.faults
        clients = sorted({a.split("/")[0] for a in faults.served_503})
        assert faults.stalled == 2 and {"python-gcsfs", "tensorstore"} <= set(clients), faults
        local = _download(gcs, "pod-bucket", "run/", tmp_path / "local")
    assert_same_checkpoint(local, reference, steps)
    assert_same_metrics(local, reference, steps)
    print(f"relaunch through the faults: {len(faults.served_503)} answers 503 ({', '.join(clients)}), "
          f"{faults.stalled} stalls, all retried")
