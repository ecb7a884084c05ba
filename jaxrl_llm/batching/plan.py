"""Sequence packing, planned on the host (numpy, no device work): where each micro-batch's tokens go
in packed rows (`PackedLayout`) for the no-grad passes and the updates (`model.use_remove_padding`).

Each row shard (one per data-parallel device) packs its sequences first-fit-decreasing into `rows`
rows of `width` tokens, with segment ids 1, 2, ... per row (0 on padding). The plans read only a
step's `StepRows` (row spans and prompt groups the rollout already has on the host); the device
side (batching/ops.py) gathers the packed tokens, runs the model with segment ids and scatters
per-token outputs back to the padded [n, R] response layout, so everything after it (losses,
metrics, denominators) is the unpacked code path and packed and padded runs give the same numbers.

Shared prompts (`model.share_packed_prompts`): rows of one prompt group that land in one shard's
block form one segment: the prompt once, then each row's response, with explicit positions (a
response continues its prompt's) and branch ids (0 on the prompt, j on the j-th response) so a
response attends to the prompt and to itself only. The response's first token is scored by the
prompt's last hidden state, which the samples share. A group that does not fit one row is split into
several segments, each with its own copy of the prompt; no segment is longer than its rows alone, so
a token budget's worst case still holds.

Aligned segments (`StepRows.segment_align`, batch-invariant mode): each sequence starts at a multiple
of the attention's key block, so its keys fall in the blocks the sampler's cache cuts; first-fit then
counts each sequence as its length rounded up to the multiple (exact for the row widths above
WIDTH_GRANULE, which are multiples of it).

Shapes come from a few buckets (row width >= the longest sequence and row count: `bucket`, 4
sizes per doubling, the width picked among the next few buckets for the fewest computed tokens;
response slots M: powers of two; token-budget micro-batches: one shape from the config), so a new
step with other lengths mostly reuses a compiled program.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np

from jaxrl_llm.batching.layout import PackedLayout, StepRows, UpdateLayout
from jaxrl_llm.shapes import next_power_of_two

WIDTH_GRANULE = 128  # packed row widths are multiples of this (powers of two below it)
MIN_RESPONSE_SLOTS = 16
WIDTH_CHOICES = 4  # row widths tried per layout (the bucket of the longest sequence and the next 3)


def bucket(x: int, granule: int = 1) -> int:
    """Smallest granule * u >= x with u in 1..8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (four
    sizes per doubling: at most 25% padding, few distinct shapes)."""
    units = max(1, -(-int(x) // granule))
    if units > 8:
        step = 1 << (units.bit_length() - 3)
        units = -(-units // step) * step
    return units * granule


def row_width(longest: int) -> int:
    """Packed row width for sequences of at most `longest` tokens."""
    if longest <= WIDTH_GRANULE:
        return max(8, next_power_of_two(longest))
    return bucket(longest, WIDTH_GRANULE)


# ---------------------------------------------------------------------------- host side


def _first_fit_decreasing(lengths: np.ndarray, width: int) -> list[list[int]]:
    """Sequences (indices into `lengths`) per packed row, longest first into the first row with room."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(int(i))
                free[r] -= n
                break
        else:
            rows.append([int(i)])
            free.append(width - n)
    return rows


def _aligned(n: int, align: int) -> int:
    """n rounded up to a multiple of `align` (where the next aligned segment may start)."""
    return -(-n // align) * align


def _shard_counts(geometry: "_Geometry", shared: np.ndarray | None, groups: np.ndarray, width: int, align: int
                  ) -> tuple[int, int]:
    """(max packed rows, max response tokens) over the shards of `groups` [..., n_d]."""
    flat = groups.reshape(-1, groups.shape[-1])
    rows = max(len(_packed_rows(g, geometry, shared, width, align)) for g in flat)
    return rows, int(geometry.resp_tokens[flat].sum(1).max())


def _pick_width(geometry: "_Geometry", shared: np.ndarray | None, groups: np.ndarray, align: int
                ) -> tuple[int, int, int]:
    """(width, bucketed rows, max response tokens) of the least computed tokens (rows x width) among
    the WIDTH_CHOICES smallest row widths >= the longest sequence: the narrowest width is not always
    best, since the row-count bucket can round a few rows up by 25% where a wider row packs into a
    smaller bucket. Every candidate is a `row_width` bucket, so the shapes stay on the same grid."""
    width = row_width(int(geometry.length[groups.reshape(-1)].max()))
    best = None
    for _ in range(WIDTH_CHOICES):
        need_rows, need_m = _shard_counts(geometry, shared, groups, width, align)
        rows = bucket(need_rows)
        if best is None or rows * width < best[0] * best[1]:
            best = (rows, width, need_m)
        if need_rows == 1:  # one row already: a wider one only adds padding
            break
        width = row_width(width + 1)
    assert best is not None  # WIDTH_CHOICES >= 1
    rows, width, need_m = best
    return width, rows, need_m


class _Geometry(NamedTuple):
    """Per row of a rollout's attention mask: where its real tokens start, how many there are, how
    many of them are prompt tokens, the first response column that is scored, and how many response
    tokens are scored."""

    start: np.ndarray
    length: np.ndarray
    prompt: np.ndarray
    first_resp: np.ndarray
    resp_tokens: np.ndarray


def _response_geometry(rows: StepRows) -> _Geometry:
    start, length, response_len = rows.start, rows.length, rows.response_len
    resp0 = rows.seq_len - response_len
    # response column c is scored by the hidden state at c - 1; both must be real tokens
    first_resp = np.maximum(resp0, start + 1)
    return _Geometry(start, length, np.clip(resp0 - start, 0, length), first_resp,
                     np.maximum(start + length - first_resp, 0))


def prompt_groups(input_ids: np.ndarray, attention_mask: np.ndarray, response_len: int) -> np.ndarray:
    """[N] int32: equal for rows whose prompts (the first P - R columns' real tokens) are the same,
    e.g. the n samples of a GRPO group; packing computes such a prompt once for all of them."""
    prompt_cols = np.shape(input_ids)[1] - response_len
    keys = np.where(np.asarray(attention_mask)[:, :prompt_cols] > 0, np.asarray(input_ids)[:, :prompt_cols], -1)
    return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int32)


class _Unit(NamedTuple):
    """One packed segment: the prompt of row `prompt` (an index into the block's group), then the
    responses of `members` (rows with that same prompt) back to back."""

    prompt: int
    members: tuple[int, ...]
    length: int


def _units(group: np.ndarray, geometry: _Geometry, shared: np.ndarray | None, width: int) -> list[_Unit]:
    """The segments of `group`'s rows: each row alone, or with `shared` (`prompt_groups`) the rows of
    one prompt as one prompt + their responses, first-fit-decreasing into as few segments of at
    most `width` tokens as fit (every row fits alone, so it never takes more segments than rows)."""
    length, prompt = geometry.length[group], geometry.prompt[group]
    if shared is None:
        return [_Unit(i, (i,), int(length[i])) for i in range(len(group))]
    by_prompt: dict[tuple[int, int], list[int]] = {}
    for i, g in enumerate(group):  # the prompt length in the key: only equal prompts are ever shared
        by_prompt.setdefault((int(shared[g]), int(prompt[i])), []).append(i)
    units = []
    for (_, p), rows in by_prompt.items():
        if p == 0:
            units += [_Unit(i, (i,), int(length[i])) for i in rows]
            continue
        for members in _first_fit_decreasing(length[rows] - p, width - p):
            picked = tuple(rows[m] for m in members)
            units.append(_Unit(picked[0], picked, p + int(sum(length[i] - p for i in picked))))
    return units


def _packed_rows(group: np.ndarray, geometry: _Geometry, shared: np.ndarray | None, width: int, align: int
                 ) -> list[list[_Unit]]:
    """`group`'s segments (`_units`) per packed row of `width`, first-fit-decreasing, each taking its
    length rounded up to `align` (a longer one than `width` alone in its row: it starts at column 0)."""
    units = _units(group, geometry, shared, width)
    footprints = np.array([_aligned(u.length, align) for u in units])
    return [[units[u] for u in row] for row in _first_fit_decreasing(footprints, width)]


def _fill_block(row_units: Sequence[Sequence[_Unit]], group: np.ndarray, geometry: _Geometry, width: int,
                seq_len: int, response_len: int, align: int) -> tuple[np.ndarray, ...]:
    """(token_index, segment_ids, positions, branch_ids [rows, width], response src, response dst)
    of one block: row r holds the segments `row_units[r]` one after another, each at the next multiple of
    `align` and each its prompt then its members' responses; indices are relative to the block's group
    (its flattened [len(group) * seq_len] tokens / [len(group) * R] responses)."""
    start, length, prompt, first_resp, _ = geometry
    resp0 = seq_len - response_len
    shape = (len(row_units), width)
    token_index, segment_ids = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    positions, branch_ids = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    src, dst = [], []

    def place(r: int, offset: int, row: int, col0: int, n: int, seg: int, pos0: int, branch: int) -> None:
        token_index[r, offset:offset + n] = row * seq_len + col0 + np.arange(n)
        segment_ids[r, offset:offset + n] = seg
        positions[r, offset:offset + n] = pos0 + np.arange(n)
        branch_ids[r, offset:offset + n] = branch

    for r, units in enumerate(row_units):
        offset = 0
        for seg, unit in enumerate(units, start=1):
            offset = _aligned(offset, align)
            p = int(prompt[group[unit.prompt]])
            place(r, offset, unit.prompt, int(start[group[unit.prompt]]), p, seg, 0, 0)
            prompt_at, offset = offset, offset + p
            for branch, local in enumerate(unit.members, start=1):
                g = group[local]
                first, n = int(start[g]) + p, int(length[g]) - p  # the row's first response column
                place(r, offset, local, first, n, seg, p, branch)
                pred = np.arange(int(first_resp[g]), int(start[g] + length[g])) - 1  # columns whose states score
                src.append(r * width + np.where(pred < first, prompt_at + pred - (first - p), offset + pred - first))
                dst.append(local * response_len + (pred + 1 - resp0))
                offset += n
    cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32)  # noqa: E731
    return token_index, segment_ids, positions, branch_ids, cat(src), cat(dst)


def _stack_blocks(blocks: list[tuple], lead: tuple[int, ...], n_d: int, response_len: int,
                  min_slots: int = MIN_RESPONSE_SLOTS, max_slots: int | None = None) -> PackedLayout:
    """One `PackedLayout` with leading axes `lead` from its blocks (equal [rows, width] each); the
    response slots M: a power of two >= the most response tokens of a block (few distinct shapes),
    at least `min_slots`, at most `max_slots` and the n_d * R response tokens there are."""
    cap = min(n_d * response_len, max_slots or n_d * response_len)
    m = min(max(min_slots, next_power_of_two(max(len(b[-2]) for b in blocks))), cap)
    src = np.zeros((len(blocks), m), np.int32)
    dst = np.full((len(blocks), m), n_d * response_len, np.int32)
    for i, (*_, s, d) in enumerate(blocks):
        src[i, :len(s)], dst[i, :len(d)] = s, d
    rows, width = blocks[0][0].shape
    grid = lambda k: np.stack([b[k] for b in blocks]).reshape(*lead, rows, width)  # noqa: E731
    return PackedLayout(token_index=grid(0), segment_ids=grid(1), positions=grid(2), branch_ids=grid(3),
                        response_src=src.reshape(*lead, m), response_dst=dst.reshape(*lead, m))


def build_layout(rows: StepRows, groups: np.ndarray) -> PackedLayout:
    """The packed layout (numpy) of `groups` [..., shards, n_d]: global row ids, each shard's rows in
    micro-batch order. Shapes: width >= the longest sequence, rows and M bucketed to the largest
    shard's need, so all micro-batches of a call share one shape. With `rows.prompt_groups`, rows of
    one block with the same prompt share one copy of it (`_units`)."""
    geometry, shared, response_len = _response_geometry(rows), rows.prompt_groups, rows.response_len
    groups = np.asarray(groups)
    align = rows.segment_align
    width, num_rows, _ = _pick_width(geometry, shared, groups, align)
    blocks = []
    for group in groups.reshape(-1, groups.shape[-1]):
        members = _packed_rows(group, geometry, shared, width, align)
        members += [[] for _ in range(num_rows - len(members))]
        blocks.append(_fill_block(members, group, geometry, width, rows.seq_len, response_len, align))
    return _stack_blocks(blocks, groups.shape[:-1], groups.shape[-1], response_len)


def capacity_shape(seq_len: int, token_budget: int, rows_per_shard: int) -> tuple[int, int, int]:
    """(micro-batches, rows, width) of token-budget packing (`use_dynamic_bsz`): rows of the width
    bucket of the longest possible sequence, as many per micro-batch as `token_budget` holds (at
    least one), and enough micro-batches for the worst case (every sequence alone in a row). Only
    the config sets them, never this step's lengths, so the programs never recompile for a new
    length mix; micro-batches a step does not fill are skipped on device."""
    width = row_width(seq_len)
    rows = max(1, min(token_budget // width, rows_per_shard))
    return -(-rows_per_shard // rows), rows, width


def build_capacity_layout(step_rows: StepRows, groups: np.ndarray, num_micro: int, rows: int, width: int
                          ) -> PackedLayout:
    """Token-budget layout of `groups` [..., shards, n_d] with leading axes [..., num_micro, shards]:
    each shard's sequences packed first-fit-decreasing into rows of `width`, `rows` rows per
    micro-batch in turn (trailing micro-batches empty). Indices are relative to the shard's whole
    group, which every micro-batch reads (roles/update.py). Shared prompts as `build_layout`'s: a
    segment never holds more tokens than its rows alone, so the worst case still fits."""
    geometry, shared, response_len = _response_geometry(step_rows), step_rows.prompt_groups, step_rows.response_len
    groups = np.asarray(groups)
    lead, n_d = groups.shape[:-2], groups.shape[-1]
    shards = groups.shape[-2]
    flat = groups.reshape(-1, shards, n_d)
    longest = int(geometry.length[flat.reshape(-1)].max())
    if longest > width:
        raise ValueError(f"a sequence of {longest} tokens does not fit packed rows of {width}")
    blocks: list[list[tuple]] = [[None] * shards for _ in range(len(flat) * num_micro)]
    for i, shard_groups in enumerate(flat):
        for s, group in enumerate(shard_groups):
            members = _packed_rows(group, geometry, shared, width, step_rows.segment_align)
            members += [[] for _ in range(num_micro * rows - len(members))]
            for k in range(num_micro):
                blocks[i * num_micro + k][s] = _fill_block(members[k * rows:(k + 1) * rows], group, geometry,
                                                           width, step_rows.seq_len, response_len,
                                                           step_rows.segment_align)
    # M: every token a micro-batch computes (one shape); the LM head skips the slot blocks past the
    # filled ones (`token_logprobs(rows_in_use=)`), so its work follows the real response tokens
    return _stack_blocks([b for mb in blocks for b in mb], (*lead, num_micro, shards), n_d, response_len,
                         min_slots=rows * width, max_slots=rows * width)


def epoch_orders(rng: jax.Array, epochs: int, num_rows: int, shuffle: bool) -> np.ndarray:
    """[epochs, N] row order of each epoch: exactly the permutations `run_update_epochs` draws on
    device when it shuffles (same keys, same function), else arange."""
    if not shuffle:
        return np.tile(np.arange(num_rows, dtype=np.int32), (epochs, 1))
    return np.stack([np.asarray(jax.random.permutation(k, num_rows))
                     for k in jax.random.split(rng, epochs)]).astype(np.int32)


def balanced_orders(length: np.ndarray, orders: np.ndarray, num_mini: int, bins: int,
                    shared: np.ndarray | None = None) -> np.ndarray:
    """`orders` [epochs, N] with each mini-batch's rows re-ordered so that its `bins` (micro-batch x
    shard) groups of equal size hold about equal real tokens: longest first, each into the group
    with the fewest tokens that has room. All groups of a call share the largest group's packed
    shape, so balanced groups compute less padding. With `shared` (`prompt_groups`) the rows of one
    prompt move together where a group has room for all of them, so packing computes the prompt
    once. The mini-batches keep their rows, and losses and metrics are sums over the mini-batch's
    global denominators (roles/update.py), so the update is the same up to float summation order."""
    if bins == 1:
        return orders
    out = np.empty_like(orders)
    size = orders.shape[1] // num_mini
    per_bin = size // bins
    for e in range(orders.shape[0]):
        for b in range(num_mini):
            rows = orders[e, b * size:(b + 1) * size]
            keys = rows if shared is None else np.asarray(shared)[rows]
            blocks: dict[int, list[int]] = {}
            for i in np.argsort(-length[rows], kind="stable"):
                blocks.setdefault(int(keys[i]), []).append(int(rows[i]))
            members: list[list[int]] = [[] for _ in range(bins)]
            tokens = np.zeros(bins, np.int64)
            for block in sorted(blocks.values(), key=lambda rs: -int(length[rs].sum())):
                whole = [i for i in range(bins) if len(members[i]) + len(block) <= per_bin]
                for part in ([block] if whole else [[r] for r in block]):
                    open_bins = [i for i in range(bins) if len(members[i]) + len(part) <= per_bin]
                    target = min(open_bins, key=lambda i: tokens[i])
                    members[target] += part
                    tokens[target] += length[part].sum()
            out[e, b * size:(b + 1) * size] = np.concatenate(members)
    return out


def plan_update(rows: StepRows, rng: jax.Array, *, epochs: int, shuffle: bool, num_mini: int,
                num_micro: int | None, shards: int, token_budget: int | None = None) -> tuple[UpdateLayout, int]:
    """(layout, micro-batches to split each mini-batch into) of one `run_update_epochs` call.
    num_micro None: a dynamic batch size (`token_budget` tokens per shard per micro-batch): a
    `by_budget` layout whose shapes only the config sets, and 1 (every micro-batch reads the whole
    mini-batch and scores its own sequences). Rows of one `rows.prompt_groups` group that land in
    one micro-batch shard compute their prompt once."""
    num_rows, shared = rows.num_rows, rows.prompt_groups
    orders = epoch_orders(rng, epochs, num_rows, shuffle)
    if num_micro is None:
        if token_budget is None:
            raise ValueError("plan_update: a dynamic batch size (num_micro=None) needs token_budget")
        per_shard = num_rows // num_mini // shards
        if per_shard * shards * num_mini != num_rows:
            raise ValueError(f"{num_rows} rows do not split into {num_mini} mini-batches x {shards} shards")
        count, micro_rows, width = capacity_shape(rows.seq_len, token_budget, per_shard)
        groups = orders.reshape(epochs, num_mini, shards, per_shard)
        layout = build_capacity_layout(rows, groups, count, micro_rows, width)
        return UpdateLayout(orders, layout, by_budget=True), 1
    n_d = num_rows // num_mini // num_micro // shards
    if n_d * shards * num_micro * num_mini != num_rows:
        raise ValueError(f"{num_rows} rows do not split into {num_mini} mini-batches x {num_micro} micro-batches "
                         f"x {shards} shards")
    orders = balanced_orders(rows.length, orders, num_mini, num_micro * shards, shared)
    groups = orders.reshape(epochs, num_mini, num_micro, shards, n_d)
    return UpdateLayout(orders, build_layout(rows, groups)), num_micro


def plan_chunks(rows: StepRows, micro_rows: int, shards: int) -> PackedLayout:
    """Layout of a no-grad pass over consecutive chunks of `micro_rows` rows: leading axis = chunks."""
    num_rows = rows.num_rows
    micro_rows = min(micro_rows, num_rows)
    shards = shards if micro_rows % shards == 0 else 1
    groups = np.arange(num_rows).reshape(num_rows // micro_rows, shards, micro_rows // shards)
    return build_layout(rows, groups)


def plan_capacity_chunks(rows: StepRows, shards: int, token_budget: int) -> PackedLayout:
    """Token-budget layout of a no-grad pass (leading axes [chunks, shards]): each chunk reads all
    rows and computes `token_budget` tokens per shard (`roles/forward.py` `packed_chunks`)."""
    shards = shards if rows.num_rows % shards == 0 else 1
    per_shard = rows.num_rows // shards
    count, micro_rows, width = capacity_shape(rows.seq_len, token_budget, per_shard)
    return build_capacity_layout(rows, np.arange(rows.num_rows).reshape(shards, per_shard), count, micro_rows, width)


def update_metrics(layout: PackedLayout) -> dict[str, float]:
    """What an update's packed micro-batches computed (`perf/packing/*`): tokens run in the
    micro-batches that ran (empty ones are skipped), the real tokens among them (a shared prompt
    counts once), and micro-batches run per mini-batch."""
    seg = np.asarray(layout.segment_ids)
    per_micro = seg.reshape(-1, int(np.prod(seg.shape[-3:])))  # [epochs * mini * micro, shards * rows * width]
    ran = (per_micro > 0).any(1)
    return {"perf/packing/computed_tokens": float(per_micro[ran].size),
            "perf/packing/real_tokens": float((seg > 0).sum()),
            "perf/packing/micro_batches": float(ran.sum() / max(1, int(np.prod(seg.shape[:2]))))}


def packing_stats(layout: PackedLayout) -> dict[str, int]:
    """Tokens the packed shape computes vs the real tokens in it (for benchmarks and logs)."""
    seg = np.asarray(layout.segment_ids)
    return {"computed_tokens": int(seg.size), "real_tokens": int((seg > 0).sum())}
