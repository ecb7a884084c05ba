"""Per-token quantities of a batch of (prompt + response) sequences under a model's params:
response log-probs (+ entropy) through the fused vocabulary-streaming kernel, and critic values.

Sequences are `input_ids [N, P + R]` with the prompt left-padded to P and the response
right-padded to R; position t of the hidden states predicts token t + 1, so the response tokens
are scored by hidden positions P-1 .. P+R-2. No `[N, T, V]` logits are ever formed.
"""
from __future__ import annotations

from typing import Any, Callable, Literal, NamedTuple, TypeVar, overload

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm.batching import (
    PackedLayout,
    filled_slots,
    pack_response,
    packed_response_hidden,
    unless_empty,
    unpack_response,
)
from jaxrl_llm.losses.distill import TopK, teacher_topk, topk_log_probs
from jaxrl_llm.losses.logprob import token_logprobs
from jaxrl_llm.models import ModelConfig, forward_hidden_moe, invariant, lm_head_weight, value_from_hidden
from jaxrl_llm.models.dtypes import COMPUTE_DTYPES, as_jnp_dtype
from jaxrl_llm.models.moe import MoeOut
from jaxrl_llm.models.vision.qwen_vl import RowImages
from jaxrl_llm.models.vision.tower_lora import tower_params

Array = jax.Array
ChunkOut = TypeVar("ChunkOut")  # what a chunk function returns: an array or a pytree of them


def compute_dtype_of(name: str):
    return as_jnp_dtype(name, allowed=COMPUTE_DTYPES, what="model.dtype")


def response_hidden(params: dict, model_cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                    response_len: int, *, compute_dtype: str = "float32", remat: bool | str = False,
                    replay: Array | None = None, images: RowImages | None = None) -> tuple[Array, MoeOut | None]:
    """Hidden states [N, R, H] at the positions that predict the response tokens (and a MoE model's
    router stats over every valid token). `replay` [N, P + R, L, k]: the experts each token's layers
    run (routing replay; models/moe.py). `images`: a vision-language policy's rows' image features and M-RoPE
    positions (models/vision/qwen_vl.py)."""
    positions, embeds = (None, None) if images is None else images.decoder_inputs()
    hidden, moe = forward_hidden_moe(params, model_cfg, input_ids, attention_mask, positions=positions,
                                     compute_dtype=compute_dtype_of(compute_dtype), remat=remat,
                                     replay=None if replay is None else jnp.moveaxis(replay, 2, 0), embeds=embeds)
    start = input_ids.shape[1] - response_len - 1
    return jax.lax.dynamic_slice_in_dim(hidden, start, response_len, axis=1), moe


class ResponseScores(NamedTuple):
    log_prob: Array         # [N, R] fp32
    entropy: Array | None   # [N, R] fp32 (with_entropy)
    router: MoeOut | None   # a mixture-of-experts model's router stats (models/moe.py)
    topk: TopK | None = None  # [N, R, k] ids and log-probs: the model's own top-k, or at given ids


def _topk_scores(hidden: Array, unembed: Array, vocab_major: bool, model_cfg: ModelConfig, temperature: float,
                 topk: int, topk_ids: Array | None) -> TopK | None:
    """The top-k part of `response_scores` on [..., H] hidden states (ids [..., k] already in their layout)."""
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    softcap = model_cfg.final_logit_softcapping
    if topk_ids is not None:
        lp = topk_log_probs(flat, unembed, topk_ids.reshape(-1, topk_ids.shape[-1]), temperature=temperature,
                            vocab_major=vocab_major, softcap=softcap)
        return TopK(topk_ids, lp.reshape(topk_ids.shape))
    if topk:
        top = teacher_topk(jax.lax.stop_gradient(flat), unembed, k=topk, temperature=temperature,
                           vocab_major=vocab_major, softcap=softcap)
        return TopK(top.ids.reshape(*lead, topk), top.log_probs.reshape(*lead, topk))
    return None


def response_scores(params: dict, model_cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                    response_len: int, *, temperature: float = 1.0, compute_dtype: str = "float32",
                    remat: bool | str = False, with_entropy: bool = False, packing: PackedLayout | None = None,
                    logprob_impl: str = "auto", mesh: Mesh | None = None, replay: Array | None = None,
                    topk: int = 0, topk_ids: Array | None = None, images: RowImages | None = None
                    ) -> ResponseScores:
    """`response_log_probs` with its forward's router stats (the actor loss's MoE terms); `replay`
    [N, P + R, L, k]: recorded expert ids the MoE layers run (routing replay). `topk`: also the
    model's k most likely tokens at each response position (a teacher's pass); `topk_ids` [N, R, k]:
    also the log-probs of these ids (the student's side of the top-k distillation loss); `images`: the rows'
    images (`response_hidden`)."""
    with invariant.mode(model_cfg.batch_invariant):  # traced with the model's numerics (models/invariant.py)
        return _response_scores(params, model_cfg, input_ids, attention_mask, response_len, temperature=temperature,
                                compute_dtype=compute_dtype, remat=remat, with_entropy=with_entropy, packing=packing,
                                logprob_impl=logprob_impl, mesh=mesh, replay=replay, topk=topk, topk_ids=topk_ids,
                                images=images)


def _response_scores(params: dict, model_cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                     response_len: int, *, temperature: float, compute_dtype: str, remat: bool | str,
                     with_entropy: bool, packing: PackedLayout | None, logprob_impl: str, mesh: Mesh | None,
                     replay: Array | None, topk: int, topk_ids: Array | None, images: RowImages | None
                     ) -> ResponseScores:
    if images is not None and images.tower is not None:  # a trained tower: the features from these params' tower
        images = images.with_tower_features(tower_params(params), compute_dtype_of(compute_dtype))
    # tied embeddings are read as the [V, H] table itself: no transposed copy of it per call
    unembed, vocab_major = ((params["embedding"], True) if model_cfg.tie_word_embeddings
                            else (lm_head_weight(params, model_cfg), False))
    if packing is None:
        hidden, moe = response_hidden(params, model_cfg, input_ids, attention_mask, response_len,
                                      compute_dtype=compute_dtype, remat=remat, replay=replay, images=images)
        targets = input_ids[:, input_ids.shape[1] - response_len:]
        out = token_logprobs(hidden, unembed.astype(hidden.dtype), targets, temperature=temperature,
                             return_entropy=with_entropy, vocab_major=vocab_major, impl=logprob_impl, mesh=mesh,
                             softcap=model_cfg.final_logit_softcapping)
        top = _topk_scores(hidden, unembed.astype(hidden.dtype), vocab_major, model_cfg, temperature, topk, topk_ids)
        if isinstance(out, tuple):
            return ResponseScores(out[0], out[1], moe, top)
        return ResponseScores(out, None, moe, top)
    hidden, targets, moe = packed_response_hidden(params, model_cfg, input_ids, packing, response_len,
                                                  compute_dtype=compute_dtype_of(compute_dtype), remat=remat,
                                                  replay=replay, images=images)
    # the LM head skips the slot blocks past the filled ones
    out = token_logprobs(hidden, unembed.astype(hidden.dtype), targets, temperature=temperature,
                         return_entropy=with_entropy, vocab_major=vocab_major, impl=logprob_impl, mesh=mesh,
                         softcap=model_cfg.final_logit_softcapping,
                         rows_in_use=filled_slots(packing, input_ids.shape[0], response_len))
    num_rows = input_ids.shape[0]
    unpack = lambda x: unpack_response(x, packing, num_rows, response_len)  # noqa: E731
    packed_ids = None if topk_ids is None else pack_response(topk_ids, packing)
    top = _topk_scores(hidden, unembed.astype(hidden.dtype), vocab_major, model_cfg, temperature, topk, packed_ids)
    top = None if top is None else TopK(unpack(top.ids) if topk_ids is None else topk_ids, unpack(top.log_probs))
    if isinstance(out, tuple):  # with_entropy
        return ResponseScores(unpack(out[0]), unpack(out[1]), moe, top)
    return ResponseScores(unpack(out), None, moe, top)


@overload
def response_log_probs(params: dict, model_cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                       response_len: int, *, temperature: float = ..., compute_dtype: str = ...,
                       remat: bool | str = ..., with_entropy: Literal[False] = ..., packing: PackedLayout | None = ...,
                       logprob_impl: str = ..., mesh: Mesh | None = ..., replay: Array | None = ...,
                       images: RowImages | None = ...) -> Array: ...
@overload
def response_log_probs(params: dict, model_cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                       response_len: int, *, temperature: float = ..., compute_dtype: str = ...,
                       remat: bool | str = ..., with_entropy: Literal[True], packing: PackedLayout | None = ...,
                       logprob_impl: str = ..., mesh: Mesh | None = ..., replay: Array | None = ...,
                       images: RowImages | None = ...) -> tuple[Array, Array]: ...
def response_log_probs(params: dict, model_cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                       response_len: int, *, temperature: float = 1.0, compute_dtype: str = "float32",
                       remat: bool | str = False, with_entropy: bool = False, packing: PackedLayout | None = None,
                       logprob_impl: str = "auto", mesh: Mesh | None = None, replay: Array | None = None,
                       images: RowImages | None = None) -> Array | tuple[Array, Array]:
    """log p(response token) [N, R] fp32 under softmax(logits / temperature) (and entropy [N, R]).
    With `packing` the model runs on packed rows (jaxrl_llm/batching) and only real response
    tokens are scored (0 elsewhere). `logprob_impl`: the fused head's backend (losses/logprob.py);
    `mesh`: the program's mesh (a kernel then runs per shard of the rows); `replay`: a MoE model's
    recorded routing [N, P + R, L, k] to run (routing replay); `images`: the rows' images (a vision-language
    policy's; models/vision/qwen_vl.py `RowImages`)."""
    scores = response_scores(params, model_cfg, input_ids, attention_mask, response_len, temperature=temperature,
                             compute_dtype=compute_dtype, remat=remat, with_entropy=with_entropy, packing=packing,
                             logprob_impl=logprob_impl, mesh=mesh, replay=replay, images=images)
    if with_entropy:
        assert scores.entropy is not None
        return scores.log_prob, scores.entropy
    return scores.log_prob


def response_values(params: dict, model_cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                    response_len: int, *, compute_dtype: str = "float32", remat: bool | str = False,
                    packing: PackedLayout | None = None, images: RowImages | None = None) -> Array:
    """Critic values [N, R] fp32 at the positions that predict the response tokens (veRL's
    `values[:, -response_length - 1 : -1]`); packed as `response_log_probs`. `images`: the rows' images (a
    vision-language critic: the policy's folder, whose frozen tower's features they are)."""
    if packing is not None:
        hidden, _, _ = packed_response_hidden(params, model_cfg, input_ids, packing, response_len,
                                              compute_dtype=compute_dtype_of(compute_dtype), remat=remat,
                                              images=images)
        values = value_from_hidden(params, hidden).astype(jnp.float32)
        return unpack_response(values, packing, input_ids.shape[0], response_len)
    hidden, _ = response_hidden(params, model_cfg, input_ids, attention_mask, response_len,
                                compute_dtype=compute_dtype, remat=remat, images=images)
    return value_from_hidden(params, hidden).astype(jnp.float32)


def micro_batched(fn: Callable[[dict], ChunkOut], batch: dict, micro_rows: int, per_chunk: Any = None) -> ChunkOut:
    """Apply `fn` to `micro_rows` rows at a time with `lax.map` (bounds activation memory for
    no-grad passes: reference / old log-probs, values). `per_chunk`: a pytree with a leading
    chunk axis (a `PackedLayout`), passed to `fn` as `chunk["per_chunk"]`."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    micro_rows = min(micro_rows, rows)
    if rows % micro_rows:
        raise ValueError(f"{rows} rows do not split into micro-batches of {micro_rows}")
    chunks = jax.tree.map(lambda x: x.reshape(rows // micro_rows, micro_rows, *x.shape[1:]), batch)
    if per_chunk is not None:
        chunks = {**chunks, "per_chunk": per_chunk}
    out = jax.lax.map(fn, chunks)
    return jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), out)


def budget_chunked(fn: Callable[[dict], ChunkOut], batch: dict, layouts: PackedLayout) -> ChunkOut:
    """Sum of `fn` over token-budget chunks (`batching.plan_capacity_chunks`, leading axis =
    chunks): each call reads all of `batch` with one chunk's layout as `chunk["per_chunk"]` and
    returns per-token values that are 0 outside that chunk's tokens; a chunk this step leaves empty
    is skipped. Unlike `micro_batched`, the shapes never depend on the lengths."""
    run = lambda layout: fn({**batch, "per_chunk": layout})  # noqa: E731
    out_shape = jax.eval_shape(run, jax.tree.map(lambda x: x[0], layouts))

    def step(total, layout):
        return jax.tree.map(jnp.add, total, unless_empty(layout, run, layout)), None

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
    return jax.lax.scan(step, zeros, layouts)[0]
