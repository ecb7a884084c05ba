"""Sequence packing on device: gather a micro-batch's tokens into the packed rows a host plan
(batching/plan.py) laid out, run the model with segment ids (attention never crosses sequences,
positions restart per sequence: models/cache.py), and scatter per-token outputs (log-probs, entropy,
values) back to the padded [n, R] response layout. Positions outside a row's attention mask come back
as 0 (the padded path computes throwaway values there; every consumer masks them).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.arrays import DType, Params
from jaxrl_llm.batching.layout import PackedLayout
from jaxrl_llm.batching.step import NO_PADS, PassLayout
from jaxrl_llm.models import ModelConfig, forward_hidden_moe
from jaxrl_llm.models.moe import NOT_RECORDED, MoeOut
from jaxrl_llm.models.vision.qwen_vl import RowImages

Array = jax.Array


def packed_response_hidden(params: dict, cfg: ModelConfig, input_ids: Array, layout: PackedLayout,
                           response_len: int, *, compute_dtype: DType, remat: bool | str = False,
                           replay: Array | None = None, images: RowImages | None = None
                           ) -> tuple[Array, Array, MoeOut | None]:
    """(hidden [shards, M, H] predicting the response tokens, those tokens [shards, M], a MoE model's
    router stats over the packed tokens) of the micro-batch `input_ids` [n, P + R] run packed as
    `layout` says. `replay` [n, P + R, L, k]: recorded expert ids, packed like the tokens. `images`: a
    vision-language policy's rows' images, packed like the tokens (`packed_images`)."""
    shards, rows, width = layout.segment_ids.shape
    n, seq_len = input_ids.shape
    token_index, seg, branch_ids, positions = (jnp.asarray(x) for x in (
        layout.token_index, layout.segment_ids, layout.branch_ids, layout.positions))
    tokens = jnp.take_along_axis(input_ids.reshape(shards, -1), token_index.reshape(shards, -1), axis=1)
    seg = seg.reshape(shards * rows, width)
    if replay is not None:  # [n, P + R, L, k] -> the packed layout's [L, shards * rows, width, k]
        flat = replay.reshape(shards, -1, *replay.shape[2:])
        packed = jnp.take_along_axis(flat, token_index.reshape(shards, -1)[..., None, None], axis=1)
        replay = jnp.moveaxis(packed.reshape(shards * rows, width, *replay.shape[2:]), 2, 0)
    positions = positions.reshape(shards * rows, width)
    embeds = None
    if images is not None:
        positions, embeds = packed_images(images, token_index)
    hidden, moe = forward_hidden_moe(params, cfg, tokens.reshape(shards * rows, width), (seg > 0).astype(jnp.int32),
                                     segment_ids=seg, branch_ids=branch_ids.reshape(shards * rows, width),
                                     positions=positions, compute_dtype=compute_dtype, remat=remat, replay=replay,
                                     embeds=embeds)
    hidden = hidden.reshape(shards, rows * width, hidden.shape[-1])
    picked = jnp.take_along_axis(hidden, layout.response_src[..., None], axis=1)
    response = input_ids[:, seq_len - response_len:].reshape(shards, -1)
    targets = jnp.take_along_axis(response, jnp.minimum(layout.response_dst, response.shape[1] - 1), axis=1)
    return picked, targets, moe


def packed_images(images: RowImages, token_index: Array) -> tuple[Array, tuple[Array, ...]]:
    """A micro-batch's images in its packed rows: (M-RoPE positions [3, shards * rows, width], embeds) for
    `forward_hidden`. `token_index` [shards, rows, width]: each packed token's index in its shard's flattened
    [n_d * T] tokens. Each packed token's feature is taken within its shard (rows stay on their devices) into
    one feature per packed token [shards * rows, width, H], which the image tokens read at their own column
    (Qwen3-VL's deepstack features alike: [D, shards * rows, width, H])."""
    shards, rows, width = token_index.shape
    flat_index = token_index.reshape(shards, -1)
    n, _, t = images.positions.shape
    positions = jnp.moveaxis(images.positions.reshape(shards, n // shards, 3, t), 2, 1).reshape(shards, 3, -1)
    positions = jnp.take_along_axis(positions, flat_index[:, None], axis=2)  # [shards, 3, rows * width]
    positions = jnp.moveaxis(positions, 1, 0).reshape(3, shards * rows, width)
    slots = jnp.take_along_axis(images.slots.reshape(shards, -1), flat_index, axis=1)  # the row's own feature
    room, hidden = images.features.shape[1:]
    features = images.features.reshape(shards, -1, hidden)  # [shards, n_d * K, H]
    in_shard = (flat_index // t) * room + jnp.maximum(slots, 0)  # the feature's index in its shard's
    picked = jnp.take_along_axis(features, in_shard[..., None], axis=1).reshape(shards * rows, width, hidden)
    columns = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (shards * rows, width))
    own = jnp.where(slots.reshape(shards * rows, width) >= 0, columns, -1)
    if images.deepstack is None:
        return positions, (own, picked)
    depth = images.deepstack.shape[1]  # [n, D, K, H] -> per shard [D, shards, n_d * K, H]
    deep = jnp.moveaxis(images.deepstack.reshape(shards, n // shards, depth, room, hidden), 2, 0).reshape(
        depth, shards, -1, hidden)
    deep = jax.vmap(lambda table: jnp.take_along_axis(table, in_shard[..., None], axis=1))(deep)
    return positions, (own, picked, deep.reshape(depth, shards * rows, width, hidden))


def unpack_response(x: Array, layout: PackedLayout, num_rows: int, response_len: int) -> Array:
    """Per-token values [shards, M, ...] back to the padded response layout [n, R, ...] (0 where no token)."""
    shards, rest = x.shape[0], x.shape[2:]
    out = jnp.zeros((shards, num_rows // shards * response_len, *rest), x.dtype)
    out = jax.vmap(lambda o, i, v: o.at[i].set(v, mode="drop"))(out, layout.response_dst, x)
    return out.reshape(num_rows, response_len, *rest)


def pack_response(x: Array, layout: PackedLayout) -> Array:
    """Per-response-token values [n, R, ...] in the packed slots' order [shards, M, ...], as the
    packed targets are taken (`packed_response_hidden`; padding slots read the last token)."""
    shards = layout.response_dst.shape[-2]
    flat = x.reshape(shards, -1, *x.shape[2:])
    index = jnp.minimum(layout.response_dst, flat.shape[1] - 1)
    return jnp.take_along_axis(flat, index.reshape(*index.shape, *(1,) * (x.ndim - 2)), axis=1)


def unless_empty(layout: PackedLayout, fn: Callable[..., Any], *operands: Any) -> Any:
    """`fn(*operands)`, or zeros shaped like its output where `layout` holds no token: a token-budget
    micro-batch or chunk that a step's lengths leave empty costs nothing (`lax.cond`)."""
    zeros = lambda *a: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fn, *a))  # noqa: E731
    return jax.lax.cond(jnp.any(layout.segment_ids > 0), fn, zeros, *operands)


def filled_slots(layout: PackedLayout, num_rows: int, response_len: int) -> Array:
    """[..., shards, M] bool: the response slots that hold a token (padding slots point past the
    shard's n_d * R responses); they are filled from the front."""
    return jnp.asarray(layout.response_dst) < num_rows // layout.response_dst.shape[-2] * response_len


def response_coverage(layout: PackedLayout, num_rows: int, response_len: int) -> Array:
    """[n, R] float32: 1 where `layout` scores a response token (a token-budget micro-batch's own
    tokens), else 0."""
    return unpack_response(jnp.ones(layout.response_dst.shape, jnp.float32), layout, num_rows, response_len)


@functools.partial(jax.jit, static_argnames=("prompt_pad", "response_pad"))
def pad_columns(sequences: dict[str, Array], responses: dict[str, Array], prompt_pad: int, response_pad: int
                ) -> tuple[dict[str, Array], dict[str, Array]]:
    """[N, P + R] `sequences` with `prompt_pad` columns before the prompts and `response_pad` after
    the responses, [N, R] `responses` with `response_pad` after (0s: masked everywhere), so that
    token-budget packing sees the config's longest shapes whatever this step's lengths
    (`StepBatching.budget_pads`)."""
    pad = lambda before, after: lambda x: jnp.pad(x, ((0, 0), (before, after)))  # noqa: E731
    return (jax.tree.map(pad(prompt_pad, response_pad), sequences), jax.tree.map(pad(0, response_pad), responses))


def run_no_grad_pass(fn: Callable[..., Any], params: Params, input_ids: Array, attention_mask: Array,
                     response_mask: Array, how: PassLayout, routing: Array | None = None,
                     images: RowImages | None = None, **settings: Any) -> Any:
    """`fn` (roles/experience.py `log_probs_no_grad` / `values_no_grad` / `teacher_no_grad`; an
    array [N, R, ...] or a dict of them) over the rows as `how`
    says: the rows padded by `how.pads` first, the result cut back to the step's [N, R]. `routing`:
    a MoE policy's recorded routing [N, P + R, L, k] for `fn` to replay (padded with the rows); `images`: a
    vision-language policy's rows' images (padded alike)."""
    if routing is not None:
        settings["routing"] = routing
    if images is not None:
        settings["images"] = images
    if how.pads == NO_PADS:
        return fn(params, input_ids, attention_mask, response_mask, how.layout, micro_rows=how.micro_rows, **settings)
    response_len = response_mask.shape[1]
    sequences, responses = pad_columns({"ids": input_ids, "attn": attention_mask}, {"resp": response_mask}, *how.pads)
    if routing is not None:
        settings["routing"] = pad_routing(routing, *how.pads)
    if images is not None:
        settings["images"] = images.pad_columns(*how.pads)
    out = fn(params, sequences["ids"], sequences["attn"], responses["resp"], how.layout, micro_rows=how.micro_rows,
             **settings)
    return jax.tree.map(lambda x: x[:, :response_len], out)


def pad_routing(routing: Array, before: int, after: int) -> Array:
    """A recorded routing [N, P + R, L, k] with columns added as `pad_columns` adds them (not recorded)."""
    return jnp.pad(routing, ((0, 0), (before, after), (0, 0), (0, 0)), constant_values=NOT_RECORDED)
