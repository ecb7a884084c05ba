"""Sequence packing (`model.use_remove_padding`): the forward/backward and no-grad passes run on
rows that hold several variable-length sequences back to back, not on [N, P + R] padded rows.

The host builds a `PackedLayout` per micro-batch from the attention masks it already has (no
device work): for each row shard (one per data-parallel device) the shard's sequences are packed
first-fit-decreasing into `rows` rows of `width` tokens, with segment ids 1, 2, ... per row (0 on
padding). Inside the jit the packed tokens are gathered from the micro-batch's padded
`input_ids`, the model runs with segment ids (attention never crosses sequences, positions restart
per sequence: models/cache.py), the hidden states that predict response tokens are gathered into
[shards, M, H], and per-token outputs (log-probs, entropy, values) are scattered back to the
padded [n, R] response layout. Everything after that (losses, metrics, denominators) is the
unpacked code path, so packed and padded runs give the same numbers.

Shared prompts (`model.share_packed_prompts`): rows whose prompts are the same (`prompt_groups`,
from the host's prompt tokens: the n samples of a GRPO group) and that land in one shard's block
form one segment: the prompt once, then each row's response, with explicit positions (a response
continues its prompt's) and branch ids (0 on the prompt, j on the j-th response) so a response
attends to the prompt and to itself only. The response's first token is scored by the prompt's last
hidden state, which the samples share. A group that does not fit one row is split into several
segments, each with its own copy of the prompt; no segment is longer than its rows alone, so a
token budget's worst case still holds.

Shapes come from a few buckets (row width >= the longest sequence and row count: `bucket`, 4
sizes per doubling, the width picked among the next few buckets for the fewest computed tokens;
response slots M: powers of two; token-budget micro-batches: one shape from the config), so a new
step with other lengths mostly reuses a compiled program. Positions outside a row's attention mask
come back as 0 (the padded path computes throwaway values there; every consumer masks them).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import ModelConfig, forward_hidden

Array = jax.Array
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
        return max(8, 1 << max(longest - 1, 0).bit_length())
    return bucket(longest, WIDTH_GRANULE)


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

    token_index: Array
    segment_ids: Array
    response_src: Array
    response_dst: Array
    positions: Array
    branch_ids: Array


class CapacityPacking(NamedTuple):
    """Token-budget packing of an update call (`use_dynamic_bsz`): `order` as `UpdatePacking`'s and
    `layout` with leading [epochs, mini-batches, micro-batches, shards] axes whose sizes come from
    the config alone (`capacity_shape`). Each micro-batch reads its whole mini-batch and scores the
    sequences its rows hold; micro-batches a step leaves empty are skipped."""

    order: Any
    layout: PackedLayout


class HostRows(NamedTuple):
    """What the host plans a step's packed layouts from: the rows' attention masks [N, P + R] and
    their `prompt_groups` [N] (rows with one prompt share its tokens when packed together)."""

    attention_mask: np.ndarray
    prompt_groups: np.ndarray | None

    def padded(self, pads: tuple[int, int]) -> "HostRows":
        """The rows padded by (prompt, response) columns as `pad_experience` pads the device rows."""
        return self._replace(attention_mask=np.pad(self.attention_mask, ((0, 0), pads)))


class UpdatePacking(NamedTuple):
    """Packing of a whole update call: `order` [epochs, N] the rows of each epoch in order (the
    shuffle's permutation, computed on the host with the padded path's function, or arange) and
    `layout`, a `PackedLayout` with leading [epochs, mini-batches, micro-batches] axes."""

    order: Any
    layout: PackedLayout


# ---------------------------------------------------------------------------- host side


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


def _shard_counts(geometry: "_Geometry", shared: np.ndarray | None, groups: np.ndarray, width: int
                  ) -> tuple[int, int]:
    """(max packed rows, max response tokens) over the shards of `groups` [..., n_d]."""
    flat = groups.reshape(-1, groups.shape[-1])
    rows = max(len(_packed_rows(g, geometry, shared, width)) for g in flat)
    return rows, int(geometry.resp_tokens[flat].sum(1).max())


def _pick_width(geometry: "_Geometry", shared: np.ndarray | None, groups: np.ndarray) -> tuple[int, int, int]:
    """(width, bucketed rows, max response tokens) of the least computed tokens (rows x width) among
    the WIDTH_CHOICES smallest row widths >= the longest sequence: the narrowest width is not always
    best, since the row-count bucket can round a few rows up by 25% where a wider row packs into a
    smaller bucket. Every candidate is a `row_width` bucket, so the shapes stay on the same grid."""
    width = row_width(int(geometry.length[groups.reshape(-1)].max()))
    best = None
    for _ in range(WIDTH_CHOICES):
        need_rows, need_m = _shard_counts(geometry, shared, groups, width)
        rows = bucket(need_rows)
        if best is None or rows * width < best[0] * best[1]:
            best = (rows, width, need_m)
        if need_rows == 1:  # one row already: a wider one only adds padding
            break
        width = row_width(width + 1)
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


def _response_geometry(mask: np.ndarray, response_len: int) -> _Geometry:
    start, length = sequence_spans(mask)
    resp0 = mask.shape[1] - response_len
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


def _packed_rows(group: np.ndarray, geometry: _Geometry, shared: np.ndarray | None, width: int
                 ) -> list[list[_Unit]]:
    """`group`'s segments (`_units`) per packed row of `width`, first-fit-decreasing."""
    units = _units(group, geometry, shared, width)
    return [[units[u] for u in row] for row in _first_fit_decreasing(np.array([u.length for u in units]), width)]


def _fill_block(row_units: Sequence[Sequence[_Unit]], group: np.ndarray, geometry: _Geometry, width: int,
                seq_len: int, response_len: int) -> tuple[np.ndarray, ...]:
    """(token_index, segment_ids, positions, branch_ids [rows, width], response src, response dst)
    of one block: row r holds the segments `row_units[r]` back to back, each its prompt then its
    members' responses; indices are relative to the block's group (its flattened
    [len(group) * seq_len] tokens / [len(group) * R] responses)."""
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
            p = int(prompt[group[unit.prompt]])
            place(r, offset, unit.prompt, int(start[group[unit.prompt]]), p, seg, 0, 0)
            prompt_at, offset = offset, offset + p
            for branch, local in enumerate(unit.members, start=1):
                g = group[local]
                first, n = int(start[g]) + p, int(length[g]) - p  # the row's first response column
                place(r, offset, local, first, n, seg, p, branch)
                pred = np.arange(first_resp[g], start[g] + length[g]) - 1  # columns whose states score
                src.append(r * width + np.where(pred < first, prompt_at + pred - (first - p), offset + pred - first))
                dst.append(local * response_len + (pred + 1 - resp0))
                offset += n
    cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32)  # noqa: E731
    return token_index, segment_ids, positions, branch_ids, cat(src), cat(dst)


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _stack_blocks(blocks: list[tuple], lead: tuple[int, ...], n_d: int, response_len: int,
                  min_slots: int = MIN_RESPONSE_SLOTS, max_slots: int | None = None) -> PackedLayout:
    """One `PackedLayout` with leading axes `lead` from its blocks (equal [rows, width] each); the
    response slots M: a power of two >= the most response tokens of a block (few distinct shapes),
    at least `min_slots`, at most `max_slots` and the n_d * R response tokens there are."""
    cap = min(n_d * response_len, max_slots or n_d * response_len)
    m = min(max(min_slots, _pow2(max(len(b[-2]) for b in blocks))), cap)
    src = np.zeros((len(blocks), m), np.int32)
    dst = np.full((len(blocks), m), n_d * response_len, np.int32)
    for i, (*_, s, d) in enumerate(blocks):
        src[i, :len(s)], dst[i, :len(d)] = s, d
    rows, width = blocks[0][0].shape
    grid = lambda k: np.stack([b[k] for b in blocks]).reshape(*lead, rows, width)  # noqa: E731
    return PackedLayout(token_index=grid(0), segment_ids=grid(1), positions=grid(2), branch_ids=grid(3),
                        response_src=src.reshape(*lead, m), response_dst=dst.reshape(*lead, m))


def build_layout(attention_mask: np.ndarray, response_len: int, groups: np.ndarray,
                 shared: np.ndarray | None = None) -> PackedLayout:
    """The packed layout (numpy) of `groups` [..., shards, n_d]: global row ids, each shard's rows in
    micro-batch order. Shapes: width >= the longest sequence, rows and M bucketed to the largest
    shard's need, so all micro-batches of a call share one shape. `shared` (`prompt_groups`, [N]):
    rows of one block with the same prompt share one copy of it (`_units`)."""
    mask = np.asarray(attention_mask)
    geometry = _response_geometry(mask, response_len)
    groups = np.asarray(groups)
    width, rows, _ = _pick_width(geometry, shared, groups)
    blocks = []
    for group in groups.reshape(-1, groups.shape[-1]):
        members = _packed_rows(group, geometry, shared, width)
        members += [[] for _ in range(rows - len(members))]
        blocks.append(_fill_block(members, group, geometry, width, mask.shape[1], response_len))
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


def build_capacity_layout(attention_mask: np.ndarray, response_len: int, groups: np.ndarray, num_micro: int,
                          rows: int, width: int, shared: np.ndarray | None = None) -> PackedLayout:
    """Token-budget layout of `groups` [..., shards, n_d] with leading axes [..., num_micro, shards]:
    each shard's sequences packed first-fit-decreasing into rows of `width`, `rows` rows per
    micro-batch in turn (trailing micro-batches empty). Indices are relative to the shard's whole
    group, which every micro-batch reads (trainer/update.py). `shared` as `build_layout`'s: a
    segment never holds more tokens than its rows alone, so the worst case still fits."""
    mask = np.asarray(attention_mask)
    geometry = _response_geometry(mask, response_len)
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
            members = _packed_rows(group, geometry, shared, width)
            members += [[] for _ in range(num_micro * rows - len(members))]
            for k in range(num_micro):
                blocks[i * num_micro + k][s] = _fill_block(members[k * rows:(k + 1) * rows], group, geometry,
                                                           width, mask.shape[1], response_len)
    # M: every token a micro-batch computes (one shape); the LM head skips the slot blocks past the
    # filled ones (`token_logprobs(rows_in_use=)`), so its work follows the real response tokens
    return _stack_blocks([b for mb in blocks for b in mb], (*lead, num_micro, shards), n_d, response_len,
                         min_slots=rows * width, max_slots=rows * width)


def epoch_orders(rng: Array, epochs: int, num_rows: int, shuffle: bool) -> np.ndarray:
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
    global denominators (trainer/update.py), so the update is the same up to float summation order."""
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


def plan_update(attention_mask: np.ndarray, response_len: int, rng: Array, *, epochs: int, shuffle: bool,
                num_mini: int, num_micro: int | None, shards: int, token_budget: int | None = None,
                shared: np.ndarray | None = None) -> tuple[UpdatePacking | CapacityPacking, int]:
    """(packing, micro-batches to split each mini-batch into) of one `run_update_epochs` call.
    num_micro None: a dynamic batch size (`token_budget` tokens per shard per micro-batch): a
    `CapacityPacking` whose shapes only the config sets, and 1 (every micro-batch reads the whole
    mini-batch and scores its own sequences). `shared`: `prompt_groups` of the rows (rows with
    one prompt that land in one micro-batch shard compute it once)."""
    mask = np.asarray(attention_mask)
    num_rows = mask.shape[0]
    orders = epoch_orders(rng, epochs, num_rows, shuffle)
    if num_micro is None:
        per_shard = num_rows // num_mini // shards
        if per_shard * shards * num_mini != num_rows:
            raise ValueError(f"{num_rows} rows do not split into {num_mini} mini-batches x {shards} shards")
        count, rows, width = capacity_shape(mask.shape[1], token_budget, per_shard)
        groups = orders.reshape(epochs, num_mini, shards, per_shard)
        return CapacityPacking(orders, build_capacity_layout(mask, response_len, groups, count, rows, width,
                                                             shared)), 1
    n_d = num_rows // num_mini // num_micro // shards
    if n_d * shards * num_micro * num_mini != num_rows:
        raise ValueError(f"{num_rows} rows do not split into {num_mini} mini-batches x {num_micro} micro-batches "
                         f"x {shards} shards")
    orders = balanced_orders(sequence_spans(mask)[1], orders, num_mini, num_micro * shards, shared)
    groups = orders.reshape(epochs, num_mini, num_micro, shards, n_d)
    return UpdatePacking(orders, build_layout(mask, response_len, groups, shared)), num_micro


def plan_chunks(attention_mask: np.ndarray, response_len: int, micro_rows: int, shards: int,
                shared: np.ndarray | None = None) -> PackedLayout:
    """Layout of a no-grad pass over consecutive chunks of `micro_rows` rows: leading axis = chunks."""
    num_rows = np.shape(attention_mask)[0]
    micro_rows = min(micro_rows, num_rows)
    shards = shards if micro_rows % shards == 0 else 1
    groups = np.arange(num_rows).reshape(num_rows // micro_rows, shards, micro_rows // shards)
    return build_layout(attention_mask, response_len, groups, shared)


def plan_capacity_chunks(attention_mask: np.ndarray, response_len: int, shards: int, token_budget: int,
                         shared: np.ndarray | None = None) -> PackedLayout:
    """Token-budget layout of a no-grad pass (leading axes [chunks, shards]): each chunk reads all
    rows and computes `token_budget` tokens per shard (`forward.packed_chunks`)."""
    mask = np.asarray(attention_mask)
    shards = shards if mask.shape[0] % shards == 0 else 1
    per_shard = mask.shape[0] // shards
    count, rows, width = capacity_shape(mask.shape[1], token_budget, per_shard)
    return build_capacity_layout(mask, response_len, np.arange(mask.shape[0]).reshape(shards, per_shard),
                                 count, rows, width, shared)


def unless_empty(layout: PackedLayout, fn: Callable[..., Any], *operands: Any) -> Any:
    """`fn(*operands)`, or zeros shaped like its output where `layout` holds no token: a token-budget
    micro-batch or chunk that a step's lengths leave empty costs nothing (`lax.cond`)."""
    zeros = lambda *a: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fn, *a))  # noqa: E731
    return jax.lax.cond(jnp.any(layout.segment_ids > 0), fn, zeros, *operands)


def filled_slots(layout: PackedLayout, num_rows: int, response_len: int) -> Array:
    """[..., shards, M] bool: the response slots that hold a token (padding slots point past the
    shard's n_d * R responses); they are filled from the front."""
    return layout.response_dst < num_rows // layout.response_dst.shape[-2] * response_len


def response_coverage(layout: PackedLayout, num_rows: int, response_len: int) -> Array:
    """[n, R] float32: 1 where `layout` scores a response token (a token-budget micro-batch's own
    tokens), else 0."""
    return unpack_response(jnp.ones(layout.response_dst.shape, jnp.float32), layout, num_rows, response_len)


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


# ---------------------------------------------------------------------------- device side


def packed_response_hidden(params: dict, cfg: ModelConfig, input_ids: Array, layout: PackedLayout,
                           response_len: int, *, compute_dtype: Any, remat: bool | str = False
                           ) -> tuple[Array, Array]:
    """(hidden [shards, M, H] predicting the response tokens, those tokens [shards, M]) of the
    micro-batch `input_ids` [n, P + R] run packed as `layout` says."""
    shards, rows, width = layout.segment_ids.shape
    n, seq_len = input_ids.shape
    tokens = jnp.take_along_axis(input_ids.reshape(shards, -1), layout.token_index.reshape(shards, -1), axis=1)
    seg = layout.segment_ids.reshape(shards * rows, width)
    hidden, _ = forward_hidden(params, cfg, tokens.reshape(shards * rows, width), (seg > 0).astype(jnp.int32),
                               segment_ids=seg, branch_ids=layout.branch_ids.reshape(shards * rows, width),
                               positions=layout.positions.reshape(shards * rows, width),
                               compute_dtype=compute_dtype, remat=remat)
    hidden = hidden.reshape(shards, rows * width, hidden.shape[-1])
    picked = jnp.take_along_axis(hidden, layout.response_src[..., None], axis=1)
    response = input_ids[:, seq_len - response_len:].reshape(shards, -1)
    targets = jnp.take_along_axis(response, jnp.minimum(layout.response_dst, response.shape[1] - 1), axis=1)
    return picked, targets


def unpack_response(x: Array, layout: PackedLayout, num_rows: int, response_len: int) -> Array:
    """Per-token values [shards, M] back to the padded response layout [n, R] (0 where no token)."""
    shards = x.shape[0]
    out = jnp.zeros((shards, num_rows // shards * response_len), x.dtype)
    out = jax.vmap(lambda o, i, v: o.at[i].set(v, mode="drop"))(out, layout.response_dst, x)
    return out.reshape(num_rows, response_len)


def map_response(outputs: Sequence[Array] | Array, layout: PackedLayout, num_rows: int, response_len: int):
    """`unpack_response` over one array or a tuple of them."""
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(unpack_response(o, layout, num_rows, response_len) for o in outputs)
    return unpack_response(outputs, layout, num_rows, response_len)
