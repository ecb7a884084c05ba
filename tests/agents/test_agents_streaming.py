"""run_multi_turn_streaming: a trajectory waiting on its tool or environment holds only itself."""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agent_fixtures import FAKE_SCHEMA, FakeTool, ScriptedContinue, hermes_char_tokenizer, serve_via

from jaxrl_llm.agents import (
    BaseTool,
    ChatRenderer,
    Environment,
    GuessNumberEnv,
    ToolResult,
    Trajectory,
    TurnLimits,
    run_multi_turn,
    run_multi_turn_streaming,
)
from jaxrl_llm.models import ModelConfig, compute_logits, init_params
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.engine import EngineSpec, PagedEngine

SLEEP_S = 1.0


class _SleepTool(BaseTool):
    """Sleeps SLEEP_S seconds; records when each call ended."""

    default_schema = {"type": "function", "function": {"name": "sleep", "parameters": {
        "type": "object", "properties": {}}}}

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        self.ended: list[float] = []
        self.lock = threading.Lock()

    def execute(self, instance_id, parameters):
        time.sleep(SLEEP_S)
        with self.lock:
            self.ended.append(time.monotonic())
        return ToolResult("woke up", 0.0, {})


def _call(name: str, args: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def _two_trajectories():
    """A calls the sleeping tool once; B calls the fast tool three times; both then answer."""
    tok = hermes_char_tokenizer()
    sleep, fake = _SleepTool(), FakeTool()
    renderer = ChatRenderer(tok, tools=[sleep.tool_schema, FAKE_SCHEMA])
    eos = tok.eos_token_id
    a, b = (Trajectory.start(renderer, [{"role": "user", "content": c}]) for c in ("A", "B"))

    def turn(text):
        ids = renderer.encode(text) + [eos]
        return ids, [-0.5] * len(ids), "eos"

    script = {tuple(a.prompt_ids): [turn(_call("sleep")), turn("A done")],
              tuple(b.prompt_ids): [turn(_call("fake", '{"x": 1}'))] * 3 + [turn("B done")]}
    cont = ScriptedContinue(script, {k: len(a.prompt_ids) for k in script})
    return [a, b], cont, {"sleep": sleep, "fake": fake}, sleep


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "rounds"])
def test_other_trajectories_keep_decoding_while_a_slow_tool_runs(streaming):
    trajs, cont, tools, sleep = _two_trajectories()
    b_gens: list[float] = []  # when each of B's generations started
    b_key = tuple(trajs[1].prompt_ids)

    def note(prefix):
        if tuple(prefix[:len(b_key)]) == b_key:
            b_gens.append(time.monotonic())

    limits = TurnLimits(max_response_length=2000, max_tool_response_length=100)
    if streaming:
        res = run_multi_turn_streaming(trajs, serve_via(cont, on_request=lambda req: note(req.ids)), limits=limits,
                                       tools=tools, max_parallel_calls=2, tool_timeout_s=10)
    else:
        def rounds(prefixes, budgets, stops):
            for p in prefixes:
                note(p)
            return cont(prefixes, budgets, stops)
        res = run_multi_turn(trajs, rounds, limits=limits, tools=tools, max_parallel_calls=2, tool_timeout_s=10)
    a, b = res.trajectories
    assert a.stop_reason == b.stop_reason == "eos" and a.assistant_turns == 2 and b.assistant_turns == 4
    assert b.tool_calls == 3 and a.tool_calls == 1 and len(sleep.ended) == 1
    if streaming:  # all of B's turns ran while A's tool slept
        assert len(b_gens) == 4 and b_gens[-1] < sleep.ended[0]
    else:  # rounds: B's second turn waited for A's tool
        assert b_gens[1] >= sleep.ended[0]


class _SlowEnv(Environment):
    """Replies "again" twice, then ends with reward 1; the second step sleeps `delay` seconds."""

    def __init__(self, config=None):
        super().__init__(config)
        self.steps = 0
        self.delay = float((config or {}).get("delay", 0.0))

    def reset(self, prompt_row):
        return "start"

    def step(self, assistant_message):
        self.steps += 1
        if self.steps == 2:
            time.sleep(self.delay)
        if assistant_message == "boom":
            raise RuntimeError("the environment broke")
        return ("again", 0.0, False) if self.steps < 3 else (None, 1.0, True)


def _env_run(delay, texts=("one", "two", "three"), timeout=5.0):
    tok = hermes_char_tokenizer()
    renderer = ChatRenderer(tok)
    traj = Trajectory.start(renderer, [], env=_SlowEnv({"delay": delay}))
    turns = [(renderer.encode(t) + [tok.eos_token_id], [-0.1] * (len(t) + 1), "eos") for t in texts]
    key = tuple(traj.prompt_ids)
    cont = ScriptedContinue({key: turns}, {key: len(key)})
    return run_multi_turn_streaming([traj], serve_via(cont), limits=TurnLimits(max_response_length=500),
                                    tool_timeout_s=timeout)


def test_environment_steps_run_off_the_engine_loop_with_a_timeout():
    res = _env_run(0.0)
    t = res.trajectories[0]
    assert t.stop_reason == "env_done" and t.env_rewards == [0.0, 0.0, 1.0] and t.assistant_turns == 3
    t = _env_run(1.5, timeout=0.3).trajectories[0]
    assert t.stop_reason == "env_timeout" and t.assistant_turns == 2 and t.env_rewards == [0.0]
    with pytest.raises(RuntimeError, match="the environment broke"):
        _env_run(0.0, texts=("boom",))


# ---------------------------------------------------------------------------- on the real paged engine
class _DelayedGuess(GuessNumberEnv):
    """GuessNumberEnv whose steps sleep a random few milliseconds (`delays` seeds the pattern)."""

    delays = 0

    def step(self, assistant_message):
        time.sleep(float(self._rng.uniform(0.0, 0.03)))
        return super().step(assistant_message)

    def reset(self, prompt_row):
        self._rng = np.random.default_rng([_DelayedGuess.delays, int(prompt_row["extra_info"]["interaction_kwargs"]
                                                                    ["target"])])
        return super().reset(prompt_row)


def _tiny_model(vocab: int):
    cfg = ModelConfig.tiny("llama", vocab_size=vocab, max_position_embeddings=1024)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.ones(s.shape, s.dtype) if "norm" in jax.tree_util.keystr(path)
        else jnp.asarray(rng.normal(0.0, 0.1, s.shape), s.dtype), shapes)
    return cfg, params


def _guess_trajs(renderer):
    rows = [{"extra_info": {"interaction_kwargs": {"target": t}}} for t in (5, 50, 95)]
    return [Trajectory.start(renderer, [], row=row, env=_DelayedGuess({"max_guesses": 3}))
            for row in rows for _ in range(2)]


LIMITS = TurnLimits(max_response_length=200, max_tokens_per_turn=6)


def _streamed(cfg, params, tok, sampling, *, slots, delays):
    _DelayedGuess.delays = delays
    settings, knobs = sampling.compile_args(cfg.eos_token_ids, tok.pad_token_id, vocab_size=cfg.vocab_size)
    spec = EngineSpec(max_num_seqs=slots, page_size=16, num_pages=slots * 32 + 1, pages_per_slot=32)
    engine = PagedEngine(cfg, spec, steps_per_call=2)
    stats = []
    serve = lambda src: stats.append(engine.serve(params, src, jax.random.key(11), knobs, settings))  # noqa: E731
    res = run_multi_turn_streaming(_guess_trajs(ChatRenderer(tok)), serve, limits=LIMITS, max_parallel_calls=3)
    return res, stats[0]


def test_paged_engine_streaming_is_reproducible_and_its_logprobs_are_the_models():
    tok = hermes_char_tokenizer()
    cfg, params = _tiny_model(len(tok))
    # every other character stops a turn: turns are 1-6 tokens, ending on "stop", EOS or the limit
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(range(4, len(tok), 2)))
    base, stats = _streamed(cfg, params, tok, sampling, slots=4, delays=0)
    other, _ = _streamed(cfg, params, tok, sampling, slots=2, delays=1)  # other env timings, fewer slots
    for t, u in zip(base.trajectories, other.trajectories):
        assert t.ids == u.ids and t.loss_mask == u.loss_mask
        np.testing.assert_allclose(t.response_log_probs, u.response_log_probs, atol=1e-6)
    reasons = [t.stop_reason for t in base.trajectories]
    assert set(reasons) <= {"env_done", "length"} and max(t.assistant_turns for t in base.trajectories) > 1, reasons
    assert base.trajectories[0].ids != base.trajectories[1].ids  # two samples of one prompt differ
    # the two samples of a prompt share their first turn's prefill (later turns share when equal)
    turns = sum(t.assistant_turns for t in base.trajectories)
    assert stats.prefill_calls <= turns - 3 and stats.decode_steps > 0
    assert any(len(s.ids) > 1 for t in base.trajectories for s in t.segments if s.kind == "model")
    # rollout log-probs = a forward pass over the final conversations, on model tokens
    width = max(len(t.ids) for t in base.trajectories)
    batch = np.zeros((6, width), np.int32)
    valid = np.zeros((6, width), np.int32)
    for row, t in enumerate(base.trajectories):
        batch[row, :len(t.ids)], valid[row, :len(t.ids)] = t.ids, 1
    logp = np.asarray(jax.nn.log_softmax(compute_logits(params, cfg, jnp.asarray(batch), jnp.asarray(valid)), -1))
    for row, t in enumerate(base.trajectories):
        ids, p = np.asarray(t.ids), len(t.prompt_ids)
        rescored = logp[row, np.arange(len(ids) - 1), ids[1:]][p - 1:]
        mask = np.asarray(t.loss_mask, bool)
        np.testing.assert_allclose(np.asarray(t.response_log_probs)[mask], rescored[mask], atol=1e-5, rtol=1e-5)


def test_paged_engine_streaming_equals_rounds_greedy():
    from jaxrl_llm.rollout.multi_turn import PagedContinue
    from jaxrl_llm.sampler.engine.setup import EngineOptions

    tok = hermes_char_tokenizer()
    cfg, params = _tiny_model(len(tok))
    # the other half of the characters stop: this model's greedy turns are one token, three of them
    sampling = SamplingParams(do_sample=False, max_new_tokens=6, stop_token_ids=tuple(range(5, len(tok), 2)))
    streamed, _ = _streamed(cfg, params, tok, sampling, slots=4, delays=2)
    cont = PagedContinue(params, cfg, sampling, eos=cfg.eos_token_ids, pad_token_id=tok.pad_token_id,
                         opts=EngineOptions(engine="paged", max_num_seqs=8), mesh=None, compute_dtype="float32",
                         rng=jax.random.key(0))
    rounds = run_multi_turn(_guess_trajs(ChatRenderer(tok)), cont, limits=LIMITS)
    for t, u in zip(streamed.trajectories, rounds.trajectories):
        assert t.ids == u.ids and t.stop_reason == u.stop_reason == "env_done" and t.assistant_turns == 3
        np.testing.assert_allclose(t.response_log_probs, u.response_log_probs, atol=1e-5)
