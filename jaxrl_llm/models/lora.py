"""LoRA adapters on the decoder's linear projections (veRL's `model.lora_rank / lora_alpha /
target_modules`, PEFT's semantics).

A targeted projection computes `x @ W + scale * (x @ A) @ B` with `scale = alpha / rank`, inside
the layer: the full weights are never merged, held or copied for training or sampling. Adapters
are a plain nested dict stacked on the layer axis like the base params (models/model.py):

    layers/attn/{q,k,v}_proj/{A [L, H, r], B [L, r, heads|kv_heads, D]}
    layers/attn/o_proj/{A [L, heads, D, r], B [L, r, H]}
    (multi-head latent attention: q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)
    layers/mlp/{gate,up}_proj/{A [L, H, r], B [L, r, F]}   layers/mlp/down_proj/{A [L, F, r], B [L, r, H]}

Mixture-of-experts models: the attention projections, and Qwen2-MoE's shared expert under
`layers/shared_expert/{gate,up,down}_proj` (its params: layers/moe/shared_expert). The routed experts and
the router get no adapters, so 'all-linear' means the attention (and shared-expert) projections there;
naming gate/up/down_proj for a model without a shared expert is an error. A model with dense MLP layers
between the sparse ones (`decoder_sparse_step`, `mlp_only_layers`) also has `layers/mlp` adapters on its
dense layers; each group is stacked over the layers its params are (`group_layer_ids`).

Qwen3.5 (models/hybrid.py): the gated attention's q / k / v / o_proj under `layers/attn` (stacked over the
full-attention layers; q_proj's adapter covers query and gate), the gated delta net's in_proj_qkv / in_proj_z /
in_proj_b / in_proj_a / out_proj under `layers/linear` (over the delta-net layers), the MLPs (or Qwen3.5-MoE's
shared expert) over every layer. 'all-linear' names them all, as PEFT's does (every nn.Linear but the head).

`A` is initialised as PEFT's default (kaiming-uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in))) and `B` at
zero, so step 0 is exactly the base model. A forward pass sees the adapters when the params dict
carries them under "lora" (`with_lora`); the base dict without that entry is the model with the
adapters off (the reference policy of a LoRA run: no copy of the weights).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.param_init import hybrid_layer_ids, init_backbone, param_logical_axes, typed_layer_ids
from jaxrl_llm.models.vision.tower_lora import merged_tower

Array = jax.Array
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# multi-head latent attention's projections beyond q_proj / o_proj (DeepSeek-V3; models/mla.py), as HF names them
MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# the gated delta net's projections (Qwen3.5; models/hybrid.py), as HF names them
DELTA_NET_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTN_MODULES + MLA_MODULES + DELTA_NET_MODULES + MLP_MODULES
# the projections only some architectures have (a config naming them targets nothing in the others)
ARCH_MODULES = MLA_MODULES + DELTA_NET_MODULES
# kernel dims (after the layer axis) that are the projection's input: o_proj / out_proj read (heads, head_dim)
_IN_DIMS = {"o_proj": 2, "out_proj": 2}


# adapter group -> the path of its projections under params["layers"]
GROUP_PATHS = {"attn": ("attn",), "mlp": ("mlp",), "shared_expert": ("moe", "shared_expert"),
               # Gemma 4's per-kind stacks (models/param_init.py `typed_layer_ids`)
               "attn_full": ("attn_full",), "kv": ("kv",), "kv_full": ("kv_full",), "mlp_wide": ("mlp_wide",),
               "linear": ("linear",)}  # Qwen3.5's delta-net stack (its attention: the "attn" stack of its layers)


def module_groups(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """{projection: the adapter groups holding it} for the projections LoRA can target in this model (a
    mixed-layer Qwen2-MoE's gate_proj is in its dense MLPs and in its shared experts)."""
    if cfg.typed_layers:  # Gemma 4: each projection in the stacks of the layer kinds that have it
        kinds = typed_layer_ids(cfg)
        holders = {"q_proj": ("attn", "attn_full"), "o_proj": ("attn", "attn_full"), "k_proj": ("kv", "kv_full"),
                   "v_proj": ("kv",) + (() if cfg.attention_k_eq_v else ("kv_full",)),
                   **{m: ("mlp", "mlp_wide") for m in MLP_MODULES}}
        return {m: tuple(g for g in groups if g in kinds) for m, groups in holders.items()
                if any(g in kinds for g in groups)}
    if cfg.hybrid:  # Qwen3.5: each mixer's projections in the stack of its layer kind
        kinds = hybrid_layer_ids(cfg)
        groups: dict[str, tuple[str, ...]] = {
            **{m: ("attn",) for m in ATTN_MODULES if "attn" in kinds},
            **{m: ("linear",) for m in DELTA_NET_MODULES if "linear" in kinds}}
    elif cfg.is_mla:  # the latent attention's own projections (q_proj only without a q bottleneck)
        attn = ("q_a_proj", "q_b_proj") if cfg.q_lora_rank else ("q_proj",)
        groups = {m: ("attn",) for m in (*attn, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
    else:
        groups = {m: ("attn",) for m in ATTN_MODULES}
    mlp = (("mlp",) if cfg.dense_layer_ids else ()) + (
        ("shared_expert",) if cfg.is_moe and cfg.shared_expert_intermediate_size else ())
    if mlp:
        groups.update({m: mlp for m in MLP_MODULES})
    return groups


def group_layer_ids(cfg: ModelConfig, group: str) -> tuple[int, ...]:
    """The layers an adapter group is stacked over (as its params: a mixed-layer model's dense MLPs and
    experts are stacked over their own layers, models/param_init.py)."""
    if cfg.typed_layers:
        return typed_layer_ids(cfg)[group]
    if cfg.hybrid and group in ("attn", "linear"):
        return hybrid_layer_ids(cfg)[group]
    if group == "mlp":
        return cfg.dense_layer_ids
    if group == "shared_expert":
        return cfg.moe_layer_ids
    return tuple(range(cfg.num_hidden_layers))


def _slots(cfg: ModelConfig, targets: Sequence[str]) -> list[tuple[str, str]]:
    """(group, projection) of every adapter for `targets`, in a fixed order."""
    return [(g, m) for m, groups in module_groups(cfg).items() if m in targets for g in groups]


def _get(tree: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        tree = tree[key]
    return tree


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank > 0, alpha, and the targeted projections (a subset of ALL_LINEAR, in that order)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_LINEAR
    dropout: float = 0.0  # PEFT's lora_dropout: on the adapters' input, in the update's forward only

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"LoraConfig.rank={self.rank}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout={self.dropout}: must be in [0, 1)")
        object.__setattr__(self, "targets", parse_target_modules(self.targets))

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)


def parse_target_modules(value: str | Sequence[str], key: str = "target_modules") -> tuple[str, ...]:
    """'all-linear' (q, k, v, o, gate, up, down projections, MLA's q_a / q_b / kv_a_proj_with_mqa / kv_b and the
    delta net's in_proj_qkv / z / b / a and out_proj)
    or a list / comma-separated string of those names; raises ValueError naming `key` on an unknown one."""
    names = [value] if isinstance(value, str) else list(value)
    names = [n.strip() for item in names for n in str(item).split(",") if n.strip()]
    if "all-linear" in names:
        return ALL_LINEAR
    bad = [n for n in names if n not in ALL_LINEAR]
    if bad or not names:
        raise ValueError(f"{key}={value!r}: unknown module name(s) {bad or '(none given)'}; valid: "
                         f"'all-linear' or a list of {', '.join(ALL_LINEAR)}")
    return tuple(n for n in ALL_LINEAR if n in names)


@flax.struct.dataclass
class LoraAdapters:
    """Adapters attached to a params dict (`params["lora"]`): the arrays are pytree leaves, the scale
    is static (part of the tree structure, so a jitted function specialises on it)."""

    weights: dict
    scale: float = flax.struct.field(pytree_node=False)


def with_lora(base: dict, adapters: dict, scale: float, dropout: float = 0.0, rng: Array | None = None) -> dict:
    """The params dict of base + adapters (`adapters` as `init_lora` returns them). With `dropout` > 0 and
    `rng` (the update's forward), each adapter drops its input's elements with probability `dropout` and
    scales the rest by 1 / (1 - dropout), PEFT's `lora_dropout`: a mask of its own per projection, layer,
    token and feature; the base projection sees the whole input."""
    if dropout > 0.0 and rng is not None:
        adapters = _with_dropout_keys(adapters, 1.0 - dropout, rng)
    return {**base, "lora": LoraAdapters(adapters, float(scale))}


def _with_dropout_keys(tree: dict, keep: float, rng: Array, counter: list[int] | None = None) -> dict:
    """Each adapter {A, B} of `tree` with a dropout key per layer and the keep probability beside it
    (stacked on its layer axis, so the layer scan hands each layer its own)."""
    counter = [0] if counter is None else counter
    if "A" in tree and "B" in tree:
        layers = tree["A"].shape[0]
        counter[0] += 1
        keys = jax.random.split(jax.random.fold_in(rng, counter[0]), layers)
        return {**tree, "dropout_key": keys, "dropout_keep": jnp.full((layers,), keep, jnp.float32)}
    return {k: _with_dropout_keys(v, keep, rng, counter) if isinstance(v, dict) else v for k, v in sorted(tree.items())}


def split_lora(params: dict) -> tuple[dict, LoraAdapters | None]:
    """(base params without adapters, the adapters or None)."""
    base = {k: v for k, v in params.items() if k != "lora"}
    return base, params.get("lora")


Shape = tuple[int, ...]


def adapter_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[tuple[str, str], tuple[Shape, Shape]]:
    """{(group, module): (A shape, B shape)} for the targeted modules ('all-linear': those this model has)."""
    missing = [m for m in lora.targets if m not in module_groups(cfg)]
    if missing and lora.targets != ALL_LINEAR:
        raise ValueError(f"target_modules: {', '.join(missing)} not in {cfg.architecture} (it has "
                         f"{', '.join(module_groups(cfg))}): a mixture-of-experts model's routed experts get no LoRA "
                         "adapters (only the attention and a shared expert's projections do; docs/moe.md)")
    shapes = jax.eval_shape(lambda: init_backbone(cfg, jax.random.key(0)))["layers"]
    out = {}
    for g, m in _slots(cfg, lora.targets):
        shape = _get(shapes, GROUP_PATHS[g])[m]["kernel"].shape
        n_in = _IN_DIMS.get(m, 1)
        layers, ins, outs = shape[0], shape[1:1 + n_in], shape[1 + n_in:]
        out[(g, m)] = ((layers, *ins, lora.rank), (layers, lora.rank, *outs))
    return out


def init_lora(cfg: ModelConfig, lora: LoraConfig, rng: Array, dtype: DType = jnp.float32) -> dict:
    """Fresh adapters: A ~ U(+-1/sqrt(fan_in)) (PEFT's kaiming_uniform(a=sqrt(5))), B = 0."""
    adapters: dict = {"layers": {}}
    for i, ((g, m), (a_shape, b_shape)) in enumerate(adapter_shapes(cfg, lora).items()):
        bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
        a = jax.random.uniform(jax.random.fold_in(rng, i), a_shape, dtype, -bound, bound)
        adapters["layers"].setdefault(g, {})[m] = {"A": a, "B": jnp.zeros(b_shape, dtype)}
    return adapters


def lora_logical_axes(cfg: ModelConfig, lora: LoraConfig) -> dict:
    """Logical axes of the adapters: A like its kernel's input dims, B like its output dims (the
    rank dim is replicated). Leaves are tuples, as `param_logical_axes`."""
    kernel_axes = param_logical_axes(cfg)["layers"]
    out: dict = {"layers": {}}
    for g, m in adapter_shapes(cfg, lora):
        axes = _get(kernel_axes, GROUP_PATHS[g])[m]["kernel"]
        n_in = _IN_DIMS.get(m, 1)
        out["layers"].setdefault(g, {})[m] = {
            "A": (axes[0], *axes[1:1 + n_in], None), "B": (axes[0], None, *axes[1 + n_in:])}
    return out


def lora_delta(x: Array, adapter: dict | None, scale: float, compute_dtype: DType) -> Array | None:
    """scale * (x @ A) @ B for one layer's adapter {A [in..., r], B [r, out...]} (None: no adapter)."""
    if adapter is None:
        return None
    if "dropout_key" in adapter:  # the update's forward under lora_dropout (`with_lora`)
        keep = adapter["dropout_keep"]
        kept = jax.random.bernoulli(adapter["dropout_key"], keep, x.shape)
        x = jnp.where(kept, x / keep.astype(x.dtype), jnp.zeros((), x.dtype))
    a, b = adapter["A"].astype(compute_dtype), adapter["B"].astype(compute_dtype)
    n_in = a.ndim - 1
    u = jnp.tensordot(x.astype(compute_dtype), a, axes=(tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))))
    return (jnp.tensordot(u, b, axes=1) * jnp.asarray(scale, compute_dtype)).astype(compute_dtype)


def merge_lora(params: dict) -> dict:
    """The plain params dict with every targeted kernel replaced by W + scale * A @ B (in fp32, then
    the kernel's dtype), for export; params without adapters are returned as they are."""
    base, adapters = split_lora(params)
    if adapters is None:
        return params
    layers = jax.tree.map(lambda x: x, base["layers"])  # a fresh dict tree over the same arrays
    for g, mods in adapters.weights["layers"].items():
        projections = _get(layers, GROUP_PATHS[g])
        for m, ad in mods.items():
            kernel = projections[m]["kernel"]
            a = jnp.asarray(ad["A"], jnp.float32)
            b = jnp.asarray(ad["B"], jnp.float32)
            delta = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                               b.reshape(b.shape[0], b.shape[1], -1)).reshape(kernel.shape)
            merged = (jnp.asarray(kernel, jnp.float32) + adapters.scale * delta).astype(kernel.dtype)
            projections[m] = {**projections[m], "kernel": merged}
    out = {**base, "layers": layers}
    tower = adapters.weights.get("vision")  # LoRA on a vision tower (models/vision/tower_lora.py), where it is here
    if tower is not None and "vision" in base:
        out["vision"] = merged_tower(base["vision"], tower, adapters.scale)
    return out
