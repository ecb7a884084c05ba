"""The models a run trains or reads, placed on the mesh: policy (actor + its sampler), reference,
critic. Each trained role carries its params, optimizer, optimizer state and its update, which is
jitted here and nowhere else (one compiled program per (mini-batches, micro-batches) split).

The sampler reads `policy.model_params` directly: the arrays the optimizer updates are the arrays
the next rollout generates with (no weight sync, no copy). With LoRA (`model.lora_rank > 0`) the
trained params are `{"lora": adapters}` (so is the optimizer state) and the base is `frozen`: it is
passed to the jitted update as its own argument (not differentiated, not donated), and
`model_params` is the base with the adapters attached (models/lora.py `with_lora`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from jaxrl_llm import checkpoint as ckpt
from jaxrl_llm.arrays import ArrayTree, DType, ShardingTree
from jaxrl_llm.batching.batch_plan import RoleBatch
from jaxrl_llm.config import ConfigError
from jaxrl_llm.config.spec import ActorSpec, CriticSpec, ModelSpec, OptimSpec
from jaxrl_llm.hf import load_any, read_hf_config  # the HF bridge reads folders and GGUF files
from jaxrl_llm.hf.gguf_load import gguf_config, open_gguf
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig, init_params, param_logical_axes
from jaxrl_llm.models.config import with_hf_overrides
from jaxrl_llm.models.lora import LoraConfig, init_lora, lora_logical_axes, with_lora
from jaxrl_llm.models.remat import warn_once
from jaxrl_llm.models.vision.tower_lora import init_tower_lora
from jaxrl_llm.rewards.spec import JudgeSpec
from jaxrl_llm.roles.forward import compute_dtype_of
from jaxrl_llm.roles.optim import make_optimizer
from jaxrl_llm.roles.reference import offload_supported, reference_on_device, to_host
from jaxrl_llm.rollout.weights import PolicyWeights
from jaxrl_llm.sampler.engine.setup import EngineOptions
from jaxrl_llm.sharding import logical_to_sharding, optimizer_state_sharding

if TYPE_CHECKING:
    from jaxrl_llm.roles.judge import Judge

log = logging.getLogger("jaxrl_llm")
TINY_PREFIX = "tiny:"
# update_fn(params, opt_state, batch, rng, lr, packing, *, tx, num_mini_batches, num_micro_batches, rows_sharding)
UpdateFn = Callable[..., tuple[Any, Any, dict[str, jax.Array]]]


@dataclasses.dataclass
class TrainedRole:
    """A model the run trains, with everything its update reads: its model spec (packing), loss
    settings (epochs, shuffle; also bound into `update_fn`), batch split and LR-step offset."""

    name: str  # "actor" | "critic": the metric prefix
    model_cfg: ModelConfig
    params: dict
    tx: optax.GradientTransformation
    schedule: Callable[[Any], jax.Array]  # LR of the role's RL-step count (roles/optim.py)
    opt_state: ArrayTree
    param_shardings: ShardingTree
    opt_state_shardings: ShardingTree
    update_fn: UpdateFn  # `update_actor` / `update_critic` with model_cfg and settings bound
    model: ModelSpec  # the role's model spec (packing: use_remove_padding, share_packed_prompts)
    settings: ActorSpec | CriticSpec  # its loss settings (ppo_epochs, shuffle, ...)
    batch: RoleBatch  # its mini- / micro-batch split (batching/batch_plan.py)
    frozen: dict | None = None  # LoRA: the frozen base params (then `params` is {"lora": adapters})
    lora: LoraConfig | None = None
    lr_offset: int = 0  # RL steps before its first update (the actor: trainer.critic_warmup)
    # optim.offload: `opt_state` lives in pinned host memory between updates (`make_trained_role`)
    offload_optimizer: bool = False
    _compiled: dict[tuple[int, int], Callable] = dataclasses.field(default_factory=dict)

    @property
    def model_params(self) -> dict:
        """The params a forward pass / the sampler reads: `params`, or the base with the adapters."""
        if self.frozen is None:
            return self.params
        return with_lora(self.frozen, self.params["lora"], self.lora_scale)

    def weights(self) -> PolicyWeights:
        """What rollouts read of this role (jaxrl_llm/rollout/weights.py): always its arrays of now."""
        if self.frozen is None:
            return PolicyWeights(sampling=lambda: self.params, donated=lambda: self.params, rebuild=lambda copy: copy)
        frozen, scale = self.frozen, self.lora_scale
        return PolicyWeights(sampling=lambda: self.model_params, donated=lambda: self.params["lora"],
                             rebuild=lambda adapters: with_lora(frozen, adapters, scale))

    @property
    def lora_scale(self) -> float:
        """alpha / rank of the adapters (0 without LoRA)."""
        return self.lora.scale if self.lora is not None else 0.0

    @property
    def num_params(self) -> int:
        """Parameters of the model (the base's plus the adapters' with LoRA)."""
        return sum(int(x.size) for x in jax.tree.leaves(self.model_params))

    @property
    def compiled_updates(self) -> dict[tuple[int, int], Callable]:
        """The jitted update per (mini-batches, micro-batches) split compiled so far."""
        return dict(self._compiled)

    @property
    def num_trainable_params(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.params))

    def update(self, batch: Any, rng: jax.Array, *, lr_step: int, num_mini_batches: int, num_micro_batches: int,
               rows_sharding: Sharding | None, packing: Any = None) -> dict[str, jax.Array]:
        """Runs the role's update over `batch` in place; returns its (device) metrics.

        lr_step: how many RL steps this role has been updated before (veRL steps its LR scheduler
        once per update call); every optimizer update of this call uses `schedule(lr_step)`,
        which the metrics report as `<name>/lr`. packing: a `batching.UpdateLayout` to run
        packed (its shapes are bucketed, so the jitted update compiles once per bucket)."""
        key = (num_mini_batches, num_micro_batches)
        if key not in self._compiled:
            self._compiled[key] = jit_update(self.update_fn, self.tx, self.param_shardings, self.opt_state_shardings,
                                             num_mini_batches=num_mini_batches, num_micro_batches=num_micro_batches,
                                             rows_sharding=rows_sharding)
        # a host scalar: traced by the jitted update (no recompile per value), valid on every process
        lr = np.float32(self.schedule(max(int(lr_step), 0)))
        frozen = () if self.frozen is None else (self.frozen,)  # never donated: it is not updated
        # an offloaded optimizer state comes to the device for the update only (the device copy is donated)
        opt_state = reference_on_device(self.opt_state)
        self.params, opt_state, metrics = self._compiled[key](self.params, opt_state, batch, rng, lr, packing, *frozen)
        self.opt_state = to_host(opt_state) if self.offload_optimizer else opt_state
        return metrics


def jit_update(update_fn: UpdateFn, tx: optax.GradientTransformation, param_shardings: ShardingTree,
               opt_state_shardings: ShardingTree, *, num_mini_batches: int, num_micro_batches: int,
               rows_sharding: Any) -> Callable:
    """The jitted update of one (mini-batches, micro-batches) split: the program `TrainedRole.update`
    runs, and the one the memory plan (planning/memory.py) lowers ahead of time.
    Outputs keep the params' / optimizer state's own shardings, so the next rollout and update see
    the same layouts and reuse their compiled programs."""
    return jax.jit(functools.partial(update_fn, tx=tx, num_mini_batches=num_mini_batches,
                                     num_micro_batches=num_micro_batches, rows_sharding=rows_sharding),
                   out_shardings=(param_shardings, opt_state_shardings, None), donate_argnums=(0, 1))


def param_shardings_of(model_cfg: ModelConfig, head: str, mesh: Mesh,
                       dtype: DType) -> tuple[ArrayTree, ShardingTree]:
    """(abstract params, their shardings) of a model as `load_model` places it, without weights."""
    abstract = jax.eval_shape(lambda: init_params(model_cfg, jax.random.PRNGKey(0), head=head, dtype=dtype))
    return abstract, logical_to_sharding(param_logical_axes(model_cfg, head=head), abstract, mesh)


def _param_shardings(model_cfg: ModelConfig, head: str, mesh: Mesh, dtype: DType) -> ShardingTree:
    return param_shardings_of(model_cfg, head, mesh, dtype)[1]


def load_model(model: ModelSpec, *, head: str, mesh: Mesh, tokenizer: Tokenizer, seed: int) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params placed on the mesh) for `model.path`: an HF folder, a .gguf file, our
    checkpoint, or `tiny:<family>` (a random model with the dims in `model.tiny`, for tests), with
    `model.override_config`'s HF config fields replaced (they never change a parameter's shape)."""
    model_cfg, params = _load(model, head=head, mesh=mesh, tokenizer=tokenizer, seed=seed)
    return _as_configured(model_cfg, model), params


def _as_configured(model_cfg: ModelConfig, model: ModelSpec) -> ModelConfig:
    """`model_cfg` with `model.override_config`'s HF fields and the run's compute choices
    (mesh.context_attention, model.batch_invariant)."""
    cfg = with_hf_overrides(model_cfg, dict(model.override_config))
    if (cfg.context_attention, cfg.batch_invariant) == (model.context_attention, model.batch_invariant):
        return cfg
    return dataclasses.replace(cfg, context_attention=model.context_attention, batch_invariant=model.batch_invariant)


def _load(model: ModelSpec, *, head: str, mesh: Mesh, tokenizer: Tokenizer, seed: int) -> tuple[ModelConfig, dict]:
    dtype = compute_dtype_of(model.param_dtype)
    if model.is_tiny:
        model_cfg = _tiny_config(model, tokenizer)
        shardings = _param_shardings(model_cfg, head, mesh, dtype)
        init = jax.jit(lambda key: init_params(model_cfg, key, head=head, dtype=dtype), out_shardings=shardings)
        return model_cfg, init(jax.random.PRNGKey(dict(model.tiny)["seed"]))
    ckpt.register_checkpoint_loader()  # a policy may also start from one of our checkpoints

    # A value head on a causal-LM checkpoint is initialised fresh from `seed`.
    model_cfg, params = load_any(model.path, dtype=dtype, head=head, rng=jax.random.PRNGKey(seed))
    return model_cfg, jax.device_put(params, _param_shardings(model_cfg, head, mesh, dtype))


def _tiny_config(model: ModelSpec, tokenizer: Tokenizer) -> ModelConfig:
    tiny = dict(model.tiny)
    tiny.pop("seed")
    family = model.path[len(TINY_PREFIX):]
    mrope = None
    if family == "qwen2_5_vl":  # the text model of a tiny Qwen2.5-VL: Qwen2 with M-RoPE (roles/vision.py)
        from jaxrl_llm.roles.vision import tiny_mrope_section

        family = "qwen2"
        mrope = tiny_mrope_section(tiny["head_dim"] or tiny["hidden_size"] // tiny["num_attention_heads"])
    # unset: the family's tiny default (validate.py refuses the MoE keys on dense models)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "tie_word_embeddings"):
        if tiny.get(key) is None:
            tiny.pop(key, None)
    if tiny.get("vocab_size") is None:
        tiny["vocab_size"] = len(tokenizer)
    if tiny.get("head_dim") is None:
        tiny["head_dim"] = tiny["hidden_size"] // tiny["num_attention_heads"]
    special: dict[str, Any] = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                   else tokenizer.eos_token_id)
    if mrope is not None:
        special["mrope_section"] = mrope
    return ModelConfig.tiny(family, **{**tiny, **special})


def model_config_of(model: ModelSpec, tokenizer: Tokenizer) -> ModelConfig:
    """The `ModelConfig` `load_model` would return, read without loading any weight: the tiny dims,
    an HF folder's config.json, a GGUF file's header (tensor table only) or a checkpoint's meta."""
    if model.is_tiny:
        cfg = _tiny_config(model, tokenizer)
    elif model.path.endswith(".gguf"):
        cfg = gguf_config(open_gguf(model.path))  # memory-mapped: no tensor data is read
    elif ckpt.is_checkpoint(model.path):
        cfg = ModelConfig.from_hf_config(ckpt.read_checkpoint_meta(model.path)["model_config"])
    else:
        cfg = ModelConfig.from_hf_config(read_hf_config(model.path))
    return _as_configured(cfg, model)


def packing_for(model: ModelSpec, cfg: ModelConfig) -> ModelSpec:
    """`model` as `cfg` can be packed: a hybrid model's delta-net layers read a packed segment's tokens in order
    (models/hybrid.py), so a prompt shared by several responses (`share_packed_prompts`) would hand the second
    response the first one's state; its packed rows hold the prompt once per response instead. So do a
    batch-invariant model's (`batch_invariant`): a response after its siblings would cut other key blocks than
    the sampler's cache (batching/step.py)."""
    if not (model.use_remove_padding and model.share_packed_prompts):
        return model
    if model.batch_invariant:
        return dataclasses.replace(model, share_packed_prompts=False)
    if not cfg.hybrid:
        return model
    warn_once("hybrid_shared_prompts", "%s: model.share_packed_prompts off (its gated delta-net layers read a "
              "packed prompt's responses one after another, not each from the prompt): packed rows hold each "
              "response's prompt", cfg.architecture)
    return dataclasses.replace(model, share_packed_prompts=False)


def make_trained_role(name: str, model_cfg: ModelConfig, params: dict, optim: OptimSpec,
                      update_fn: UpdateFn, *, model: ModelSpec, settings: ActorSpec | CriticSpec, batch: RoleBatch,
                      lora: LoraConfig | None = None, seed: int = 0, lr_offset: int = 0) -> TrainedRole:
    """A role training `params`, or with `lora` fresh adapters (from `seed`) on `params` kept frozen;
    `model`, `settings`, `batch` and `lr_offset` are what its updates in a run read (TrainedRole)."""
    frozen = None
    model = packing_for(model, model_cfg)
    if lora is not None:
        frozen, params = params, {"lora": init_adapters(model_cfg, lora, _mesh_of(params), seed,
                                                        tower=params.get("vision"))}
    tx, schedule = make_optimizer(optim)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    abstract_state = jax.eval_shape(tx.init, params)
    state_shardings = optimizer_state_sharding(abstract_state, param_shardings)
    opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)
    offload = optim.offload
    if offload and not offload_supported():
        warn_once(f"{name}_optimizer_offload", "%s optim.offload: no effect on this backend (%s has no pinned_host "
                  "memory); the optimizer state stays in device memory", name, jax.default_backend())
        offload = False
    if offload:
        opt_state = to_host(opt_state)
    return TrainedRole(name, model_cfg, params, tx, schedule, opt_state, param_shardings, state_shardings, update_fn,
                       model=model, settings=settings, batch=batch, frozen=frozen, lora=lora, lr_offset=lr_offset,
                       offload_optimizer=offload)


def _mesh_of(params: dict) -> Mesh:
    return jax.tree.leaves(params)[0].sharding.mesh


def init_adapters(model_cfg: ModelConfig, lora: LoraConfig, mesh: Mesh, seed: int, tower: dict | None = None
                  ) -> dict:
    """Fresh float32 adapters (models/lora.py `init_lora`) placed on `mesh` by their logical axes; with `tower` (a
    trained vision tower's params: LoRA on it too, models/vision/tower_lora.py) its adapters under "vision",
    replicated (rank x the tower's widths: small)."""
    adapters = adapter_init(model_cfg, lora, tower)
    abstract = jax.eval_shape(adapters, jax.random.PRNGKey(0))
    shardings = adapter_shardings(model_cfg, lora, abstract, mesh)
    init = jax.jit(adapters, out_shardings=shardings)
    return init(jax.random.fold_in(jax.random.PRNGKey(seed), 0x10AA))


def adapter_init(model_cfg: ModelConfig, lora: LoraConfig, tower: Any = None) -> Callable[[jax.Array], dict]:
    """key -> fresh adapters of the text model and, given a trained tower's (abstract) params, of the tower."""
    targets = None if tower is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tower)

    def init(key: jax.Array) -> dict:
        adapters = init_lora(model_cfg, lora, key)
        if targets is not None:
            adapters["vision"] = init_tower_lora(targets, lora.rank, jax.random.fold_in(key, 0x7157))
        return adapters

    return init


def adapter_shardings(model_cfg: ModelConfig, lora: LoraConfig, abstract: dict, mesh: Mesh) -> dict:
    """Where `adapter_init`'s adapters live: the text model's by their logical axes, the tower's replicated."""
    text = {k: v for k, v in abstract.items() if k != "vision"}
    out = logical_to_sharding(lora_logical_axes(model_cfg, lora), text, mesh)
    if "vision" in abstract:
        out["vision"] = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), abstract["vision"])
    return out


def load_judge(path: str, spec: JudgeSpec, *, policy_model: ModelSpec, tokenizer: Tokenizer, mesh: Mesh,
               engine: EngineOptions, dtype: str, seed: int) -> Judge:
    """The judge at `path` (HF folder, .gguf, our checkpoint, or tiny:<arch> with the policy's tiny
    dims, for tests) placed on `mesh`; `tokenizer` is the policy's (a tiny judge's own)."""
    from jaxrl_llm.roles.judge import Judge

    model = dataclasses.replace(policy_model, path=path, param_dtype=dtype, override_config=(), lora=None)
    judge_tokenizer = tokenizer_of(model, tokenizer, key="reward_model.model.path")
    model_cfg, params = load_model(model, head="lm", mesh=mesh, tokenizer=judge_tokenizer, seed=seed)
    return Judge(spec, model_cfg, params, judge_tokenizer, mesh=mesh, engine=engine, compute_dtype=dtype, path=path)


def tokenizer_of(model: ModelSpec, tiny_tokenizer: Tokenizer, *, key: str) -> Tokenizer:
    """The tokenizer that comes with `model.path` (a second model's: teacher, judge): a folder's or
    GGUF file's own, the one a checkpoint's metadata names, or `tiny_tokenizer` for tiny:<arch>."""
    from jaxrl_llm.hf import load_tokenizer

    if model.is_tiny:
        return tiny_tokenizer
    if ckpt.is_checkpoint(model.path):
        source = ckpt.read_checkpoint_meta(model.path).get("tokenizer")
        if not source:
            raise ValueError(f"{key}={model.path!r}: the checkpoint names no tokenizer")
        return load_tokenizer(source)
    return load_tokenizer(model.path)


_VOCAB_SAMPLE = 64  # token ids compared between the two tokenizers, spread over the vocabulary


def check_vocabulary(own_cfg: ModelConfig, own_tokenizer: Tokenizer, other_cfg: ModelConfig,
                     other_tokenizer: Tokenizer, path: str, *, key: str, names: tuple[str, str], purpose: str) -> None:
    """A second model (a teacher, a draft model) reads the policy's token ids: the same vocabulary
    size and the same token for a sample of ids across the vocabulary (chat templates may differ).
    ConfigError naming `key`, the sizes or the first differing id otherwise. names: (the policy's
    role, the other model's role) as the message calls them."""
    own, other = names
    if other_cfg.vocab_size != own_cfg.vocab_size:
        raise ConfigError(f"{key}={path!r}: the {other}'s vocabulary has {other_cfg.vocab_size} tokens, the "
                          f"{own}'s {own_cfg.vocab_size}; {purpose} needs the same vocabulary")
    size = min(len(own_tokenizer), len(other_tokenizer))
    if len(own_tokenizer) != len(other_tokenizer):
        raise ConfigError(f"{key}={path!r}: the {other}'s tokenizer has {len(other_tokenizer)} tokens, the "
                          f"{own}'s {len(own_tokenizer)}; {purpose} needs the same vocabulary")
    ids = sorted(set(np.linspace(0, size - 1, _VOCAB_SAMPLE).astype(int).tolist()))
    mine, theirs = (tok.convert_ids_to_tokens(ids) for tok in (own_tokenizer, other_tokenizer))
    differ = [(i, s, t) for i, s, t in zip(ids, mine, theirs) if s != t]
    if differ:
        i, s, t = differ[0]
        raise ConfigError(f"{key}={path!r}: the tokenizers differ at {len(differ)} of {len(ids)} sampled ids "
                          f"(id {i}: {own} {s!r}, {other} {t!r}); {purpose} needs the same vocabulary")
