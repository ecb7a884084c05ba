"""One step's batching, planned once on the host from what the rollout already knows (row lengths
and prompt groups: no device array is read) and handed to each pass:

    rows = batching.rows_of(rollout)                                   StepRows
    batching.no_grad(plan.ref_log_prob, spec.model, rows)  -> PassLayout   (reference, old, values)
    batching.update(role.batch, role.model, rows, rng, ...) -> UpdateSplit (actor / critic update)

A pass runs on padded rows in micro-batches, on packed chunks of a fixed number of rows, or packed
to a token budget (`use_dynamic_bsz`); token-budget passes first pad the rows to the config's
longest prompt bucket + response length (`pads`), so their programs never follow a step's lengths.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import numpy as np

from jaxrl_llm.batching.batch_plan import BatchPlan, MicroBatching, RoleBatch
from jaxrl_llm.batching.layout import PackedLayout, StepRows, UpdateLayout
from jaxrl_llm.batching.plan import plan_capacity_chunks, plan_chunks, plan_update
from jaxrl_llm.models.invariant import KEY_BLOCK
from jaxrl_llm.sampler.host import bucket_length

NO_PADS = (0, 0)  # (prompt, response) columns added to a step's rows: none


class PassLayout(NamedTuple):
    """How one no-grad pass runs: `micro_rows` rows (all devices) per chunk, or 0 for token-budget
    chunks over all rows; packed as `layout` (None: padded rows); after adding `pads` (prompt,
    response) columns to the rows (`ops.pad_columns`)."""

    micro_rows: int
    layout: PackedLayout | None = None
    pads: tuple[int, int] = NO_PADS


class UpdateSplit(NamedTuple):
    """How one role's update call splits the step: mini-batches per epoch, micro-batches per
    mini-batch, the packed `layout` (None: padded rows) and the `pads` its rows take first."""

    num_mini: int
    num_micro: int
    layout: UpdateLayout | None = None
    pads: tuple[int, int] = NO_PADS


class PackingSwitches(Protocol):
    """The model spec's packing keys a pass reads (config.spec.ModelSpec has them)."""

    @property
    def use_remove_padding(self) -> bool: ...

    @property
    def share_packed_prompts(self) -> bool: ...

    @property
    def batch_invariant(self) -> bool: ...


class RolloutRows(Protocol):
    """What `StepBatching.rows_of` reads of a rollout (rollout/batch.py `Rollout`)."""

    # read-only: only the arrays' shapes and the host lengths / groups are read (an SFT batch's are numpy)
    @property
    def input_ids(self) -> jax.Array | np.ndarray: ...

    @property
    def response_mask(self) -> jax.Array | np.ndarray: ...

    @property
    def prompt_lengths(self) -> np.ndarray: ...

    @property
    def response_lengths(self) -> np.ndarray: ...

    @property
    def group_ids(self) -> np.ndarray: ...


class StepBatching:
    """The batch splits of a run (`BatchPlan`) applied to one step's rows, over `shards` row shards
    (the data-parallel devices)."""

    def __init__(self, plan: BatchPlan, shards: int):
        self.plan = plan
        self.shards = int(shards)

    @staticmethod
    def rows_of(rollout: RolloutRows) -> StepRows:
        """The step's rows from the rollout's host arrays: spans from its prompt / response lengths,
        prompt groups from its group ids (the n samples of a prompt)."""
        seq_len, response_len = int(rollout.input_ids.shape[1]), int(rollout.response_mask.shape[1])
        return StepRows.of_lengths(rollout.prompt_lengths, rollout.response_lengths, seq_len, response_len,
                                   prompt_groups=rollout.group_ids)

    def budget_pads(self, rows: StepRows) -> tuple[int, int]:
        """(prompt, response) columns that bring [N, P + R] rows to the config's longest prompt bucket
        + response length: token-budget packing's shapes then never follow the step."""
        prompt_len = rows.seq_len - rows.response_len
        return (max(prompt_len, bucket_length(self.plan.max_prompt_length)) - prompt_len,
                max(rows.response_len, self.plan.response_length) - rows.response_len)

    def no_grad(self, micro: MicroBatching, model: PackingSwitches, rows: StepRows) -> PassLayout:
        """The layout of a no-grad pass (log-probs, values) of `model` over the step's rows."""
        if not model.use_remove_padding:
            return PassLayout(self.plan.forward_micro_rows(micro, rows.num_rows, rows.seq_len))
        rows = _as_seen_by(rows, model)
        if micro.token_budget is not None:
            pads = self.budget_pads(rows)
            return PassLayout(0, plan_capacity_chunks(rows.padded(pads), self.shards, micro.token_budget), pads)
        micro_rows = self.plan.forward_micro_rows(micro, rows.num_rows, rows.seq_len)
        return PassLayout(micro_rows, plan_chunks(rows, micro_rows, self.shards))

    def update(self, role: RoleBatch, model: PackingSwitches, rows: StepRows, rng: jax.Array, *, epochs: int,
               shuffle: bool) -> UpdateSplit:
        """The split of a role's update over the step's rows; packed, the host plans every epoch's
        layout and draws the shuffle (the same permutations the device would draw from `rng`)."""
        num_mini, num_micro = self.plan.update_split(role, rows.num_rows, rows.seq_len)
        if not model.use_remove_padding:
            return UpdateSplit(num_mini, num_micro)
        rows = _as_seen_by(rows, model)
        budget = role.micro.token_budget
        pads = NO_PADS if budget is None else self.budget_pads(rows)
        layout, num_micro = plan_update(rows.padded(pads), rng, epochs=epochs, shuffle=shuffle, num_mini=num_mini,
                                        num_micro=None if budget is not None else num_micro, shards=self.shards,
                                        token_budget=budget)
        return UpdateSplit(num_mini, num_micro, layout, pads)


def _as_seen_by(rows: StepRows, model: PackingSwitches) -> StepRows:
    """`rows` as `model`'s packing sees them: no shared prompts unless `model.share_packed_prompts`; in
    batch-invariant mode each sequence alone, at a key block's start (models/invariant.py: its keys then fall
    in the blocks the sampler's cache cuts)."""
    if model.batch_invariant:
        return rows.aligned(KEY_BLOCK)
    return rows if model.share_packed_prompts else rows.unshared()
