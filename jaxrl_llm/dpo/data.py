"""Preference rows -> (chosen, rejected) pairs of SFT examples sharing one prompt.

Rows as TRL and veRL store them: `data.prompt_key` (a string or chat messages) with `dpo.chosen_key` /
`dpo.rejected_key` (strings, or message lists whose assistant turn is the response); or, without a
prompt column, chosen / rejected as whole conversations that differ only in their last assistant turn
(TRL's implicit prompt): the shared messages are the prompt. The prompt is rendered with the chat
template and its generation prompt, each response is followed by EOS (as SFT's single-turn rows,
sft/data.py), and the loss mask covers the response. Both rows of a pair hold the same prompt tokens, so
packing holds that prompt once (`model.share_packed_prompts`). Optional precomputed reference
log-probs (`dpo.ref_chosen_key` / `ref_rejected_key`, TRL's precompute_ref_log_probs columns) ride
along.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.prompts import _is_message_list, _normalise_prompt, with_system_prompt
from jaxrl_llm.data.sources import DataError, RowRef, read_files
from jaxrl_llm.data.spec import DataSpec
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.sft.data import SftExample, encode_segments, single_turn_segments

log = logging.getLogger("jaxrl_llm")


@dataclasses.dataclass(frozen=True)
class DpoSpec:
    """The `dpo.*` settings (config/tree_sft.py)."""

    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    reference_free: bool = False
    ref_chosen_key: str = "ref_chosen_logps"
    ref_rejected_key: str = "ref_rejected_logps"
    max_length: int = 1024
    micro_batch_size_per_device: int = 2


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One preference pair: two examples with the same prompt, and the reference's log-probs of each
    response when the row carries them (precomputed)."""

    chosen: SftExample
    rejected: SftExample
    ref_logps: tuple[float, float] | None = None

    def __iter__(self):  # the SFT loader flattens an item into its rows (sft/batch.py)
        return iter((self.chosen, self.rejected))


def _response_text(value: Any, where: object, column: str) -> tuple[str, list[dict[str, Any]] | None]:
    """(the response text, the conversation before it when `value` is a whole conversation)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: empty response in column {column!r}")
        return value, None
    if _is_message_list(value):
        messages = [dict(m) for m in value]
        if messages[-1].get("role") != "assistant":
            raise DataError(f"{where}: column {column!r} is a message list whose last message is not the "
                            "assistant's response")
        content = messages[-1].get("content")
        if not isinstance(content, str) or not content.strip():
            raise DataError(f"{where}: column {column!r}: the assistant's response is empty or not text")
        return content, messages[:-1]
    raise DataError(f"{where}: column {column!r} is neither a string nor a list of chat messages; got "
                    f"{type(value).__name__}: {str(value)[:80]!r}")


def _ids_of(prompt: Any, response: str, data: DataSpec, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    (prompt_text, _), (response_text, _) = single_turn_segments(prompt, response, tokenizer,
                                                                data.apply_chat_template, {})
    return (encode_segments([(prompt_text, False)], tokenizer)[0],
            encode_segments([(response_text, True)], tokenizer)[0])


def _fit(prompt: np.ndarray, responses: list[np.ndarray], max_length: int, mode: str, where: object
         ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The pair cut to `max_length` tokens a sequence, the prompt cut the same for both."""
    excess = len(prompt) + max(len(r) for r in responses) - max_length
    if excess <= 0:
        return prompt, responses
    if mode == "error":
        raise DataError(f"{where}: prompt + response has {len(prompt) + max(len(r) for r in responses)} tokens, "
                        f"more than dpo.max_length={max_length} (set data.truncation=left or right)")
    if mode == "left" and excess < len(prompt):
        return prompt[excess:], responses
    if mode in ("right", "left") and len(prompt) < max_length:
        return prompt, [r[:max_length - len(prompt)] for r in responses]
    raise DataError(f"{where}: the prompt alone has {len(prompt)} tokens, dpo.max_length={max_length} leaves no "
                    "response token" if mode in ("left", "right") else
                    f"data.truncation={mode!r}: a preference pair is cut left or right")


def _pair(row: Mapping[str, Any], where: RowRef, data: DataSpec, dpo: DpoSpec, tokenizer: Tokenizer
          ) -> PreferencePair:
    for column, key in ((dpo.chosen_key, "dpo.chosen_key"), (dpo.rejected_key, "dpo.rejected_key")):
        if column not in row:
            raise DataError(f"{where}: missing column {column!r} ({key}); columns are {sorted(row)}")
    chosen, chosen_context = _response_text(row[dpo.chosen_key], where, dpo.chosen_key)
    rejected, rejected_context = _response_text(row[dpo.rejected_key], where, dpo.rejected_key)
    if data.prompt_key in row:
        prompt = _normalise_prompt(row[data.prompt_key], where, data.prompt_key)
        if isinstance(prompt, list) and chosen_context:  # TRL conversational: prompt + [assistant] each
            prompt = prompt + chosen_context
    elif chosen_context:  # implicit prompt: the conversations' shared messages
        if chosen_context != rejected_context:
            raise DataError(f"{where}: no {data.prompt_key!r} column, and {dpo.chosen_key!r} / {dpo.rejected_key!r} "
                            "differ before their last assistant turn (the implicit prompt must be shared)")
        prompt = chosen_context
    else:
        raise DataError(f"{where}: missing column {data.prompt_key!r} (data.prompt_key); columns are {sorted(row)}")
    if chosen.strip() == rejected.strip():
        raise DataError(f"{where}: the chosen and the rejected response are the same text; a pair must differ")
    prompt = with_system_prompt(prompt, data.system_prompt)
    if not isinstance(prompt, str) and not data.apply_chat_template:
        raise DataError(f"{where}: prompt is a message list but data.apply_chat_template=False")
    p_ids, c_ids = _ids_of(prompt, chosen, data, tokenizer)
    _, r_ids = _ids_of(prompt, rejected, data, tokenizer)
    p_ids, (c_ids, r_ids) = _fit(p_ids, [c_ids, r_ids], dpo.max_length, data.truncation, where)
    ref = None
    if dpo.ref_chosen_key in row and dpo.ref_rejected_key in row:
        try:
            ref = (float(row[dpo.ref_chosen_key]), float(row[dpo.ref_rejected_key]))
        except (TypeError, ValueError):
            raise DataError(f"{where}: {dpo.ref_chosen_key!r} / {dpo.ref_rejected_key!r} are not numbers "
                            "(precomputed reference log-probs)") from None
    as_example = lambda ids: SftExample(p_ids, ids, np.ones(len(ids), np.float32), str(where))  # noqa: E731
    return PreferencePair(as_example(c_ids), as_example(r_ids), ref)


def read_pairs(files: Sequence[str], data: DataSpec, dpo: DpoSpec, tokenizer: Tokenizer,
               max_samples: int = -1) -> list[PreferencePair]:
    """The preference pairs of `files` (errors name file and row)."""
    rows, refs = read_files(list(files))
    if max_samples > 0:
        rows, refs = rows[:max_samples], refs[:max_samples]
    if not rows:
        raise DataError(f"{', '.join(files)}: no rows")
    if data.apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template; DPO renders prompts with it (data.chat_template, or "
                        "data.apply_chat_template=False for string prompts)")
    pairs = [_pair(row, ref, data, dpo, tokenizer) for row, ref in zip(rows, refs)]
    with_ref = sum(p.ref_logps is not None for p in pairs)
    if 0 < with_ref < len(pairs):
        raise DataError(f"{', '.join(files)}: {with_ref} of {len(pairs)} rows carry precomputed reference log-probs "
                        f"({dpo.ref_chosen_key!r}, {dpo.ref_rejected_key!r}); all or none must")
    return pairs
