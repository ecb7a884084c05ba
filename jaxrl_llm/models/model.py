"""Pure functions over a plain params dict: init, logical axes, forward, LM / value / score heads.

Params layout (plain nested dict of arrays; layer params stacked on a leading axis of size L):

    embedding [V, H]
    layers/attn_norm/scale [L, H]          layers/mlp_norm/scale [L, H]
    layers/attn/{q,k,v}_proj/kernel [L, H, heads|kv_heads, D]   (+ bias [L, heads, D] for Qwen2)
    layers/attn/o_proj/kernel [L, heads, D, H]
    layers/attn/{q,k}_norm/scale [L, D]    (Qwen3)
    layers/mlp/{gate,up}_proj/kernel [L, H, F]   layers/mlp/down_proj/kernel [L, F, H]
    final_norm/scale [H]
    lm_head/kernel [H, V]                  (head="lm", untied only)
    value_head/kernel [H, 1], bias [1]     (head="value")
    score/kernel [H, num_labels]           (head="score"; HF `score.weight`, no bias)
    lora                                   (optional) LoRA adapters, models/lora.py `with_lora`
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models.cache import attention_context
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.dtypes import as_jnp_dtype

Array = jax.Array
HEADS = ("lm", "value", "score")
BACKBONE_KEYS = ("embedding", "layers", "final_norm")


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")


def init_head_params(cfg: ModelConfig, rng: Array, *, head: str = "lm", num_labels: int = 1,
                     dtype: Any = jnp.float32) -> dict:
    """Freshly initialised head params (the part of `init_params` outside the backbone)."""
    _check_head(head)
    normal = jax.nn.initializers.normal(cfg.initializer_range)
    h = cfg.hidden_size
    if head == "lm":
        return {} if cfg.tie_word_embeddings else {
            "lm_head": {"kernel": normal(rng, (h, cfg.vocab_size), dtype)}}
    if head == "value":
        return {"value_head": {"kernel": normal(rng, (h, 1), dtype), "bias": jnp.zeros((1,), dtype)}}
    return {"score": {"kernel": normal(rng, (h, num_labels), dtype)}}


def init_params(cfg: ModelConfig, rng: Array, *, head: str = "lm", num_labels: int = 1,
                dtype: Any = jnp.float32) -> dict:
    """Random params (normal(initializer_range) matrices, unit norms) as a plain nested dict."""
    _check_head(head)
    return _init_params_jit(cfg, rng, head, num_labels, as_jnp_dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _init_params_jit(cfg: ModelConfig, rng: Array, head: str, num_labels: int, dtype: Any) -> dict:
    backbone_rng, head_rng = jax.random.split(rng)
    ids = jnp.zeros((1, 1), jnp.int32)
    allowed = jnp.ones((1, 1, 1), bool)
    variables = Decoder(cfg, param_dtype=dtype).init(backbone_rng, ids, ids, allowed)
    params = _plain(variables["params"])
    params.update(init_head_params(cfg, head_rng, head=head, num_labels=num_labels, dtype=dtype))
    return params


def _plain(tree: Any) -> Any:
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _layer_axes(path: tuple[str, ...]) -> tuple:
    *mods, leaf = path
    mod = mods[-1]
    if mod.endswith("norm"):
        return ("layers", None)
    heads = "heads" if mod in ("q_proj", "o_proj") else "kv_heads"
    table = {
        ("q_proj", "kernel"): ("layers", "embed", heads, "head_dim"),
        ("k_proj", "kernel"): ("layers", "embed", heads, "head_dim"),
        ("v_proj", "kernel"): ("layers", "embed", heads, "head_dim"),
        ("q_proj", "bias"): ("layers", heads, "head_dim"),
        ("k_proj", "bias"): ("layers", heads, "head_dim"),
        ("v_proj", "bias"): ("layers", heads, "head_dim"),
        ("o_proj", "kernel"): ("layers", "heads", "head_dim", "embed"),
        ("gate_proj", "kernel"): ("layers", "embed", "mlp"),
        ("up_proj", "kernel"): ("layers", "embed", "mlp"),
        ("down_proj", "kernel"): ("layers", "mlp", "embed"),
    }
    return table[(mod, leaf)]


_TOP_AXES = {
    ("embedding",): ("vocab", "embed"),
    ("final_norm", "scale"): (None,),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("value_head", "kernel"): ("embed", None),
    ("value_head", "bias"): (None,),
    ("score", "kernel"): ("embed", None),
}


def param_logical_axes(cfg: ModelConfig, *, head: str = "lm", num_labels: int = 1) -> dict:
    """Same structure as params; each leaf is a tuple of logical axis names (or None) per dim.

    Leaves are tuples, so map with `is_leaf=lambda x: isinstance(x, tuple)`.
    """
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), head=head,
                                                num_labels=num_labels))

    def axes(path, _leaf):
        keys = tuple(p.key for p in path)
        return _layer_axes(keys) if keys[0] == "layers" else _TOP_AXES[keys]

    return jax.tree_util.tree_map_with_path(axes, shapes)


def forward_hidden(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array, *,
                   positions: Array | None = None, cache: dict | None = None,
                   compute_dtype: Any = jnp.float32, remat: bool | str = False,
                   segment_ids: Array | None = None, branch_ids: Array | None = None
                   ) -> tuple[Array, dict | None]:
    """Hidden states after the final norm [B, T, H] (compute dtype) and the updated cache or None.

    Positions default to cumsum(attention_mask) - 1 clipped at 0 (over the cache slots too when a
    cache is given), so left padding does not change any real token's output. segment_ids [B, T]
    (no cache): packed rows holding several sequences (ids 1, 2, ... per row, attention_mask 0 on
    the padding); attention stays within a segment and positions restart per segment, so every
    sequence's hidden states equal those of the sequence alone (trainer/packing.py). branch_ids [B, T]
    (with segment_ids and positions): a segment holding one prompt and several continuations of it,
    each seeing the prompt and itself only (`attention_context`). LoRA adapters in
    `params["lora"]` (models/lora.py) are applied inside the layers.
    """
    positions, allowed, write_index, new_mask = attention_context(cfg, attention_mask, positions,
                                                                  cache, segment_ids, branch_ids)
    backbone = {k: params[k] for k in BACKBONE_KEYS}
    param_dtype = backbone["embedding"].dtype
    lora = params.get("lora")
    module = Decoder(cfg, compute_dtype=compute_dtype, param_dtype=param_dtype, remat=remat,
                     lora_scale=0.0 if lora is None else lora.scale)
    k_cache = v_cache = None
    if cache is not None:
        k_cache, v_cache = cache["k"], cache["v"]
    hidden, k_cache, v_cache = module.apply({"params": backbone}, input_ids, positions, allowed,
                                            write_index, k_cache, v_cache,
                                            None if lora is None else lora.weights["layers"])
    if cache is None:
        return hidden, None
    new_cache = {"k": k_cache, "v": v_cache, "mask": new_mask,
                 "index": cache["index"] + input_ids.shape[1]}
    return hidden, new_cache


def lm_head_weight(params: dict, cfg: ModelConfig) -> Array:
    """The [H, V] output projection (the embedding transposed when tied)."""
    if cfg.tie_word_embeddings:
        return params["embedding"].T
    return params["lm_head"]["kernel"]


def logits_from_hidden(params: dict, cfg: ModelConfig, hidden: Array) -> Array:
    """[..., V] float32 logits (matmul in the hidden's dtype, fp32 accumulation)."""
    w = lm_head_weight(params, cfg).astype(hidden.dtype)
    return jnp.einsum("...h,hv->...v", hidden, w, preferred_element_type=jnp.float32)


def compute_logits(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                   **kwargs: Any) -> Array | tuple[Array, dict]:
    """Full [B, T, V] fp32 logits (tests / eval). With `cache=` returns (logits, new_cache)."""
    hidden, new_cache = forward_hidden(params, cfg, input_ids, attention_mask, **kwargs)
    logits = logits_from_hidden(params, cfg, hidden)
    return logits if kwargs.get("cache") is None else (logits, new_cache)


def value_from_hidden(params: dict, hidden: Array) -> Array:
    """Critic value per token [B, T] fp32."""
    head = params["value_head"]
    v = jnp.einsum("bth,ho->bto", hidden.astype(jnp.float32), head["kernel"].astype(jnp.float32))
    return v[..., 0] + head["bias"].astype(jnp.float32)[0]


def last_valid_index(attention_mask: Array) -> Array:
    """Index of the last position whose mask is 1, per row [B] (works for left or right padding)."""
    t = attention_mask.shape[1]
    return jnp.argmax(jnp.arange(t) * (attention_mask > 0), axis=1)


def score_from_hidden(params: dict, hidden: Array, attention_mask: Array) -> Array:
    """Sequence score [B, num_labels] fp32 at the last valid token (HF *ForSequenceClassification)."""
    idx = last_valid_index(attention_mask)
    last = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
    return last.astype(jnp.float32) @ params["score"]["kernel"].astype(jnp.float32)
