"""The types a step's batching is planned in (host) and run with (device).

`StepRows` is what the host knows about a step's rows without reading a device array: where each
row's real tokens sit in its [P + R] columns (from the rollout's prompt / response lengths) and
which rows share a prompt (the rollout's group ids), and where packing may start a sequence
(`segment_align`). `PackedLayout` says where a micro-batch's tokens go in packed rows; `UpdateLayout`
is the packing of one whole update call.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from jaxrl_llm.arrays import HostOrDevice  # planned on the host (numpy), then read on device: layouts hold either

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class StepRows:
    """Per row of a step's [N, P + R] batch: the first real column `start` and the number of real
    tokens `length` (one contiguous run: a left-padded prompt, then a right-padded response), and
    `prompt_groups` [N] (equal for rows with the same prompt, whose tokens packing may share; None:
    share nothing) and `segment_align`: each sequence of a packed row starts at a multiple of it (the
    batch-invariant attention's key block, so a packed sequence's keys fall in the blocks the sampler's
    cache cuts: models/invariant.py; 1: back to back)."""

    start: np.ndarray  # int64 [N]
    length: np.ndarray  # int64 [N]
    seq_len: int  # P + R
    response_len: int  # R
    prompt_groups: np.ndarray | None = None
    segment_align: int = 1

    @property
    def num_rows(self) -> int:
        return int(self.start.shape[0])

    @classmethod
    def of_lengths(cls, prompt_lengths: np.ndarray, response_lengths: np.ndarray, seq_len: int, response_len: int,
                   prompt_groups: np.ndarray | None = None) -> "StepRows":
        """From host lengths (a rollout's `prompt_lengths` / `response_lengths`): row i's tokens are its
        last prompt_lengths[i] prompt columns and its first response_lengths[i] response columns."""
        prompt = np.asarray(prompt_lengths, np.int64)
        resp = np.asarray(response_lengths, np.int64)
        prompt_cols = seq_len - response_len
        if (prompt > prompt_cols).any() or (resp > response_len).any() or (prompt < 0).any() or (resp < 0).any():
            raise ValueError(f"row lengths do not fit [{prompt_cols} prompt + {response_len} response] columns")
        groups = None if prompt_groups is None else np.asarray(prompt_groups, np.int32)
        return cls(prompt_cols - prompt, prompt + resp, int(seq_len), int(response_len), groups)

    @classmethod
    def of_mask(cls, attention_mask: np.ndarray, response_len: int,
                prompt_groups: np.ndarray | None = None) -> "StepRows":
        """From an attention mask [N, P + R] (tests, benchmarks); raises unless each row's 1s are one
        contiguous run."""
        start, length = sequence_spans(attention_mask)
        groups = None if prompt_groups is None else np.asarray(prompt_groups, np.int32)
        return cls(start, length, int(np.shape(attention_mask)[1]), int(response_len), groups)

    def padded(self, pads: tuple[int, int]) -> "StepRows":
        """The rows with (prompt, response) columns added as `ops.pad_columns` adds them."""
        return dataclasses.replace(self, start=self.start + pads[0], seq_len=self.seq_len + pads[0] + pads[1],
                                   response_len=self.response_len + pads[1])

    def unshared(self) -> "StepRows":
        return dataclasses.replace(self, prompt_groups=None)

    def aligned(self, multiple: int) -> "StepRows":
        """The rows packed with each sequence starting at a multiple of `multiple` columns, each its own
        segment (a shared prompt would put a response's keys after its siblings')."""
        return dataclasses.replace(self, prompt_groups=None, segment_align=int(multiple))

    def attention_mask(self) -> np.ndarray:
        """[N, P + R] int32: 1 on each row's real tokens."""
        cols = np.arange(self.seq_len)[None]
        return ((cols >= self.start[:, None]) & (cols < (self.start + self.length)[:, None])).astype(np.int32)


def sequence_spans(attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each row's real tokens; raises unless they are one contiguous run (left-
    padded prompt + right-padded response, the rollout layout)."""
    mask = np.asarray(attention_mask) > 0
    length = mask.sum(1).astype(np.int64)
    start = np.argmax(mask, axis=1).astype(np.int64)
    idx = np.arange(mask.shape[1])[None]
    inside = (idx >= start[:, None]) & (idx < (start + length)[:, None])
    if not np.array_equal(inside, mask):
        raise ValueError("model.use_remove_padding needs each row's attention_mask to be one contiguous run of "
                         "1s (left-padded prompt + right-padded response)")
    return start, length


@flax.struct.dataclass
class PackedLayout:
    """Where a micro-batch's tokens go in its packed rows, per row shard (leading axis `shards`; the
    shard's sequences are its `n / shards` consecutive rows of the micro-batch).

    token_index  int32 [shards, rows, width]: index into the shard's flattened [n_d * T] tokens
    segment_ids  int32 [shards, rows, width]: 1, 2, ... per sequence of a packed row; 0 = padding
    response_src int32 [shards, M]: index into the shard's flattened [rows * width] hidden states
                 of the state that predicts a response token
    response_dst int32 [shards, M]: that token's index in the shard's flattened [n_d * R] response
                 layout; n_d * R on padding entries (dropped by the scatter)
    positions    int32 [shards, rows, width]: each token's position in its own sequence
    branch_ids   int32 [shards, rows, width]: 0 on a segment's prompt, j on the j-th response that
                 follows it (a segment is one prompt + the responses of the rows that share it)
    Extra leading axes (epochs, mini-batches, micro-batches) are scanned over by the update.
    """

    token_index: HostOrDevice
    segment_ids: HostOrDevice
    response_src: HostOrDevice
    response_dst: HostOrDevice
    positions: HostOrDevice
    branch_ids: HostOrDevice


@flax.struct.dataclass
class UpdateLayout:
    """The packing of one update call (`run_update_epochs`).

    order  [epochs, N]: the rows of each epoch in order (the shuffle's permutation, drawn on the host
           with the device path's function, or arange)
    layout a `PackedLayout` with leading axes [epochs, mini-batches, micro-batches] (fixed
           micro-batches), or [epochs, mini-batches, micro-batches, shards] with `by_budget`
    by_budget (static): token-budget packing (`use_dynamic_bsz`): the micro-batch count and shapes
           come from the config alone; each micro-batch reads its whole mini-batch and scores the
           sequences its rows hold, and micro-batches a step leaves empty are skipped.
    """

    order: HostOrDevice
    layout: PackedLayout
    by_budget: bool = flax.struct.field(pytree_node=False, default=False)
