"""The jitted generate: prefill a left-padded prompt batch, then a `lax.while_loop` KV-cache decode.

    settings, knobs = sampling_params.compile_args(cfg.eos_token_ids, pad_id, vocab_size=cfg.vocab_size)
    out = sample(params, cfg, prompt_ids, prompt_mask, rng, knobs, settings=settings, mesh=mesh)

`params` are the policy's own (possibly sharded) arrays, the same pytree the optimizer updates:
nothing is copied or converted, so a call after an update samples from the updated policy.
Each prompt is prefilled once; its cache and last logits are then repeated `settings.n` times by
index (row b*n + j is sample j of prompt b); every row draws its own random numbers.

The cache holds P + R - 1 slots (the last sampled token is never fed back). It is allocated inside
the program and carried through the loop, so XLA updates it in place (there is no caller-side
buffer to donate). Finished rows keep running with attention mask 0 (their slots are ignored) and
emit the pad id; the loop exits as soon as every row has finished. Sharding: the batch dim of the
prompts and the cache is constrained to ('data', 'fsdp') and the cache's kv-heads dim to 'tensor'
(when divisible); the params bring their own shardings (heads / MLP / vocab over 'tensor').
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxrl_llm.arrays import HostOrDevice
from jaxrl_llm.models import (
    ModelConfig,
    as_jnp_dtype,
    forward_hidden,
    forward_hidden_routed,
    init_cache,
    logits_from_hidden,
)
from jaxrl_llm.models.hybrid import RECURRENT_KEYS
from jaxrl_llm.models.moe import NOT_RECORDED, routing_dtype
from jaxrl_llm.models.vision.qwen_vl import ImagePrompt
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.sampling import choose_tokens
from jaxrl_llm.sharding import mesh_context, with_activation_constraint

Array = jax.Array

FINISH_LENGTH, FINISH_EOS, FINISH_STOP = 0, 1, 2
FINISH_REASONS = ("length", "eos", "stop")  # indexed by the codes above

_CACHE_AXES = ("layers", "batch", "act_kv_heads", "length", "act_head_dim")  # models.cache layout


class SampleOutput(NamedTuple):
    """What `sample` returns (B' = B * n rows, R = max_new_tokens): device arrays from the static
    sampler, host arrays from the paged engine (which builds its results on the host)."""

    tokens: HostOrDevice  # int32 [B', R] response ids, right-padded with the pad id
    response_mask: HostOrDevice  # int32 [B', R] 1 up to and including the EOS / stop token
    log_probs: HostOrDevice  # fp32 [B', R] log p(token) under softmax(logits / T) (T = 1 if greedy); 0 on pad
    lengths: HostOrDevice  # int32 [B'] number of response tokens (sum of response_mask)
    finish_reason: HostOrDevice  # int32 [B'] FINISH_LENGTH / FINISH_EOS / FINISH_STOP
    prompt_ids: HostOrDevice  # int32 [B', P] the prompts, repeated n times by index
    prompt_mask: HostOrDevice  # int32 [B', P]
    num_steps: HostOrDevice  # int32 scalar: tokens generated per row before the loop stopped (<= R)
    # settings.record_routing on a MoE model: [B', P + R, L, k] the experts each fed token's layers ran
    # (models/moe.py routing_dtype; NOT_RECORDED for the last sampled token, never fed, and unused columns)
    routing: HostOrDevice | None = None


class _LoopState(NamedTuple):
    step: Array
    last: Array
    done: Array
    finish: Array
    lengths: Array
    tokens: Array
    log_probs: Array
    cache: dict
    routing: Array | None  # [B', P + R, L, k] when recording


_KV_KEYS = ("k", "v", "k_full", "v_full")  # models/cache.py `kv_shapes` (the *_full: Gemma 4's full layers)


def _constrain_cache(cache: dict, mesh: Mesh | None) -> dict:
    kv = {name: with_activation_constraint(cache[name], _CACHE_AXES, mesh) for name in _KV_KEYS if name in cache}
    kv.update({name: with_activation_constraint(cache[name], ("layers", "batch") + (None,) * (cache[name].ndim - 2),
                                                mesh) for name in RECURRENT_KEYS if name in cache})
    return {**kv, "mask": with_activation_constraint(cache["mask"], ("batch", "length"), mesh),
            "index": cache["index"]}


def _record(state: _LoopState, step: Array, tok: Array, lp: Array, knobs: SampleKnobs) -> _LoopState:
    """Writes column `step` for rows still generating (pad / 0 for finished rows); updates done."""
    active = ~state.done
    tok = jnp.where(active, tok, knobs.pad_id)
    lp = jnp.where(active, lp, 0.0)
    is_eos = active & jnp.any(tok[:, None] == knobs.eos_ids[None, :], axis=-1)
    is_stop = active & ~is_eos & jnp.any(tok[:, None] == knobs.stop_ids[None, :], axis=-1)
    finish = jnp.where(is_eos, FINISH_EOS, jnp.where(is_stop, FINISH_STOP, state.finish))
    return state._replace(
        last=tok, done=state.done | is_eos | is_stop, finish=finish,
        lengths=state.lengths + active.astype(jnp.int32),
        tokens=lax.dynamic_update_slice(state.tokens, tok[:, None], (0, step)),
        log_probs=lax.dynamic_update_slice(state.log_probs, lp[:, None], (0, step)))


@functools.partial(jax.jit, static_argnames=("cfg", "settings", "mesh"))
def sample_program(params: dict, cfg: ModelConfig, prompt_ids: Array, prompt_mask: Array, rng: Array,
                   knobs: SampleKnobs, *, settings: SampleSettings, mesh: Mesh | None,
                   prompt_routing: Array | None = None, images: ImagePrompt | None = None) -> SampleOutput:
    """The jitted program behind `sample` (no input checks): what the memory plan lowers and what
    tests count compiled programs of. Traced on `mesh` (expert parallelism reads it)."""
    with mesh_context(mesh):
        return _sample(params, cfg, prompt_ids, prompt_mask, rng, knobs, settings=settings, mesh=mesh,
                       prompt_routing=prompt_routing, images=images)


def _sample(params: dict, cfg: ModelConfig, prompt_ids: Array, prompt_mask: Array, rng: Array,
            knobs: SampleKnobs, *, settings: SampleSettings, mesh: Mesh | None,
            prompt_routing: Array | None, images: ImagePrompt | None) -> SampleOutput:
    prompt_ids = with_activation_constraint(prompt_ids.astype(jnp.int32), ("batch", "length"), mesh)
    prompt_mask = with_activation_constraint(prompt_mask.astype(jnp.int32), ("batch", "length"), mesh)
    n = settings.n
    r = settings.max_new_tokens
    dtype = as_jnp_dtype(settings.compute_dtype)

    # prefill each prompt once, then repeat its cache and last logits by index (row b*n + j is
    # sample j of prompt b): n samples share one prefill instead of computing it n times
    cache = _constrain_cache(init_cache(cfg, prompt_ids.shape[0], prompt_ids.shape[1] + r - 1, dtype), mesh)
    record = settings.record_routing and cfg.is_moe
    routing = None
    # a vision-language prompt adds its image features and M-RoPE positions (models/vision/qwen_vl.py)
    positions, embeds = (None, None) if images is None else (images.positions, images.embeds)
    if record:
        replay = None if prompt_routing is None else jnp.moveaxis(prompt_routing.astype(jnp.int32), 2, 0)
        hidden, cache, prefill_routing = forward_hidden_routed(params, cfg, prompt_ids, prompt_mask, cache=cache,
                                                               compute_dtype=dtype, replay=replay,
                                                               positions=positions, embeds=embeds)
        routing = _routing_buffer(prefill_routing, prompt_mask, cfg, r)
    else:
        hidden, cache = forward_hidden(params, cfg, prompt_ids, prompt_mask, cache=cache, compute_dtype=dtype,
                                       positions=positions, embeds=embeds)
    # each row's decode positions: its token count, plus its M-RoPE delta after images
    offset = None if images is None else images.deltas.astype(jnp.int32)
    # left padding: the last slot of every row is its last real prompt token
    logits = logits_from_hidden(params, cfg, hidden[:, -1])
    if n > 1:
        prompt_ids, prompt_mask, logits = (jnp.repeat(x, n, axis=0) for x in (prompt_ids, prompt_mask, logits))
        offset = None if offset is None else jnp.repeat(offset, n, axis=0)
        routing = None if routing is None else jnp.repeat(routing, n, axis=0)
        per_row = (*_KV_KEYS, *RECURRENT_KEYS)  # rows on axis 1 (a hybrid model's state: [layers, B, ...])
        cache = {**{name: jnp.repeat(cache[name], n, axis=1) for name in per_row if name in cache},
                 "mask": jnp.repeat(cache["mask"], n, axis=0), "index": cache["index"]}
        prompt_ids = with_activation_constraint(prompt_ids, ("batch", "length"), mesh)
        prompt_mask = with_activation_constraint(prompt_mask, ("batch", "length"), mesh)
    cache = _constrain_cache(cache, mesh)
    b = prompt_ids.shape[0]
    tok, lp = choose_tokens(logits, jax.random.fold_in(rng, 0), knobs, settings)
    state = _LoopState(
        step=jnp.int32(1), last=tok, done=jnp.zeros((b,), bool),
        finish=jnp.full((b,), FINISH_LENGTH, jnp.int32), lengths=jnp.zeros((b,), jnp.int32),
        tokens=jnp.full((b, r), knobs.pad_id, jnp.int32), log_probs=jnp.zeros((b, r), jnp.float32),
        cache=cache, routing=routing)
    state = _record(state, jnp.int32(0), tok, lp, knobs)

    def keep_going(s: _LoopState) -> Array:
        return (s.step < r) & ~jnp.all(s.done)

    def decode_one(s: _LoopState) -> _LoopState:
        feed_mask = (~s.done).astype(jnp.int32)[:, None]  # finished rows: slot ignored from now on
        if s.routing is not None:  # the fed token (response column step - 1) is at column P + step - 1
            hidden, cache, fed = forward_hidden_routed(params, cfg, s.last[:, None], feed_mask, cache=s.cache,
                                                       compute_dtype=dtype, position_offset=offset)
            assert fed is not None
            column = jnp.moveaxis(fed, 0, 2).astype(s.routing.dtype)  # [B, 1, L, k]
            column = jnp.where(feed_mask[:, :, None, None] > 0, column, jnp.asarray(NOT_RECORDED, column.dtype))
            s = s._replace(routing=lax.dynamic_update_slice(
                s.routing, column, (0, prompt_ids.shape[1] + s.step - 1, 0, 0)))
        else:
            hidden, cache = forward_hidden(params, cfg, s.last[:, None], feed_mask, cache=s.cache,
                                           compute_dtype=dtype, position_offset=offset)
        tok, lp = choose_tokens(logits_from_hidden(params, cfg, hidden[:, 0]),
                                jax.random.fold_in(rng, s.step), knobs, settings)
        s = _record(s._replace(cache=_constrain_cache(cache, mesh)), s.step, tok, lp, knobs)
        return s._replace(step=s.step + 1)

    state = lax.while_loop(keep_going, decode_one, state)
    response_mask = (jnp.arange(r, dtype=jnp.int32)[None, :] < state.lengths[:, None]).astype(jnp.int32)
    return SampleOutput(tokens=state.tokens, response_mask=response_mask, log_probs=state.log_probs,
                        lengths=state.lengths, finish_reason=state.finish, prompt_ids=prompt_ids,
                        prompt_mask=prompt_mask, num_steps=state.step, routing=state.routing)


def _routing_buffer(prefill: Array | None, prompt_mask: Array, cfg: ModelConfig, max_new_tokens: int) -> Array:
    """[B, P + R, L, k] with the prefill's routing [L, B, P, k] in its first P columns (NOT_RECORDED on
    the padding) and NOT_RECORDED after."""
    assert prefill is not None
    rows = jnp.moveaxis(prefill, 0, 2).astype(routing_dtype(cfg.num_experts))  # [B, P, L, k]
    rows = jnp.where(prompt_mask[:, :, None, None] > 0, rows, jnp.asarray(NOT_RECORDED, rows.dtype))
    rest = jnp.full((rows.shape[0], max_new_tokens, *rows.shape[2:]), NOT_RECORDED, rows.dtype)
    return jnp.concatenate([rows, rest], axis=1)


def sample(params: dict, cfg: ModelConfig, prompt_ids: HostOrDevice, prompt_mask: HostOrDevice, rng: Array,
           knobs: SampleKnobs, *, settings: SampleSettings, mesh: Mesh | None = None,
           prompt_routing: HostOrDevice | None = None, images: ImagePrompt | None = None) -> SampleOutput:
    """Generates up to `settings.max_new_tokens` tokens for every row of a LEFT-padded prompt batch.

    prompt_ids / prompt_mask: int [B, P], every row with at least one real token and its last
    slot real (left padding). rng: a PRNG key. knobs / settings: from
    `SamplingParams.compile_args`. mesh: the mesh the params live on (None: the mesh in context,
    or a single device). prompt_routing: with settings.record_routing on a MoE model, int
    [B, P, L, k] experts the prefill runs (a multi-turn conversation's earlier turns; NOT_RECORDED:
    the router's choice), recorded as they ran. images: a vision-language model's prompt images
    (`models.vision.qwen_vl.image_prompt`: features, M-RoPE positions, decode deltas). Jitted (static: cfg,
    settings, mesh); callable inside another jit.
    """
    if settings.batch_invariant != cfg.batch_invariant:  # the log-probs follow the model's numerics
        settings = dataclasses.replace(settings, batch_invariant=cfg.batch_invariant)
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {prompt_ids.shape} and prompt_mask {prompt_mask.shape} must be "
                         "equal 2-D [batch, prompt_len] shapes")
    if prompt_ids.shape[1] < 1:
        raise ValueError("prompt_ids: prompt length must be >= 1")
    if prompt_routing is not None and prompt_routing.shape[:2] != prompt_ids.shape:
        raise ValueError(f"prompt_routing {prompt_routing.shape} does not start with prompt_ids' {prompt_ids.shape}")
    if images is not None and images.slots.shape != prompt_ids.shape:
        raise ValueError(f"images: slots {images.slots.shape} must be prompt_ids' {prompt_ids.shape}")
    return sample_program(params, cfg, prompt_ids, prompt_mask, rng, knobs, settings=settings, mesh=mesh,
                          prompt_routing=prompt_routing, images=images)
