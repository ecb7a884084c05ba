"""veRL `ppo_trainer.yaml`-shaped configs (all sections) -> our tree.

Our tree keeps veRL's names, so most keys map to themselves; `*_per_gpu` -> `*_per_device` and
`warmup_style` -> `lr_scheduler_type` as for command-line overrides. The keys handled specially
(mesh, deprecated global micro-batch sizes, meaning-changing switches) are in `SPECIAL`; every
other key our tree lacks is listed in the import's warning. Trinity-RFT's `trainer.trainer_config`
section is imported with the same code.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

from jaxrl_llm.config.importers.common import (
    NO_COUNTERPART,
    PLACEMENT,
    Mapper,
    Source,
    Unresolved,
    flatten,
    int_or_error,
    logger_sinks,
)
from jaxrl_llm.config.overrides import FIELDS, LEAF_RENAMES, OPEN_SECTIONS, is_torch_only, our_value

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
    if any(key.startswith(s + ".") for s in OPEN_SECTIONS):
        return key
    parts = key.split(".")
    leaf = LEAF_RENAMES.get(parts[-1], parts[-1])
    if leaf.endswith("_per_gpu"):
        leaf = leaf[: -len("_per_gpu")] + "_per_device"
    renamed = ".".join(parts[:-1] + [leaf])
    return renamed if renamed in FIELDS else None


def _tensor_parallel(m: Mapper, src: str, value: Any) -> None:
    m.set("mesh.tensor", int_or_error(m, src, value), src)


def _fsdp_size(m: Mapper, src: str, value: Any) -> None:
    size = int_or_error(m, src, value)
    if size > 0:  # HSDP: shard within groups of `size` devices, replicate across groups
        m.set("mesh.fsdp", size, src)
        m.set("mesh.data", -1, src)


def _placement(m: Mapper, src: str, value: Any) -> None:
    m.ignore(src, f"{PLACEMENT}: jaxrl_llm uses every visible device, laid out by mesh.*")


def _error_if(pred: Callable[[Any], bool], why: str):
    def handle(m: Mapper, src: str, value: Any) -> None:
        if pred(value):
            m.error(src, f"{value!r}: {why}")
        m.ignore(src, "off; no counterpart in jaxrl_llm")
    return handle


def _correction_loss(m: Mapper, src: str, value: Any) -> None:
    if value not in (None, "ppo_clip"):  # before: one of the no-counterpart names, and the run was PPO-clip
        m.error(src, f"{value!r}: jaxrl_llm's bypass mode trains with ppo_clip only (veRL's reinforce loss, an "
                     "IS-weighted policy gradient, is not available)")
    m.ignore(src, "ppo_clip: jaxrl_llm's only bypass-mode loss")


def _optimizer(m: Mapper, src: str, value: Any) -> None:
    if str(value).lower().replace("_", "") not in ("adamw", "adam"):
        m.error(src, f"{value!r}: jaxrl_llm trains with AdamW (optax.adamw) only")
    m.ignore(src, "AdamW is the only optimizer (optax.adamw)")


def _logger(m: Mapper, src: str, value: Any) -> None:
    m.set("trainer.logger", logger_sinks(m, src, [value] if isinstance(value, str) else value), src)


def _clip_grad(role: str) -> Callable[[Mapper, str, Any], None]:
    def handle(m: Mapper, src: str, value: Any) -> None:
        if value is not None:
            m.set(f"{role}.grad_clip", value, src)
    return handle


SPECIAL: dict[str, Callable[[Mapper, str, Any], None]] = {
    "actor_rollout_ref.rollout.tensor_model_parallel_size": _tensor_parallel,
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": _fsdp_size,
    "trainer.nnodes": _placement,
    "trainer.n_gpus_per_node": _placement,
    "algorithm.use_pf_ppo": _error_if(bool, "preference-feedback PPO (sample reweighting) is not supported"),
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
}

# keys that configure only veRL's own machinery (on top of overrides.TORCH_ONLY_PATTERNS)
VERL_MACHINERY = ("*.agent.*", "*.agent", "*.use_shm",
                  "trainer.ray_*", "*.use_dynamic_bsz_balance", "*.swanlab*", "*.mlflow*", "global_profiler*",
                  "transfer_queue*", "*.nsight*", "*.profile_*", "trainer.profile_steps", "*.router_replay*")


def _generic(m: Mapper, src: str, key: str, value: Any, raw: str | None = None) -> None:
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
    elif is_torch_only(key) or any(fnmatch.fnmatchcase(key, p) for p in VERL_MACHINERY):
        m.ignore(src, PLACEMENT)
    else:
        m.ignore(src, NO_COUNTERPART)


def import_verl_source(m: Mapper, src: Source, *, skip: tuple[str, ...] = (),
                       raw: dict[str, str] | None = None) -> None:
    """Maps every key of `src` (veRL names); keys under a prefix in `skip` are ignored with a note
    (Trinity sets those itself); `raw`: interpolation texts by key (see DERIVED_FROM)."""
    raw = raw or {}
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
            else:
                m.ignore(full, "deprecated global size (null); use *_per_gpu")
            continue
        value = src.drop(key)  # unresolved values are an error only where they are used (Mapper.set)
        handler = SPECIAL.get(key.lstrip("+"))
        if handler is not None:
            if isinstance(value, Unresolved) and handler is not _placement:
                src.unresolved(key, value)
            handler(m, full, value)
        else:
            _generic(m, full, key, value, raw.get(key))


def import_verl(data: dict[str, Any], m: Mapper, raw: dict[str, str] | None = None) -> None:
    """A veRL config (nested dict, interpolations resolved; `raw` their texts by dotted key) into `m`."""
    src = Source(flatten(data, leaves=OPEN_SECTIONS), m.source)
    import_verl_source(m, src, raw=raw)
