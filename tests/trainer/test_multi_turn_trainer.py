"""Multi-turn rollouts in the trainer (actor_rollout_ref.rollout.multi_turn): masks (model tokens in the
loss, tool / user tokens attended only), rollout log-probs == recomputed ones on model tokens, a full
train_step with multi_turn/* metrics, the tool path and reward sum, and the start-of-run errors."""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import tiny_runs
from tiny_runs import GUESS_YAML, assert_host_rows_match

from jaxrl_llm.agents import AgentConfigError, Generated
from jaxrl_llm.config import resolve_config
from jaxrl_llm.config.schema import ConfigError
from jaxrl_llm.rollout import multi_turn as mt_module
from jaxrl_llm.rollout.multi_turn import MultiTurn
from jaxrl_llm.sampler.engine.setup import EngineOptions, sized_engine
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")
MT = "actor_rollout_ref.rollout.multi_turn"
TOOLS_YAML = """tools:
  - class_name: jaxrl_llm.agents.calculator.CalculatorTool
    config: {}
"""


def guess_config(tmp_path, **overrides):
    (tmp_path / "guess.yaml").write_text(GUESS_YAML)
    return tiny_runs.tiny_config(tmp_path / "run", **{
        "data.synthetic.task": "guess", "data.max_prompt_length": 96, "data.max_response_length": 64,
        f"{MT}.enable": True, f"{MT}.interaction_config_path": str(tmp_path / "guess.yaml"),
        f"{MT}.max_assistant_turns": 3,
        # every token ends a turn: a random model's turns are one token, the environment always replies
        "actor_rollout_ref.rollout.stop_token_ids": list(range(49152)),
        "actor_rollout_ref.rollout.engine": "static", **overrides})


@pytest.fixture(scope="module")
def guess_trainer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mt")
    return Trainer(guess_config(tmp)), tmp


def test_masks_logprobs_and_a_train_step(guess_trainer):
    trainer, _ = guess_trainer
    batch = next(trainer.train_loader)
    rollout = trainer.generator.generate(batch, trainer.actor.model_params, trainer.spec.train_sampling,
                                         jax.random.key(0))
    attn = np.asarray(rollout.attention_mask)
    loss = np.asarray(rollout.response_mask)
    width = loss.shape[1]
    resp_attn = attn[:, -width:]
    assert rollout.num_rows == 8
    for i, t_len in enumerate(rollout.response_lengths):
        # attention covers the whole response (model + environment tokens), contiguous from the prompt
        assert resp_attn[i, :t_len].all() and not resp_attn[i, t_len:].any()
        # 3 one-token model turns; the environment's two replies in between are context (loss mask 0)
        assert loss[i].sum() == 3, loss[i]
        model_at = np.flatnonzero(loss[i])
        assert model_at[0] == 0 and model_at[-1] == t_len - 1
        assert resp_attn[i, model_at[0] + 1:model_at[1]].all() and not loss[i, model_at[0] + 1:model_at[1]].any()
        # the score sits on the last model token
        scores = np.asarray(rollout.token_level_scores)[i]
        assert np.flatnonzero(scores).tolist() in ([], [t_len - 1])
    assert "user" in rollout.texts[0] and rollout.meta["data_source"][0] == "synthetic/guess"
    assert rollout.reward_metrics["multi_turn/num_turns/mean"] == 6.0  # 3 assistant + 2 user + 1
    assert rollout.reward_metrics["multi_turn/model_tokens/mean"] == 3.0
    # rollout log-probs == the trainer's recomputed old log-probs (fp32, packed) on model tokens
    # the step's rows from host lengths and group ids equal what the device arrays say
    assert_host_rows_match(rollout)
    recomputed = np.asarray(trainer.log_probs(trainer.actor.model_params, rollout))
    sampled = np.asarray(rollout.rollout_log_probs)
    on = loss > 0
    np.testing.assert_allclose(sampled[on], recomputed[on], atol=1e-5, rtol=0)
    assert np.all(sampled[~on] == 0.0)

    metrics = trainer.step()
    assert all(math.isfinite(v) for v in metrics.values())
    for key in ("multi_turn/num_turns/mean", "multi_turn/num_turns/max", "multi_turn/tool_calls/mean",
                "multi_turn/tool_errors", "multi_turn/tool_timeouts", "multi_turn/response_length/turn_1/mean",
                "multi_turn/tokenization_mismatches", "actor/pg_loss", "critic/score/mean"):
        assert key in metrics, key
    # a random model emits lone byte tokens ("\ufffd") that re-tokenize differently: the check counts them
    assert 0 <= metrics["multi_turn/tokenization_mismatches"] <= 8
    val = trainer.validate()
    assert "val-core/synthetic/guess/reward/mean@1" in val and "val-aux/synthetic/guess/num_turns/mean@1" in val


def test_paged_engine_continue_matches_recomputed_logprobs(guess_trainer, monkeypatch):
    trainer, _ = guess_trainer
    monkeypatch.setattr(trainer.generator, "engine", EngineOptions(engine="paged", max_num_seqs=8))
    sized = []  # the prompt length the engine is sized for: the run's bound, as the single-turn engine's
    monkeypatch.setattr(mt_module, "sized_engine", lambda *a, max_prompt_len, **kw: sized.append(max_prompt_len) or
                        sized_engine(*a, max_prompt_len=max_prompt_len, **kw))
    trainer.train_loader.reset()
    batch = next(trainer.train_loader)
    r = trainer.generator.generate(batch, trainer.actor.model_params, trainer.spec.train_sampling, jax.random.key(2))
    assert sized == [96]  # data.max_prompt_length (guess_config), not this batch's longest prompt
    loss = np.asarray(r.response_mask)
    assert (loss.sum(-1) == 3).all()  # three one-token model turns through the paged engine too
    # streamed (agents/streaming.py): one engine run for every turn, the n samples of a row share
    # their first prefill
    stats, rows = trainer.generator.last_engine_stats, len(loss)
    assert stats is not None and stats.prefill_calls < 3 * rows
    # (one-token turns: token 0 comes from the prefill, so no decode step runs)
    assert r.reward_metrics["rollout/engine/slot_utilisation"] == stats.utilisation
    assert r.reward_metrics["rollout/engine/prefill_tokens"] == stats.prefill_tokens > 0
    assert_host_rows_match(r)
    recomputed = np.asarray(trainer.log_probs(trainer.actor.model_params, r))
    np.testing.assert_allclose(np.asarray(r.rollout_log_probs)[loss > 0], recomputed[loss > 0], atol=1e-5, rtol=0)


def test_paged_rounds_run_one_engine_for_every_round(guess_trainer, monkeypatch):
    trainer, _ = guess_trainer
    monkeypatch.setattr(trainer.generator, "engine", EngineOptions(engine="paged", max_num_seqs=8))
    monkeypatch.setattr(mt_module, "jax", tiny_runs.TwoProcesses())
    sized, runs = [], []  # what each round's engine is sized for, and the budgets it runs

    def spy(*a, num_requests, max_prompt_len, settings, **kw):
        sized.append((num_requests, max_prompt_len, settings.max_new_tokens))
        engine = sized_engine(*a, num_requests=num_requests, max_prompt_len=max_prompt_len, settings=settings, **kw)
        run = engine.run
        monkeypatch.setattr(engine, "run", lambda *ra, **rk: runs.append(rk["max_new_tokens"]) or run(*ra, **rk))
        return engine

    monkeypatch.setattr(mt_module, "sized_engine", spy)
    trainer.train_loader.reset()
    batch = next(trainer.train_loader)
    r = trainer.generator.generate(batch, trainer.actor.model_params, trainer.spec.train_sampling, jax.random.key(2))
    loss = np.asarray(r.response_mask)
    assert (loss.sum(-1) == 3).all()  # three one-token model turns: three rounds
    # every round: the trajectory count, data.max_prompt_length and data.max_response_length, as the
    # streaming path's engine (each round's own longest prefix built a new engine per round before)
    assert sized == [(len(loss), 96, 64)] * 3
    # each conversation runs with what is left of its budget (the environment's replies use some)
    assert runs[0] == [64] * len(loss) and all(max(b) < 64 for b in runs[1:])
    recomputed = np.asarray(trainer.log_probs(trainer.actor.model_params, r))
    np.testing.assert_allclose(np.asarray(r.rollout_log_probs)[loss > 0], recomputed[loss > 0], atol=1e-5, rtol=0)


class ScriptedCalculatorCall:
    """A continue_fn: first turn a hermes calculator call, then the number it read back."""

    def __init__(self, *args, tokenizer, **kwargs):
        self.tok = tokenizer

    def __call__(self, prefixes, budgets, stops=()):
        out = []
        for prefix in prefixes:
            text = self.tok.decode(prefix)
            if "<|im_start|>tool" in text.split("What is 47")[-1]:
                reply = "1786<|im_end|>"
            else:
                reply = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 38"}}\n'
                         "</tool_call><|im_end|>")
            ids = self.tok(reply, add_special_tokens=False)["input_ids"]
            out.append(Generated(ids, [-0.5] * len(ids), "eos"))
        return out


def test_tool_tokens_are_masked_out_and_rewards_add(guess_trainer, tmp_path, monkeypatch):
    trainer, _ = guess_trainer
    (tmp_path / "tools.yaml").write_text(TOOLS_YAML)
    spec = resolve_config(tiny_runs.tiny_config(tmp_path / "run", **{
        f"{MT}.enable": True, f"{MT}.tool_config_path": str(tmp_path / "tools.yaml")}), dp_size=8).multi_turn
    gen = trainer.generator
    monkeypatch.setattr(gen, "multi_turn", MultiTurn(spec, trainer.tokenizer))
    monkeypatch.setattr(gen, "max_prompt_length", 512)
    monkeypatch.setattr(mt_module, "StaticSamplerContinue",
                        lambda *a, **k: ScriptedCalculatorCall(tokenizer=trainer.tokenizer))
    question = [{"role": "user",
                 "content": "What is 47 * 38? Use the calculator tool, then answer with only the number."}]
    batch = {"raw_prompt": np.array([question, question], dtype=object),
             "raw_prompt_ids": np.array([[1], [1]], dtype=object),
             "data_source": np.array(["synthetic/multiply"] * 2, dtype=object),
             "ground_truth": np.array(["1786", "1000"], dtype=object),
             "extra_info": np.array([{"task": "multiply", "answer_format": "first"}] * 2, dtype=object)}
    r = gen.generate(batch, trainer.actor.model_params, trainer.spec.train_sampling, jax.random.key(1))
    assert r.num_rows == 4
    loss, lp = np.asarray(r.response_mask), np.asarray(r.rollout_log_probs)
    tok = trainer.tokenizer
    for i in range(r.num_rows):
        ids = np.asarray(r.input_ids)[i, -loss.shape[1]:][: r.response_lengths[i]]
        model_text = tok.decode(ids[loss[i, : len(ids)] > 0])
        context_text = tok.decode(ids[loss[i, : len(ids)] == 0])
        assert "<tool_call>" in model_text and "1786<|im_end|>" in model_text
        assert "<|im_start|>tool\n1786<|im_end|>" in context_text and "calculator" not in context_text
        assert np.all(lp[i][loss[i] > 0] == -0.5) and np.all(lp[i][loss[i] == 0] == 0.0)
    # scorer on the final answer ("1786"): rows of the first prompt 1, of the second 0; no tool rewards
    np.testing.assert_array_equal(r.scores, [1.0, 1.0, 0.0, 0.0])
    assert r.reward_metrics["multi_turn/tool_calls/mean"] == 1.0 and r.reward_metrics["multi_turn/tool_errors"] == 0


@pytest.mark.parametrize("key,value,match", [
    ("format", "xml", r"multi_turn.format='xml'"),
    ("use_inference_chat_template", True, "token in, token out"),
    ("interaction_config_path", None, "needs .*tool_config_path"),
    ("tool_call_timeout_s", 0.0, "must be > 0"),
])
def test_config_errors(tmp_path, key, value, match):
    cfg = guess_config(tmp_path, **{f"{MT}.{key}": value})
    with pytest.raises(ConfigError, match=match):
        resolve_config(cfg, dp_size=8)


def test_bad_tool_yaml_is_one_error_at_start(tmp_path):
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: no_such_pkg.Tool\n    config: {}\n")
    cfg = tiny_runs.tiny_config(tmp_path / "run", **{f"{MT}.enable": True,
                                                     f"{MT}.tool_config_path": str(tmp_path / "tools.yaml")})
    with pytest.raises(AgentConfigError, match=r"tools\[0\].class_name: cannot import module 'no_such_pkg'"):
        Trainer(cfg)
