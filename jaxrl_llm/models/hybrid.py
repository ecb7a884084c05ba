"""Qwen3.5's hybrid decoder: gated delta-net linear attention (`cfg.linear_layers`) between gated full-attention
layers, as pure functions over the params dict (layout: models/param_init.py `_HybridStack`; the decoder calls
`hybrid_decoder_hidden` in place of its own layer scan).

Each layer is pre-norm with (1 + w) RMSNorms and a SwiGLU MLP, like Qwen3; its mixer is one of:

- gated full attention (`gated_attention`): q_proj gives a query and an output gate per head; q / k RMS-normed per
  head, RoPE on the first `rotary_dim` dims of each head (rotate-half within them); the attention output, in the
  compute dtype whatever the path returned, times sigmoid(gate) before o_proj. The attention itself is the path's
  `LayerAttention` (models/blocks.py).
- the gated delta net (`delta_net`): one fused projection to q / k / v, a causal depthwise conv of
  `linear_conv_kernel` taps over them (SiLU), q / k L2-normalised and repeated from the key heads to the value
  heads, the gated delta rule (models/delta_rule.py, chunked, its chunks a Pallas kernel on a TPU; batch-invariant
  mode: the recurrence, with the chunked form's gradient) with
  beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), then an RMSNorm of each head's output times SiLU(z)
  and out_proj.

The two kinds' weights are stacked over their own layers; the layer scan steps over periods of the layer pattern
(`layer_period`), each layer reading its row of its kind's stack.

Rows: padding tokens are zeroed before the delta net reads them (as transformers does), so a left-padded row
equals the same row alone. Packed rows (several sequences in one row) restart the state and the conv window at
each sequence's first token: a token's conv tap d tokens back is read only when the token's position is >= d,
and the delta rule restarts where the position is 0 (positions restart per sequence, `attention_context`). A
prompt followed by ONE response (branch 1 of `branch_ids`) is one sequence to the delta net; a prompt shared by
several responses (`model.share_packed_prompts`) would hand the second response the first one's state, so packing
gives these models each response with its own copy of the prompt (roles/trained.py `packing_for`).

Sampling (`HybridState`): a decoding model carries, beside the full-attention layers' KV (a dense cache's or the
paged pool's, over those layers only), each row's recurrent state of every delta-net layer: the conv window (the
last K - 1 projected inputs, fp32) and the delta rule's state S [Hv, Dk, Dv] (fp32), layer-major as the KV cache
([layers, rows, ...]: a layer reads and rewrites one contiguous block in place; with the rows first, every layer's
update of a strided slice was a copy of the whole state). A call with it (a prefill, a chunk of one, a decode
step, several tokens) reads its tokens after the state and leaves the state after its last VALID token: padding
(left or right) neither decays nor writes the state (g = 0, beta = 0) and is not shifted into the window, so a
right-padded prefill bucket or a finished row's ignored slot leaves the state as the real tokens left it. One
token runs the recurrence (`recurrent_delta_rule`), several the chunked form from the given state.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.arrays import ArrayTree, DType
from jaxrl_llm.models import invariant
from jaxrl_llm.models.blocks import (
    LayerAttention,
    apply_rope,
    embed_tokens,
    project,
    rms_norm,
    rope_cos_sin,
    take_row,
)
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.context_parallel import context_parallel_delta_rule, context_parallel_invariant_delta_rule
from jaxrl_llm.models.delta_rule import (
    ChunkTerms,
    chunk_terms,
    chunked_delta_rule,
    invariant_delta_rule,
    l2_normalize,
    recurrent_delta_rule,
)
from jaxrl_llm.models.delta_rule_pallas import chunk_terms_pallas, delta_rule_impl
from jaxrl_llm.models.moe import MoeOut
from jaxrl_llm.models.param_init import hybrid_layer_ids
from jaxrl_llm.models.remat import checkpoint_policy, remat_name, scan_layers
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sharding.mesh import context_parallel_size

Array = jax.Array
DELTA_CHUNK = 64  # tokens per chunk of the gated delta rule (transformers' and fla's default)


RECURRENT_KEYS = ("conv", "delta")  # the per-row state's arrays, as caches and the engine hold them (by name)


class HybridState(NamedTuple):
    """A decoding hybrid model's state (module doc): the attention's, and the delta-net layers' per row."""

    attention: Any  # the full-attention layers' KV: a dense cache's (k, v) or a page pool, over those layers only
    conv: Array  # fp32 [linear layers, B, K - 1, conv channels]: the last K - 1 projected inputs (zeros: none)
    delta: Array  # fp32 [linear layers, B, value heads, key head dim, value head dim]

    @classmethod
    def of(cls, attention: Any, arrays: Mapping[str, Array]) -> "HybridState":
        """The state of `attention`'s and the `RECURRENT_KEYS` arrays of `arrays` (a cache, the engine's dict)."""
        return cls(attention, *(arrays[name] for name in RECURRENT_KEYS))

    @property
    def recurrent(self) -> dict[str, Array]:
        """The per-row arrays by name (`RECURRENT_KEYS`), as caches and the engine hold them."""
        return dict(zip(RECURRENT_KEYS, (self.conv, self.delta)))


def recurrent_shapes(cfg: ModelConfig, batch: int) -> dict[str, tuple[int, ...]]:
    """Shapes of a hybrid model's per-row recurrent state (`HybridState` conv and delta, rows on axis 1), fp32."""
    layers = len(cfg.linear_layers)
    channels = 2 * cfg.linear_key_heads * cfg.linear_key_head_dim + cfg.linear_value_heads * cfg.linear_value_head_dim
    return dict(zip(RECURRENT_KEYS, ((layers, batch, cfg.linear_conv_kernel - 1, channels),
                                     (layers, batch, cfg.linear_value_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim))))


def recurrent_bytes(cfg: ModelConfig) -> int:
    """Bytes of one row's (one slot's) recurrent state over all delta-net layers (0 for other models)."""
    if not cfg.hybrid:
        return 0
    return 4 * sum(int(np.prod(shape)) for shape in recurrent_shapes(cfg, 1).values())


def zero_recurrent(cfg: ModelConfig, batch: int) -> dict[str, Array]:
    """An empty recurrent state (no token read yet) for `batch` rows."""
    return {name: jnp.zeros(shape, jnp.float32) for name, shape in recurrent_shapes(cfg, batch).items()}


def gated_attention(cfg: ModelConfig, weights: dict, adapters: dict, x: Array, cos: Array, sin: Array,
                    attention: LayerAttention, kv: ArrayTree, layer: Array, *, dtype: DType, lora_scale: float = 0.0
                    ) -> tuple[Array, ArrayTree]:
    """(fp32 [B, T, H] output of a full-attention layer for normed x [B, T, H] (compute dtype), the attention's
    new state); `layer`: the layer's row among the full-attention layers (its KV's index); `adapters`: its LoRA
    adapters by projection ({} for none)."""
    b, t, _ = x.shape
    hd, rd, eps = cfg.head_dim, cfg.rotary_dim, cfg.rms_norm_eps

    def proj(name: str, a: Array, in_axes: int = 1) -> Array:
        return project(a, weights[name], adapters.get(name), lora_scale, dtype, in_axes=in_axes)

    q = proj("q_proj", x)  # [B, T, heads, 2 x head_dim]: query, gate
    gate = q[..., hd:] if cfg.attention_output_gate else None
    q = rms_norm(q[..., :hd], weights["q_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
    k = rms_norm(proj("k_proj", x), weights["k_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
    v = proj("v_proj", x)

    def rope(a: Array) -> Array:
        return jnp.concatenate([apply_rope(a[..., :rd], cos, sin), a[..., rd:]], axis=-1)

    out, kv = attention(rope(q).astype(dtype), rope(k).astype(dtype), v.astype(dtype), kv, layer, None)
    # in the compute dtype before the gate, as transformers has it: the paged kernels return that dtype and the
    # dense attention fp32, and a gate applied to the unrounded fp32 output put the paged engine's bf16 log-probs
    # off the trainer's (up to 0.1 in a tiny model, batch-invariant mode included)
    out = out.reshape(b, t, -1, hd).astype(dtype).astype(jnp.float32)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    return proj("o_proj", out.astype(dtype), in_axes=2), kv


def _chunk_terms() -> ChunkTerms:
    """The chunks' parallel part for the platform the program compiles for: the Pallas kernel on a TPU
    (models/delta_rule_pallas.py), XLA's fusions elsewhere."""
    return chunk_terms_pallas if delta_rule_impl(target_platform(), DELTA_CHUNK) == "pallas" else chunk_terms


def causal_conv(x: Array, kernel: Array, positions: Array, window: Array | None = None) -> Array:
    """Causal depthwise conv of x [B, T, C] with taps kernel [K, C] (the last tap on the token itself). Without
    a window a tap d tokens back is read only where the token's position is >= d (a packed row's sequences do
    not see each other); with `window` [B, K - 1, C] (a decoding row's previous inputs) the taps before x read
    it."""
    taps, t = kernel.shape[0], x.shape[1]
    if window is None:
        padded = jnp.pad(x, [(0, 0), (taps - 1, 0), (0, 0)])
    else:
        padded = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    out = jnp.zeros(x.shape, jnp.float32)
    for d in range(taps):
        back = padded[:, taps - 1 - d:taps - 1 - d + t]
        if window is None:
            back = jnp.where((positions >= d)[..., None], back, 0.0)
        out = out + back * kernel[taps - 1 - d].astype(jnp.float32)
    return out


def next_window(window: Array, x: Array, valid: Array) -> Array:
    """The conv window [B, K - 1, C] after reading x [B, T, C]: the K - 1 inputs up to each row's last valid
    token (the old window where a row has none)."""
    taps_back = window.shape[1]
    padded = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    last = jnp.max(jnp.where(valid, jnp.arange(x.shape[1]), -1), axis=1)  # -1: no valid token
    index = (last + 1)[:, None] + jnp.arange(taps_back)[None]  # padded's rows last - K + 2 .. last
    return jnp.take_along_axis(padded, index[..., None], axis=1)


def delta_net(cfg: ModelConfig, weights: dict, adapters: dict, x: Array, valid: Array, positions: Array, *,
              dtype: DType, lora_scale: float = 0.0, recurrent: tuple[Array, Array] | None = None
              ) -> tuple[Array, tuple[Array, Array] | None]:
    """(fp32 [B, T, H] output of a gated delta-net layer for normed x [B, T, H] (compute dtype), the new
    recurrent state or None); valid [B, T]: the real tokens, positions [B, T]: where each sequence starts (module
    doc); `adapters`: its LoRA adapters by projection. `recurrent`: this layer's (conv window [B, K - 1, C],
    delta state [B, Hv, Dk, Dv]) of a decoding row."""
    b, t, _ = x.shape

    def proj(name: str, a: Array, in_axes: int = 1) -> Array:
        return project(a, weights[name], adapters.get(name), lora_scale, dtype, in_axes=in_axes)

    hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))  # padding reads as nothing (its projections: 0)
    inputs = proj("in_proj_qkv", x)
    window = None if recurrent is None else recurrent[0]
    mixed = jax.nn.silu(causal_conv(inputs, weights["conv1d"]["kernel"], positions, window))
    q = mixed[..., :hk * dk].reshape(b, t, hk, dk)
    k = mixed[..., hk * dk:2 * hk * dk].reshape(b, t, hk, dk)
    v = mixed[..., 2 * hk * dk:].reshape(b, t, hv, dv)
    q, k = (l2_normalize(jnp.repeat(a, hv // hk, axis=2)) for a in (q, k))  # key head i // (hv / hk) per value head
    beta = jax.nn.sigmoid(proj("in_proj_b", x))
    a = proj("in_proj_a", x) + weights["dt_bias"].astype(jnp.float32)
    g = -jnp.exp(weights["A_log"].astype(jnp.float32)) * jax.nn.softplus(a)
    # batch-invariant mode runs the recurrence on every path, its sums by fixed trees (models/delta_rule.py): the
    # chunked form rounds otherwise; in training with the chunked form's gradient (`invariant_delta_rule`)
    exact = invariant.enabled()
    terms = _chunk_terms()
    chunked = functools.partial(chunked_delta_rule, chunk=DELTA_CHUNK, terms=terms)
    if recurrent is None and context_parallel_size() > 1:  # tokens split over 'context': the state passed along
        if exact:  # (the row's tokens gathered on every device, the recurrence over all of them)
            out = context_parallel_invariant_delta_rule(q, k, v, g, beta, positions == 0, chunk=DELTA_CHUNK,
                                                        terms=terms)
        else:
            out = context_parallel_delta_rule(q, k, v, g, beta, positions == 0, chunk=DELTA_CHUNK)
        new_state = None
    elif recurrent is None:
        training_rule = functools.partial(invariant_delta_rule, terms=terms) if exact else chunked
        out, _ = training_rule(q, k, v, g, beta, starts=positions == 0, chunk=DELTA_CHUNK)
        new_state = None
    else:  # padding neither decays nor writes: the state is the last valid token's
        g, beta = (jnp.where(valid[..., None], w, 0.0) for w in (g, beta))
        rule = recurrent_delta_rule if t == 1 or exact else chunked
        out, delta = rule(q, k, v, g, beta, state=recurrent[1])
        new_state = (next_window(recurrent[0], inputs, valid), delta)
    z = proj("in_proj_z", x)  # [B, T, value heads, Dv]
    normed = rms_norm(out, weights["norm"]["scale"], cfg.rms_norm_eps, jnp.float32) * jax.nn.silu(z)
    return proj("out_proj", normed.astype(dtype), in_axes=2), new_state


# (layer weights, its MLP adapters, normed x, valid, replay, LoRA scale) -> (out, MoE stats and ids or None)
LayerMlp = Callable[[dict, dict, Array, Array, Any, float], tuple[Array, Any]]


def layer_period(cfg: ModelConfig) -> int:
    """The shortest p dividing the layer count whose pattern of layer kinds repeats every p layers (Qwen3.5's
    three delta-net layers then an attention layer: 4; an irregular pattern: the layer count)."""
    is_linear = np.isin(np.arange(cfg.num_hidden_layers), cfg.linear_layers)
    for p in range(1, cfg.num_hidden_layers + 1):
        if cfg.num_hidden_layers % p == 0 and (is_linear.reshape(-1, p) == is_linear[:p]).all():
            return p
    return cfg.num_hidden_layers


def layer_scan_trips(cfg: ModelConfig) -> int:
    """Trips of the model's layer scan (models/remat.py `scan_layers`): a hybrid model's scan runs a period of
    layers a trip (`layer_period`), the other decoders' one layer. The memory plan counts one trip's work and
    multiplies it by these."""
    return cfg.num_hidden_layers // layer_period(cfg) if cfg.hybrid else cfg.num_hidden_layers


def hybrid_decoder_hidden(params: dict, cfg: ModelConfig, input_ids: Array, positions: Array,
                          attention: LayerAttention, state: HybridState | None, *, dtype: DType, remat: bool | str,
                          valid: Array | None, mlp: LayerMlp, replay: Array | None = None,
                          record_routing: bool = False) -> tuple[Array, HybridState | None, MoeOut | None]:
    """`decoder_hidden` of a Qwen3.5 model: hidden states after the final norm [B, T, H] (compute dtype), the
    new `HybridState` (None without one: the training / scoring forward) and a Qwen3.5-MoE model's `MoeOut`. The
    attention is called with a layer's row among the full-attention layers (its KV's layer index); `mlp` is the
    decoder's MLP of a layer (models/decoder.py `layer_mlp`: the dense SwiGLU, or the experts with their router
    stats and ids, `replay` [L, B, T, k] choosing them as in the other MoE families).

    The scan steps over periods of the layer pattern (`layer_period`: 4 layers for Qwen3.5), each period's runs of
    one kind (three delta-net layers, one attention layer) an inner scan with the kind known when traced. A scan
    over single layers would have to choose the kind with `lax.cond`, and XLA copies the operands a conditional
    updates: the whole KV pool and state, at every layer of every decode step (25M numbers a step for a 4-layer
    model with a 16 MiB pool); and a loop body writing one buffer several times (a period unrolled) copied the
    buffer per write on XLA:CPU. One write per buffer per body is what the other decoders' layer scans do."""
    adapters = params.get("lora")  # LoRA (models/lora.py): the mixers' per kind, the MLPs' per layer
    lora_layers = {} if adapters is None else adapters.weights["layers"]
    lora_scale = 0.0 if adapters is None else adapters.scale
    valid = jnp.ones(input_ids.shape, bool) if valid is None else valid
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    x, _ = embed_tokens(params, cfg, input_ids, dtype)
    cos, sin = rope_cos_sin(cfg, positions)
    kinds = hybrid_layer_ids(cfg)
    period = layer_period(cfg)
    periods = cfg.num_hidden_layers // period
    pattern = ["linear" if i in cfg.linear_layers else "attn" for i in range(period)]
    per_period = {kind: pattern.count(kind) for kind in kinds}  # each kind's layers in a period
    row_in_period = [pattern[:j].count(pattern[j]) for j in range(period)]

    stacks = {kind: params["layers"][kind] for kind in kinds}
    kind_adapters = {kind: lora_layers.get(kind, {}) for kind in kinds}
    layers = {k: v for k, v in params["layers"].items() if k not in kinds}  # per layer: norms and MLP
    mlp_adapters = {k: v for k, v in lora_layers.items() if k in ("mlp", "shared_expert")}

    def one_layer(kind: str, x: Array, index: Array, kind_row: Array, state: HybridState | None
                  ) -> tuple[Array, Any, Any]:
        """Layer `index` (`kind_row` in its kind's stack, KV and state): (x, state, its MoE stats and ids or None).
        Its weights are read by index from the stacks as they are (reshaping a stack into periods made XLA copy
        every weight per call)."""
        weights, layer_adapters = take_row(layers, index), take_row(mlp_adapters, index)
        mixer, own = take_row(stacks[kind], kind_row), take_row(kind_adapters[kind], kind_row)
        normed = rms_norm(x, weights["attn_norm"]["scale"], eps, dtype, offset)
        if kind == "attn":
            h, kv = gated_attention(cfg, mixer, own, normed, cos, sin, attention,
                                    None if state is None else state.attention, kind_row, dtype=dtype,
                                    lora_scale=lora_scale)
            state = None if state is None else state._replace(attention=kv)
        elif state is None:
            h, _ = delta_net(cfg, mixer, own, normed, valid, positions, dtype=dtype, lora_scale=lora_scale)
        else:  # the layer's block of the layer-major state, rewritten in place
            mine = (lax.dynamic_index_in_dim(state.conv, kind_row, 0, keepdims=False),
                    lax.dynamic_index_in_dim(state.delta, kind_row, 0, keepdims=False))
            h, new = delta_net(cfg, mixer, own, normed, valid, positions, dtype=dtype, lora_scale=lora_scale,
                               recurrent=mine)
            assert new is not None
            state = state._replace(conv=lax.dynamic_update_index_in_dim(state.conv, new[0], kind_row, 0),
                                   delta=lax.dynamic_update_index_in_dim(state.delta, new[1], kind_row, 0))
        x = x + h
        normed = rms_norm(x, weights["mlp_norm"]["scale"], eps, dtype, offset)
        layer_replay = None if replay is None else lax.dynamic_index_in_dim(replay, index, 0, keepdims=False)
        h, moe = mlp(weights, layer_adapters, normed, valid, layer_replay, lora_scale)
        if moe is not None and not record_routing:
            moe = (moe[0], None)
        return x + h, state, moe

    # the period as runs of one kind (Qwen3.5: three delta-net layers, one attention layer), each run a scan over
    # its layers: every loop body then rewrites one block of the KV or of the state, which XLA does in place (a
    # body with several writes into one buffer copied the whole buffer per write on XLA:CPU)
    runs, start = [], 0  # (kind, the run's first layer in the period, its layers)
    for kind, group in itertools.groupby(pattern):
        length = len(list(group))
        runs.append((kind, start, length))
        start += length

    def run_period(carry: tuple[Array, Array, HybridState | None], _: None
                   ) -> tuple[tuple[Array, Array, HybridState | None], Any]:
        x, step, state = carry
        outs = []
        for kind, start, length in runs:
            layer = functools.partial(one_layer, kind)
            if remat_name(remat) != "none":  # each layer recomputed on its own, as the other decoders' scans
                layer = jax.checkpoint(layer, prevent_cse=False, policy=checkpoint_policy(remat))
            first_row = step * per_period[kind] + row_in_period[start]

            def body(c: tuple[Array, HybridState | None], i: Array, layer: Callable = layer, start: int = start,
                     first_row: Array = first_row) -> tuple[tuple[Array, HybridState | None], Any]:
                x, state = c
                x, state, moe = layer(x, step * period + start + i, first_row + i, state)
                return (x, state), moe

            (x, state), moe = lax.scan(body, (x, state), jnp.arange(length, dtype=jnp.int32))
            outs.append(moe)
        moe = None if outs[0] is None else jax.tree.map(lambda *o: jnp.concatenate(o), *outs)
        return (x, step + 1, state), moe

    (x, _, state), moe = scan_layers(run_period, None, cfg.scan_repeat, (x, jnp.int32(0), state), None,
                                     length=periods)
    if moe is not None:  # [periods, period, ...] -> [L, ...]
        moe = jax.tree.map(lambda a: a.reshape(cfg.num_hidden_layers, *a.shape[2:]), moe)
    return (rms_norm(x, params["final_norm"]["scale"], eps, dtype, offset), state,
            None if moe is None else MoeOut(*moe))
