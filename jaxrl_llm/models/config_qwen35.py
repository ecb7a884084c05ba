"""Qwen3.5's config.json fields (`qwen3_5_text`, `qwen3_5_moe_text`, and the text model of `qwen3_5` multimodal
folders) as ModelConfig keyword arguments, and back. Kept apart from models/config_hf.py (which imports this module)
because Qwen3.5 interleaves two kinds of layers: gated delta-net linear attention (`linear_*` fields;
models/hybrid.py) and gated full attention (an output gate from a q_proj twice as wide, RoPE on the first
`partial_rotary_factor` of each head's dims), listed per layer in `layer_types`. The functions taking `cfg` take a
ModelConfig (typed Any: that module imports this one)."""
from __future__ import annotations

from typing import Any

_LINEAR = ("linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
           "linear_conv_kernel_dim")


def qwen35_fields(d: dict[str, Any], model_type: str = "qwen3_5_text") -> dict[str, Any]:
    """ModelConfig fields of a Qwen3.5 (or Qwen3.5-MoE) text config.json beyond the shared (and MoE) ones."""
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types") or ["linear_attention" if (i + 1) % int(d.get("full_attention_interval", 4))
                                     else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("linear_attention", "full_attention") for t in types):
        raise ValueError(f"config.json: layer_types={types!r} must list 'linear_attention' or 'full_attention' for "
                         f"each of the {layers} layers")
    missing = [k for k in _LINEAR if not d.get(k)]
    if missing:
        raise ValueError(f"config.json: {model_type} needs a positive {missing[0]}")
    if int(d["linear_num_value_heads"]) % int(d["linear_num_key_heads"]):
        raise ValueError(f"config.json: linear_num_value_heads={d['linear_num_value_heads']} must be a multiple of "
                         f"linear_num_key_heads={d['linear_num_key_heads']}")
    rope = dict(d.get("rope_parameters") or {})
    return dict(linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                linear_key_heads=int(d["linear_num_key_heads"]), linear_value_heads=int(d["linear_num_value_heads"]),
                linear_key_head_dim=int(d["linear_key_head_dim"]),
                linear_value_head_dim=int(d["linear_value_head_dim"]),
                linear_conv_kernel=int(d["linear_conv_kernel_dim"]),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
                attention_output_gate=True, norm_offset=1.0)


def qwen35_hf_fields(cfg: Any) -> dict[str, Any]:
    """config.json fields of a Qwen3.5 ModelConfig beyond the shared ones."""
    return {"layer_types": ["linear_attention" if i in cfg.linear_layers else "full_attention"
                            for i in range(cfg.num_hidden_layers)],
            "linear_num_key_heads": cfg.linear_key_heads, "linear_num_value_heads": cfg.linear_value_heads,
            "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_conv_kernel_dim": cfg.linear_conv_kernel, "attention_bias": cfg.attention_bias,
            "partial_rotary_factor": cfg.partial_rotary_factor}


def check_qwen35(cfg: Any) -> None:
    """The hybrid fields' consistency (ModelConfig.__post_init__)."""
    if not cfg.linear_layers:
        return
    if cfg.model_type not in ("qwen3_5_text", "qwen3_5_moe_text"):
        raise ValueError(f"{cfg.model_type}: gated delta-net layers (linear_layers) are Qwen3.5's")
    if any(not 0 <= i < cfg.num_hidden_layers for i in cfg.linear_layers):
        raise ValueError(f"linear_layers={list(cfg.linear_layers)}: layers are 0..{cfg.num_hidden_layers - 1}")
    if cfg.linear_value_heads % cfg.linear_key_heads:
        raise ValueError(f"linear_value_heads={cfg.linear_value_heads} must be a multiple of linear_key_heads="
                         f"{cfg.linear_key_heads}")
    if cfg.is_moe and cfg.mixed_layers:  # every Qwen3.5-MoE layer is sparse; the hybrid scan assumes it
        raise ValueError(f"{cfg.model_type}: dense MLP layers between the sparse ones (mlp_only_layers="
                         f"{list(cfg.mlp_only_layers)}, decoder_sparse_step={cfg.decoder_sparse_step}) are unsupported")
    if cfg.sliding_window is not None:
        raise ValueError(f"{cfg.model_type} has no sliding window")
