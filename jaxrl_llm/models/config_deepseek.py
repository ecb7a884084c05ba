"""DeepSeek-V3's config.json fields (`deepseek_v3`: DeepSeek-V3 / R1 / V3.1, Kimi-K2 and the other models of
its shape) as ModelConfig keyword arguments, and back. Kept apart from models/config_hf.py (which imports this
module) because DeepSeek names its shapes its own way: multi-head latent attention (`kv_lora_rank`,
`q_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; models/mla.py) and a router of its own
(`n_routed_experts`, `n_shared_experts`, `n_group`, `topk_group`, `routed_scaling_factor`,
`first_k_dense_replace`; models/moe.py `route`). The functions taking `cfg` take a ModelConfig (typed Any: that
module imports this one)."""
from __future__ import annotations

import math
from typing import Any

# the model types whose attention is multi-head latent attention and whose router is DeepSeek's
DEEPSEEK_FAMILIES = ("deepseek_v3", "deepseek_v2")


def deepseek_fields(d: dict[str, Any], model_type: str = "deepseek_v3") -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V3 (or V2: `model_type`) config.json beyond the shared ones (the head_dim
    is the rope part of a head, as transformers sets it; the attention's own shapes are the MLA fields)."""
    v2 = model_type == "deepseek_v2"
    method = d.get("topk_method") or ("greedy" if v2 else "noaux_tc")
    if method not in (("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)):
        raise ValueError(f"config.json: topk_method={method!r} is unsupported for {model_type}")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not d.get(key):
            raise ValueError(f"config.json: {model_type} needs a positive {key}")
    experts = int(d.get("n_routed_experts") or d.get("num_local_experts") or 0)
    if experts == 0:
        raise ValueError(f"config.json: n_routed_experts=0 leaves {model_type} without routed experts")
    limited = method != "greedy"
    groups = int(d.get("n_group") or 1) if limited else 1
    topk_group = int(d.get("topk_group") or groups) if limited else 1
    if experts % groups or not 0 < topk_group <= groups:
        raise ValueError(f"config.json: n_group={groups} must divide n_routed_experts={experts} and "
                         f"topk_group={topk_group} be in 1..n_group")
    if not v2 and experts // groups < 2:
        raise ValueError(f"config.json: n_group={groups} leaves fewer than 2 experts a group (a group is scored "
                         "by its best two)")
    layers = int(d["num_hidden_layers"])
    dense = int(d.get("first_k_dense_replace") or 0)
    if not 0 <= dense < layers:
        raise ValueError(f"config.json: first_k_dense_replace={dense} must be in 0..{layers - 1}")
    width = int(d.get("moe_intermediate_size") or 0)
    q_lora = d.get("q_lora_rank")
    return dict(
        head_dim=int(d["qk_rope_head_dim"]),
        num_key_value_heads=int(d["num_attention_heads"]),
        kv_lora_rank=int(d["kv_lora_rank"]), q_lora_rank=int(q_lora or 0),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
        rope_interleave=True if v2 else bool(d.get("rope_interleave", True)),  # V2 turns (even, odd) pairs
        num_experts=experts, num_experts_per_tok=int(d.get("num_experts_per_tok") or 8),
        moe_intermediate_size=width, shared_expert_intermediate_size=int(d.get("n_shared_experts") or 0) * width,
        # V2's router never renormalises (transformers ignores its norm_topk_prob)
        norm_topk_prob=False if v2 else bool(d.get("norm_topk_prob", True)), mlp_only_layers=tuple(range(dense)),
        router_sigmoid=not v2, router_group_max=v2 and limited, n_group=groups, topk_group=topk_group,
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        router_aux_loss_coef=float(d.get("router_aux_loss_coef") or 0.0),
        output_router_logits=bool(d.get("output_router_logits", False)))


def deepseek_hf_fields(cfg: Any) -> dict[str, Any]:
    """config.json fields of a DeepSeek-V3 ModelConfig beyond the shared ones (transformers 5 derives head_dim
    and qk_head_dim from them)."""
    return {
        "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.head_dim, "v_head_dim": cfg.v_head_dim,
        "attention_bias": cfg.attention_bias,
        "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_shared_experts": cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob, "first_k_dense_replace": len(cfg.mlp_only_layers),
        "n_group": cfg.n_group, "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
        "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": cfg.output_router_logits,
        "num_nextn_predict_layers": 0,
        **({"topk_method": "group_limited_greedy" if cfg.router_group_max else "greedy"}
           if cfg.model_type == "deepseek_v2" else {"rope_interleave": cfg.rope_interleave, "topk_method": "noaux_tc"}),
    }


def check_deepseek(cfg: Any) -> None:
    """The MLA and router fields' consistency (ModelConfig.__post_init__)."""
    if cfg.kv_lora_rank:
        if cfg.model_type not in DEEPSEEK_FAMILIES:
            raise ValueError(f"{cfg.model_type}: multi-head latent attention (kv_lora_rank) is DeepSeek's")
        if cfg.qk_nope_head_dim < 1 or cfg.v_head_dim < 1:
            raise ValueError("multi-head latent attention needs positive qk_nope_head_dim and v_head_dim")
        if cfg.num_key_value_heads != cfg.num_attention_heads:
            raise ValueError(f"multi-head latent attention: num_key_value_heads={cfg.num_key_value_heads} must equal "
                             f"num_attention_heads={cfg.num_attention_heads} (each head expands the latent its own "
                             "way)")
        if cfg.qk_norm or cfg.sliding_window is not None or cfg.attention_sinks:
            raise ValueError("multi-head latent attention has no QK-norm, sliding window or sinks")
    if (cfg.router_sigmoid or cfg.router_group_max) and (cfg.num_experts % cfg.n_group
                                                         or not 0 < cfg.topk_group <= cfg.n_group):
        raise ValueError(f"n_group={cfg.n_group} must divide num_experts={cfg.num_experts} and topk_group="
                         f"{cfg.topk_group} be in 1..n_group")


def mla_softmax_scale(cfg: Any) -> float:
    """The scale of an MLA score q . k: (qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2
    where the rope scaling has one (transformers' `yarn_apply_mscale`: DeepSeek scales the whole score, not
    just the rotary dims)."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    s = cfg.rope_scaling_dict
    if s.get("rope_type", "default") != "default" and s.get("mscale_all_dim"):
        factor = float(s["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale
