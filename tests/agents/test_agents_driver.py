"""run_multi_turn with a scripted continue_fn: exact tokens, masks and log-probs over 8 turns."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from agent_fixtures import FAKE_SCHEMA, FakeTool, ScriptedContinue, hermes_char_tokenizer, serve_via

from jaxrl_llm.agents import (
    BaseTool,
    ChatRenderer,
    GuessNumberEnv,
    ToolResult,
    Trajectory,
    TurnLimits,
    run_multi_turn,
    run_multi_turn_streaming,
)

PROMPT = [{"role": "user", "content": "Add things up."}]


def _call(x) -> str:
    return f'<tool_call>{{"name": "fake", "arguments": {{"x": {x}}}}}</tool_call>'


def _turns(k: int):
    """Turn k's assistant text, finish reason, and the tool replies it gets (8 turns)."""
    if k == 7:
        return "All done: 28.", "eos", None
    if k == 2:  # two calls in one turn, one malformed
        return f"Two at once {_call(2)} and <tool_call>{{oops</tool_call>", "eos", [
            "result-2", "Error: the tool call is not valid JSON (Expecting property name enclosed in double "
                        "quotes at char 1)"]
    if k == 4:  # unknown tool name and a badly typed argument
        return ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                '<tool_call>{"name": "fake", "arguments": {"x": "four"}}</tool_call>'), "eos", [
            "Error: unknown tool 'nope'; available: ['fake']", "Error: fake: argument 'x' must be of type integer, "
                                                             "got str"]
    # odd turns stop at the end of the call (a single-token stop would), without EOS
    return f"Step {k}: {_call(k)}", ("stop" if k % 2 else "eos"), [f"result-{k}"]


def _script(renderer: ChatRenderer, eos_id: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    turns = []
    for k in range(8):
        text, finish, _ = _turns(k)
        ids = renderer.encode(text) + ([eos_id] if finish == "eos" else [])
        turns.append((ids, (-rng.random(len(ids))).round(4).tolist(), finish))
    return turns


def _expected_messages():
    msgs = list(PROMPT)
    for k in range(8):
        text, _, replies = _turns(k)
        msgs.append({"role": "assistant", "content": text})
        msgs += [{"role": "tool", "content": r} for r in (replies or [])]
    return msgs


def _drive(streaming: bool, trajs, cont, **kwargs):
    """run_multi_turn (rounds), or run_multi_turn_streaming over an engine stand-in, on one script."""
    if streaming:
        return run_multi_turn_streaming(trajs, serve_via(cont), **kwargs)
    return run_multi_turn(trajs, cont, **kwargs)


def _check_eight_turns(tokenizer, streaming=False):
    renderer = ChatRenderer(tokenizer, tools=[FAKE_SCHEMA])
    traj = Trajectory.start(renderer, PROMPT)
    script = _script(renderer, tokenizer.eos_token_id)
    cont = ScriptedContinue({tuple(traj.prompt_ids): script}, {tuple(traj.prompt_ids): len(traj.prompt_ids)})
    tool = FakeTool()
    res = _drive(streaming, [traj], cont, limits=TurnLimits(max_response_length=4096, max_tool_response_length=200),
                 tools={"fake": tool}, max_parallel_calls=3, sanity_check=True)
    t = res.trajectories[0]
    # exact tokens: the whole conversation rendered once by the template, tokenized once
    want = renderer.encode(renderer.render(_expected_messages(), add_generation_prompt=False))
    got = t.ids
    assert got == want[:len(got)] and len(want) - len(got) == len(renderer.encode("\n")), (
        renderer.decode(got), renderer.decode(want))
    assert res.mismatches == [None]
    # model tokens masked in with their log-probs, everything else masked out with 0
    mask, lps, resp = np.array(t.loss_mask), np.array(t.response_log_probs), np.array(t.response_ids)
    assert resp.shape == mask.shape == lps.shape
    assert resp[mask == 1].tolist() == [i for ids, _, _ in script for i in ids]
    np.testing.assert_array_equal(lps[mask == 1], [x for _, lp, _ in script for x in lp])
    assert np.all(lps[mask == 0] == 0.0) and (mask == 0).sum() > 0
    # prompt + 8 model turns + 7 tool turns, alternating
    assert [s.kind for s in t.segments] == ["prompt"] + ["model", "context"] * 7 + ["model"]
    for seg, (_, _, replies) in zip(t.segments[2::2], map(_turns, range(7))):
        text = renderer.decode(seg.ids)
        assert all(r in text for r in replies)
    assert t.stop_reason == "eos" and t.assistant_turns == 8 and t.user_turns == 7
    assert t.tool_calls == 9 and t.tool_errors == 3 and t.tool_timeouts == 0
    assert t.reward_parts == {"tool_step": pytest.approx(sum([0, 1, 2, 3, 5, 6]) / 10), "tool_final": 6.0,
                              "interaction": 0.0}
    assert tool.released == [next(iter(tool.calls))]
    m = res.metrics
    assert m["multi_turn/num_turns/mean"] == 16 and m["multi_turn/tool_calls/mean"] == 9
    assert m["multi_turn/tool_errors"] == 3 and m["multi_turn/tool_timeouts"] == 0
    assert m["multi_turn/response_length/turn_3/mean"] == len(script[2][0])
    assert m["multi_turn/tokenization_mismatches"] == 0 and m["multi_turn/stop_reason/eos"] == 1.0
    # each round saw the whole trajectory so far as its prefix, never re-tokenized
    assert cont.prefix_lengths[0] == [len(t.prompt_ids)]
    return t


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_eight_turns_exact_tokens_masks_logprobs_char_tokenizer(streaming):
    _check_eight_turns(hermes_char_tokenizer(), streaming)


@pytest.mark.slow
def test_eight_turns_exact_tokens_masks_logprobs_smollm2():
    from jaxrl_llm.config import smollm2_gguf_path
    from jaxrl_llm.hf import load_tokenizer

    t = _check_eight_turns(load_tokenizer(smollm2_gguf_path()))
    assert "<|im_start|>tool" in t.renderer.decode(t.segments[2].ids)  # SmolLM2's template: a 'tool' role


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_only_active_trajectories_continue_and_limits_apply(streaming):
    tok = hermes_char_tokenizer()
    renderer = ChatRenderer(tok, tools=[FAKE_SCHEMA])
    eos = tok.eos_token_id
    prompts = [[{"role": "user", "content": c}] for c in ("A", "B", "C")]
    trajs = [Trajectory.start(renderer, p) for p in prompts]
    call = renderer.encode(_call(1)) + [eos]
    script = {tuple(trajs[0].prompt_ids): [(renderer.encode("no call") + [eos], [-0.5] * 8, "eos")],
              tuple(trajs[1].prompt_ids): [(call, [-0.1] * len(call), "eos")] * 10,
              tuple(trajs[2].prompt_ids): [(call, [-0.1] * len(call), "eos")] * 2
              + [(renderer.encode("x" * 100), [-0.2] * 100, "eos")]}
    lens = {k: len(trajs[0].prompt_ids) for k in script}
    cont = ScriptedContinue(script, lens)
    limits = TurnLimits(max_response_length=1000, max_user_turns=3, max_tokens_per_turn=70,
                        max_tool_response_length=4, tool_response_truncate_side="left")
    res = _drive(streaming, trajs, cont, limits=limits, tools={"fake": FakeTool()})
    a, b, c = res.trajectories
    # rounds: A ends at once, C's third turn is cut, B runs to its limit; streaming: one at a time
    assert cont.batch_sizes == ([1] * 8 if streaming else [3, 2, 2, 1])
    assert a.stop_reason == "eos" and a.assistant_turns == 1
    assert b.stop_reason == "max_user_turns" and b.user_turns == 3 and b.assistant_turns == 4
    assert c.stop_reason == "length" and c.turn_lengths[-1] == 70  # max_tokens_per_turn
    assert "resu...(truncated)" in renderer.decode(b.segments[2].ids)
    assert res.metrics["multi_turn/stop_reason/length"] == pytest.approx(1 / 3)
    assert res.metrics["multi_turn/num_turns/max"] == 8


class _SlowTool(BaseTool):
    default_schema = {"type": "function", "function": {"name": "slow", "parameters": {
        "type": "object", "properties": {"s": {"type": "number"}}}}}

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        self.concurrent = self.peak = 0
        self.lock = threading.Lock()

    def execute(self, instance_id, parameters):
        with self.lock:
            self.concurrent += 1
            self.peak = max(self.peak, self.concurrent)
        try:
            if parameters.get("s", 0) < 0:
                raise RuntimeError("negative sleep")
            time.sleep(parameters.get("s", 0))
        finally:
            with self.lock:
                self.concurrent -= 1
        return ToolResult("slept", 0.0, {})


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_parallel_calls_timeouts_and_exceptions_are_counted_and_fed_back(streaming):
    tok = hermes_char_tokenizer()
    tool = _SlowTool()
    renderer = ChatRenderer(tok, tools=[tool.tool_schema])
    eos = tok.eos_token_id
    calls = "".join(f'<tool_call>{{"name": "slow", "arguments": {{"s": {s}}}}}</tool_call>'
                    for s in (0.3, 0.3, 0.3, 5, -1))
    traj = Trajectory.start(renderer, [{"role": "user", "content": "go"}])
    ids = renderer.encode(calls) + [eos]
    key = tuple(traj.prompt_ids)
    cont = ScriptedContinue({key: [(ids, [0.0] * len(ids), "eos"), ([eos], [0.0], "eos")]}, {key: len(key)})
    start = time.monotonic()
    res = _drive(streaming, [traj], cont, limits=TurnLimits(max_response_length=2000, max_tool_response_length=500),
                 tools={"slow": tool}, max_parallel_calls=4, tool_timeout_s=1.0)
    took = time.monotonic() - start
    t = res.trajectories[0]
    assert t.tool_calls == 5 and t.tool_timeouts == 1 and t.tool_errors == 1
    assert tool.peak >= 3 and took < 4.0  # in parallel, and the 5 s call did not hold the rollout
    reply = renderer.decode(t.segments[2].ids)
    assert reply.count("slept") == 3 and "timed out after 1s" in reply and "RuntimeError: negative sleep" in reply
    assert res.metrics["multi_turn/tool_timeouts"] == 1 and res.metrics["multi_turn/tool_errors"] == 1


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_environment_turns_guess_the_number(streaming):
    tok = hermes_char_tokenizer()
    renderer = ChatRenderer(tok)
    eos = tok.eos_token_id
    env = GuessNumberEnv({"low": 1, "high": 100, "max_guesses": 5})
    traj = Trajectory.start(renderer, [], row={"extra_info": {"interaction_kwargs": {"target": 37}}}, env=env)
    assert "between 1 and 100" in traj.messages[0]["content"]
    key = tuple(traj.prompt_ids)
    guesses = [renderer.encode(g) + [eos] for g in ("50", "25", "37")]
    cont = ScriptedContinue({key: [(g, [-1.0] * len(g), "eos") for g in guesses]}, {key: len(key)})
    res = _drive(streaming, [traj], cont, limits=TurnLimits(max_response_length=500), sanity_check=True)
    t = res.trajectories[0]
    assert [m["content"] for m in t.messages[1:]] == ["50", "lower", "25", "higher", "37"]
    assert t.stop_reason == "env_done" and t.env_rewards == [0.0, 0.0, 1.0] and res.mismatches == [None]
    assert sum(t.loss_mask) == sum(len(g) for g in guesses)


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_a_hung_tool_with_one_worker_times_out_the_calls_queued_behind_it(streaming):
    tok = hermes_char_tokenizer()
    tool = _SlowTool()
    renderer = ChatRenderer(tok, tools=[tool.tool_schema])
    calls = "".join(f'<tool_call>{{"name": "slow", "arguments": {{"s": {s}}}}}</tool_call>' for s in (3, 0))
    traj = Trajectory.start(renderer, [{"role": "user", "content": "go"}])
    ids = renderer.encode(calls) + [tok.eos_token_id]
    key = tuple(traj.prompt_ids)
    cont = ScriptedContinue({key: [(ids, [0.0] * len(ids), "eos"), ([tok.eos_token_id], [0.0], "eos")]},
                            {key: len(key)})
    start = time.monotonic()
    res = _drive(streaming, [traj], cont, limits=TurnLimits(max_response_length=2000, max_tool_response_length=500),
                 tools={"slow": tool}, max_parallel_calls=1, tool_timeout_s=0.5)
    assert time.monotonic() - start < 2.5 and res.trajectories[0].tool_timeouts == 2
    assert renderer.decode(res.trajectories[0].segments[2].ids).count("timed out after 0.5s") == 2
