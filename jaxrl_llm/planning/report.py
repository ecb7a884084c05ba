"""What a memory plan reports (planning/memory.py makes it): each program's per-device bytes, FLOPs and cost
(`ProgramMemory`), the plan's table, estimates and fit check (`MemoryPlan`), and the lines a multi-host mesh adds
(what each process reads and holds, which mesh axes cross slices)."""
from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.config.schema import ConfigError
from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.planning.roofline import Cost, Roofline, roofline
from jaxrl_llm.platform.chips import Chip
from jaxrl_llm.sharding.mesh import slice_of

GiB = 1 << 30


class MemoryPlanError(ConfigError):
    """A program of the step does not fit the device memory (message: the program and the keys)."""


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One program's per-device memory and cost."""

    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    resident_bytes: int  # persistent step state held meanwhile, not among the arguments
    params_bytes: int  # params among the arguments
    opt_state_bytes: int  # optimizer state among the arguments
    kv_bytes: int  # the sampler's KV cache (inside temporaries)
    flops: float  # per device, loop trips included
    micro: int | None  # sequences per device per micro-batch (passes that have one)
    keys: tuple[str, ...]  # config keys that make it smaller
    note: str | None = None  # e.g. the TPU compiler refused it for lack of HBM (temps: what it needed)
    counted: Cost | None = None  # the compiled program's own counts (each loop body once), when it compiled
    # of `counted`'s HBM bytes, those outside the program's loops (a TPU target: planning/hbm_bytes.py), for a
    # program whose loop trips do not repeat them (`Program.prologue_once`); None: not read
    outside_loops_hbm: float | None = None
    # one trip of its layer scans in HBM bytes, counted in the program (a TPU target: planning/hbm_bytes.py
    # `layer_loop_bytes`); None: one layer's bytes come from the program compiled with two layers a trip
    layer_hbm: float | None = None
    cost: Cost | None = None  # the whole program per device, every layer and loop trip (`Planner.costed`)
    model_flops: float | None = None  # FLOPs of the model math it runs, no recompute (updates: the MFU numerator)
    # our Pallas kernels' custom calls in the compiled program, (call target, count), on a TPU or GPU target:
    # where a kernel should serve and none is listed, XLA's own formulation runs instead
    kernels: tuple[tuple[str, int], ...] = ()

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.resident_bytes

    def fits(self, limit: int) -> bool:
        """Within `limit` bytes per device, and compiled: a program the TPU compiler refused for lack of
        HBM does not fit whatever its bytes add up to (the compiler's usable HBM is below the published
        figure, and its refusal counts the temporaries only)."""
        return self.note is None and self.total_bytes <= limit


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    programs: tuple[ProgramMemory, ...]
    device_memory: int | None  # bytes per device; None = unknown (no limit)
    device_memory_source: str
    peak_flops: float | None  # FLOP/s of one device (measured matmul)
    batch_plan: BatchPlan  # with every 'auto' micro-batch resolved
    auto: tuple[tuple[str, int], ...] = ()  # (pass, picked sequences per device)
    target: str | None = None  # the TPU slice compiled for (None: the local devices)
    peak_source: str = "the measured matmul peak"
    chip: Chip | None = None  # the device's published figures (None: a CPU, or a device the table lacks)
    hbm_bandwidth: float | None = None  # bytes/s per device where the chip table has none (a measured CPU)
    num_devices: int | None = None  # the mesh's
    hosts: tuple[str, ...] = ()  # what each process of a multi-host mesh loads, writes and exchanges (`hosts_lines`)
    levers: tuple[str, ...] = ()  # `key=value` the plan set to make the step fit (planning/levers.py)
    levers_left: tuple[str, ...] = ()  # levers this run could still use, not in trainer.memory_levers
    spec: RunSpec | None = None  # the run as planned: levers pulled, every 'auto' micro-batch resolved

    def program(self, name: str) -> ProgramMemory:
        return next(p for p in self.programs if p.name == name)

    def roofline(self, p: ProgramMemory) -> Roofline | None:
        """`p`'s estimated time (planning/roofline.py), where its whole cost was computed."""
        if p.cost is None or not self.peak_flops:
            return None
        return roofline(p.cost, self.chip, self.peak_flops, hbm_bandwidth=self.hbm_bandwidth)

    def estimates(self) -> list[str]:
        """The step's estimated time, the rollout's tokens/s per device and the updates' MFU (lines)."""
        lines = []
        times = {p.name: r for p in self.programs if (r := self.roofline(p)) is not None}
        if not times:
            return lines
        bp = self.batch_plan
        lines.append(f"estimated step: {sum(r.seconds for r in times.values()):.2f} s over {len(times)} programs "
                     f"(roofline estimates at {self._figures()}; measured steps run slower)")
        if "sample" in times:
            tokens = bp.sequences * bp.response_length
            devices = self.num_devices or 1
            lines.append(f"estimated rollout: {tokens / times['sample'].seconds / devices:,.0f} response tokens/s "
                         f"per device ({bp.sequences} x {bp.response_length} tokens over {devices} devices)")
        for p in self.programs:
            r = times.get(p.name)
            if r is not None and p.model_flops and self.peak_flops:
                # XLA's count can fall short of the model's (how it partitions a matmul's gradient): then the
                # estimate's time, and this MFU, are off by that much
                short = (f"; XLA counts {r.cost.flops / p.model_flops:.2f}x the model's FLOPs"
                         if r.cost.flops < p.model_flops else "")
                lines.append(f"estimated {p.name} MFU: {100 * p.model_flops / r.seconds / self.peak_flops:.1f}% "
                             f"(model FLOPs, no recompute{short})")
        return lines

    def _figures(self) -> str:
        chip, peak = self.chip, self.peak_flops or 0.0
        if chip is None:
            hbm = f", {self.hbm_bandwidth / 1e9:.0f} GB/s measured" if self.hbm_bandwidth else ", no bandwidth figure"
            return f"{peak / 1e12:.2f} TFLOP/s{hbm}"
        return (f"{chip.name}'s published {peak / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s "
                f"HBM, {chip.link_bandwidth / 1e9:.0f} GB/s interconnect")


    def table(self) -> str:
        mem = "unknown (no limit)" if self.device_memory is None else gib(self.device_memory)
        lines = [f"compiled for {self.target}"] if self.target else []
        lines += list(self.hosts)
        lines += [f"memory plan (per device; device memory {mem}, {self.device_memory_source}):",
                 f"{'program':<14}{'micro':>6}{'args':>10}{'outputs':>10}{'temps':>10}{'resident':>10}"
                 f"{'total':>10}{'fit':>5}{'params':>10}{'opt':>10}{'KV':>10}{'TFLOP':>10}{'GB HBM':>10}"
                 f"{'GB link':>10}{'est. s':>10}{'bound':>8}"]
        for p in self.programs:
            fit = "-" if self.device_memory is None else ("ok" if p.fits(self.device_memory) else "NO")
            if p.note:
                fit += "*"
            r = self.roofline(p)
            if r is not None:
                work = f"{r.cost.flops / 1e12:>10.2f}{r.cost.hbm_bytes / 1e9:>10.1f}{r.cost.link_bytes / 1e9:>10.1f}"
                secs = f"{r.seconds:10.2f}{r.bound:>8}"
            else:
                work = f"{p.flops / 1e12:>10.2f}{'-':>10}{'-':>10}"
                secs = (f"{p.flops / self.peak_flops:10.2f}" if self.peak_flops else f"{'-':>10}") + f"{'-':>8}"
            lines.append(f"{p.name:<14}{p.micro if p.micro is not None else '-':>6}{gib(p.argument_bytes):>10}"
                         f"{gib(p.output_bytes):>10}{gib(p.temp_bytes):>10}{gib(p.resident_bytes):>10}"
                         f"{gib(p.total_bytes):>10}{fit:>5}{gib(p.params_bytes):>10}{gib(p.opt_state_bytes):>10}"
                         f"{gib(p.kv_bytes):>10}{work}{secs}")
        total = sum(p.cost.flops if p.cost is not None else p.flops for p in self.programs)
        est = f", ~{total / self.peak_flops:.3f} s at {self.peak_source} of {self.peak_flops / 1e12:.2f} " \
              "TFLOP/s" if self.peak_flops else ""
        bp = self.batch_plan
        lines.append(f"step: {total / 1e12:.2f} TFLOP per device{est}; worst-case shapes (every prompt "
                     f"{bp.max_prompt_length} tokens bucketed, every response {bp.response_length})")
        lines += self.estimates()
        for name, size in self.auto:
            lines.append(f"auto: {self.batch_plan.micro_of(name).key}={size}")
        for key in self.levers:
            lines.append(f"auto: {key} (trainer.memory_levers: the step did not fit without it)")
        calls = [f"{p.name} {', '.join(f'{t} x{n}' for t, n in p.kernels) or 'none'}" for p in self.programs
                 if p.note is None and self.chip is not None]
        if calls:
            lines.append("kernels (Pallas calls compiled in): " + "; ".join(calls))
        for p in self.programs:
            if p.note:
                lines.append(f"* {p.name}: {p.note} (temps: what it asked for)")
        return "\n".join(lines)

    def check(self) -> None:
        """Raises MemoryPlanError naming the first program that does not fit and the keys to change."""
        if self.device_memory is None:
            return
        for p in self.programs:
            if not p.fits(self.device_memory):
                message = does_not_fit(p, self.device_memory, self.device_memory_source)
                floor = [self.batch_plan.micro_of(name).key for name, size in self.auto if size == 1]
                message += "".join(f" (even {key}=1 does not fit)" for key in floor if p.keys[0].startswith(f"{key}="))
                if self.levers:
                    message += f"; the plan already set {', '.join(self.levers)}"
                if self.levers_left:
                    message += ("; levers trainer.memory_levers does not list: " + "; ".join(self.levers_left))
                raise MemoryPlanError(message)


def gib(n: int) -> str:
    return f"{n / GiB:.3f}G" if n >= GiB // 100 else f"{n / (1 << 20):.2f}M"


def does_not_fit(p: ProgramMemory, limit: int, source: str) -> str:
    refused = f" ({p.note}: its temporaries alone asked for {gib(p.temp_bytes)})" if p.note else ""
    return (f"memory plan: program '{p.name}' needs {gib(p.total_bytes)} per device ({gib(p.peak_bytes)} of its "
            f"own + {gib(p.resident_bytes)} of other resident state){refused} but the device has {gib(limit)} "
            f"({source}); to make it fit change: {'; '.join(p.keys)}")


def slice_crossing_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which neighbouring devices sit in different slices (multislice): their
    collectives cross the data-centre network (DCN), not the slice's ICI."""
    slices = np.vectorize(slice_of)(mesh.devices)
    return tuple(name for axis, name in enumerate(mesh.axis_names)
                 if mesh.devices.shape[axis] > 1 and (np.diff(slices, axis=axis) != 0).any())


def hosts_lines(mesh: Mesh, plan: BatchPlan, rows: tuple[ProgramMemory, ...]) -> tuple[str, ...]:
    """For a mesh over several processes (hosts): the process and slice counts, the prompts each
    process's data loader reads per step (data/loader.py: its contiguous share of the batch), the
    trained state its devices hold (what its checkpoint shards come from; orbax writes a replicated
    shard once) and the mesh axes whose collectives cross slices. Nothing for a single process."""
    # compile-only multislice devices number their processes within each slice
    processes = sorted({(slice_of(d), d.process_index) for d in mesh.devices.flat})
    if len(processes) <= 1:
        return ()
    per_process = mesh.size // len(processes)
    slices = len({index for index, _ in processes})
    state = max((p.params_bytes + p.opt_state_bytes for p in rows if p.name.startswith("update_")), default=0)
    crossing = slice_crossing_axes(mesh)
    between = ("collectives over mesh axes " + ", ".join(repr(a) for a in crossing) + " cross slices (DCN)"
               if crossing else "no mesh axis crosses a slice" if slices > 1 else "one slice: every collective on ICI")
    return (f"hosts: {len(processes)} processes x {per_process} devices, {slices} slice(s); each process reads "
            f"{plan.prompts // len(processes)} of the step's {plan.prompts} prompts "
            f"({plan.sequences // len(processes)} of {plan.sequences} sequences) and holds "
            f"{gib(state * per_process)} of params and optimizer state (its checkpoint writes are its shards of "
            f"that: all of it where the state is split, less where replicated); {between}",)
