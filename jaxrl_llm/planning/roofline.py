"""How fast a step would run, estimated: a roofline per program from its compiled cost analysis.

A program's time is estimated as the largest of
    FLOPs / the chip's matmul peak          (compute-bound)
    bytes accessed / its HBM bandwidth      (memory-bound)
    collective bytes / its link bandwidth   (interconnect-bound: ICI on TPU, NVLink on GPU)
per device, with the published figures of platform/chips.py. Everything here is an estimate: the
peaks are never reached, collectives overlap compute, and XLA's cost model is a model.

Counts (`Cost`) come from the compiled program (`compiled.cost_analysis()`: FLOPs, bytes accessed;
the collectives' wire bytes from its HLO), which counts every loop body once. So, as the memory plan
does for FLOPs: the same program compiled with each layer-scan trip running its layer twice counts one
layer more (`ModelConfig.scan_repeat`), the other layers are added, and the loops around the layers (micro-batches,
decode steps) are multiplied in by the program's own `Program.total_cost`, which also adds what the
compiled count cannot see (the decode attention kernel's KV reads: a custom call's cost is unknown
to XLA; the prefill the plan does not compile; a MoE model's routed experts inside the grouped
kernel's loop).

Collective wire bytes per device, ring algorithms over a group of n devices with a result of R bytes:
all-gather (n-1)/n * R, reduce-scatter (n-1) * R, all-reduce 2 (n-1)/n * R, all-to-all (n-1)/n * R,
collective-permute R.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from jaxrl_llm.planning.hbm_bytes import ARRAY, array_bytes, hbm_bytes_of
from jaxrl_llm.platform.chips import Chip

# `%name = TYPE op(`: an instruction's result type (an array or a tuple of arrays) and its op
_INSTRUCTION = re.compile(r"=\s*(\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+(all-gather|all-reduce|reduce-scatter|"
                          r"all-to-all|collective-permute)(-start)?\(")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")  # [groups, size]<=[devices]
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]+)\}")  # {{0,1,2,3},{4,5,6,7}}
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")  # mesh['a'=2,'b'=4] {'b'}


@dataclasses.dataclass(frozen=True)
class Cost:
    """Work of a program per device: FLOPs, HBM bytes accessed, collective bytes on the wire."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    link_bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes, self.link_bytes + other.link_bytes)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.flops - other.flops, self.hbm_bytes - other.hbm_bytes, self.link_bytes - other.link_bytes)

    def __mul__(self, k: float) -> Cost:
        return Cost(self.flops * k, self.hbm_bytes * k, self.link_bytes * k)

    def at_least_zero(self) -> Cost:
        return Cost(max(self.flops, 0.0), max(self.hbm_bytes, 0.0), max(self.link_bytes, 0.0))


def _group_size(line: str) -> int:
    by_mesh = _GROUPS_MESH.search(line)
    if by_mesh:
        sizes = {name.strip("'\" "): int(size) for name, size in
                 (axis.split("=") for axis in by_mesh.group(1).split(",") if "=" in axis)}
        return int(np.prod([sizes.get(name.strip("'\" "), 1) for name in by_mesh.group(2).split(",") if name.strip()]))
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota.group(2))
    listed = _GROUPS_LIST.search(line)
    return len(listed.group(1).split(",")) if listed else 1


def link_bytes_of(hlo_text: str) -> float:
    """Wire bytes per device of the collectives in a compiled module's text (each instruction once; see
    the module doc for the ring factors). An async pair counts at its start."""
    total = 0.0
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        result, op = match.group(1), match.group(2)
        if match.group(3):  # -start: (operands..., results...) tuples; the result is the second half
            arrays = ARRAY.findall(result)
            result = " ".join(f"{d}[{s}]" for d, s, _ in arrays[len(arrays) // 2:]) if len(arrays) > 1 else result
        size, n = array_bytes(result, on_chip=True), _group_size(line)  # on the wire wherever it lives
        if n <= 1 and op != "collective-permute":
            continue
        factor = {"all-gather": (n - 1) / n, "reduce-scatter": n - 1.0, "all-reduce": 2 * (n - 1) / n,
                  "all-to-all": (n - 1) / n, "collective-permute": 1.0}[op]
        total += factor * size
    return total


def compiled_cost(compiled: jax.stages.Compiled, text: str | None = None) -> Cost:
    """A compiled program's own counts (loop bodies once); `text`: its `as_text()` where the caller
    already holds it (a large program's text takes a while to print). HBM bytes on TPU are counted from the
    program's text (planning/hbm_bytes.py: XLA's TPU count charges whole weight stacks and on-chip buffers);
    elsewhere they are XLA's count."""
    from jaxrl_llm.platform.target import target_platform

    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis  # older jax: one per computation
    analysis = analysis or {}
    text = (compiled.as_text() or "") if text is None else text
    hbm = hbm_bytes_of(text) if target_platform() == "tpu" else float(analysis.get("bytes accessed", 0.0))
    return Cost(float(analysis.get("flops", 0.0)), hbm, link_bytes_of(text))


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A program's estimated time on a chip: each bound's seconds and the largest."""

    cost: Cost
    compute_s: float
    hbm_s: float
    link_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.hbm_s, self.link_s)

    @property
    def bound(self) -> str:
        """Which bound holds: 'compute', 'hbm' or 'link'."""
        return max((self.compute_s, "compute"), (self.hbm_s, "hbm"), (self.link_s, "link"))[1]


def roofline(cost: Cost, chip: Chip | None, peak_flops: float, hbm_bandwidth: float | None = None,
             link_bandwidth: float | None = None) -> Roofline:
    """`cost` against a chip's figures (`chip`), or the given ones where the chip table has no row
    (a CPU: its measured matmul peak; no HBM / link figure: those bounds are 0)."""
    hbm = hbm_bandwidth or (chip.hbm_bandwidth if chip else None)
    link = link_bandwidth or (chip.link_bandwidth if chip else None)
    return Roofline(cost, cost.flops / peak_flops, cost.hbm_bytes / hbm if hbm else 0.0,
                    cost.link_bytes / link if link else 0.0)
