"""SFT rows -> token sequences with a loss mask, as veRL's SFT datasets read them.

Single-turn rows (veRL `SFTDataset`): the prompt column (`data.prompt_key`, read through
`sft.prompt_dict_keys`) is a string or a chat message list, rendered with the chat template and the
generation prompt; the response column (`sft.response_key` through `sft.response_dict_keys`) is a
string, followed by the EOS token. The loss covers the response and its EOS.

Multi-turn rows (veRL `MultiTurnSFTDataset`, `sft.multiturn`): `data.messages_key` holds the
conversation, `sft.tools_key` its tool schemas, `sft.enable_thinking_key` its thinking flag. The loss
covers every assistant turn: its content as the template renders that turn, and the EOS that ends it.
The sequence is built turn by turn, exactly as our multi-turn rollouts build it
(`agents/chat.py ChatRenderer`): the first assistant turn's prompt, then each assistant turn as the
model produced it, then the template's text that takes the conversation to the next assistant turn
(`delta_text`). So each assistant turn is trained in the context it is sampled in. A template that
rewrites earlier turns once the conversation goes on (Qwen3 drops earlier `<think>` blocks) renders the
whole conversation differently from that sequence; the sequence keeps every turn as produced (the
policy produced those tokens at its turn), and one warning says how many rows differ from the
whole-conversation rendering (veRL instead errors unless `ignore_input_ids_mismatch`).

Segments are tokenized one by one (`add_special_tokens=False`; the template carries the special tokens)
and concatenated, as a rollout's prompt, sampled tokens and continuations are. Each sequence is split at
its first trained token into (prompt, response): the layout every RL pass reads (left-padded prompt,
right-padded response; roles/forward.py), with the response's loss mask.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.agents.chat import ChatRenderer, TemplateError
from jaxrl_llm.data.prompts import _normalise_prompt, render_prompt, with_system_prompt
from jaxrl_llm.data.sources import DataError, RowRef, read_files
from jaxrl_llm.data.spec import DataSpec, SftSpec
from jaxrl_llm.hf.tokenizer import Tokenizer, render_chat

log = logging.getLogger("jaxrl_llm")



@dataclasses.dataclass(frozen=True)
class SftExample:
    """One training sequence: prompt ids, response ids and the response's loss mask (1 = trained)."""

    prompt: np.ndarray  # int32 [P], P >= 1
    response: np.ndarray  # int32 [R]
    loss_mask: np.ndarray  # float32 [R]
    where: str  # file and row


def _nested(row: Mapping[str, Any], column: str, keys: Sequence[str], where: RowRef, key_name: str) -> Any:
    if column not in row:
        raise DataError(f"{where}: missing column {column!r} (sft.{key_name}, or data.prompt_key for prompts); "
                        f"columns are {sorted(row)}")
    value = row[column]
    path = column
    for k in keys:
        if isinstance(value, np.ndarray) and value.dtype == object and value.shape == ():
            value = value.item()
        if not isinstance(value, Mapping) or k not in value:
            raise DataError(f"{where}: {path} has no key {k!r} (dict keys of sft.{key_name.replace('key', 'dict_keys')}"
                            f"); it is {type(value).__name__}: {str(value)[:80]!r}")
        value = value[k]
        path = f"{path}[{k!r}]"
    return value


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def single_turn_segments(prompt: list[dict[str, Any]] | str, response: str, tokenizer: Tokenizer,
                         apply_chat_template: bool, template_kwargs: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """(text, trained) segments of a prompt and its response (veRL SFTDataset: response + EOS)."""
    if template_kwargs and (apply_chat_template or not isinstance(prompt, str)):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        prompt_text = render_chat(tokenizer, messages, add_generation_prompt=True, **template_kwargs)
    else:
        prompt_text = render_prompt(prompt, tokenizer, apply_chat_template)
    return [(prompt_text, False), (response + (tokenizer.eos_token or ""), True)]


def conversation_segments(messages: list[dict[str, Any]], tools: list[dict] | None, tokenizer: Tokenizer,
                          template_kwargs: Mapping[str, Any], where: object) -> tuple[list[tuple[str, bool]], bool]:
    """(text, trained) segments of a conversation built turn by turn (module doc), and whether that
    text equals the template's rendering of the whole conversation (up to its last assistant turn)."""
    renderer = ChatRenderer(tokenizer, tools, template_kwargs)
    messages = renderer.with_tools_prompt(messages)
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    eos = tokenizer.eos_token or ""
    segments: list[tuple[str, bool]] = []
    try:
        for n, i in enumerate(turns):
            # a conversation that opens with an assistant turn: what the template puts before its content
            head = renderer.render(messages[:i], add_generation_prompt=True) if i else renderer.opening(messages[:1])
            if n == 0:
                segments.append((head, False))
            whole = renderer.render(messages[: i + 1], add_generation_prompt=False)
            if not whole.startswith(head):
                raise DataError(f"{where}: the chat template renders the turns before assistant message {i} "
                                "differently once that message is added; its text cannot be located")
            # the turn as the model produces it: its content, then the end of turn it emits (the EOS where
            # the template's closure starts with it, else the closure without its trailing newlines)
            closure = renderer.closure(messages[: i + 1])
            turn = whole[len(head):]
            if not turn.endswith(closure):
                raise DataError(f"{where}: the chat template renders assistant message {i} with content it "
                                "does not end with; its text cannot be located")
            end = eos if eos and closure.startswith(eos) else closure.rstrip()
            segments.append((turn[: len(turn) - len(closure)] + end, True))
            if n + 1 < len(turns):
                segments.append((renderer.delta_text(messages[: i + 1], messages[i + 1: turns[n + 1]], end), False))
    except TemplateError as err:
        raise DataError(f"{where}: {err}") from None
    last = turns[-1]
    whole = renderer.render(messages[: last + 1], add_generation_prompt=False)
    built = "".join(text for text, _ in segments)
    return segments, whole.startswith(built)


def encode_segments(segments: Sequence[tuple[str, bool]], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained mask) of the segments, each tokenized on its own and concatenated."""
    ids: list[int] = []
    mask: list[float] = []
    for text, trained in segments:
        piece = _ids(tokenizer, text) if text else []
        ids += piece
        mask += [1.0 if trained else 0.0] * len(piece)
    return np.asarray(ids, np.int32), np.asarray(mask, np.float32)


def truncate_sequence(ids: np.ndarray, mask: np.ndarray, max_length: int, mode: str, where: object
                      ) -> tuple[np.ndarray, np.ndarray]:
    """`ids` / `mask` cut to `max_length` tokens: `left` keeps the end, `right` the start, `middle` the
    head (max_length // 2 tokens) and the tail (as prompts are cut: data/prompts.py); `error` raises a
    DataError naming `where` and the length."""
    n = len(ids)
    if n <= max_length:
        return ids, mask
    if mode == "error":
        raise DataError(f"{where}: the sequence has {n} tokens, more than sft.max_length={max_length} "
                        "(set data.truncation=left, right or middle)")
    if mode == "left":
        return ids[n - max_length:], mask[n - max_length:]
    if mode == "right":
        return ids[:max_length], mask[:max_length]
    if mode == "middle":
        head, tail = max_length // 2, n - (max_length - max_length // 2)
        return np.concatenate([ids[:head], ids[tail:]]), np.concatenate([mask[:head], mask[tail:]])
    raise DataError(f"data.truncation={mode!r}: one of error, left, right, middle")


def split_at_first_trained(ids: np.ndarray, mask: np.ndarray, where: str) -> SftExample | None:
    """The (prompt, response, loss mask) layout of a sequence: the prompt ends before its first
    trained token (at least one token: the first token of a sequence is never predicted); None when
    no trained token is left."""
    trained = np.flatnonzero(mask[1:] > 0)
    if len(trained) == 0:
        return None
    k = int(trained[0]) + 1
    return SftExample(ids[:k], ids[k:], mask[k:].astype(np.float32), where)


def _conversation(row: Mapping[str, Any], where: RowRef, data: DataSpec, sft: SftSpec, tokenizer: Tokenizer
                  ) -> tuple[list[tuple[str, bool]], bool]:
    column = sft.messages_key or data.messages_key
    if column not in row:
        raise DataError(f"{where}: missing column {column!r} (sft.messages_key / data.messages_key, "
                        f"sft.multiturn=True); columns are "
                        f"{sorted(row)}")
    value = row[column]
    messages = _normalise_prompt(value, where, column)
    if isinstance(messages, str):
        raise DataError(f"{where}: column {column!r} is a string; sft.multiturn reads a list of chat messages")
    for j, m in enumerate(messages):
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise DataError(f"{where}: message {j} has role {m.get('role')!r} (system, user, assistant or tool)")
    tools = row.get(sft.tools_key)
    if isinstance(tools, np.ndarray):
        tools = tools.tolist()
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise DataError(f"{where}: column {sft.tools_key!r} (sft.tools_key) is not a list of tool schemas")
    kwargs = dict(sft.template_kwargs)
    thinking = row.get(sft.enable_thinking_key)
    if thinking is not None:
        kwargs["enable_thinking"] = bool(thinking)
    return conversation_segments(messages, [dict(t) for t in tools] if tools else None, tokenizer, kwargs, where)


def _single_turn(row: Mapping[str, Any], where: RowRef, data: DataSpec, sft: SftSpec, tokenizer: Tokenizer
                 ) -> list[tuple[str, bool]]:
    prompt_key = sft.prompt_key or data.prompt_key
    prompt_value = _nested(row, prompt_key, sft.prompt_dict_keys, where, "prompt_key")
    prompt = with_system_prompt(_normalise_prompt(prompt_value, where, prompt_key), data.system_prompt)
    response = _nested(row, sft.response_key, sft.response_dict_keys, where, "response_key")
    if isinstance(response, np.ndarray) and response.shape == ():
        response = response.item()
    if not isinstance(response, str):
        raise DataError(f"{where}: the response ({sft.response_key!r}, sft.response_key) is "
                        f"{type(response).__name__}, not a string: {str(response)[:80]!r}")
    if not response.strip():
        raise DataError(f"{where}: empty response (column {sft.response_key!r})")
    if not isinstance(prompt, str) and not data.apply_chat_template:
        raise DataError(f"{where}: prompt is a message list but data.apply_chat_template=False")
    return single_turn_segments(prompt, response, tokenizer, data.apply_chat_template, dict(sft.template_kwargs))


def encode_rows(rows: Sequence[Mapping[str, Any]], refs: Sequence[RowRef], data: DataSpec, sft: SftSpec,
                tokenizer: Tokenizer) -> list[SftExample]:
    """Every row as an `SftExample` (errors name file and row); rows whose trained tokens were all cut
    by truncation are dropped, with a warning counting them."""
    if (data.apply_chat_template or sft.multiturn) and getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template; SFT renders prompts and conversations with it "
                        "(data.chat_template, or data.apply_chat_template=False for string prompts)")
    examples: list[SftExample] = []
    dropped = rewritten = 0
    for row, ref in zip(rows, refs):
        if sft.multiturn:
            segments, as_whole = _conversation(row, ref, data, sft, tokenizer)
            rewritten += not as_whole
        else:
            segments = _single_turn(row, ref, data, sft, tokenizer)
        ids, mask = encode_segments(segments, tokenizer)
        ids, mask = truncate_sequence(ids, mask, sft.max_length, data.truncation, ref)
        example = split_at_first_trained(ids, mask, str(ref))
        if example is None:
            dropped += 1
            continue
        examples.append(example)
    if rewritten:
        log.warning("sft: the chat template renders %d of %d conversations differently as a whole than turn by "
                    "turn (it rewrites earlier turns, e.g. drops their <think> blocks); each assistant turn is "
                    "trained as produced at its turn (jaxrl_llm/sft/data.py)", rewritten, len(rows))
    if dropped:
        log.warning("sft: %d of %d rows have no trained token left after data.truncation=%s to sft.max_length=%d; "
                    "dropped", dropped, len(rows), data.truncation, sft.max_length)
    if not examples:
        raise DataError(f"no SFT row has a trained token ({len(rows)} rows read)")
    return examples


def read_sft_examples(files: Sequence[str], data: DataSpec, sft: SftSpec, tokenizer: Tokenizer,
                      max_samples: int = -1) -> list[SftExample]:
    """The examples of `files` (parquet / jsonl / json / csv), at most `max_samples` rows (-1: all)."""
    rows, refs = read_files(list(files))
    if max_samples > 0:
        rows, refs = rows[:max_samples], refs[:max_samples]
    if not rows:
        raise DataError(f"{', '.join(files)}: no rows")
    return encode_rows(rows, refs, data, sft, tokenizer)
