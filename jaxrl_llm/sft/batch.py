"""SFT batches: the epoch order over the examples (resumable), the host collation into the RL passes'
layout, and the device batch the update reads.

A batch is `data.train_batch_size` sequences (veRL's SFT `train_batch_size`, global): prompts left-padded
and responses right-padded to length buckets of the batch's longest (sampler/host.py `bucket_length`: a
few compiled shapes, not one per batch). The order is a seeded permutation per epoch (`data.shuffle`,
`data.seed`), the last partial batch dropped (veRL's SFT sampler drops it too). Hand-written rather than a
grain pipeline: the examples are already tokenized in memory and a resume needs only (epoch, batch).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import numpy as np

from jaxrl_llm.batching import PackedLayout
from jaxrl_llm.sampler.host import bucket_length
from jaxrl_llm.sft.data import SftExample


@flax.struct.dataclass
class SftBatch:
    """Device rows of one step: [N, P + R] ids and attention mask, [N, R] loss mask; `packing` is set per
    micro-batch by the update (model.use_remove_padding). What `roles/update.py` needs of a batch."""

    input_ids: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    packing: PackedLayout | None = None


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """One batch on the host, with what `batching.StepBatching.rows_of` reads (lengths, groups)."""

    input_ids: np.ndarray  # int32 [N, P + R]
    attention_mask: np.ndarray  # int32 [N, P + R]
    response_mask: np.ndarray  # float32 [N, R]: the loss mask
    prompt_lengths: np.ndarray  # int32 [N]
    response_lengths: np.ndarray  # int32 [N]
    group_ids: np.ndarray  # int32 [N]: every row its own group (no shared prompts)

    def device_fields(self) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "response_mask": self.response_mask}

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


def collate(examples: Sequence[SftExample], pad_id: int, *, prompt_len: int | None = None,
            response_len: int | None = None, group_size: int = 1) -> HostBatch:
    """`examples` as one padded batch: prompts left-padded, responses right-padded to their length
    buckets (or to `prompt_len` / `response_len`); every `group_size` consecutive rows share their
    prompt (a DPO pair: packing then holds it once)."""
    n = len(examples)
    p = prompt_len or bucket_length(max(len(e.prompt) for e in examples))
    r = response_len or bucket_length(max(max(len(e.response) for e in examples), 1))
    ids = np.full((n, p + r), pad_id, np.int32)
    attn = np.zeros((n, p + r), np.int32)
    loss = np.zeros((n, r), np.float32)
    for i, e in enumerate(examples):
        lp, lr = len(e.prompt), len(e.response)
        ids[i, p - lp:p] = e.prompt
        ids[i, p:p + lr] = e.response
        attn[i, p - lp:p + lr] = 1
        loss[i, :lr] = e.loss_mask
    return HostBatch(ids, attn, loss, np.asarray([len(e.prompt) for e in examples], np.int32),
                     np.asarray([len(e.response) for e in examples], np.int32),
                     (np.arange(n) // group_size).astype(np.int32))


class SftLoader:
    """Batches of `batch_size` items, epoch after epoch: `next()` gives the next one, `state()` /
    `set_state()` the position a checkpoint saves (the same batches follow a resume). An item is an
    `SftExample`, or with `group_size` > 1 a tuple of that many examples sharing a prompt (a DPO pair:
    its rows stay consecutive, so micro-batches of even rows never split it)."""

    def __init__(self, examples: Sequence[Any], batch_size: int, *, shuffle: bool, seed: int | None,
                 pad_id: int, group_size: int = 1):
        if len(examples) < batch_size:
            raise ValueError(f"{len(examples)} SFT rows make no batch of data.train_batch_size={batch_size}")
        self.examples = list(examples)
        self.batch_size = int(batch_size)
        self.shuffle, self.seed, self.pad_id = shuffle, 0 if seed is None else int(seed), pad_id
        self.group_size = int(group_size)
        self.last_items: list[Any] = []
        self.epoch, self.index = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return len(self.examples) // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.examples))
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.examples))

    def next(self) -> HostBatch:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        order = self._order(self.epoch)[self.index * self.batch_size:(self.index + 1) * self.batch_size]
        self.index += 1
        self.last_items = [self.examples[i] for i in order]  # what the batch holds (DPO reads its pairs' extras)
        return collate(self.rows(self.last_items), self.pad_id, group_size=self.group_size)

    def rows(self, items: list[Any]) -> list[SftExample]:
        """The examples (rows) of `items`: the items themselves, or each group's examples in turn."""
        return items if self.group_size == 1 else [e for item in items for e in item]

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    def longest(self) -> tuple[int, int]:
        """(longest prompt, longest response) in tokens: the token-budget passes pad to these."""
        rows = self.rows(self.examples)
        return max(len(e.prompt) for e in rows), max(len(e.response) for e in rows)


def eval_batches(examples: Sequence[SftExample], batch_size: int, pad_id: int) -> list[HostBatch]:
    """Every example once, in order, in batches of `batch_size` (the last one filled up with copies of
    the first example whose loss mask is zeroed, so every batch divides over the devices)."""
    out = []
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start:start + batch_size])
        missing = batch_size - len(chunk)
        filler = dataclasses.replace(examples[0], loss_mask=np.zeros_like(examples[0].loss_mask))
        out.append(collate(chunk + [filler] * missing, pad_id))
    return out
