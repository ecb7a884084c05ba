"""SFT rows -> (prompt, response, loss mask): veRL's single-turn and multi-turn layouts, the turn-by-turn
sequence of conversations (templates that rewrite history included), truncation and bad rows."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_models import CHATML, make_char_tokenizer

from jaxrl_llm.data import DataError
from jaxrl_llm.data.sources import RowRef
from jaxrl_llm.data.spec import DataSpec
from jaxrl_llm.sft import SftSpec, encode_rows
from jaxrl_llm.sft.batch import SftLoader, collate

# Qwen3-like: an assistant turn followed by later messages loses its <think>...</think> part
THINK_DROPPING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

DATA = DataSpec(train_files=None, val_files=None, tokenizer=None, prompt_key="prompt", messages_key="messages",
                apply_chat_template=True, max_prompt_length=512, train_batch_size=2, val_batch_size=None,
                return_raw_chat=False, truncation="error", filter_overlong_prompts=False,
                filter_overlong_prompts_workers=1, shuffle=False, seed=0, train_max_samples=-1, val_max_samples=-1,
                dataloader_num_workers=0, custom_cls_path=None, custom_cls_name=None)


def _refs(n: int) -> list[RowRef]:
    return [RowRef("data.parquet", i) for i in range(n)]


def _trained_text(tok, example) -> str:
    return "".join(tok.decode([int(t)]) if m else "|" for t, m in zip(example.response, example.loss_mask))


def test_single_turn_trains_the_response_and_its_eos_after_the_templated_prompt():
    tok = make_char_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "response": "4"},
            {"prompt": "hi", "response": "yo"}]
    a, b = encode_rows(rows, _refs(2), DATA, SftSpec(), tok)
    assert tok.decode(list(a.prompt)) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(list(a.response)) == "4<|im_end|>" and a.loss_mask.tolist() == [1.0, 1.0]
    assert tok.decode(list(b.prompt)).endswith("hi<|im_end|>\n<|im_start|>assistant\n")  # a string is a user turn


def test_nested_columns_read_through_the_dict_keys():
    tok = make_char_tokenizer()
    rows = [{"extra": {"q": {"text": "why"}}, "reward_model": {"ground_truth": "because"}}]
    data = dataclasses.replace(DATA, prompt_key="extra")
    sft = SftSpec(response_key="reward_model", response_dict_keys=("ground_truth",), prompt_dict_keys=("q", "text"))
    (e,) = encode_rows(rows, _refs(1), data, sft, tok)
    assert tok.decode(list(e.response)) == "because<|im_end|>"
    assert "why" in tok.decode(list(e.prompt))


def test_conversation_trains_every_assistant_turn_and_equals_the_whole_rendering_on_chatml():
    tok = make_char_tokenizer(CHATML)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"}, {"role": "user", "content": "unanswered"}]
    (e,) = encode_rows([{"messages": messages}], _refs(1), DATA, SftSpec(multiturn=True), tok)
    between = tok("\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert _trained_text(tok, e) == "b<|im_end|>" + "|" * len(between) + "d<|im_end|>"
    whole = tok.apply_chat_template(messages[:5], tokenize=False)
    assert tok.decode(list(e.prompt) + list(e.response)) + "\n" == whole


def test_a_history_rewriting_template_keeps_each_turn_as_produced(caplog):
    tok = make_char_tokenizer(THINK_DROPPING)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>x</think>A"},
                {"role": "user", "content": "r"}, {"role": "assistant", "content": "<think>y</think>B"}]
    with caplog.at_level("WARNING"):
        (e,) = encode_rows([{"messages": messages}], _refs(1), DATA, SftSpec(multiturn=True), tok)
    trained = _trained_text(tok, e)
    assert trained.startswith("<think>x</think>A<|im_end|>|") and trained.endswith("<think>y</think>B<|im_end|>")
    assert "renders 1 of 1 conversations differently" in caplog.text


def test_tools_and_thinking_flag_reach_the_template():
    template = ("{% if tools %}T:{{ tools[0]['name'] }}\n{% endif %}{% if enable_thinking is defined and not "
                "enable_thinking %}NOTHINK\n{% endif %}" + CHATML)
    tok = make_char_tokenizer(template)
    row = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}],
           "tools": [{"name": "calc"}], "enable_thinking": False}
    (e,) = encode_rows([row], _refs(1), DATA, SftSpec(multiturn=True), tok)
    assert tok.decode(list(e.prompt)).startswith("T:calc\nNOTHINK\n")


@pytest.mark.parametrize("mode,expect", [("left", "keeps the end"), ("right", "keeps the start")])
def test_truncation_cuts_the_sequence(mode, expect):
    tok = make_char_tokenizer()
    rows = [{"prompt": "p" * 10, "response": "r" * 20}]
    data = dataclasses.replace(DATA, truncation=mode)
    (e,) = encode_rows(rows, _refs(1), data, SftSpec(max_length=40), tok)
    assert len(e.prompt) + len(e.response) == 40
    if mode == "left":
        assert tok.decode(list(e.response)) == "r" * 20 + "<|im_end|>"
    else:
        assert tok.decode(list(e.response)) == "r" * (40 - len(e.prompt))
    with pytest.raises(DataError, match=r"data.parquet row 0: the sequence has \d+ tokens, more than sft.max_length"):
        encode_rows(rows, _refs(1), DATA, SftSpec(max_length=40), tok)


@pytest.mark.parametrize("row,multiturn,message", [
    ({"prompt": "p"}, False, "row 0: missing column 'response'"),
    ({"prompt": "p", "response": ["a", "b"]}, False, "row 0: the response .* is list, not a string"),
    ({"prompt": "p", "response": " "}, False, "row 0: empty response"),
    ({"prompt": 3, "response": "r"}, False, "row 0: column 'prompt' is neither a string nor a list of chat messages"),
    ({"messages": [{"role": "user", "content": "u"}]}, True, "row 0: the conversation has no assistant message"),
    ({"prompt": "p"}, True, "row 0: missing column 'messages'"),
    ({"messages": [{"role": "bot", "content": "u"}]}, True, "row 0: message 0 has role 'bot'"),
])
def test_bad_rows_name_file_and_row(row, multiturn, message):
    with pytest.raises(DataError, match=message):
        encode_rows([row], _refs(1), DATA, SftSpec(multiturn=multiturn), make_char_tokenizer())


def test_batches_use_the_rl_layout_and_resume_where_they_stopped():
    tok = make_char_tokenizer()
    rows = [{"prompt": "p" * (i + 1), "response": "r" * (5 - i)} for i in range(5)]
    examples = encode_rows(rows, _refs(5), DATA, SftSpec(), tok)
    batch = collate(examples[:2], pad_id=0)
    p = batch.input_ids.shape[1] - batch.response_mask.shape[1]
    for i, e in enumerate(examples[:2]):
        assert batch.input_ids[i, p - len(e.prompt):p].tolist() == e.prompt.tolist()  # left-padded prompt
        assert batch.input_ids[i, p:p + len(e.response)].tolist() == e.response.tolist()  # right-padded response
        assert batch.attention_mask[i].sum() == len(e.prompt) + len(e.response)
    loader = SftLoader(examples, 2, shuffle=True, seed=3, pad_id=0)
    seen = [loader.next().input_ids for _ in range(3)]  # epoch 0 has 2 batches (the 5th row dropped), then epoch 1
    resumed = SftLoader(examples, 2, shuffle=True, seed=3, pad_id=0)
    resumed.set_state({"epoch": 0, "index": 2})
    np.testing.assert_array_equal(resumed.next().input_ids, seen[2])
    assert loader.epoch == 1
