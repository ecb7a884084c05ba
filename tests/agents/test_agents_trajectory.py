"""Trajectory deltas on templates that rewrite history, the sanity check's report, the length limits."""
from __future__ import annotations

import pytest
from tiny_models import CHATML, make_char_tokenizer

from jaxrl_llm.agents import ChatRenderer, TemplateError, Trajectory, TurnLimits

# Like Qwen3's: an assistant turn followed by later messages loses its <think>...</think> part.
THINK_DROPPING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _model_turn(traj: Trajectory, text: str, finish: str = "eos") -> list[int]:
    tok = traj.renderer.tokenizer
    ids = traj.renderer.encode(text) + ([tok.eos_token_id] if finish == "eos" else [])
    traj.add_model_turn(ids, [-0.25] * len(ids), finish)
    return ids


def test_delta_is_exact_and_sanity_check_passes_on_chatml():
    r = ChatRenderer(make_char_tokenizer(CHATML))
    traj = Trajectory.start(r, [{"role": "user", "content": "hi"}])
    _model_turn(traj, "hello")
    assert traj.add_context_turn([{"role": "user", "content": "more"}], TurnLimits(max_response_length=100))
    assert r.decode(traj.segments[-1].ids) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    _model_turn(traj, "cut", finish="length")  # an unterminated last turn: ids are a prefix of the render
    assert traj.tokenization_mismatch() is None


def test_history_rewriting_template_uses_the_base_conversation_and_the_check_reports_it():
    r = ChatRenderer(make_char_tokenizer(THINK_DROPPING))
    traj = Trajectory.start(r, [{"role": "user", "content": "q"}])
    _model_turn(traj, "<think>hmm</think>A")
    before = traj.ids
    assert traj.add_context_turn([{"role": "user", "content": "again"}], TurnLimits(max_response_length=100))
    assert traj.ids[:len(before)] == before  # the model's tokens (with the thinking) are kept as produced
    assert r.decode(traj.segments[-1].ids) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    report = traj.tokenization_mismatch()
    think_at = len(traj.prompt_ids)
    assert report is not None and report.startswith(f"tokenization mismatch at token {think_at} (segment 1, model)")
    assert "'<think>h" in report


def test_context_turn_that_does_not_fit_is_not_appended():
    r = ChatRenderer(make_char_tokenizer(CHATML))
    traj = Trajectory.start(r, [{"role": "user", "content": "hi"}])
    _model_turn(traj, "hello")
    limits = TurnLimits(max_response_length=len(traj.response_ids) + 20)
    assert not traj.add_context_turn([{"role": "user", "content": "a long reply " * 3}], limits)
    assert [s.kind for s in traj.segments] == ["prompt", "model"] and traj.user_turns == 0
    total = TurnLimits(max_response_length=1000, max_total_length=len(traj.ids) + 5)
    assert traj.token_budget(total) == 5


def test_bad_inputs_are_clear_errors():
    tok = make_char_tokenizer(CHATML)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat_template"):
        ChatRenderer(tok)
    r = ChatRenderer(make_char_tokenizer(CHATML))
    traj = Trajectory.start(r, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="3 ids but 2 log-probs"):
        traj.add_model_turn([5, 6, 7], [0.0, 0.0], "eos")
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        TurnLimits(max_response_length=10, tool_response_truncate_side="both")


def test_rows_to_trajectories_to_padded_arrays():
    import numpy as np

    from jaxrl_llm.agents import GuessNumberEnv, pad_trajectories, trajectories_from_rows

    r = ChatRenderer(make_char_tokenizer(CHATML))
    envs = {"small": lambda: GuessNumberEnv({"high": 9}), "big": lambda: GuessNumberEnv({"high": 999})}
    rows = [{"prompt": "play", "extra_info": {"interaction_kwargs": {"name": "big", "target": 500}}},
            {"prompt": [{"role": "system", "content": "s"}], "extra_info": {"interaction_kwargs": {"name": "small"}}}]
    a, b = trajectories_from_rows(rows, r, interactions=envs)
    assert a.env.high == 999 and a.env.target == 500 and b.env.high == 9
    assert [m["role"] for m in a.messages] == ["user", "user"] and a.messages[0]["content"] == "play"
    with pytest.raises(ValueError, match=r"row 0: extra_info.interaction_kwargs.name=None; configured"):
        trajectories_from_rows([{"prompt": "x"}], r, interactions=envs)
    ids = _model_turn(a, "42")
    a.add_context_turn([{"role": "user", "content": "higher"}], TurnLimits(max_response_length=100))
    batch = pad_trajectories([a, b], prompt_length=len(b.prompt_ids) + 200, response_length=40, pad_id=0)
    n = len(a.response_ids)
    assert batch.prompt_mask[0].sum() == len(a.prompt_ids) and batch.prompt_mask[0, -1] == 1
    assert batch.response_ids[0, :n].tolist() == a.response_ids and batch.response_mask[0].sum() == n
    assert batch.loss_mask[0].tolist() == [1] * len(ids) + [0] * (40 - len(ids))
    np.testing.assert_array_equal(batch.rollout_log_probs[0, :len(ids)], -0.25)
    assert batch.response_mask[1].sum() == 0 and batch.num_turns.tolist() == [3, 1]
    with pytest.raises(ValueError, match="trajectory 0: prompt"):
        pad_trajectories([a], prompt_length=4, response_length=40, pad_id=0)


def test_tool_instructions_go_to_the_system_turn_only_when_the_template_ignores_tools():
    from agent_fixtures import FAKE_SCHEMA, HERMES_TEMPLATE

    from jaxrl_llm.agents import trajectories_from_rows

    plain = ChatRenderer(make_char_tokenizer(CHATML), tools=[FAKE_SCHEMA])
    assert not plain.renders_tools
    (t,) = trajectories_from_rows([{"prompt": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "hi"}]}], plain)
    assert t.messages[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "fake"' in t.messages[0]["content"]
    assert "<tool_call></tool_call> XML tags" in plain.decode(t.prompt_ids)
    hermes = ChatRenderer(make_char_tokenizer(HERMES_TEMPLATE), tools=[FAKE_SCHEMA])
    h0, h1 = trajectories_from_rows([{"prompt": "hi"}], hermes, n=2)
    assert hermes.renders_tools and h0.messages == h1.messages == [{"role": "user", "content": "hi"}]
    assert h0.prompt_ids == h1.prompt_ids and h0.segments[0] is not h1.segments[0]


def test_recorded_routing_covers_the_ids_fed_and_pads_the_rest():
    """Routing replay (docs/moe.md): a model turn's record covers its prefix and its tokens; a context
    turn appended after it (and the turn's last token, never fed) is NOT_RECORDED for the next prefill,
    and the padded rows lay it out as [prompt | response]."""
    import numpy as np

    from jaxrl_llm.agents import pad_trajectories
    from jaxrl_llm.models.moe import NOT_RECORDED

    r = ChatRenderer(make_char_tokenizer(CHATML))
    traj = Trajectory.start(r, [{"role": "user", "content": "hi"}])
    assert traj.prefix_routing() is None  # nothing recorded yet: the router chooses
    prompt = len(traj.ids)
    ids = r.encode("ok")
    record = np.arange((prompt + len(ids)) * 2 * 2, dtype=np.int8).reshape(prompt + len(ids), 2, 2) % 8
    record[-1] = NOT_RECORDED  # the last generated token is never fed
    with pytest.raises(ValueError, match="routing for 3 tokens"):
        traj.add_model_turn(ids, [-0.5] * len(ids), "length", routing=record[:3])
    traj.add_model_turn(ids, [-0.5] * len(ids), "length", routing=record)
    assert traj.add_context_turn([{"role": "user", "content": "more"}], TurnLimits(max_response_length=100))
    prefix = traj.prefix_routing()
    assert prefix is not None and prefix.shape == (len(traj.ids), 2, 2)
    np.testing.assert_array_equal(prefix[:len(record)], record)
    assert (prefix[len(record):] == NOT_RECORDED).all()  # the reply: routed (and recorded) by the next prefill
    batch = pad_trajectories([traj], prompt_length=prompt + 3, response_length=len(traj.ids) - prompt + 2, pad_id=0)
    assert batch.routing is not None and batch.routing.shape == (1, len(traj.ids) + 5, 2, 2)
    np.testing.assert_array_equal(batch.routing[0, 3:3 + len(traj.ids)], prefix)
    assert (batch.routing[0, :3] == NOT_RECORDED).all() and (batch.routing[0, -2:] == NOT_RECORDED).all()
