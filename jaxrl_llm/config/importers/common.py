"""Shared machinery of the config importers: reading a YAML file with its OmegaConf
interpolations resolved, a flat view of it whose keys are taken one by one (`Source`), and the
`Mapper` that collects our settings, the ignored keys (one warning) and raises `ConfigError`s that
name the file and the key.

Rules every importer follows (docs/importing.md):
- a key is set only on keys of our tree (`jaxrl_llm/config/tree.py`);
- a key with no counterpart, or one that only configures torch / vLLM / Ray / placement, is listed
  in the import's single warning;
- a key whose value changes what the run computes and that we cannot honour raises a ConfigError
  before anything runs.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import ml_collections

from jaxrl_llm.config import names
from jaxrl_llm.config.overrides import FIELDS, OPEN_SECTIONS
from jaxrl_llm.config.schema import ConfigError, get_path, set_path

logger = logging.getLogger(__name__)

# A dual-clip constant that never binds: the vanilla loss caps log-ratios at 20 (ratio <= e^20 ~ 4.9e8),
# so max(-A * ratio, ...) can never exceed -A * 1e9. Used for frameworks whose PPO loss has no dual clip.
NO_DUAL_CLIP = 1e9

PLACEMENT = "torch/vLLM/Ray/placement only"
NO_VALUE = object()  # Mapper.ignore without a value to show
NO_COUNTERPART = "no counterpart in jaxrl_llm"

# A value read from a peer's config file: a scalar, list, dict or None as YAML / JSON / a script's
# flags give it, or an `Unresolved` interpolation.
SourceValue = Any


class Unresolved:
    """A value whose interpolation could not be resolved; an error only if the key is used."""

    def __init__(self, text: str, why: str):
        self.text, self.why = text, why

    def __repr__(self) -> str:
        return f"<unresolved {self.text}>"


def _raw_text(node: Any, key: Any) -> str:
    """`node[key]` as written, before interpolation (e.g. '${data.max_prompt_length}')."""
    child = node._get_node(key)
    return "" if child is None else str(child._value())


def _resolve_node(node: Any, prefix: str = "", raw: dict[str, str] | None = None) -> SourceValue:
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(node, DictConfig):
        out = {}
        for key in node.keys():
            if raw is not None and isinstance(key, (str, int)) and OmegaConf.is_interpolation(node, key):
                raw[f"{prefix}{key}"] = _raw_text(node, key)
            try:
                child = node[key]
            except OmegaConfBaseException as err:
                out[key] = Unresolved(_raw_text(node, key), str(err).splitlines()[0])
                continue
            out[key] = _resolve_node(child, f"{prefix}{key}.", raw)
        return out
    if isinstance(node, ListConfig):
        try:
            return OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as err:
            return Unresolved(str(node), str(err).splitlines()[0])
    return node


def read_config_file(path: str) -> Any:
    """The file as OmegaConf reads it (a DictConfig: nothing composed or resolved); a missing file,
    bad YAML or a top level that is not a mapping is a ConfigError naming the file."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        cfg = OmegaConf.load(path)
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot parse YAML ({err})") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return cfg


def load_yaml(path: str, raw: dict[str, str] | None = None, *, missing_groups: str = "error") -> dict[str, Any]:
    """A YAML file as plain nested dicts, Hydra/OmegaConf interpolations (`${oc.env:HOME}`,
    `${oc.env:X,default}`, `${oc.select:a.b,default}`, `${a.b}`) resolved; values that cannot be
    resolved become `Unresolved` (an error only where the importer uses them). A file with a Hydra
    `defaults:` list is composed first (`compose_hydra`); when a group file is not there,
    `missing_groups="error"` raises and `"skip"` reads the file without its defaults list (ROLL's
    defaults are DeepSpeed / environment groups: keys that read them stay unresolved, an error only
    where used). `raw`, when given, receives dotted key -> interpolation text for every interpolated
    value."""
    cfg = read_config_file(path)
    if "defaults" in cfg:
        try:
            cfg = compose_hydra(path)
        except MissingGroupError:
            if missing_groups == "error":
                raise
            cfg.pop("defaults")
    return _resolve_node(cfg, raw=raw)


class MissingGroupError(ConfigError):
    """A Hydra defaults list names a config group file that is not there."""


def compose_hydra(path: str) -> Any:
    """The config Hydra composes from `path` and its `defaults:` list (config groups read from the
    file's folder and its `hydra.searchpath`, as veRL's `--config-path` / `--config-name` do), with
    Hydra itself. A group file that is not there is a ConfigError naming it."""
    import warnings

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    folder, name = os.path.split(os.path.abspath(path))
    searchpath = _search_path(path)
    overrides = [f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else []
    try:
        with warnings.catch_warnings(), initialize_config_dir(config_dir=folder, version_base=None):
            warnings.simplefilter("ignore", UserWarning)  # Hydra 1.1's note on a defaults list without _self_
            return compose(config_name=os.path.splitext(name)[0], overrides=overrides)
    except MissingConfigException as err:
        missing = getattr(err, "missing_cfg_file", None) or str(err).splitlines()[0]
        raise MissingGroupError(f"{path}: defaults: the config group file {missing!r} is not there (Hydra reads the "
                                f"groups from {folder} and the file's hydra.searchpath; for veRL, copy veRL's "
                                "verl/trainer/config folder beside it, or import veRL's _generated_ppo_trainer.yaml, "
                                "which has no defaults list)") from None
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(f"{path}: cannot compose its Hydra defaults list ({str(err).splitlines()[0]})") from None


def _search_path(path: str) -> list[str]:
    """The file's `hydra.searchpath` with each relative `file://` folder made absolute: Hydra reads it from
    the working directory (veRL's examples name `file://verl/trainer/config`, run from veRL's root); one
    not there is looked for from the file's own folder up (the repository the file sits in). [] when the
    file has none."""
    import yaml

    with open(path) as f:
        node = yaml.safe_load(f) or {}
    entries = (node.get("hydra") or {}).get("searchpath") if isinstance(node, Mapping) else None
    if not entries:
        return []
    out = []
    for entry in entries:
        entry = str(entry)
        rel = entry[len("file://"):] if entry.startswith("file://") else None
        if rel is not None and not os.path.isabs(rel) and not os.path.isdir(rel):
            here = os.path.dirname(os.path.abspath(path))
            while not os.path.isdir(os.path.join(here, rel)) and os.path.dirname(here) != here:
                here = os.path.dirname(here)
            if os.path.isdir(os.path.join(here, rel)):
                entry = "file://" + os.path.join(here, rel)
        out.append(entry)
    return out


def flatten(node: Mapping[str, Any], prefix: str = "", leaves: Iterable[str] = ()) -> dict[str, Any]:
    """Dotted keys -> leaf values; dicts are descended except empty ones and keys in `leaves`."""
    out: dict[str, Any] = {}
    leaves = tuple(leaves)
    for name, value in node.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and value and key not in leaves:
            out.update(flatten(value, key + ".", leaves))
        else:
            out[key] = value
    return out


class Source:
    """The flat keys of one imported file (or section); each key is taken at most once.

    `display` is prepended to keys in messages (e.g. `trainer.trainer_config.` for Trinity's veRL
    section), so errors and the warning name the key as the user wrote it.
    """

    def __init__(self, flat: dict[str, Any], path: str, display: str = ""):
        self.flat, self.path, self.display = dict(flat), path, display

    def full(self, key: str) -> str:
        return self.display + key

    def has(self, key: str) -> bool:
        return key in self.flat

    def peek(self, key: str, default: SourceValue = None) -> SourceValue:
        value = self.flat.get(key, default)
        if isinstance(value, Unresolved):
            self.unresolved(key, value)
        return value

    def take(self, key: str, default: SourceValue = None) -> SourceValue:
        """The value of `key` (removed from the remaining keys), `default` when absent."""
        if key not in self.flat:
            return default
        value = self.flat.pop(key)
        if _has_unresolved(value):
            self.unresolved(key, value)
        return value

    def drop(self, key: str) -> SourceValue:
        """Removes `key` and returns its raw value (possibly `Unresolved`): for keys that are ignored."""
        return self.flat.pop(key, None)

    def unresolved(self, key: str, value: SourceValue) -> NoReturn:
        bad = value if isinstance(value, Unresolved) else next(_iter_unresolved(value))
        raise ConfigError(f"{self.path}: {self.full(key)}: cannot resolve {bad.text} ({bad.why})")

    def sub(self, prefix: str) -> Source:
        """Moves the keys under `prefix` into a new Source (keys relative to the prefix)."""
        keys = [k for k in self.flat if k.startswith(prefix)]
        return Source({k[len(prefix):]: self.flat.pop(k) for k in keys}, self.path, self.display + prefix)

    def keys_under(self, prefix: str) -> list[str]:
        return [k for k in self.flat if k == prefix or k.startswith(prefix + ".")]

    def remaining(self) -> list[str]:
        return list(self.flat)


def _iter_unresolved(value: SourceValue):
    if isinstance(value, Unresolved):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _iter_unresolved(v)
    elif isinstance(value, list):
        for v in value:
            yield from _iter_unresolved(v)


def _has_unresolved(value: SourceValue) -> bool:
    return next(_iter_unresolved(value), None) is not None


def _short(value: SourceValue, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    if isinstance(value, Unresolved):
        text = value.text
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclasses.dataclass
class ImportResult:
    """What an import produced: our settings (key -> value, applied in order onto a base config),
    the ignored keys (key -> reason, reported in one warning) and the format."""

    format: str
    source: str
    settings: dict[str, Any]
    ignored: dict[str, str]
    origin: dict[str, str] = dataclasses.field(default_factory=dict)  # our key -> the key it came from
    values: dict[str, Any] = dataclasses.field(default_factory=dict)  # ignored key -> its value, where known

    def apply(self, cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """Sets the imported values on `cfg` (in place) and returns it."""
        for key, value in self.settings.items():
            set_path(cfg, key, copy.deepcopy(value))
        return cfg

    def config(self, base: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
        """The imported values on a copy of `base` (default: the default tree)."""
        from jaxrl_llm.config import default_config

        return self.apply(copy.deepcopy(base) if base is not None else default_config())

    def overrides(self) -> list[str]:
        """The settings as `key=value` strings (YAML flow values), e.g. to paste on a command line."""
        import yaml

        return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                for k, v in self.settings.items()]

    def warning(self) -> str | None:
        if not self.ignored:
            return None
        by_reason: dict[str, list[str]] = {}
        for key, why in self.ignored.items():
            shown = f"{key}={_short(self.values[key])}" if key in self.values else key
            by_reason.setdefault(why, []).append(shown)
        parts = [f"{', '.join(keys)} ({why})" for why, keys in by_reason.items()]
        return (f"{self.source} ({self.format}): {len(self.ignored)} key(s) change nothing jaxrl_llm computes and "
                f"were ignored: " + "; ".join(parts))

    def warn(self) -> None:
        """Logs the single warning listing every ignored key (if any)."""
        message = self.warning()
        if message:
            logger.warning(message)


class Mapper:
    """Collects our settings from one import; `base` is the config the import is applied to (its
    values are read where a mapping needs the current value of a key the file does not set)."""

    def __init__(self, fmt: str, source: str, *, base: ml_collections.ConfigDict | None = None,
                 num_devices: int | None = None, dp_size: int | None = None):
        from jaxrl_llm.config import default_config

        self.format, self.source = fmt, source
        self.base = base if base is not None else default_config()
        self.num_devices, self.dp_size = num_devices, dp_size
        self.settings: dict[str, Any] = {}
        self.ignored: dict[str, str] = {}
        self.values: dict[str, Any] = {}
        self.origin: dict[str, str] = {}

    def set(self, ours: str, value: SourceValue, src: str) -> None:
        if ours not in FIELDS and not any(ours.startswith(s + ".") for s in OPEN_SECTIONS):
            raise AssertionError(f"importer bug: {ours} is not a key of the config tree")
        if _has_unresolved(value):
            bad = next(_iter_unresolved(value))
            self.error(src, f"cannot resolve {bad.text} ({bad.why})")
        self.settings.pop(ours, None)  # re-setting moves the key to the end (later wins)
        self.settings[ours] = value
        self.origin[ours] = src

    def get(self, ours: str) -> Any:
        """The value `ours` will have: imported if set, else the base config's."""
        return self.settings[ours] if ours in self.settings else get_path(self.base, ours)

    def ignore(self, src: str, why: str = NO_COUNTERPART, value: SourceValue = NO_VALUE) -> None:
        """`src` changes nothing jaxrl_llm computes: listed (with `value`, when given) in the one warning."""
        self.ignored[src] = why
        if value is not NO_VALUE:
            self.values[src] = value

    def error(self, src: str, why: str) -> NoReturn:
        raise ConfigError(f"{self.source}: {src}: {why}")

    def dp(self) -> int:
        """Data-parallel size the imported per-device sizes are measured against."""
        if self.dp_size is not None:
            return self.dp_size
        from jaxrl_llm.config.validate import mesh_dp_size
        from jaxrl_llm.sharding.mesh import MESH_AXES

        mesh = copy.deepcopy(self.base.mesh)
        for axis in MESH_AXES:
            mesh[axis] = self.get(f"mesh.{axis}")
        return mesh_dp_size(ml_collections.ConfigDict({"mesh": mesh}), self.devices())

    def devices(self) -> int:
        """Devices the import is measured against (`num_devices`, else this host's)."""
        if self.num_devices is not None:
            return self.num_devices
        import jax

        return jax.device_count()

    def set_lora(self, rank: SourceValue, alpha: SourceValue, targets: SourceValue, src: tuple[str, str, str]) -> None:
        """A peer's LoRA adapter -> model.lora_rank / lora_alpha / target_modules (`src`: the three keys
        it came from); a comma-separated target string becomes a list, as PEFT reads it."""
        if isinstance(targets, str) and targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        model = "actor_rollout_ref.model"
        self.set(f"{model}.lora_rank", int_or_error(self, src[0], rank), src[0])
        self.set(f"{model}.lora_alpha", alpha, src[1])
        self.set(f"{model}.target_modules", targets, src[2])

    def check_names(self) -> None:
        """Estimator / loss / KL / aggregation names we do not have: an error naming the source key."""
        checks = [("algorithm.adv_estimator", names.adv_estimators()),
                  ("actor_rollout_ref.actor.policy_loss.loss_mode", names.policy_losses()),
                  ("actor_rollout_ref.actor.loss_agg_mode", names.loss_agg_modes()),
                  ("actor_rollout_ref.actor.kl_loss_type", names.kl_names()),
                  ("algorithm.kl_penalty", names.kl_names())]
        for key, valid in checks:
            if key in self.settings and self.settings[key] not in valid:
                self.error(self.origin[key], f"{self.settings[key]!r} is not available in jaxrl_llm "
                                             f"({key}: {', '.join(sorted(valid))})")

    def result(self) -> ImportResult:
        self.check_names()
        return ImportResult(self.format, self.source, dict(self.settings), dict(self.ignored), dict(self.origin),
                            dict(self.values))


def is_off(value: SourceValue) -> bool:
    """Unset or switched off: a key with this value asks for nothing."""
    return value is None or value is False or (isinstance(value, (str, list, dict, tuple)) and not value) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def leftover(m: Mapper, key: str, value: SourceValue, why: str | None = None) -> None:
    """A key no rule of the importer took: listed (with its value) when `why` says what makes it
    harmless or it is off; otherwise an error, since what it would change cannot be honoured."""
    if why is not None:
        m.ignore(key, why, value)
    elif is_off(value):
        m.ignore(key, "no counterpart in jaxrl_llm; unset / off, so it changes nothing", value)
    else:
        m.error(key, f"{value!r}: no counterpart in jaxrl_llm, so what it would change cannot be honoured (a key "
                     "that changes nothing computed is listed in the importer's harmless keys: "
                     "docs/importing.md)")


def ratio_steps(value: int, per_step: int) -> int:
    """A count in optimizer steps converted to our training steps (rounded up, at least 1)."""
    return max(1, math.ceil(value / per_step))


def int_or_error(m: Mapper, src: str, value: SourceValue) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        m.error(src, f"expected an integer, got {value!r}")
    return int(value)


# trackers veRL / TRL / ROLL / Trinity-RFT configs name that jaxrl_llm does not log to (warned, dropped)
PEER_LOGGERS = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio", "file", "comet_ml", "neptune", "aim",
                "dvclive", "codecarbon", "azure_ml", "dagshub", "flyte")


def logger_sinks(m: Mapper, src: str, names_in: Iterable[str]) -> list[str]:
    """Other frameworks' logger / tracker names -> trainer.logger (console + jsonl always kept)."""
    import importlib.util

    sinks = ["console", "jsonl"]
    for name in names_in:
        low = str(name).lower()
        package = {"tensorboard": "tensorboardX", "wandb": "wandb"}.get(low)
        if package is not None and importlib.util.find_spec(package) is None:
            m.ignore(f"{src}={name}", f"a logging backend whose package ({package}) is not installed; the run logs to "
                                      "console and jsonl")
        elif package is not None:
            sinks.append(low)
        elif low in PEER_LOGGERS:  # a tracker of the peers': a logging backend changes nothing computed
            m.ignore(f"{src}={name}", f"logger {name!r} is not available (console, jsonl, tensorboard, wandb)")
        elif low not in ("console", "stdout", "none", "", "jsonl"):
            m.error(src, f"unknown sink {name!r}: neither jaxrl_llm's (console, jsonl, tensorboard, wandb) nor a "
                         f"tracker the peers name ({', '.join(PEER_LOGGERS)})")
    return list(dict.fromkeys(sinks))
