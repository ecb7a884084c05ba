"""TPU slices without a TPU: gcloud accelerator-type names -> compile-only devices from libtpu.

`jax.experimental.topologies.get_topology_desc(platform="tpu", ...)` describes a slice on any x86
host when libtpu is installed (the `tpu-plan` extra); a program jitted on a mesh of those devices
compiles with the real TPU compiler (Mosaic kernels included) and reports its memory and cost
analyses. Nothing runs: the devices are compile-only.

Names as gcloud spells them: `v4-N`, `v5p-N` and `tpu7x-N` count TensorCores (2 per chip: one megacore
JAX device per chip on v4 / v5p, one device per TensorCore on TPU7x), `v5litepod-N` / `v5e-N` and
`v6e-N` count chips; a topology string (`v5e:2x2`, `v5p:2x2x1`, `tpu7x:2x2x1`) is accepted as it is.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import re
from typing import Any

from jaxrl_llm.platform.chips import Chip, Device, chip_for

log = logging.getLogger("jaxrl_llm")


@dataclasses.dataclass(frozen=True)
class _Generation:
    topology: str  # libtpu's topology prefix
    cores_per_chip: int  # TensorCores per chip in the accelerator-type count
    rank: int  # torus dimensions
    devices_per_chip: int  # JAX devices per chip
    device_kind: str  # what its devices' `device_kind` starts with (the chip table's key)


_V5E = _Generation("v5e", 1, 2, 1, "tpu v5 lite")
_GENERATIONS = {"v4": _Generation("v4", 2, 3, 1, "tpu v4"), "v5p": _Generation("v5p", 2, 3, 1, "tpu v5p"),
                "v5litepod": _V5E, "v5e": _V5E, "v6e": _Generation("v6e", 1, 2, 1, "tpu v6 lite"),
                "tpu7x": _Generation("tpu7x", 2, 3, 2, "tpu7x")}
_BY_TOPOLOGY = {g.topology: g for g in _GENERATIONS.values()}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
              512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16", 8192: "16x16x32"}
INSTALL_HINT = "pip install 'jaxrl_llm[tpu-plan]' (libtpu: the TPU compiler, which runs on any x86 host)"


class TpuPlanError(ValueError):
    """A TPU target that cannot be planned (unknown name, libtpu missing): a user error, one line."""


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A slice (or several) as compile-only devices."""

    name: str  # what the user asked for, e.g. v5p-64
    topology: str  # libtpu's topology string, e.g. v5p:2x4x4
    num_slices: int
    chip: Chip
    devices: tuple[Device, ...]

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        chip = self.chip
        unit = "devices (TensorCores)" if _BY_TOPOLOGY[self.topology.split(":")[0]].devices_per_chip > 1 else "chips"
        return (f"{self.name} ({self.topology}{slices}: {self.num_devices} {chip.name} {unit}, "
                f"{chip.hbm_bytes / (1 << 30):.0f} GiB HBM and {chip.bf16_flops / 1e12:.0f} bf16 TFLOP/s each)")


def parse_accelerator_type(name: str) -> tuple[str, int]:
    """(libtpu topology string, JAX devices per slice) of an accelerator type or a topology string."""
    text = name.strip().lower()
    if ":" in text:  # a topology string already
        gen, _, shape = text.partition(":")
        if gen not in _BY_TOPOLOGY or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
            raise TpuPlanError(f"--topology {name!r}: not a TPU topology (e.g. v5e:2x2, v5p:2x2x1, tpu7x:2x2x1)")
        chips = 1
        for d in shape.split("x"):
            chips *= int(d)
        return text, chips * _BY_TOPOLOGY[gen].devices_per_chip
    match = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e|tpu7x)-(\d+)", text)
    if not match:
        raise TpuPlanError(f"--topology {name!r}: expected an accelerator type as gcloud names it "
                           "(v4-8, v5litepod-8 / v5e-8, v5p-64, v6e-8, tpu7x-8) or a topology (v5e:2x2)")
    gen = _GENERATIONS[match.group(1)]
    count = int(match.group(2))
    chips, rem = divmod(count, gen.cores_per_chip)
    shapes = _SHAPES_3D if gen.rank == 3 else _SHAPES_2D
    if rem or chips not in shapes:
        unit = "TensorCores" if gen.cores_per_chip > 1 else "chips"
        raise TpuPlanError(f"--topology {name!r}: {match.group(1)} slices come in "
                           f"{sorted(c * gen.cores_per_chip for c in shapes)} ({unit})")
    return f"{gen.topology}:{shapes[chips]}", chips * gen.devices_per_chip


def accelerator_chip(name: str) -> Chip:
    """The chip of an accelerator type or topology string (v5p-64 -> TPU v5p)."""
    topology, _ = parse_accelerator_type(name)
    chip = chip_for(_BY_TOPOLOGY[topology.split(":")[0]].device_kind)
    if chip is None:  # parse_accelerator_type accepts only chips the table knows
        raise TpuPlanError(f"{name}: no chip figures for {topology}")
    return chip


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


# libtpu 0.0.42.1 (jax 0.10.2's) segfaults compiling full-size programs for TPU7x (the 0.5B sampler at
# 1k + 2k tokens; the tiny test programs compile); 0.0.45 compiles them with the same jax
# (docs/performance-history.md, "libtpu's crashes"). Newer releases (0.0.52) no longer read jax 0.10.2's HLO.
TPU7X_LIBTPU = (0, 0, 45)


def tpu7x_libtpu_warning(topology: str, libtpu_version: str | None, library_path: str | None) -> str | None:
    """Why planning `topology` with this libtpu may crash, and the fix; None where it will not.
    `library_path`: TPU_LIBRARY_PATH (another libtpu.so chosen by hand: its version is not the package's)."""
    if not topology.startswith("tpu7x") or library_path or libtpu_version is None:
        return None
    release = tuple(int(x) for x in re.findall(r"\d+", libtpu_version)[:3])
    if release >= TPU7X_LIBTPU:
        return None
    return (f"libtpu {libtpu_version} crashes (SIGSEGV) compiling full-size programs for {topology}; libtpu "
            f"{'.'.join(map(str, TPU7X_LIBTPU))} compiles them with this jax: pip download --no-deps "
            f"libtpu=={'.'.join(map(str, TPU7X_LIBTPU))}, unzip it and set "
            "TPU_LIBRARY_PATH=<that folder>/libtpu/libtpu.so")


def _libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def tpu_target(name: str, num_slices: int = 1) -> TpuTarget:
    """Compile-only devices of `name` (see the module docstring); raises TpuPlanError with what to
    install when libtpu is missing."""
    topology, _ = parse_accelerator_type(name)
    if num_slices < 1:
        raise TpuPlanError(f"--num_slices={num_slices} must be >= 1")
    if not libtpu_installed():
        raise TpuPlanError(f"--topology {name}: compiling for a TPU needs libtpu: {INSTALL_HINT}")
    from jax.experimental import topologies

    # compile-only use needs no exclusive TPU: without this a second process (a test beside a
    # planning run) fails on libtpu's lockfile
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    warning = tpu7x_libtpu_warning(topology, _libtpu_version(), os.environ.get("TPU_LIBRARY_PATH"))
    if warning:
        log.warning(warning)

    kwargs: dict[str, Any] = {"num_slices": num_slices} if num_slices > 1 else {}
    if topology.startswith("v4:"):  # one JAX device per chip (its two TensorCores as one), as v4 pods run
        kwargs["chip_config_name"] = "megacore"
    if topology.endswith(":2x4"):  # GCP's v5e-8 / v6e-8 are one VM of 8 chips (larger slices: 4 a host)
        kwargs["chips_per_host_bounds"] = (2, 4, 1)
    try:
        devices = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs).devices
    except Exception as err:  # libtpu's own message names what it did not accept
        raise TpuPlanError(f"--topology {name} ({topology}): libtpu could not describe it: {err}") from err
    chip = chip_for(devices[0])
    if chip is None:
        raise TpuPlanError(f"--topology {name}: no published figures for device kind {devices[0].device_kind!r}")
    return TpuTarget(name, topology, num_slices, chip, tuple(devices))
