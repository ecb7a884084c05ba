"""Host-side helpers around the jitted core: prompt-length buckets, left padding, decoded text.

Buckets keep the number of compiled shapes small while wasting little prefill compute: prompt
lengths round up to a multiple of 16 up to 128, of 64 up to 512, then of 256 (at most ~14 shapes
up to 1k tokens); batch sizes round up to a power of two and to a multiple of the mesh's batch ways.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_llm.arrays import HostOrDevice
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampler.core import FINISH_REASONS
from jaxrl_llm.shapes import next_power_of_two

_LENGTH_STEPS = ((128, 16), (512, 64))  # (up to this length, round to a multiple of this)
_LONG_STEP = 256


def bucket_length(length: int) -> int:
    """Prompt length bucket: a multiple of 16 up to 128, of 64 up to 512, then of 256."""
    if length < 1:
        raise ValueError(f"prompt length must be >= 1, got {length}")
    step = next((s for limit, s in _LENGTH_STEPS if length <= limit), _LONG_STEP)
    return -(-length // step) * step


def bucket_batch(rows: int, multiple_of: int = 1) -> int:
    """Batch bucket: next power of two >= rows, then up to a multiple of `multiple_of`."""
    if rows < 1:
        raise ValueError(f"batch must have at least one prompt, got {rows}")
    return -(-next_power_of_two(rows) // multiple_of) * multiple_of


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, *, length: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [B, L], mask int32 [B, L]) with every prompt right-aligned (left padding).

    `length`: the padded length (default: the bucket of the longest prompt). A prompt that is empty
    or longer than `length` is an error naming its row.
    """
    lengths = [len(p) for p in prompts]
    for row, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"prompt {row} is empty")
    width = bucket_length(max(lengths)) if length is None else length
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for row, (p, n) in enumerate(zip(prompts, lengths)):
        if n > width:
            raise ValueError(f"prompt {row} has {n} tokens, more than the padded length {width}")
        ids[row, width - n:] = np.asarray(p, np.int64)
        mask[row, width - n:] = 1
    return ids, mask


def eos_ids_of(cfg: ModelConfig, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """What a generation stops at: the model's EOS ids (`ModelConfig.eos_token_ids`), and the
    tokenizer's when it names another one."""
    eos = list(cfg.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in eos:
        eos.append(int(tok_eos))
    return tuple(eos)


def decode_texts(tokenizer: Tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    """`tokenizer.decode` of each row's valid tokens (skipping special tokens)."""
    return [tokenizer.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(tokens, lengths)]


@dataclasses.dataclass
class GenerationResult:
    """Host copy of a generation (rows = prompts x n, prompt-major: row i*n + j is sample j of prompt i).

    `tokens` / `response_mask` / `log_probs` are the padded [rows, max_new_tokens] arrays;
    `token_ids` and `texts` hold only each row's valid tokens. `texts` is None without a tokenizer.
    """

    tokens: np.ndarray
    response_mask: np.ndarray
    log_probs: np.ndarray
    lengths: np.ndarray
    finish_reasons: list[str]
    prompt_index: np.ndarray
    token_ids: list[list[int]]
    texts: list[str] | None
    num_steps: int

    @classmethod
    def from_arrays(cls, tokens: HostOrDevice, response_mask: HostOrDevice, log_probs: HostOrDevice,
                    lengths: HostOrDevice, finish_reason: HostOrDevice, num_steps: int, n: int,
                    tokenizer: Tokenizer | None = None) -> "GenerationResult":
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        return cls(tokens=tokens, response_mask=np.asarray(response_mask), log_probs=np.asarray(log_probs),
                   lengths=lengths, finish_reasons=[FINISH_REASONS[int(c)] for c in np.asarray(finish_reason)],
                   prompt_index=np.arange(len(tokens)) // n,
                   token_ids=[row[:k].tolist() for row, k in zip(tokens, lengths)],
                   texts=None if tokenizer is None else decode_texts(tokenizer, tokens, lengths),
                   num_steps=int(num_steps))
