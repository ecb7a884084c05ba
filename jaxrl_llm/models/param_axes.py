"""Each param's logical axis names (the sharding rules map them to mesh axes: jaxrl_llm/sharding/rules.py), by its
path in a model's params dict; the layout itself is models/param_init.py's."""
from __future__ import annotations

# one layer's routed-expert matrices [E, H, F] / [E, F, H] (the layer scan strips the leading "layers")
EXPERT_AXES = {"gate_proj": ("expert", "embed", "mlp"), "up_proj": ("expert", "embed", "mlp"),
               "down_proj": ("expert", "mlp", "embed")}
# their biases [E, F] / [E, H] (GPT-OSS)
EXPERT_BIAS_AXES = {"gate_proj": ("expert", "mlp"), "up_proj": ("expert", "mlp"), "down_proj": ("expert", "embed")}


def layer_axes(path: tuple[str, ...]) -> tuple:
    """The logical axes of the stacked layer param at `path` (its keys, the first "layers"); KeyError for a leaf
    the table does not name."""
    *mods, leaf = path
    if leaf == "layer_scalar":
        return ("layers",)
    if leaf in ("router_scale", "expert_scale", "score_bias", "dt_bias", "A_log"):  # Gemma 4's router scales,
        return ("layers", None)  # DeepSeek's bias, the delta net's per-head decay parameters
    mod = mods[-1]
    if mod in ("ple_gate", "ple_proj"):
        return ("layers", "embed", None) if mod == "ple_gate" else ("layers", None, "embed")
    if leaf == "sinks":
        return ("layers", "heads")
    if "experts" in mods:
        return ("layers", *(EXPERT_BIAS_AXES if leaf == "bias" else EXPERT_AXES)[mod])
    if mod in ("router", "shared_expert_gate"):
        return ("layers", None) if leaf == "bias" else ("layers", "embed", None)
    if mod.endswith("norm"):
        return ("layers", None)
    heads = "heads" if mod in ("q_proj", "o_proj", "q_b_proj", "kv_b_proj") else "kv_heads"
    table = {
        # Qwen3.5's gated delta net (models/hybrid.py): fused and per-head projections, not split but by embed
        ("in_proj_qkv", "kernel"): ("layers", "embed", None),
        ("in_proj_z", "kernel"): ("layers", "embed", None, None),
        ("in_proj_b", "kernel"): ("layers", "embed", None),
        ("in_proj_a", "kernel"): ("layers", "embed", None),
        ("conv1d", "kernel"): ("layers", None, None),
        ("out_proj", "kernel"): ("layers", None, None, "embed"),
        # MLA (models/mla.py): the bottlenecks' ranks are not split; the per-head expansions split by head
        ("q_a_proj", "kernel"): ("layers", "embed", None),
        ("q_a_proj", "bias"): ("layers", None),
        ("q_b_proj", "kernel"): ("layers", None, heads, "head_dim"),
        ("kv_a_proj_with_mqa", "kernel"): ("layers", "embed", None),
        ("kv_a_proj_with_mqa", "bias"): ("layers", None),
        ("kv_b_proj", "kernel"): ("layers", None, heads, "head_dim"),
        ("q_proj", "kernel"): ("layers", "embed", heads, "head_dim"),
        ("k_proj", "kernel"): ("layers", "embed", heads, "head_dim"),
        ("v_proj", "kernel"): ("layers", "embed", heads, "head_dim"),
        ("q_proj", "bias"): ("layers", heads, "head_dim"),
        ("k_proj", "bias"): ("layers", heads, "head_dim"),
        ("v_proj", "bias"): ("layers", heads, "head_dim"),
        ("o_proj", "kernel"): ("layers", "heads", "head_dim", "embed"),
        ("o_proj", "bias"): ("layers", "embed"),
        ("gate_proj", "kernel"): ("layers", "embed", "mlp"),
        ("up_proj", "kernel"): ("layers", "embed", "mlp"),
        ("down_proj", "kernel"): ("layers", "mlp", "embed"),
    }
    return table[(mod, leaf)]


TOP_AXES = {
    ("embedding",): ("vocab", "embed"),
    ("final_norm", "scale"): (None,),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("value_head", "kernel"): ("embed", None),
    ("value_head", "bias"): (None,),
    ("score", "kernel"): ("embed", None),
    ("ple_embedding",): ("vocab", None),
    ("ple_model_proj", "kernel"): ("embed", None),
    ("ple_proj_norm", "scale"): (None,),
}


def logical_axes_at(keys: tuple[str, ...]) -> tuple | None:
    """The logical axis names of the param at `keys` (its path in a model's params dict), or None for a leaf the
    tables do not name (an adapter's, a head's of another kind)."""
    try:
        return layer_axes(keys) if keys and keys[0] == "layers" else TOP_AXES[keys]
    except (KeyError, IndexError):
        return None


def axes_at(keys: tuple[str, ...]) -> tuple:
    """`logical_axes_at`, raising KeyError for a leaf the tables do not name."""
    return layer_axes(keys) if keys[0] == "layers" else TOP_AXES[keys]
