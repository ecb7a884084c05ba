"""Partial rollouts (rollout.partial, rollout/partial.py) through the real trainer: max_staleness=0
is the plain rollout, no token is trained more than max_staleness steps after it was sampled while
samples do pause mid-response and resume, and a run resumed from a checkpoint (which keeps the
paused samples) continues exactly."""
import numpy as np
import pytest
import tiny_runs
from tiny_runs import with_reward_file

from jaxrl_llm.config import ConfigError
from jaxrl_llm.rollout import partial
from jaxrl_llm.sampler.engine.setup import sized_engine
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")  # the tiny runs use SmolLM2's tokenizer
# a fifth of the vocabulary ends a response: the random tiny model's lengths then vary, so a step
# stops while some samples are mid-response; 4 slots make the rest queue
STOPS = list(range(0, 49152, 5))
KEY = "actor_rollout_ref.rollout.partial"


def _run(run_dir, steps, **extra):
    """A tiny run that learns (a reward the random model can earn), so its policy moves from step to step."""
    cfg = tiny_runs.tiny_config(run_dir, **{
        "trainer.logger": ["jsonl"], "data.synthetic.n_train": 32, "trainer.total_training_steps": steps,
        "trainer.test_freq": -1, "actor_rollout_ref.rollout.engine": "paged",
        "actor_rollout_ref.rollout.max_num_seqs": 4, "actor_rollout_ref.rollout.stop_token_ids": STOPS, **extra})
    return Trainer(with_reward_file(cfg, run_dir.parent))


def test_max_staleness_zero_is_the_plain_rollout(tmp_path):
    _run(tmp_path / "plain", 2).fit()
    _run(tmp_path / "zero", 2, **{f"{KEY}.enable": True, f"{KEY}.max_staleness": 0}).fit()
    a, b = tiny_runs.read_metrics(tmp_path / "plain"), tiny_runs.read_metrics(tmp_path / "zero")
    for step in (1, 2):
        want, got = tiny_runs.step_numbers(a, step), tiny_runs.step_numbers(b, step)
        assert want.keys() == got.keys()
        for k in want:
            if not k.startswith("timing") and not k.startswith("perf"):
                assert got[k] == want[k], (step, k)


@pytest.mark.parametrize("bound", [1, 2])
def test_no_token_lags_more_than_the_bound_and_resume_is_exact(tmp_path, bound, monkeypatch):
    steps = 4
    full = tmp_path / "full"
    run = lambda d, n, **kw: _run(d, n, **{f"{KEY}.enable": True, f"{KEY}.max_staleness": bound,  # noqa: E731
                                           "trainer.save_freq": 1, **kw})
    sized = []  # the prompt length each step's engine is sized for
    monkeypatch.setattr(partial, "sized_engine",
                        lambda *a, max_prompt_len, **kw: sized.append(max_prompt_len) or
                        sized_engine(*a, max_prompt_len=max_prompt_len, **kw))
    run(full, steps).fit()
    # every step, resumed samples (prompt + their tokens so far) included, fits the run's prompt bound:
    # one engine for the run, as the plain rollout
    assert sized == [tiny_runs.tiny_config(tmp_path / "cfg").data.max_prompt_length] * steps
    monkeypatch.undo()
    rows = [tiny_runs.step_numbers(tiny_runs.read_metrics(full), s) for s in range(1, steps + 1)]
    assert all(r["rollout/staleness_max"] <= bound for r in rows)
    assert sum(r["rollout/partial/paused"] for r in rows) > 0  # samples stopped mid-response ...
    assert sum(r["rollout/partial/resumed"] for r in rows) > 0  # ... and went on at a later step
    assert max(r["rollout/staleness"] for r in rows) > 0
    assert rows[0]["rollout/staleness"] == 0  # the first step trains what it sampled
    # stale tokens are weighed by token-level rollout correction, on by default here
    assert any(abs(r["rollout_corr/kl"]) > 1e-6 for r in rows[1:])
    tiny_runs.assert_resume_equals_uninterrupted(run, full, tmp_path / "resumed", steps=steps)


def test_partial_rollouts_refuse_what_they_cannot_resume(tmp_path):
    for extra, match in ((dict(**{"actor_rollout_ref.rollout.engine": "static"}), r"rollout.engine='static'"),
                         ({"algorithm.filter_groups.enable": True}, "filter_groups"),
                         ({"synchronizer.sync_offset": 1}, "sync_offset=0")):
        with pytest.raises(ConfigError, match=match):
            _run(tmp_path / "x", 1, **{f"{KEY}.enable": True, **extra})


DYNAMIC = {"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_device": 80}


@pytest.mark.parametrize("level,batching", [("token", {}), ("sequence", DYNAMIC)])
def test_rollout_correction_in_the_loss_equals_the_separate_pass(tmp_path, monkeypatch, level, batching):
    """Stale tokens' IS weights taken in the actor's loss from its own forward (RunSpec.rollout_is_in_update,
    no old-log-prob pass) train as the separate pass's weights do, with the same rollout_corr/* metrics;
    with fixed micro-batches and with token-budget ones (whose log-probs the update adds up per row)."""
    from jaxrl_llm.config.spec import RunSpec

    steps, extra = 3, {f"{KEY}.enable": True, f"{KEY}.max_staleness": 1,
                       "algorithm.rollout_correction.rollout_is": level, **batching}
    in_loss = _run(tmp_path / "in_loss", steps, **extra)
    assert in_loss.spec.rollout_is_in_update and not in_loss.spec.recompute_old_log_probs
    in_loss.fit()
    monkeypatch.setattr(RunSpec, "rollout_is_in_update", property(lambda self: False))
    separate = _run(tmp_path / "separate", steps, **extra)
    assert separate.spec.recompute_old_log_probs and separate.spec.actor.rollout_is_in_loss is None
    separate.fit()
    rows = [[tiny_runs.step_numbers(tiny_runs.read_metrics(tmp_path / d), s) for s in range(1, steps + 1)]
            for d in ("in_loss", "separate")]
    assert any(abs(r["rollout_corr/kl"]) > 1e-6 for r in rows[1][1:])  # stale tokens were weighed
    for got, want in zip(*rows):
        assert got.keys() == want.keys()
        for k in want:
            # exact_token_frac counts bit-equal tokens: without model.batch_invariant the two passes' batch
            # shapes round a few log-probs apart (their values agree to the tolerance)
            if k.startswith(("actor/", "rollout_corr/", "critic/", "response_length/")) and "exact_token" not in k:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
