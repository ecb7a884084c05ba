"""Config importers: run a veRL, Trinity-RFT, ROLL or TRL config with jaxrl_llm.

    result = import_config("ppo_trainer.yaml")            # format detected from the top-level keys
    result.warn()                                          # one warning listing the ignored keys
    cfg = result.config()                                  # the default tree with the imported values
    cfg = validate_config(cfg)

    trl = import_trl_flags(["--learning_rate=1e-6", "--num_generations=8"], base=cfg)

`python launch/train.py --import_config=FILE.yaml [--import_format=verl|trinity|roll|trl]` does the
same. Keys with no counterpart are listed in one warning; keys that would change what the run
computes and that we cannot honour raise `ConfigError` naming the file and the key. Mapping tables:
docs/importing.md.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import ml_collections

from jaxrl_llm.config.importers import roll, trinity, verl
from jaxrl_llm.config.importers.common import NO_DUAL_CLIP, ImportResult, Mapper, load_yaml, read_config_file
from jaxrl_llm.config.importers.trl import import_trl, parse_trl_args, trl_trainer
from jaxrl_llm.config.schema import ConfigError

FORMATS = ("verl", "trinity", "roll", "trl", "trl_grpo", "trl_rloo")
TRL_MARKERS = ("num_generations", "per_device_train_batch_size", "learning_rate", "max_completion_length", "beta",
               "rloo_k", "output_dir", "gradient_accumulation_steps", "model_name_or_path", "reward_funcs",
               "dataset_name", "use_peft")


def detect_format(data: dict[str, Any]) -> str:
    """The format of a loaded config from its top-level keys."""
    keys = set(data)
    if "actor_rollout_ref" in keys or {"data", "algorithm", "trainer"} <= keys and "buffer" not in keys:
        return "verl"
    if "buffer" in keys or "synchronizer" in keys or ("algorithm" in keys and isinstance(data.get("algorithm"), dict)
                                                      and "algorithm_type" in data["algorithm"]):
        return "trinity"
    if keys & {"actor_train", "actor_infer", "num_return_sequences_in_group", "rollout_batch_size", "pretrain"}:
        return "roll"
    if keys & set(TRL_MARKERS):
        return "trl"
    raise ConfigError("cannot tell the config's format from its top-level keys "
                      f"({', '.join(sorted(keys)) or 'none'}); pass --import_format={'|'.join(FORMATS)}")


def _top_level(path: str) -> dict[str, Any]:
    """The file's mapping as written (no Hydra composition, interpolations left as text)."""
    from omegaconf import OmegaConf

    return cast(dict[str, Any], OmegaConf.to_container(read_config_file(path), resolve=False))


def import_config(path: str, format: str | None = None, *,  # (the CLI flag's name)
                  base: ml_collections.ConfigDict | None = None, num_devices: int | None = None,
                  dp_size: int | None = None) -> ImportResult:
    """Reads another framework's config file into our settings.

    format: verl | trinity | roll | trl (trl_grpo / trl_rloo: which TRL trainer runs the file; trl
      decides from the file); None = detected from the top-level keys.
    base: the config the result will be applied to (read where a mapping needs a current value,
      e.g. rollout.n for batch sizes); default: the default tree.
    num_devices / dp_size: for per-device sizes (default: jax.device_count() and the mesh).
    """
    raw: dict[str, str] = {}
    fmt = format or detect_format(_top_level(path))
    data = load_yaml(path, raw, missing_groups="error" if fmt == "verl" else "skip")
    if fmt not in FORMATS:
        raise ConfigError(f"--import_format={fmt!r}: expected one of {', '.join(FORMATS)}")
    m = Mapper(fmt, path, base=base, num_devices=num_devices, dp_size=dp_size)
    if fmt.startswith("trl_"):
        m.format = fmt
    if fmt == "verl":
        verl.import_verl(data, m, raw)
    elif fmt == "trinity":
        trinity.import_trinity(data, m, path)
    elif fmt == "roll":
        roll.import_roll(data, m)
    else:
        import_trl(data, m, whole_run=True, trainer=trl_trainer(data, path, fmt))
    return m.result()


def import_trl_flags(argv: Sequence[str], *, base: ml_collections.ConfigDict | None = None,
                     num_devices: int | None = None, dp_size: int | None = None) -> ImportResult:
    """TRL `GRPOConfig` / `RLOOConfig` command-line flags (`--learning_rate=1e-6 --num_generations 8`)
    as overrides on `base`."""
    m = Mapper("trl", "TRL flags", base=base, num_devices=num_devices, dp_size=dp_size)
    import_trl(parse_trl_args(argv), m, whole_run=False)
    return m.result()


HYDRA_FLAGS = ("--config-path", "--config-name")  # a pasted veRL line's Hydra config file


def split_hydra_config(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """A pasted veRL command line's `--config-path=DIR --config-name=NAME` (Hydra's flags, `=` or
    space separated) -> (the YAML file they name, the other items). The path is read from the current
    directory (Hydra reads a relative one from the veRL script's folder: give that folder's path)."""
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(items):
        name, sep, value = items[i].partition("=")
        if name in HYDRA_FLAGS:
            if not sep:
                if i + 1 >= len(items):
                    raise ConfigError(f"{name}: expected a value")
                value, i = items[i + 1], i + 1
            found[name] = value.strip("'\"")
        else:
            rest.append(items[i])
        i += 1
    if not found:
        return None, rest
    if "--config-name" not in found:
        raise ConfigError(f"--config-path={found['--config-path']}: give --config-name too (the YAML file in it)")
    folder = found.get("--config-path", ".")
    name = found["--config-name"]
    file = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    # Hydra reads a relative --config-path from the main module's folder (verl/trainer/ for main_ppo, run
    # from veRL's repository root); we try the current directory first, then that folder
    candidates = [os.path.join(folder, file)]
    if not os.path.isabs(folder):
        candidates.append(os.path.join("verl", "trainer", folder, file))
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        raise ConfigError(f"--config-path={folder} --config-name={name}: no file {' or '.join(candidates)} (a "
                          "relative --config-path is read from the current directory, then from verl/trainer/ "
                          "below it, where veRL's main_ppo reads it: run from veRL's repository root or give an "
                          "absolute path)")
    return os.path.normpath(path), rest


def split_trl_flags(items: Sequence[str]) -> tuple[list[str], list[str]]:
    """Command-line items after `--` -> (veRL `a.b=c` overrides, TRL `--name[=value]` flags with their
    values)."""
    overrides, flags = [], []
    in_flag = False
    for item in items:
        if item == "--":
            in_flag = False
        elif item.startswith("--"):
            flags.append(item)
            in_flag = "=" not in item
        elif in_flag and "=" not in item:
            flags.append(item)
        else:
            overrides.append(item)
            in_flag = False
    return overrides, flags


__all__ = ["FORMATS", "ImportResult", "NO_DUAL_CLIP", "detect_format", "import_config", "import_trl_flags",
           "load_yaml", "parse_trl_args", "split_hydra_config", "split_trl_flags"]
