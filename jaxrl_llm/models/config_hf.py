"""config.json <-> ModelConfig: the keyword arguments a transformers config.json gives (each family's keys,
multimodal folders read as their text model, RoPE in either transformers' form) and the config.json a ModelConfig
writes back; which keys `model.override_config` may change. Gemma 4's, Qwen3.5's and DeepSeek's own keys live in
models/config_gemma4.py, config_qwen35.py and config_deepseek.py. `cfg` is a ModelConfig, typed `Any` as in those:
models/config.py imports this module."""
from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config_deepseek import DEEPSEEK_FAMILIES, deepseek_fields, deepseek_hf_fields
from jaxrl_llm.models.config_gemma4 import gemma4_fields, gemma4_hf_fields
from jaxrl_llm.models.config_qwen35 import qwen35_fields, qwen35_hf_fields
from jaxrl_llm.models.families import (
    FAMILIES,
    GEMMA_FAMILIES,
    HIDDEN_ACTS,
    ORIGINAL_CONTEXT_ROPE_TYPES,
    QWEN35_FAMILIES,
    SUPPORTED_ARCHITECTURES,
    UnsupportedArchitectureError,
    arch_to_model_type,
)


def model_config_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's keyword arguments from a transformers config.json dict (`ModelConfig.from_hf_config`)."""
    d = _text_tower(d)
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if archs:
        arch = archs[0]
        arch_type = arch_to_model_type(arch)
        if model_type is not None and model_type != arch_type:
            raise ValueError(f"config.json: model_type {model_type!r} does not match {arch!r}")
        model_type = arch_type
    elif model_type in FAMILIES:
        arch = FAMILIES[model_type]["prefix"] + "ForCausalLM"
    else:
        raise UnsupportedArchitectureError(
            f"unsupported model_type {model_type!r} (no 'architectures' in config.json); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if model_type == "qwen3_5_moe_text":  # no dense MLP: every layer's is the experts'
        d = {**d, "intermediate_size": d.get("intermediate_size") or d.get("moe_intermediate_size")}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in d:
            raise ValueError(f"config.json is missing required key {key!r}")
    fam = FAMILIES[model_type]
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if act not in HIDDEN_ACTS or (act != "silu") != bool(fam.get("gemma")):
        raise ValueError(f"config.json: hidden_act {act!r} unsupported for {model_type} "
                         f"(only {'gelu_pytorch_tanh' if fam.get('gemma') else 'silu'})")
    if d.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=True is unsupported")
    quant = d.get("quantization_config") or {}
    if quant and (quant.get("quant_method") != "mxfp4" or model_type != "gpt_oss"):
        raise ValueError(f"config.json: quantization_config.quant_method={quant.get('quant_method')!r} is "
                         f"unsupported for {model_type} (only GPT-OSS's mxfp4 experts, dequantised on load)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=True (an encoder) is unsupported")
    # transformers 5 keeps theta and scaling in `rope_parameters`; older files use top-level keys.
    # Gemma 3 (transformers 5) keeps one entry per layer type
    rope = dict(d.get("rope_parameters") or {})
    local_theta = None
    if model_type == "gemma3_text":
        local = dict(rope.pop("sliding_attention", None) or {})
        rope = dict(rope.pop("full_attention", None) or rope)
        local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_parameters.sliding_attention.rope_type={local['rope_type']!r} "
                             "is unsupported (only 'default')")
    legacy = d.get("rope_scaling") or {}
    rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 1e6 if local_theta else 10000.0)))
    scaling = {**legacy, **rope}
    scaling.pop("rope_theta", None)  # a legacy rope_scaling written beside rope_parameters repeats it
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    # Qwen2.5-VL's / Qwen3-VL(-MoE)'s text model: Qwen2 / Qwen3 / Qwen3-MoE with M-RoPE (contiguous / interleaved)
    mrope = scaling.pop("mrope_section", None) if model_type in ("qwen2", "qwen3", "qwen3_moe") else None
    interleaved = bool(scaling.pop("mrope_interleaved", False)) if mrope else False
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    elif scaling["rope_type"] in ORIGINAL_CONTEXT_ROPE_TYPES:  # HF's default: the config's own context
        scaling.setdefault("original_max_position_embeddings",
                           d.get("original_max_position_embeddings") or d.get("max_position_embeddings", 2048))
    if scaling.get("rope_type") == "yarn" and scaling.get("factor") is None:  # DeepSeek's convention, as HF
        scaling["factor"] = d.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
    if model_type in QWEN35_FAMILIES:  # text positions: M-RoPE's three axes agree, so it is plain RoPE
        for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
            scaling.pop(key, None)
        if scaling.get("rope_type", "default") == "default":
            scaling = {}
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0 and model_type != "gemma4_text":
        raise ValueError(f"config.json: partial_rotary_factor={scaling['partial_rotary_factor']} is unsupported "
                         "(RoPE on every head dimension only)")
    if model_type in DEEPSEEK_FAMILIES:
        moe = deepseek_fields(d, model_type)
    else:
        moe = _moe_fields(d, model_type) if fam.get("moe") else {}
    if model_type == "gpt_oss":
        moe.update(_gpt_oss_fields(d))
    sliding_window, sliding_layers = _sliding_windows(d, model_type)
    gemma = _gemma_fields(d, act, local_theta) if fam.get("gemma") else {}
    if model_type in QWEN35_FAMILIES:
        gemma = qwen35_fields(d, model_type)
    if model_type == "gemma4_text":
        gemma = gemma4_fields(d, sliding_layers or ())
        rope_theta, scaling = gemma.pop("rope_theta"), dict(gemma.pop("rope_scaling") or ())
    heads = int(d["num_attention_heads"])
    shape = dict(num_key_value_heads=int(moe.pop("num_key_value_heads", None) or d.get("num_key_value_heads")
                                         or heads),
                 head_dim=int(moe.pop("head_dim", None) or d.get("head_dim") or d["hidden_size"] // heads))
    return dict(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=heads,
        **shape,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=tuple(sorted(scaling.items())) or None,
        mrope_section=tuple(int(x) for x in mrope) if mrope else None, mrope_interleaved=interleaved,
        bidirectional_image_tokens=int(d.get("bidirectional_image_tokens", 0)),
        experts_fused=bool(d.get("experts_fused", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", bool(fam.get("gemma")))),  # Gemma ties by default
        attention_bias=bool(d.get("qkv_bias" if model_type == "qwen2_moe" else "attention_bias",
                                  fam["attention_bias"])),
        qk_norm=fam["qk_norm"],
        sliding_window=sliding_window,
        sliding_layers=sliding_layers,
        bos_token_id=_token_ids(d.get("bos_token_id")),
        eos_token_id=_token_ids(d.get("eos_token_id")),
        pad_token_id=_first_token_id(d.get("pad_token_id")),
        initializer_range=float(d.get("initializer_range", 0.02)),
        **moe,
        **gemma,
    )


def hf_config_dict(cfg: Any, *, architecture: str | None = None, num_labels: int | None = None,
                   dtype: str = "float32") -> dict[str, Any]:
    """`cfg` as a config.json dict transformers 4.x and 5.x both read back to the same model
    (`ModelConfig.to_hf_config`)."""
    arch = architecture or cfg.architecture
    if arch_to_model_type(arch) != cfg.model_type:
        raise ValueError(f"architecture {arch!r} does not match model_type {cfg.model_type!r}")
    rope_params = {"rope_type": "default", **cfg.rope_scaling_dict, "rope_theta": cfg.rope_theta}
    if cfg.mrope_section:  # a Qwen2.5-VL / Qwen3-VL text model's (read back by `from_hf_config`)
        rope_params["mrope_section"] = list(cfg.mrope_section)
        if cfg.mrope_interleaved:
            rope_params["mrope_interleaved"] = True
    extra: dict[str, Any] = {"bidirectional_image_tokens": cfg.bidirectional_image_tokens} \
        if cfg.bidirectional_image_tokens else {}
    if cfg.experts_fused:
        extra["experts_fused"] = True
    d: dict[str, Any] = {
        **extra,
        "architectures": [arch],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_params,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": _json_ids(cfg.bos_token_id),
        "eos_token_id": _json_ids(cfg.eos_token_id),
        "pad_token_id": cfg.pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(rope_params)
    if cfg.model_type in ("llama", "qwen3", "qwen3_moe"):
        d["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "qwen2_moe":
        d["qkv_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        d["mlp_bias"] = False
    if cfg.model_type in ("mistral", "mixtral"):
        d["sliding_window"] = cfg.sliding_window
    if cfg.model_type == "gpt_oss":
        d.update(attention_bias=True, sliding_window=cfg.sliding_window, layer_types=cfg.layer_types,
                 swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
    if cfg.model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        d["sliding_window"] = cfg.sliding_window
        if cfg.sliding_window is not None and cfg.model_type != "qwen3_moe":
            d["layer_types"] = cfg.layer_types
            # transformers derives layer_types from it when a reader drops them: the first local layer
            d["max_window_layers"] = min(cfg.local_layer_ids, default=cfg.num_hidden_layers)
    if cfg.model_type == "gemma4_text":
        d.update(gemma4_hf_fields(cfg))
    elif cfg.model_type in GEMMA_FAMILIES:
        d.update(_hf_gemma_fields(cfg, rope_params))
    if cfg.model_type in QWEN35_FAMILIES:
        d.update(qwen35_hf_fields(cfg))
        d["rope_parameters"] = {**rope_params, "partial_rotary_factor": cfg.partial_rotary_factor}
    if cfg.model_type in DEEPSEEK_FAMILIES:
        d.update(deepseek_hf_fields(cfg))
    elif cfg.is_moe and not cfg.typed_layers:  # Gemma 4's: models/config_gemma4.py
        d.update(_hf_moe_fields(cfg))
    if num_labels is not None:
        d["num_labels"] = num_labels
        d["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        d["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    return d


def _hf_gemma_fields(cfg: Any, rope_params: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {
        "hidden_activation": cfg.hidden_act,
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar),  # transformers 5 wants an int
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping, "attention_bias": False,
        "sliding_window": cfg.sliding_window, "layer_types": cfg.layer_types}
    if cfg.model_type == "gemma3_text":
        local_theta = cfg.rope_local_theta or 10000.0
        d["rope_parameters"] = {"full_attention": rope_params,
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
        d["rope_local_base_freq"] = local_theta  # transformers 4
        if cfg.rope_scaling:
            d["rope_scaling"] = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    return d

def _hf_moe_fields(cfg: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"num_experts_per_tok": cfg.num_experts_per_tok,
                         "router_aux_loss_coef": cfg.router_aux_loss_coef,
                         "output_router_logits": cfg.output_router_logits}
    if cfg.model_type in ("mixtral", "gpt_oss"):  # their experts are `intermediate_size` wide
        d.update(num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_intermediate_size)
        return d
    d.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
             norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
             mlp_only_layers=list(cfg.mlp_only_layers))
    if cfg.model_type in ("qwen2_moe", "qwen3_5_moe_text"):
        d["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if cfg.model_type == "qwen3_5_moe_text":  # its router always renormalises; no dense layers
        for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            d.pop(key, None)
    return d


def _token_ids(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value) if len(value) != 1 else int(value[0])
    return int(value)


def _first_token_id(value: Any) -> int | None:
    """One token id (the first, when a config lists several)."""
    ids = _token_ids(value)
    if isinstance(ids, tuple):
        return ids[0] if ids else None
    return ids


# `model.override_config`: HF config.json fields an override may change (they reach ModelConfig
# without changing any parameter's shape) and fields it may not (architecture, shapes).
OVERRIDABLE_HF_KEYS = ("rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                       "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                       "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef", "output_router_logits",
                       "swiglu_limit", "swiglu_alpha")
FIXED_HF_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                 "attention_bias", "hidden_act", "mlp_bias", "use_sliding_window", "layer_types",
                 "num_experts", "num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "kv_lora_rank", "q_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                 "first_k_dense_replace", "n_group")


def classify_hf_overrides(keys: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(keys an override may not change, keys ModelConfig does not read) among `keys`."""
    rejected = [k for k in keys if k in FIXED_HF_KEYS]
    ignored = [k for k in keys if k not in FIXED_HF_KEYS and k not in OVERRIDABLE_HF_KEYS]
    return rejected, ignored


def _moe_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a MoE family's config.json."""
    # transformers 5 writes either name for either family (its attribute_map aliases them)
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    layout: dict[str, Any] = {}
    if model_type in ("mixtral", "gpt_oss"):
        width = int(d["intermediate_size"])
        norm_topk = model_type == "mixtral"  # Mixtral's router always renormalises its top-k (GPT-OSS: a softmax of
        # the top-k logits, `router_topk_softmax`)
    else:
        width = int(d.get("moe_intermediate_size") or 0)
        # Qwen3.5-MoE's router renormalises its top-k always (its config has no norm_topk_prob)
        norm_topk = model_type == "qwen3_5_moe_text" or bool(d.get("norm_topk_prob", False))
        if experts == 0:
            raise ValueError(f"config.json: num_experts=0 makes every layer a dense MLP in a {model_type} model; "
                             f"load it as its dense family")
        layout = dict(decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                      mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))
    if d.get("router_jitter_noise"):
        raise ValueError(f"config.json: router_jitter_noise={d['router_jitter_noise']} is unsupported "
                         "(it multiplies hidden states by training-time noise)")
    return dict(num_experts=experts, num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                moe_intermediate_size=width,
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0)
                if model_type in ("qwen2_moe", "qwen3_5_moe_text") else 0,
                norm_topk_prob=norm_topk, router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
                output_router_logits=bool(d.get("output_router_logits", False)), **layout)


def _gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a GPT-OSS config.json beyond the MoE ones."""
    if d.get("attention_bias") is False:
        raise ValueError("config.json: attention_bias=False is unsupported for gpt_oss (every released checkpoint "
                         "has q / k / v / o biases)")
    limit = d.get("swiglu_limit", 7.0)
    return dict(attention_sinks=True, o_proj_bias=True, expert_bias=True, router_topk_softmax=True,
                swiglu_limit=None if limit is None else float(limit), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))


# multimodal model types -> their text model's class prefix in transformers (`_text_tower`)
_MULTIMODAL = {"gemma3": "Gemma3", "gemma4": "Gemma4", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe",
               "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}


# Qwen vision-language model types -> (transformers' config class, their text model's family, interleaved M-RoPE)
_QWEN_VL = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "qwen2", False), "qwen3_vl": ("Qwen3VLConfig", "qwen3", True),
            "qwen3_vl_moe": ("Qwen3VLMoeConfig", "qwen3_moe", True)}


def _text_tower(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 / Gemma 4 / Qwen3.5 checkpoint's config.json (`Gemma3ForConditionalGeneration`,
    `Qwen3_5ForConditionalGeneration`, ...) read as its text model's, `Gemma3ForCausalLM` / `Qwen3_5ForCausalLM`
    (the language model is what RL trains; the vision tower is not loaded, hf/hf_folder.py maps its tensor names).
    Its `text_config` may list only what differs from transformers' defaults, so transformers fills in the rest;
    token ids come from the top level where it has them."""
    if d.get("model_type") in _QWEN_VL:  # Qwen2 / Qwen3 with M-RoPE (Qwen2.5-VL's releases: text keys on top)
        import transformers

        config_class, family, interleaved = _QWEN_VL[d["model_type"]]
        vl = getattr(transformers, config_class)(**{k: v for k, v in d.items()
                                                    if k not in ("model_type", "architectures")})
        text_config = vl.text_config
        assert text_config is not None
        out = dict(text_config) if isinstance(text_config, dict) else text_config.to_dict()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if d.get(key) is not None:
                out[key] = d[key]
        out.update(model_type=family, architectures=[FAMILIES[family]["prefix"] + "ForCausalLM"])
        if interleaved:  # Qwen3-VL's layout of the M-RoPE sections (its config does not say it: its code does)
            out["rope_parameters"] = {**(out.get("rope_parameters") or {}), "mrope_interleaved": True}
        if d["model_type"] == "qwen3_vl_moe":  # its router renormalises its top-k; each layer's experts in 2 tensors
            out.update(norm_topk_prob=True, experts_fused=True)
        return out
    if d.get("model_type") not in _MULTIMODAL or not isinstance(d.get("text_config"), dict):
        return d
    import transformers

    family = _MULTIMODAL[d["model_type"]]
    text = {k: v for k, v in d["text_config"].items() if k not in ("model_type", "architectures")}
    out = getattr(transformers, f"{family}TextConfig")(**text).to_dict()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if d.get(key) is not None:
            out[key] = d[key]
    out.update(model_type=f"{d['model_type']}_text", architectures=[f"{family}ForCausalLM"])
    if d["model_type"] == "gemma3":  # an image's tokens see each other (models/vision/siglip.py)
        out["bidirectional_image_tokens"] = int(d.get("mm_tokens_per_image", 256))
    if d["model_type"] == "gemma4" and out.get("use_bidirectional_attention") == "vision" and d.get("vision_config"):
        # on its sliding layers (models/model.py); an image holds at most 1120 tokens (the processor's largest budget)
        out["bidirectional_image_tokens"] = 1120
    if out.get("use_bidirectional_attention") == "vision":  # what it means is the line above's, not an encoder's
        out.pop("use_bidirectional_attention")
    return out


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


def _gemma_fields(d: dict[str, Any], act: str, local_theta: float | None) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2 / Gemma 3 config.json beyond the shared ones."""
    def optional(key: str) -> float | None:
        return None if d.get(key) is None else float(d[key])

    return dict(hidden_act=act, norm_offset=1.0, scale_embeddings=True, sandwich_norms=True,
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
                attn_logit_softcapping=optional("attn_logit_softcapping"),
                final_logit_softcapping=optional("final_logit_softcapping"),
                rope_local_theta=local_theta)


def _sliding_windows(d: dict[str, Any], model_type: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding_window, sliding_layers) of a config.json, as transformers reads it per family: Mistral /
    Mixtral window every layer; Qwen2 / Qwen3 only with `use_sliding_window`, on the layers `layer_types`
    marks "sliding_attention" (default: from `max_window_layers` on); Qwen3-MoE every layer."""
    layers = int(d["num_hidden_layers"])
    if model_type in GEMMA_FAMILIES:  # Gemma 2: every other layer from the first; Gemma 3: 5 of every 6
        pattern = 2 if model_type == "gemma2" else int(d.get("sliding_window_pattern", 6))
        types = d.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                         for i in range(layers)]
        if model_type == "gemma4_text":  # transformers makes the last layer a full one whatever the file says
            types = list(types)[:-1] + ["full_attention"]
        window = d.get("sliding_window")
        if window is None:
            return None, None
        return int(window), _sliding_layer_ids(types, layers)
    if model_type == "gpt_oss":  # every other layer from the first, unless layer_types says otherwise
        window = d.get("sliding_window", 128)
        if window is None:
            return None, None
        types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                         for i in range(layers)]
        return int(window), _sliding_layer_ids(types, layers)
    if model_type in ("mistral", "mixtral"):
        window = d.get("sliding_window")
        return (None if window is None else int(window)), None
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if window is None:
        return None, None
    if model_type == "qwen3_moe":
        return int(window), None
    if model_type == "qwen2_moe":
        raise ValueError("config.json: use_sliding_window is unsupported for qwen2_moe (its layer_types rule "
                         "differs from Qwen2's; no released checkpoint sets it)")
    types = d.get("layer_types")
    if types is None:
        first = int(d.get("max_window_layers", layers))
        return int(window), tuple(range(first, layers))
    return int(window), _sliding_layer_ids(types, layers)


def _sliding_layer_ids(types: list[str], layers: int) -> tuple[int, ...]:
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"config.json: layer_types={types!r} must list 'sliding_attention' or 'full_attention' "
                         f"for each of the {layers} layers")
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _json_ids(v: int | tuple[int, ...] | None) -> int | list[int] | None:
    return list(v) if isinstance(v, tuple) else v
