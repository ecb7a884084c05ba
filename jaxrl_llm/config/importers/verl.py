"""veRL `ppo_trainer.yaml`-shaped configs (all sections, or pasted `key=value` overrides) -> our tree.

Our tree keeps veRL's names, so most keys map to themselves; `*_per_gpu` -> `*_per_device` and
`warmup_style` -> `lr_scheduler_type` as for command-line overrides. The keys handled specially
(mesh, deprecated global micro-batch sizes, meaning-changing switches) are in `SPECIAL`. A veRL key
with no key of ours (`verl_keys.VERL_DEFAULTS`) is:
- listed in the import's warning, with its value, when it changes nothing computed (placement,
  engines, logging, metrics: `HARMLESS`, and the torch-only patterns);
- dropped when it has veRL's default value (what jaxrl_llm computes);
- an error naming file, key and value otherwise.
A key that is neither veRL's nor ours is an error with close matches. Trinity-RFT's
`trainer.trainer_config` section is imported with the same code.

Placement, one rule from YAML and from the command line (`_fsdp_size`, `training_tensor_parallel`,
`training_expert_parallel`, `placement_only`): jaxrl_llm samples and
trains on one mesh over every visible device. veRL's training sharding maps onto it: FSDP's
`fsdp_size` (HSDP group) -> `mesh.fsdp` (the rest of the devices -> `mesh.data`), Megatron's
`tensor_model_parallel_size` -> `mesh.tensor` and `expert_model_parallel_size` -> `mesh.expert`, each
reduced to the largest size the devices hold.
The inference engine's layout (rollout TP / DP / EP / PP) and the cluster size (`nnodes`,
`n_gpus_per_node`) are warned about with their values.

Ulysses sequence parallelism (`actor.ulysses_sequence_parallel_size`, sp) -> `mesh.context` (context
parallelism: a group of devices shares rows and splits their tokens), reduced to what the devices hold.
veRL counts its per-GPU sizes per sp group: micro-batch sequence counts are per group, as ours are
per context group, and token budgets hold `ppo_max_token_len_per_gpu x sp` tokens per group's
micro-batch (the per-GPU count on each device), so they are imported multiplied by the sp size. A role
whose sp differs from the actor's (the critic's) runs on the same mesh: its sequence counts scale by
mesh.context / its sp, its token budgets by mesh.context (by its sp where the devices could not hold
the actor's, so that one sequence still fits).
"""
from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Callable
from typing import Any

from jaxrl_llm.config.importers.common import (
    PLACEMENT,
    Mapper,
    Source,
    SourceValue,
    Unresolved,
    flatten,
    int_or_error,
    logger_sinks,
)
from jaxrl_llm.config.importers.verl_keys import VERL_DEFAULTS
from jaxrl_llm.config.overrides import (
    FIELDS,
    LEAF_RENAMES,
    NAME_ALIASES,
    OPEN_SECTIONS,
    is_torch_only,
    our_value,
    unknown_key_message,
)

TOP_LEVEL = ("data", "actor_rollout_ref", "critic", "reward_model", "custom_reward_function", "algorithm", "trainer")

# veRL's deprecated global micro-batch sizes (null in current veRL): global -> per device.
GLOBAL_MICRO = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_device",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "actor_rollout_ref.ref.log_prob_micro_batch_size_per_device",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size":
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_device",
    "critic.forward_micro_batch_size": "critic.forward_micro_batch_size_per_device",
    "reward_model.micro_batch_size": "reward_model.micro_batch_size_per_device",
}


# Our derived keys (None = filled by validate_config) and the key each is derived from, as veRL's
# interpolations write them: imported as "derived" when the file interpolates the same key, so a
# later override of the source (e.g. data.max_response_length=...) still carries over, as in veRL.
DERIVED_FROM = {
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    **{f"actor_rollout_ref.{role}.log_prob_{name}": f"actor_rollout_ref.actor.{src}"
       for role in ("ref", "rollout")
       for name, src in (("micro_batch_size_per_device", "ppo_micro_batch_size_per_device"),
                         ("use_dynamic_bsz", "use_dynamic_bsz"),
                         ("max_token_len_per_device", "ppo_max_token_len_per_device"))},
    "critic.model.path": "actor_rollout_ref.model.path",
    **{f"critic.{name}": f"actor_rollout_ref.actor.{name}"
       for name in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_device", "use_dynamic_bsz", "ppo_epochs",
                    "shuffle", "loss_agg_mode")},
    "critic.forward_micro_batch_size_per_device": "critic.ppo_micro_batch_size_per_device",
    "critic.forward_max_token_len_per_device": "critic.ppo_max_token_len_per_device",
    "reward_model.reward_kwargs.max_resp_len": "data.max_response_length",
}
DEFAULT_LOCAL_DIR = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"


def _interpolates(raw: str, source: str) -> bool:
    """Does the interpolation text read exactly `source` (veRL or our spelling)?"""
    text = raw.strip()
    if not (text.startswith("${") and text.endswith("}")):
        return False
    body = text[2:-1]
    if body.startswith("oc.select:"):
        body = body[len("oc.select:"):].split(",", 1)[0]
    return our_key(body.strip()) == source


def our_key(key: str) -> str | None:
    """Our name for a veRL key, or None when our tree has no such key."""
    key = key.lstrip("+")
    if key in FIELDS:
        return key
    if "." in key and key in NAME_ALIASES:  # veRL spellings of our keys (e.g. ref.fsdp_config.param_offload)
        return NAME_ALIASES[key]
    if any(key.startswith(s + ".") for s in OPEN_SECTIONS):
        return key
    parts = key.split(".")
    leaf = LEAF_RENAMES.get(parts[-1], parts[-1])
    if leaf.endswith("_per_gpu"):
        leaf = leaf[: -len("_per_gpu")] + "_per_device"
    renamed = ".".join(parts[:-1] + [leaf])
    return renamed if renamed in FIELDS else None


def training_tensor_parallel(m: Mapper, src: str, value: SourceValue) -> None:
    """Megatron's training TP -> mesh.tensor (the largest size dividing the devices)."""
    size = int_or_error(m, src, value)
    held = math.gcd(max(size, 1), m.devices())
    m.set("mesh.tensor", held, src)
    if held != size:
        m.ignore(f"{src} (as mesh.tensor={held})", f"reduced to what the {m.devices()} device(s) hold", size)


def training_expert_parallel(m: Mapper, src: str, value: SourceValue) -> None:
    """Megatron's expert parallelism -> mesh.expert (the largest size dividing the devices TP leaves;
    like Megatron's EP group it also splits the batch)."""
    size = int_or_error(m, src, value)
    free = m.devices() // math.gcd(int(m.get("mesh.tensor") or 1), m.devices())
    held = math.gcd(max(size, 1), free)
    m.set("mesh.expert", held, src)
    if held != size:
        m.ignore(f"{src} (as mesh.expert={held})", f"reduced to what the {free} device(s) hold", size)


def _fsdp_size(m: Mapper, src: str, value: SourceValue) -> None:
    """FSDP's HSDP group -> mesh.fsdp, the rest of the devices -> mesh.data; -1 or a group at least as
    large as the devices: one FSDP group over all of them."""
    size = int_or_error(m, src, value)
    if size <= 0:
        return
    taken = int(m.get("mesh.tensor") or 1) * int(m.get("mesh.expert") or 1)
    free = m.devices() // math.gcd(taken, m.devices())
    if size >= free:
        m.set("mesh.fsdp", -1, src)
        m.set("mesh.data", 1, src)
        return
    held = math.gcd(size, free)
    m.set("mesh.fsdp", held, src)
    m.set("mesh.data", -1, src)
    if held != size:
        m.ignore(f"{src} (as mesh.fsdp={held})", f"reduced to what the {free} device(s) hold", size)


ACTOR_SP = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
SP_LEAF = "ulysses_sequence_parallel_size"


def _context_size(devices: int, sp: int) -> int:
    """veRL's sp size as mesh.context: the largest size dividing the devices."""
    return math.gcd(max(sp, 1), devices)


def context_parallel(m: Mapper, src: str, value: SourceValue) -> None:
    """The actor's Ulysses sp size (Trinity's trainer's, ROLL's ulysses_size / Megatron context_parallel_size)
    -> mesh.context (see the module doc)."""
    size = int_or_error(m, src, value)
    if size <= 1:
        return
    held = _context_size(m.devices(), size)
    m.set("mesh.context", held, src)
    if held != size:
        m.ignore(f"{src} (as mesh.context={held})", f"reduced to what the {m.devices()} device(s) hold", size)


def _role_sp(m: Mapper, src: str, value: SourceValue) -> None:
    """A ref / critic / reward-model sp size: the mesh is the actor's (its sizes scale: SP_SCALED)."""
    if not _at_default(src, value):
        m.ignore(src, "every role runs on the one mesh, whose mesh.context is the actor's "
                      "ulysses_sequence_parallel_size; this role's per-GPU sizes are scaled to it", value)


def placement_only(m: Mapper, src: str, value: SourceValue) -> None:
    if _at_default(src, value):
        return
    m.ignore(src, f"{PLACEMENT}: jaxrl_llm samples and trains on one mesh over every visible device (mesh.*)",
             value)


def _error_if(pred: Callable[[SourceValue], bool], why: str):
    def handle(m: Mapper, src: str, value: SourceValue) -> None:
        if pred(value):
            m.error(src, f"{value!r}: {why}")  # off: what jaxrl_llm computes
    return handle


def _correction_loss(m: Mapper, src: str, value: SourceValue) -> None:
    if value not in (None, "ppo_clip", "reinforce"):
        m.error(src, f"{value!r}: bypass mode's loss is ppo_clip or reinforce")
    elif value is not None:
        m.set("algorithm.rollout_correction.loss_type", value, src)


def _optimizer(m: Mapper, src: str, value: SourceValue) -> None:
    if str(value).lower().replace("_", "") not in ("adamw", "adam"):
        m.error(src, f"{value!r}: jaxrl_llm trains with AdamW (optax.adamw) only")


def _logger(m: Mapper, src: str, value: SourceValue) -> None:
    m.set("trainer.logger", logger_sinks(m, src, [value] if isinstance(value, str) else value), src)


def _clip_grad(role: str) -> Callable[[Mapper, str, SourceValue], None]:
    def handle(m: Mapper, src: str, value: SourceValue) -> None:
        if value is not None:
            m.set(f"{role}.grad_clip", value, src)
    return handle


def _router_replay(m: Mapper, src: str, value: SourceValue) -> None:
    """veRL's actor.router_replay.mode: R3 (rollout routing replay) is ours 'rollout'."""
    mode = str(value)
    if mode == "R3":
        m.set("actor_rollout_ref.actor.router_replay", "rollout", src)
    elif mode != "disabled":
        m.error(src, f"{value!r}: replaying the old log-prob pass's routing (R2) is not available; R3 (the "
                     "sampler's routing, actor.router_replay=rollout) is")


_NO_ROUTING_FILES = _error_if(lambda v: v is not None, "routing read from / written to files is not available "
                                                       "(R3 replays the sampler's routing in memory)")


SPECIAL: dict[str, Callable[[Mapper, str, Any], None]] = {
    "actor_rollout_ref.rollout.tensor_model_parallel_size": placement_only,
    "actor_rollout_ref.rollout.data_parallel_size": placement_only,
    "actor_rollout_ref.rollout.expert_parallel_size": placement_only,
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": placement_only,
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": training_tensor_parallel,
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": training_expert_parallel,
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": _fsdp_size,
    ACTOR_SP: context_parallel,
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": context_parallel,
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": _role_sp,
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": _role_sp,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": _role_sp,
    "critic.ulysses_sequence_parallel_size": _role_sp,
    "reward_model.ulysses_sequence_parallel_size": _role_sp,
    "trainer.nnodes": placement_only,
    "trainer.n_gpus_per_node": placement_only,
    "algorithm.rollout_correction.rollout_token_veto_threshold": _error_if(
        lambda v: v is not None, "per-token veto is not supported (rollout_rs modes only)"),
    "algorithm.rollout_correction.loss_type": _correction_loss,
    "algorithm.rollout_correction.rollout_rs_threshold_lower": _error_if(
        lambda v: v is not None, "give the lower bound in rollout_rs_threshold as 'lo_hi' (k1 modes)"),
    "actor_rollout_ref.actor.optim.optimizer": _optimizer,
    "critic.optim.optimizer": _optimizer,
    "actor_rollout_ref.actor.optim.clip_grad": _clip_grad("actor_rollout_ref.actor"),
    "critic.optim.clip_grad": _clip_grad("critic"),
    "trainer.logger": _logger,
    "actor_rollout_ref.actor.router_replay.mode": _router_replay,
    "actor_rollout_ref.ref.router_replay.mode": _error_if(
        lambda v: str(v) != "disabled", "the reference policy routes by itself (only the actor replays)"),
    "actor_rollout_ref.actor.router_replay.record_file": _NO_ROUTING_FILES,
    "actor_rollout_ref.actor.router_replay.replay_file": _NO_ROUTING_FILES,
    "actor_rollout_ref.ref.router_replay.record_file": _NO_ROUTING_FILES,
    "actor_rollout_ref.ref.router_replay.replay_file": _NO_ROUTING_FILES,
    # the sampler records its routing whenever actor.router_replay = rollout (R3 above)
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": lambda m, src, value: None,
}

# keys that configure only veRL's own machinery (on top of overrides.TORCH_ONLY_PATTERNS)
VERL_MACHINERY = ("*.agent.*", "*.agent", "*.use_shm",
                  "trainer.ray_*", "*.use_dynamic_bsz_balance", "*.swanlab*", "*.mlflow*", "global_profiler*",
                  "transfer_queue*", "*.nsight*", "*.profile_*", "trainer.profile_steps")


# veRL keys with no key of ours that change nothing computed: any value is listed in the warning
HARMLESS = ("*._target_", "*.calculate_entropy", "*.calculate_sum_pi_squared", "*.sum_pi_squared_checkpointing",
            "*.data_loader_seed", "*.use_prefix_grouper", "*.use_remove_padding", "*.enable_prefix_caching",
            "*.scheduling_policy", "*.tokenization_sanity_check_mode", "*.checkpoint_engine.*", "*.trace.*",
            "*.skip_dump_dir", "*.skip_tokenizer_init", "*.prometheus.*", "*.tiled_mlp.*", "*.hf_config_path",
            "data.return_raw_input_ids", "data.return_full_prompt", "data.image_patch_size",
            "data.return_multi_modal_inputs", "data.validation_shuffle",
            "reward_model.enable_resource_pool", "reward_model.n_gpus_per_node", "reward_model.nnodes",
            "reward_model.use_dynamic_bsz", "reward_model.forward_max_token_len_per_gpu",
            "reward_model.launch_reward_fn_async", "reward_model.sandbox_fusion.max_concurrent",
            "reward_model.sandbox_fusion.memory_limit_mb", "reward_model.use_reward_loop", "reward_model.num_workers",
            "reward_model.rollout.*", "reward_model.reward_loop_source",
            # arguments of loss modes jaxrl_llm refuses by name (clip_cov, kl_cov, ppo_kl)
            "*.policy_loss.clip_cov_*", "*.policy_loss.kl_cov_ratio", "*.policy_loss.ppo_kl_coef",
            # critic LoRA shape: only read when critic.model.lora_rank > 0, which is refused
            "critic.model.lora_alpha", "critic.model.target_modules", "reward_manager.source",
    # the deprecated global micro-batch sizes are null in current veRL (GLOBAL_MICRO maps a value)
    "*.ppo_micro_batch_size", "*.log_prob_micro_batch_size", "*.forward_micro_batch_size",
    "reward_model.micro_batch_size")
# why a veRL key with no key of ours cannot take another value than veRL's default
WHY = {
    "actor_rollout_ref.rollout.over_sample_rate": "over-sampling (aborting the slowest requests of a step) is not "
                                                  "available; every sample runs to its end",
    "actor_rollout_ref.rollout.logprobs_mode": "the sampler's log-probs are always those of the processed "
                                               "distribution (veRL's processed_logprobs)",
    "actor_rollout_ref.rollout.quantization": "quantized rollout weights are not available",
    "actor_rollout_ref.rollout.skip_rollout": "replaying dumped rollouts is not available",
    "data.reward_fn_key": "reward functions are chosen by the row's data_source column",
    "data.apply_chat_template_kwargs": "chat-template arguments are not available",
    "actor_rollout_ref.model.custom_chat_template": "set data.chat_template instead",
    "critic.model.lora_rank": "a LoRA critic is not available (full-parameter critic only)",
}


def _is_placement(key: str) -> bool:
    return is_torch_only(key) or any(fnmatch.fnmatchcase(key, p) for p in VERL_MACHINERY)


def _same(value: SourceValue, default: SourceValue) -> bool:
    if isinstance(value, Unresolved):
        return False
    if value in (None, {}, []) and default in (None, {}, []):
        return True
    return value == default and type(value) is type(default) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value == default)


def _at_default(src: str, value: SourceValue) -> bool:
    """Is veRL key `src` (possibly under Trinity's trainer_config prefix) at veRL's default value?"""
    key = src.removeprefix("trainer.trainer_config.").lstrip("+")
    return key in VERL_DEFAULTS and _same(value, VERL_DEFAULTS[key])


def _no_counterpart(m: Mapper, src: str, key: str, value: SourceValue) -> None:
    """A veRL key our tree lacks (see the module doc for the rule)."""
    if _same(value, VERL_DEFAULTS[key]):
        return  # veRL's default: what jaxrl_llm computes
    if any(fnmatch.fnmatchcase(key, p) for p in HARMLESS):
        m.ignore(src, "changes nothing computed (engine / placement / metrics)", value)
    else:
        why = WHY.get(key, "no counterpart in jaxrl_llm")
        m.error(src, f"{value!r}: {why} (only veRL's default, {VERL_DEFAULTS[key]!r}, is what jaxrl_llm computes)")


def _generic(m: Mapper, src: str, key: str, value: SourceValue, raw: str | None = None) -> None:
    key = key.lstrip("+")
    ours = our_key(key)
    if ours is not None and raw is not None and (
            (ours in DERIVED_FROM and _interpolates(raw, DERIVED_FROM[ours]))
            or (ours == "trainer.default_local_dir" and raw.strip() == DEFAULT_LOCAL_DIR)):
        return  # derived by validate_config from the same key, as veRL's interpolation does
    if ours is not None:
        field = FIELDS.get(ours)
        if value is None and field is not None and not field.nullable:
            m.ignore(src, "null keeps jaxrl_llm's default")
        else:
            m.set(ours, our_value(ours, value), src)
    elif key in VERL_DEFAULTS and not _is_placement(key):
        _no_counterpart(m, src, key, value)
    elif _is_placement(key):
        if not _at_default(key, value):
            m.ignore(src, PLACEMENT, value)
    elif value is None or value is False or value in ({}, [], ""):
        m.ignore(src, "not a key of current veRL or of jaxrl_llm (an older veRL's?); unset / off, so it changes "
                      "nothing", value)
    else:
        close = difflib.get_close_matches(key, list(VERL_DEFAULTS), n=2, cutoff=0.75)
        hint = f" (veRL has {', '.join(close)})" if close else ""
        m.error(src, f"{value!r}: {unknown_key_message(key)}{hint}; it is not a key of veRL's config either, so what "
                     "it changes is unknown")


def is_ours(key: str) -> bool:
    """Is `key` (a command-line override) a key of ours or one of our aliases (not a veRL-only key)?"""
    key = key.lstrip("+")
    if key in SPECIAL or key in GLOBAL_MICRO:  # handled as in a veRL file (e.g. a logger that is not installed)
        return False
    return key in FIELDS or key in NAME_ALIASES or our_key(key) is not None


def is_verl_key(key: str) -> bool:
    """Is `key` one of veRL's (its config's keys, placement patterns, or handled specially)?"""
    key = key.lstrip("+")
    return key in VERL_DEFAULTS or key in SPECIAL or key in GLOBAL_MICRO or _is_placement(key)


# veRL sizes counted per Ulysses sequence-parallel group of sp devices -> (the role whose sp applies, how they
# scale): token budgets x max(mesh.context, sp) (the per-GPU tokens on each device of a context group, and
# at least the sp group's budget x sp, so one sequence may be that long), micro-batch sequence counts
# x mesh.context / sp (a context group of ours holds mesh.context / sp of the role's sp groups)
SP_SCALED = {
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("actor_rollout_ref.actor", "tokens"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": ("actor_rollout_ref.ref", "tokens"),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": ("actor_rollout_ref.actor", "tokens"),
    "critic.ppo_max_token_len_per_gpu": ("critic", "tokens"),
    "critic.forward_max_token_len_per_gpu": ("critic", "tokens"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("actor_rollout_ref.actor", "sequences"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ("actor_rollout_ref.ref", "sequences"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ("actor_rollout_ref.actor", "sequences"),
    "critic.ppo_micro_batch_size_per_gpu": ("critic", "sequences"),
    "critic.forward_micro_batch_size_per_gpu": ("critic", "sequences"),
}


def _sp_scales(sp: int, context: int, how: str) -> bool:
    """Does a size counted per sp group of `sp` devices change on a mesh of `context` (SP_SCALED)?"""
    if how == "tokens":
        return max(sp, context) > 1
    return how == "sequences" and sp != context


def _sp_scaled(value: SourceValue, sp: int, context: int, how: str) -> Any:
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    return value * max(sp, context) if how == "tokens" else max(1, math.ceil(value * context / sp))


def _sp_size(src: Source, role: str) -> int:
    """A role's sp size: its own key or its fsdp_config's (veRL's current spelling; the critic's sits under
    critic.model), the reference's defaulting to the actor's."""
    config = "critic.model.fsdp_config" if role == "critic" else f"{role}.fsdp_config"
    sizes = [src.flat.get(f"{role}.{SP_LEAF}"), src.flat.get(f"{config}.{SP_LEAF}")]
    sizes = [int(v) for v in sizes if isinstance(v, int) and not isinstance(v, bool) and v > 1]
    if not sizes and role == "actor_rollout_ref.ref":
        return _sp_size(src, "actor_rollout_ref.actor")
    return max(sizes, default=1)


def import_verl_source(m: Mapper, src: Source, *, skip: tuple[str, ...] = (),
                       raw: dict[str, str] | None = None) -> None:
    """Maps every key of `src` (veRL names); keys under a prefix in `skip` are ignored with a note
    (Trinity sets those itself); `raw`: interpolation texts by key (see DERIVED_FROM)."""
    raw = raw or {}
    sp = {key: (_sp_size(src, role), how) for key, (role, how) in SP_SCALED.items()}
    context = _context_size(m.devices(), _sp_size(src, "actor_rollout_ref.actor"))  # what context_parallel sets
    for key in src.remaining():
        full = src.full(key)
        if any(key == p or key.startswith(p + ".") for p in skip):
            src.drop(key)
            m.ignore(full, "set by Trinity-RFT's own keys; ignored in trainer_config")
            continue
        if key.lstrip("+") in GLOBAL_MICRO:
            value = src.take(key)
            if value is not None:
                m.set(GLOBAL_MICRO[key.lstrip("+")], max(1, int_or_error(m, full, value) // m.dp()), full)
            continue  # null: the deprecated global size is unused (current veRL)
        value = src.drop(key)  # unresolved values are an error only where they are used (Mapper.set)
        handler = SPECIAL.get(key.lstrip("+"))
        if handler is not None:
            if isinstance(value, Unresolved) and handler is not placement_only:
                src.unresolved(key, value)
            handler(m, full, value)
        else:
            size, how = sp.get(key.lstrip("+"), (1, ""))
            if _sp_scales(size, context, how):  # counted per sequence-parallel group in veRL
                value = _sp_scaled(value, size, context, how)  # no longer the interpolated value: not left derived
                _generic(m, full, key, value)
            else:
                _generic(m, full, key, value, raw.get(key))


def import_verl(data: dict[str, Any], m: Mapper, raw: dict[str, str] | None = None) -> None:
    """A veRL config (nested dict, interpolations resolved; `raw` their texts by dotted key) into `m`."""
    src = Source(flatten(data, leaves=OPEN_SECTIONS), m.source)
    _one_reward_manager(src, raw or {})
    import_verl_source(m, src, raw=raw)


def _one_reward_manager(src: Source, raw: dict[str, str]) -> None:
    """Current veRL reads the root `reward_manager.name`, whose default interpolates the older
    `reward_model.reward_manager`: keep the one veRL uses (the root, unless it is that interpolation)."""
    root, old = "reward_manager.name", "reward_model.reward_manager"
    if src.has(root) and src.has(old):
        src.drop(old if "reward_model.reward_manager" not in raw.get(root, "") else root)
