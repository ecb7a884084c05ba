"""kill -9 of a tiny training run (`launch/train.py` as a subprocess, a checkpoint every step) at
random moments: while it starts or restores, mid-step, and while an asynchronous checkpoint save
is being written. After each kill the same command resumes (`resume_mode=auto`, the default); the
run that finally completes has params, optimizer state, data iterator and every metrics.jsonl
record bit-identical to the uninterrupted run's."""
import random
import time

import pytest
from preempt_runs import (
    FAULT_TRAIN,
    TOTAL_STEPS,
    Launch,
    assert_same_checkpoint,
    assert_same_metrics,
    base_env,
    committed_steps,
    reference_run,
    session_dir,
    train_args,
    wait_for,
)

# 5 kills: 3 while a save is in flight, 1 at a random moment after the run has made progress
# (mid-step, in the async save, between steps), 1 at a random moment of start-up (imports, restore,
# compilation). Each launch costs seconds of imports and tracing (compiles come from the cache) and
# up to a minute on a loaded CI host, so each kind is there once more only where it needs repeats
# (a kill in a save must find the save's temporary folder at least twice).
KILLS = ["save", "running", "start", "save", "save"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory)


def test_kill9_at_random_moments_then_resume_is_bit_identical(tmp_path, tmp_path_factory, reference):
    session = session_dir(tmp_path_factory)
    run, logs = tmp_path / "run", tmp_path / "logs"
    args = train_args(session, run)
    rng = random.Random(13)
    survived, in_flight = [], 0
    for i, kind in enumerate(KILLS):
        start = max(committed_steps(run), default=0)
        assert start <= TOTAL_STEPS - 3, f"the run got too far to place kill {i}; give it more steps"
        env = base_env(session)
        if kind == "save":
            target = start + 2  # the save of start+1 is then committed: every launch makes progress
            proc = Launch(args, {**env, "JAXRL_TEST_KILL_IN_SAVE": str(target)}, logs, f"kill{i}", FAULT_TRAIN)
            assert proc.wait() == -9, proc.tail()
            line = next(x for x in proc.stdout.splitlines() if x.startswith("killing during save"))
            in_flight += f"'{target}.orbax-checkpoint-tmp'" in line
            moment = f"during the async save of step {target}"
        else:
            proc = Launch(args, env, logs, f"kill{i}")
            if kind == "running":
                wait_for(lambda: max(committed_steps(run), default=0) > start, timeout=180, proc=proc)
                delay = rng.uniform(0.0, 0.6)  # steps take ~0.1-0.3 s here: lands anywhere in one
            else:
                delay = rng.uniform(0.5, 6.0)
            time.sleep(delay)
            assert proc.proc.poll() is None, f"kill {i}: the run ended before the kill\n{proc.tail()}"
            proc.proc.kill()
            assert proc.wait() == -9
            moment = f"{delay:.2f} s after " + ("a new checkpoint" if kind == "running" else "launch")
        survived.append(f"kill {i} {moment}: checkpoints {committed_steps(run)}")
    assert in_flight >= 2, "most kills-in-save should find the save's temporary folder"
    assert max(committed_steps(run)) < TOTAL_STEPS

    last = max(committed_steps(run))
    final = Launch(args, base_env(session), logs, "final")
    assert final.wait() == 0, final.tail()
    assert f"resumed from {run / 'checkpoints'} step {last}" in final.stdout
    assert max(committed_steps(run)) == TOTAL_STEPS
    assert_same_checkpoint(run, reference, TOTAL_STEPS)
    assert_same_metrics(run, reference)
    print(f"{len(survived)} kill -9 survived:\n" + "\n".join(survived))
