"""What the memory plan changes, by itself, when a program of the step does not fit at any micro-batch
size (`trainer.memory_levers`): each lever one config key (or one per trained role), tried in the
listed order, which is their cost order, cheapest first; a lever is kept when it shrinks what does not
fit and dropped when it does not, until the step fits. The plan prints each key it set and the run
trains with it; when the levers run out, the error names the keys left to change by hand.

Cost per step of each lever (an estimate of what it adds, for the order):
- ref_offload / teacher_offload: the frozen weights wait in pinned host memory and come to the device
  for their one pass a step (their bytes over the host link once a step; roles/reference.py);
- optimizer_offload: the optimizer state waits in pinned host memory between updates (2x its bytes
  over the host link a step: in for the update, out after it);
- remat: each decoder block's forward recomputed in the backward (remat_policy none / dots_saveable ->
  full): about a third more update FLOPs;
- bf16_moments: Adam's moments stored in bf16 (computed in fp32: roles/optim.py); no time, but the
  numbers change, so never in the default list: a user opts in by naming it.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_llm.config.names import MEMORY_LEVERS
from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.planning.context import ARR
from jaxrl_llm.roles.reference import offload_supported

# set: the changed spec and the keys it set (`key=value`); () where the lever does nothing for this run
Pull = Callable[[RunSpec], tuple[RunSpec, tuple[str, ...]]]


@dataclasses.dataclass(frozen=True)
class Lever:
    name: str
    what: str  # one phrase: what it changes and what it costs
    pull: Pull


def _ref_offload(spec: RunSpec) -> tuple[RunSpec, tuple[str, ...]]:
    # with LoRA the reference is the frozen base the actor reads: nothing to offload
    if not spec.need_ref or spec.model.lora is not None or spec.ref.param_offload or not offload_supported():
        return spec, ()
    return (dataclasses.replace(spec, ref=dataclasses.replace(spec.ref, param_offload=True)),
            (f"{ARR}.ref.param_offload=True",))


def _teacher_offload(spec: RunSpec) -> tuple[RunSpec, tuple[str, ...]]:
    d = spec.distillation
    if d is None or d.param_offload or not offload_supported():
        return spec, ()
    return (dataclasses.replace(spec, distillation=dataclasses.replace(d, param_offload=True)),
            ("algorithm.distillation.teacher.param_offload=True",))


def _per_role(spec: RunSpec, suffix: str, attr: str, key: str, value: Any, applies: Callable[[Any], bool]
              ) -> tuple[RunSpec, tuple[str, ...]]:
    """`attr` set to `value` in the actor's and the critic's spec `{role}{suffix}` (`actor`, `actor_optim`,
    ...) where `applies` to it; `key`: the config key under the role's section."""
    updates: dict[str, Any] = {}
    keys: list[str] = []
    for role, section in (("actor", f"{ARR}.actor"), ("critic", "critic")):
        current = getattr(spec, role + suffix)
        if current is not None and applies(current):
            updates[role + suffix] = dataclasses.replace(current, **{attr: value})
            keys.append(f"{section}.{key}={value}")
    return dataclasses.replace(spec, **updates), tuple(keys)


def _optimizer_offload(spec: RunSpec) -> tuple[RunSpec, tuple[str, ...]]:
    if not offload_supported():
        return spec, ()
    return _per_role(spec, "_optim", "offload", "optim.offload", True, lambda o: not o.offload)


def _remat(spec: RunSpec) -> tuple[RunSpec, tuple[str, ...]]:
    # 'offload' already keeps no activation on the device; 'full' is the most a policy recomputes
    return _per_role(spec, "", "remat", "remat_policy", "full", lambda s: s.remat in ("none", "dots_saveable"))


def _bf16_moments(spec: RunSpec) -> tuple[RunSpec, tuple[str, ...]]:
    return _per_role(spec, "_optim", "moment_dtype", "optim.moment_dtype", "bfloat16",
                     lambda o: o.moment_dtype == "float32")


LEVERS: dict[str, Lever] = {lever.name: lever for lever in (
    Lever("ref_offload", "the reference weights in host memory between its passes (one copy in a step)",
          _ref_offload),
    Lever("teacher_offload", "the teacher's weights in host memory between its passes (one copy in a step)",
          _teacher_offload),
    Lever("optimizer_offload", "the optimizer state in host memory between updates (two copies a step)",
          _optimizer_offload),
    Lever("remat", "each decoder block recomputed in the backward (about a third more update FLOPs)", _remat),
    Lever("bf16_moments", "Adam's moments stored in bf16 (computed in fp32; the numbers change)", _bf16_moments),
)}
assert tuple(LEVERS) == MEMORY_LEVERS, "config/names.py lists the levers the config accepts, in cost order"


@dataclasses.dataclass(frozen=True)
class Fitted:
    """The spec the plan settled on, the keys its levers set, and the levers that did nothing or did not help."""

    spec: RunSpec
    attempt: Any  # what `attempt(spec)` returned for it
    pulled: tuple[str, ...]  # `key=value` set, in order
    left: tuple[str, ...]  # levers not in `trainer.memory_levers` that apply to this run (for the error)


def with_keys_in_config_json(spec: RunSpec, pulled: Sequence[str]) -> RunSpec:
    """`spec` whose resolved config tree (loggers, checkpoint metadata, the resume's config check) holds the
    values the levers set (`key=value`, as `Fitted.pulled`)."""
    if not pulled:
        return spec
    tree = json.loads(spec.config_json)
    for item in pulled:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = {"True": True, "False": False}.get(value, value)
    return dataclasses.replace(spec, config_json=json.dumps(tree))


def fit_with_levers(spec: RunSpec, names: Sequence[str], attempt: Callable[[RunSpec], Any],
                    excess: Callable[[Any], int]) -> Fitted:
    """Pulls the levers `names`, in order, while `excess(attempt(spec))` (the bytes over the device's
    memory, summed over the programs) is above 0: each one kept when it lowers the excess."""
    best = attempt(spec)
    pulled: list[str] = []
    for name in names:
        if excess(best) <= 0:
            break
        changed, keys = LEVERS[name].pull(spec)
        if not keys:
            continue
        trial = attempt(changed)
        if excess(trial) < excess(best):
            spec, best = changed, trial
            pulled += keys
    left = tuple(f"{lever.name}: {lever.what}" for lever in LEVERS.values()
                 if lever.name not in names and lever.pull(spec)[1])
    return Fitted(with_keys_in_config_json(spec, pulled), best, tuple(pulled), left)
