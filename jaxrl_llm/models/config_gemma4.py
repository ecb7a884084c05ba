"""Gemma 4's config.json fields (`gemma4_text`, and the text tower of `gemma4` multimodal folders) as
ModelConfig keyword arguments, and back. Kept apart from models/config_hf.py (which imports this module)
because Gemma 4 describes its layers per type: the full-attention layers have heads of their own width
and number (`global_head_dim` / `num_global_key_value_heads`, or transformers 5's `per_layer_config`),
and each layer type has its own `rope_parameters` entry (the full layers' "proportional" RoPE turns
only the first `partial_rotary_factor` of each head's dims)."""
from __future__ import annotations

from typing import Any

_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


def gemma4_fields(d: dict[str, Any], sliding: tuple[int, ...]) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 4 text config.json beyond the shared ones; `sliding`: its sliding layers."""
    layers = int(d["num_hidden_layers"])
    moe: dict[str, Any] = {}
    if d.get("enable_moe_block"):  # routed experts beside every layer's dense MLP (gemma-4-26B-A4B)
        missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not d.get(k)]
        if missing:
            raise ValueError(f"config.json: enable_moe_block=True needs {missing[0]}")
        moe = dict(num_experts=int(d["num_experts"]), num_experts_per_tok=int(d["top_k_experts"]),
                   moe_intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=True,
                   router_aux_loss_coef=float(d.get("router_aux_loss_coef") or 0.0))
    full = [i for i in range(layers) if i not in sliding]
    head_dim, kv_heads = _full_layer_shape(d, full)
    shared = int(d.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < layers:
        raise ValueError(f"config.json: num_kv_shared_layers={shared} must be in 0..{layers - 1} (a layer that "
                         "computes its own keys and values comes first)")
    first_shared = layers - shared
    producing = {("sliding" if i in sliding else "full") for i in range(first_shared)}
    consuming = {("sliding" if i in sliding else "full") for i in range(first_shared, layers)}
    if not consuming <= producing:
        raise ValueError(f"config.json: num_kv_shared_layers={shared} leaves no earlier "
                         f"{sorted(consuming - producing)[0]}-attention layer to take keys and values from")
    rope = dict(d.get("rope_parameters") or {})
    local = dict(rope.get("sliding_attention") or {})
    glob = dict(rope.get("full_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: rope_parameters.sliding_attention.rope_type={local['rope_type']!r} is "
                         "unsupported (only 'default')")
    kind = glob.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ValueError(f"config.json: rope_parameters.full_attention.rope_type={kind!r} is unsupported "
                         "(only 'proportional' and 'default')")
    factor = float(glob.get("factor", 1.0)) if kind == "proportional" else 1.0
    per_layer = int(d.get("hidden_size_per_layer_input") or 0)

    def optional(key: str) -> float | None:
        return None if d.get(key) is None else float(d[key])

    return dict(
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        scale_embeddings=True, sandwich_norms=True, norm_offset=0.0,
        query_pre_attn_scalar=1.0,  # Gemma 4 does not scale its (RMS-normed) queries' scores
        attn_logit_softcapping=None, final_logit_softcapping=optional("final_logit_softcapping"),
        rope_theta=float(glob.get("rope_theta", 1e6)), rope_local_theta=float(local.get("rope_theta", 1e4)),
        rope_scaling=(("factor", factor), ("rope_type", "linear")) if factor != 1.0 else None,
        rope_partial_factor=float(glob.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0,
        global_head_dim=head_dim, global_kv_heads=kv_heads, attention_k_eq_v=bool(d.get("attention_k_eq_v")),
        kv_shared_layers=shared, double_wide_mlp=bool(d.get("use_double_wide_mlp")) and shared > 0,
        per_layer_input_size=per_layer,
        per_layer_vocab_size=int(d.get("vocab_size_per_layer_input") or d["vocab_size"]) if per_layer else 0, **moe)


def _full_layer_shape(d: dict[str, Any], full: list[int]) -> tuple[int, int]:
    """(head_dim, kv heads) of the full-attention layers, as transformers reads them: `per_layer_config`
    (what transformers 5 writes), else `global_head_dim` (default 512) and, with attention_k_eq_v,
    `num_global_key_value_heads`."""
    heads = int(d["num_attention_heads"])
    kv = int(d.get("num_key_value_heads") or heads)
    per_layer = d.get("per_layer_config")
    if per_layer is None:
        global_kv = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v", True) else None
        return int(d.get("global_head_dim") or 512), int(global_kv or kv)
    overrides = {int(k): dict(v or {}) for k, v in per_layer.items()}
    for i, o in overrides.items():
        extra = sorted(set(o) - set(_PER_LAYER_KEYS))
        if extra:
            raise ValueError(f"config.json: per_layer_config[{i}].{extra[0]} is unsupported (only {_PER_LAYER_KEYS})")
        if i not in full and o:
            raise ValueError(f"config.json: per_layer_config[{i}] overrides a sliding-attention layer; only the "
                             "full-attention layers may differ")
    shapes = {(int(overrides.get(i, {}).get("head_dim", d.get("head_dim") or 0)),
               int(overrides.get(i, {}).get("num_key_value_heads", kv))) for i in full}
    if len(shapes) > 1:
        raise ValueError(f"config.json: per_layer_config gives the full-attention layers different shapes "
                         f"{sorted(shapes)}; one shape per layer type is supported")
    return shapes.pop() if shapes else (int(d.get("head_dim") or 0), kv)


def gemma4_hf_fields(cfg: Any) -> dict[str, Any]:
    """The Gemma 4 keys of a config.json transformers reads back to `cfg` (a ModelConfig)."""
    full_rope: dict[str, Any] = {"rope_type": "proportional", "partial_rotary_factor": cfg.rope_partial_factor,
                                 "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        full_rope["factor"] = float(cfg.rope_scaling_dict["factor"])
    return {
        "hidden_activation": cfg.hidden_act, "final_logit_softcapping": cfg.final_logit_softcapping,
        "attention_bias": False, "sliding_window": cfg.sliding_window, "layer_types": cfg.layer_types,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
                            "full_attention": full_rope},
        "global_head_dim": cfg.full_head_dim, "num_global_key_value_heads": cfg.full_kv_heads,
        # what transformers 5 writes and reads first (the global_* keys set the kv heads only with k_eq_v)
        "per_layer_config": {str(i): {"head_dim": cfg.full_head_dim, "num_key_value_heads": cfg.full_kv_heads}
                             for i in range(cfg.num_hidden_layers) if i not in cfg.local_layer_ids},
        "attention_k_eq_v": cfg.attention_k_eq_v, "num_kv_shared_layers": cfg.kv_shared_layers,
        "use_double_wide_mlp": cfg.double_wide_mlp, "hidden_size_per_layer_input": cfg.per_layer_input_size,
        "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size, "enable_moe_block": cfg.is_moe,
        **({"num_experts": cfg.num_experts, "top_k_experts": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size} if cfg.is_moe else {}),
    }
