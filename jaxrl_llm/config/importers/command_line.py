"""One run's command line -> its resolved config: what `launch/train.py` does before anything runs.

    cfg, dp = resolve_command_line(base, items, import_path="run_qwen2-7b_math.sh", num_devices=8)

`items` are the arguments after `--`: veRL `a.b=c` overrides, TRL `--name=value` flags and a pasted
veRL line's `--config-path` / `--config-name`. `import_path` is a peer's file: a YAML file (veRL,
Trinity-RFT, ROLL or TRL; `import_format` or detected) or a veRL example script (`*.sh`, read by
`verl_script.read_verl_script` without running it). The order, later wins: the imported file, the
script's own overrides, TRL flags, then the overrides on the command line.

Overrides naming keys of ours (or their aliases) are set as they are; the others (veRL keys with no
key of ours, placement keys) are imported with the veRL importer, so a pasted key maps, warns or is
refused exactly as the same key in a veRL YAML file does.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import ml_collections

from jaxrl_llm.config.importers import import_config, import_trl_flags, split_hydra_config, split_trl_flags
from jaxrl_llm.config.importers.common import ImportResult, Mapper, Source
from jaxrl_llm.config.importers.verl import SP_SCALED, import_verl_source, is_ours, is_verl_key
from jaxrl_llm.config.importers.verl_script import read_verl_script
from jaxrl_llm.config.overrides import apply_overrides, parse_value, split_override, unknown_key_message
from jaxrl_llm.config.schema import ConfigError
from jaxrl_llm.config.validate import mesh_dp_size, validate_config


def is_script(path: str | None) -> bool:
    return bool(path) and str(path).endswith(".sh")


def split_command_line(items: Sequence[str], import_path: str | None = None,
                       import_format: str | None = None) -> tuple[str | None, str | None, list[str], list[str]]:
    """-> (file to import, its format, veRL-style overrides, TRL flags). A veRL script's command line
    comes first, then the items."""
    hydra_file, rest = split_hydra_config(list(items))
    if hydra_file is not None and import_path:
        raise ConfigError(f"--import_config={import_path} and --config-path / --config-name ({hydra_file}) both name "
                          "a file to import: give one")
    script_overrides: list[str] = []
    if is_script(import_path):
        assert import_path is not None
        script_file, script_overrides = read_verl_script(import_path)
        import_path, import_format = script_file, "verl"
    import_path = import_path or hydra_file
    if hydra_file:
        import_format = "verl"
    positional, trl_flags = split_trl_flags(rest)
    overrides = script_overrides + [a for a in positional if a != "--"]
    return import_path, import_format, overrides, trl_flags


def import_overrides(overrides: Sequence[str], base: ml_collections.ConfigDict, num_devices: int,
                     source: str = "command line") -> tuple[list[str], ImportResult | None]:
    """Splits `key=value` overrides into ours (returned as they are) and veRL keys of no key of ours,
    which are imported like the same keys of a veRL YAML file (the ImportResult, None if there are none)."""
    ours: list[str] = []
    peer: dict[str, object] = {}
    # with Ulysses SP, veRL's per-device sizes are per SP group: imported (scaled) with the SP keys
    with_sp = any(split_override(o)[0].endswith("ulysses_sequence_parallel_size") for o in overrides)
    for item in overrides:
        key, text = split_override(item)
        # the sp sizes themselves go with them: the import reads them to scale and sets mesh.context
        scaled = with_sp and (key.lstrip("+") in SP_SCALED or key.endswith("ulysses_sequence_parallel_size"))
        if is_ours(key) and not scaled:
            ours.append(item)
        elif not scaled and not is_verl_key(key):
            raise ConfigError(unknown_key_message(key.lstrip("+")))
        else:
            peer[key] = parse_value(text)
    if not peer:
        return ours, None
    m = Mapper("verl", source, base=base, num_devices=num_devices)
    import_verl_source(m, Source(peer, source))
    return ours, m.result()


def resolve_command_line(base: ml_collections.ConfigDict, items: Sequence[str] = (), *,
                         import_path: str | None = None, import_format: str | None = None,
                         extra_overrides: Sequence[str] = (), num_devices: int | None = None,
                         check_paths: bool = True) -> tuple[ml_collections.ConfigDict, int]:
    """The resolved config and its data-parallel size (see the module doc); `extra_overrides` (our
    `--config.a.b=v` flags) apply before the items' overrides; `check_paths=False` leaves out the
    check that data files and model folders exist (`validate.check_paths`). Raises ConfigError."""
    import jax

    num_devices = num_devices or jax.device_count()
    import_path, import_format, overrides, trl_flags = split_command_line(items, import_path, import_format)
    overrides = list(extra_overrides) + overrides
    mesh = [o for o in overrides if o.split("=", 1)[0].lstrip("+").startswith("mesh.")]
    cfg = base

    def with_mesh() -> ml_collections.ConfigDict:
        """The config so far with the command line's mesh: what each import's per-device sizes are
        measured against."""
        return apply_overrides(copy.deepcopy(cfg), mesh)

    if import_path:
        result = import_config(import_path, import_format, base=with_mesh(), num_devices=num_devices)
        result.warn()
        cfg = result.apply(cfg)
    if trl_flags:
        result = import_trl_flags(trl_flags, base=with_mesh(), num_devices=num_devices)
        result.warn()
        cfg = result.apply(cfg)
    ours, peer = import_overrides(overrides, with_mesh(), num_devices)
    if peer is not None:
        peer.warn()
        cfg = peer.apply(cfg)
    cfg = apply_overrides(cfg, ours)
    cfg = validate_config(cfg, num_devices=num_devices, check_paths=check_paths)
    return cfg, mesh_dp_size(cfg, num_devices)


__all__ = ["import_overrides", "is_script", "resolve_command_line", "split_command_line"]
