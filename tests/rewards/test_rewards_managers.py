"""Custom reward functions, naive / prime reward managers, shaping."""
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxrl_llm.config import default_config, resolve_reward
from jaxrl_llm.rewards import (
    PrimeRewardManager,
    RewardFunctionError,
    RewardManager,
    ScorerSpec,
    UnknownDataSourceError,
    build_reward_manager,
    missing_eos_penalty,
    overlong_penalty,
)

USER_REWARD = '''
import os
import sys
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        while True:
            time.sleep(0.05)
    if solution_str == "swallow":  # a broad except must not defeat the timeout
        try:
            while True:
                time.sleep(0.05)
        except Exception:
            return 1.0
    if solution_str == "exit":
        sys.exit(2)
    if solution_str == "interrupt":
        raise KeyboardInterrupt
    if solution_str == "raise":
        raise RuntimeError("scorer bug")
    if solution_str == "die":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "dict":
        return {"score": 0.5, "acc": True, "pred": "d"}
    return float(solution_str == ground_truth)

def length_score(data_source, solution_str, ground_truth, extra_info=None, scale=1):
    return scale * len(solution_str) + (extra_info or {}).get("bonus", 0)

NOT_CALLABLE = 3
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return path


def config(path=None, name=None, **reward_model):
    """The default config tree with the reward keys under test set."""
    cfg = default_config()
    cfg.custom_reward_function.path = str(path) if path else None
    cfg.custom_reward_function.name = name or "compute_score"
    cfg.reward_model.update(reward_model)
    return cfg


def load_reward_fn(cfg):
    return resolve_reward(cfg).scorer.load()


def test_custom_function_loading(reward_file, tmp_path):
    fn = load_reward_fn(config(reward_file, "length_score"))
    assert fn("x", "abcd", None, {"bonus": 2}) == 6
    assert load_reward_fn(config())("openai/gsm8k", "#### 3", "3") == 1.0  # default dispatch
    cfg = config(reward_file, "length_score")
    cfg.custom_reward_function.reward_kwargs = {"scale": 10}  # bound like veRL's reward_kwargs
    assert load_reward_fn(cfg)("x", "abcd", None) == 40
    with pytest.raises(RewardFunctionError, match=r"custom_reward_function.path: no such file .*missing\.py"):
        load_reward_fn(config(tmp_path / "missing.py"))
    with pytest.raises(RewardFunctionError, match=r"has no attribute 'nope'.*'compute_score', 'length_score'"):
        load_reward_fn(config(reward_file, "nope"))
    with pytest.raises(RewardFunctionError, match="is not callable"):
        load_reward_fn(config(reward_file, "NOT_CALLABLE"))
    (tmp_path / "broken.py").write_text("import not_a_module_xyz\n")
    with pytest.raises(RewardFunctionError, match="importing .*broken.py failed: ModuleNotFoundError"):
        load_reward_fn(config(tmp_path / "broken.py"))


def test_naive_manager_scores_and_counts_errors(reward_file):
    manager = build_reward_manager(resolve_reward(config(reward_file)))
    result = manager.score(["1", "2", "raise", "dict", "nan"], ["s"] * 5, ["1", "1", "1", "1", "1"])
    # NaN is passed on (the trainer counts it as reward/num_nonfinite and scores it 0), not an error
    np.testing.assert_array_equal(result.scores, np.float32([1, 0, 0, 0.5, np.nan]))
    assert result.scores.dtype == np.float32
    assert result.metrics["reward/num_errors"] == 1.0 and result.metrics["reward/num_timeouts"] == 0.0
    np.testing.assert_array_equal(result.reward_extra_info["score"], result.scores)
    assert np.isnan(result.reward_extra_info["acc"][0]) and result.reward_extra_info["acc"][3] == 1.0
    assert result.reward_extra_info["pred"].tolist() == [None, None, None, "d", None]


def test_a_failed_scorer_call_names_the_file_and_row_of_its_sample(reward_file, caplog):
    manager = build_reward_manager(resolve_reward(config(reward_file)))
    sources = [f"train.parquet row {i}" for i in (7, 150, 151)]
    with caplog.at_level("WARNING", logger="jaxrl_llm"):
        manager.score(["1", "raise", "raise"], ["s"] * 3, ["1"] * 3, sources=sources)
    assert "reward: 2 of 3 scorer calls failed (score 0); first: train.parquet row 150: " in caplog.text


def test_default_scorer_in_manager_and_unknown_source():
    manager = RewardManager()
    result = manager.score(["#### 3", "Answer: 4"], ["openai/gsm8k", "math_dapo"], ["3", "5"])
    np.testing.assert_array_equal(result.scores, np.float32([1, -1]))
    with pytest.raises(UnknownDataSourceError):
        manager.score(["x"], ["not/a/source"], ["y"])


def test_shaping_formulas():
    # DAPO: expected = 20 - 10 = 10; penalty = min(-(L - 10) / 10 * 0.5, 0)
    np.testing.assert_allclose(overlong_penalty(np.array([5, 10, 15, 20]), 20, 10, 0.5), [0, 0, -0.25, -0.5])
    np.testing.assert_array_equal(missing_eos_penalty(np.array([True, False]), 1.5), np.float32([0, -1.5]))
    with pytest.raises(ValueError, match="must be positive"):
        overlong_penalty(np.array([1]), 20, 0, 1.0)


def test_manager_applies_shaping(reward_file):
    cfg = config(reward_file, missing_eos_penalty=1.0)
    cfg.reward_model.reward_kwargs.overlong_buffer_cfg.update(enable=True, len=10, penalty_factor=1.0, log=True)
    cfg.reward_model.reward_kwargs.max_resp_len = 20  # validation derives it from data.max_response_length
    manager = build_reward_manager(resolve_reward(cfg))
    result = manager.score(["1", "1", "0", "1"], ["s"] * 4, ["1"] * 4,
                           response_lengths=np.array([4, 12, 16, 20]),
                           finished_with_eos=np.array([True, True, True, False]))
    np.testing.assert_allclose(result.scores, [1.0, 0.8, -0.6, -1.0], rtol=1e-6)
    np.testing.assert_allclose(result.reward_extra_info["overlong_reward"], [0, -0.2, -0.6, -1.0], rtol=1e-6)
    np.testing.assert_array_equal(result.reward_extra_info["score"], [1, 1, 0, 1])
    assert result.metrics["reward/overlong/frac"] == 0.75 and result.metrics["reward/missing_eos/frac"] == 0.25


def test_prime_manager_survives_raising_hanging_and_dying_scorers(reward_file):
    cfg = config(reward_file, reward_manager="prime")
    cfg.reward_model.reward_kwargs.update(timeout_s=1.0, num_workers=2)
    with build_reward_manager(resolve_reward(cfg)) as manager:
        assert isinstance(manager, PrimeRewardManager)
        manager.score(["1"], ["s"], ["1"])  # start the workers
        t0 = time.monotonic()
        result = manager.score(["1", "hang", "raise", "0", "die", "dict", "1"], ["s"] * 7, ["1"] * 7)
        elapsed = time.monotonic() - t0
        np.testing.assert_array_equal(result.scores, np.float32([1, 0, 0, 0, 0, 0.5, 1]))
        assert result.metrics["reward/num_timeouts"] == 1.0 and result.metrics["reward/num_errors"] == 2.0
        # the hanging scorer never returns: coming back at all is the timeout; the bound leaves room for a
        # loaded CI machine respawning the dead worker (12 s seen there)
        assert elapsed < 60.0, elapsed
        again = manager.score(["1", "2"], ["s", "s"], ["1", "1"])  # the pool was repaired
        np.testing.assert_array_equal(again.scores, np.float32([1, 0]))
        assert again.metrics["reward/num_errors"] == 0.0


def test_prime_default_scorer_and_unknown_source():
    with PrimeRewardManager(ScorerSpec(), timeout_s=5.0, num_workers=1) as manager:
        result = manager.score(["#### 3", "\\boxed{2}"], ["openai/gsm8k", "HuggingFaceH4/MATH-500"], ["3", "2"])
        np.testing.assert_array_equal(result.scores, np.float32([1, 1]))
        with pytest.raises(UnknownDataSourceError):
            manager.score(["x"], ["not/a/source"], ["y"])


def test_prime_pool_does_not_hang_interpreter_exit(reward_file):
    script = textwrap.dedent(f"""
        import sys, threading, time
        from jaxrl_llm.rewards import PrimeRewardManager, ScorerSpec
        m = PrimeRewardManager(ScorerSpec({str(reward_file)!r}), timeout_s=1.0, num_workers=1)
        m.score(["hang"], ["s"], ["1"])   # times out, worker replaced
        # leave a worker busy in the hanging scorer when the interpreter exits
        threading.Thread(target=m.score, args=(["hang"], ["s"], ["1"]), daemon=True).start()
        time.sleep(2.0)  # the replacement worker boots, then takes the call
        print("done", flush=True)
        sys.exit(0)
    """)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert time.monotonic() - t0 < 30


def test_prime_binds_reward_kwargs(reward_file):
    spec = ScorerSpec(str(reward_file), "length_score", (("scale", 10),))
    with PrimeRewardManager(spec, timeout_s=5.0, num_workers=1) as manager:
        result = manager.score(["ab", "abc"], ["s", "s"], [None, None], [{"bonus": 1}, None])
    np.testing.assert_array_equal(result.scores, np.float32([21, 30]))


def test_naive_manager_times_out_and_survives_system_exit(reward_file):
    cfg = config(reward_file)
    cfg.reward_model.reward_kwargs.timeout_s = 0.3
    manager = build_reward_manager(resolve_reward(cfg))
    assert type(manager) is RewardManager and manager.timeout_s == 0.3
    t0 = time.monotonic()
    result = manager.score(["1", "hang", "exit", "swallow", "raise", "1"], ["s"] * 6, ["1"] * 6)
    elapsed = time.monotonic() - t0
    np.testing.assert_array_equal(result.scores, np.float32([1, 0, 0, 0, 0, 1]))
    assert result.metrics["reward/num_timeouts"] == 2.0 and result.metrics["reward/num_errors"] == 2.0
    assert 0.6 <= elapsed < 15.0, elapsed
    # the timer is off and the previous SIGALRM handler is back after the calls
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None, signal.SIG_IGN)
    with pytest.raises(KeyboardInterrupt):  # a Ctrl-C still reaches the trainer
        manager.score(["interrupt"], ["s"], ["1"])


def test_naive_timeout_off_the_main_thread(reward_file):
    """A pipelined rollout scores on a background thread: the timeout holds there too, and no
    stray timeout reaches the thread after the calls."""
    import threading

    cfg = config(reward_file)
    cfg.reward_model.reward_kwargs.timeout_s = 0.3
    manager = build_reward_manager(resolve_reward(cfg))
    out = {}

    def job():
        t0 = time.monotonic()
        out["r"] = manager.score(["1", "hang", "swallow", "1"], ["s"] * 4, ["1"] * 4)
        out["elapsed"] = time.monotonic() - t0
        total = 0
        for i in range(3_000_000):  # busy Python code past every deadline: nothing is raised here
            total += i
        out["after"] = manager.score(["1"] * 50, ["s"] * 50, ["1"] * 50)

    thread = threading.Thread(target=job)
    thread.start()
    thread.join(30)
    np.testing.assert_array_equal(out["r"].scores, np.float32([1, 0, 0, 1]))
    assert out["r"].metrics["reward/num_timeouts"] == 2.0 and 0.6 <= out["elapsed"] < 15.0, out
    assert out["after"].metrics["reward/num_timeouts"] == 0.0 and out["after"].scores.sum() == 50


def test_prime_replaces_an_idle_worker_that_died(reward_file):
    import os
    import signal

    with PrimeRewardManager(ScorerSpec(str(reward_file)), timeout_s=5.0, num_workers=2) as manager:
        manager.score(["1", "1"], ["s", "s"], ["1", "1"])  # both workers started, now idle
        dead = manager.worker_processes
        for process in dead:
            os.kill(process.pid, signal.SIGKILL)
            process.join(5)
        result = manager.score(["1", "0", "1"], ["s"] * 3, ["1"] * 3)  # no BrokenPipeError
        np.testing.assert_array_equal(result.scores, np.float32([1, 0, 1]))
        assert result.metrics["reward/num_errors"] == 0.0
        assert all(p.is_alive() and p not in dead for p in manager.worker_processes)
