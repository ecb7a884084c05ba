"""Memory plan before launch: every program of a step compiled ahead of time on abstract inputs
(planning/programs.py; no weight loaded), XLA's per-device memory and cost analysis read
back, one table printed, and a run that would not fit stopped before anything is loaded.

Per program (per device): arguments, outputs, temporaries (`compiled.memory_analysis()`); its
peak = arguments + outputs - aliased (donated) + temporaries + generated code; plus the persistent
state of the step that is NOT among its arguments (`resident`: e.g. the critic and the reference
while the actor updates, or the fp32 masters while the paged engine decodes from their compute-dtype
copy), so `total` is what the device holds while the program runs. The row
also names the params / optimizer state / KV cache it holds, its FLOPs
(`compiled.cost_analysis()`, whose loop bodies XLA counts once: one layer's count, read from the
program lowered with each layer-scan trip running its layer twice, is added for the other layers, and the sum
is multiplied by the loop trips the plan knows) and FLOPs / the device's measured matmul peak as
a time estimate. The vocabulary chunks of the fused log-prob head (losses/logprob.py) are a loop
too, counted once (one 2048-token-chunk of the head).

`auto` micro-batch sizes: for each pass set to 'auto' (BatchPlan.auto_passes), the largest
divisor of its per-device rows whose program fits is found by bisection over the divisors
(memory grows with the micro-batch), one compile per probe; probes are cached per process.
When a program does not fit at any size, the levers of `trainer.memory_levers` are pulled, cheapest
first (planning/levers.py: host offload of frozen weights and of the optimizer state, remat),
and the run trains with the keys they set, which the table prints.

The device memory is `trainer.device_memory_gb`, else the device's `bytes_limit`
(memory_stats, GPU/TPU); on CPU, without the key, nothing is refused and 'auto' takes the
whole per-device batch (no probe).

A TPU slice as the target (`trainer.plan_topology`, `launch/train.py --plan --topology=v5p-64`,
`plan_for_config(cfg, topology=...)`): the mesh is built over that slice's compile-only devices
(platform/tpu.py, libtpu), every program is compiled by the TPU compiler (Mosaic kernels
included), the limit is the chip's published HBM and the time estimate its bf16 (or fp32) peak.
Trace-time choices that follow the backend (KV pool storage, its size from
`rollout.gpu_memory_utilization`, pinned host memory) follow the target (platform/target.py).

The plan's rows, table and fit check: planning/report.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Collection
from typing import Any

import jax
from jax.sharding import Mesh
from ml_collections import ConfigDict

from jaxrl_llm.batching.batch_plan import BatchPlan, MicroBatching
from jaxrl_llm.config.schema import ConfigError
from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.planning.context import Context, Program, bytes_per_device, device_state_bytes, make_context
from jaxrl_llm.planning.hbm_bytes import layer_loop_bytes, outside_loops_bytes
from jaxrl_llm.planning.levers import fit_with_levers
from jaxrl_llm.planning.programs import PROGRAM_BUILDERS
from jaxrl_llm.planning.report import GiB, MemoryPlan, ProgramMemory, hosts_lines
from jaxrl_llm.planning.roofline import Cost, compiled_cost
from jaxrl_llm.platform.chips import Chip, chip_for
from jaxrl_llm.platform.lowering import kernel_calls
from jaxrl_llm.platform.target import (
    CompileTarget,
    compiling_for,
    planning_in_use,
    target_memory_bytes,
    target_platform,
)
from jaxrl_llm.platform.tpu import TpuTarget, tpu_target
from jaxrl_llm.roles.vision import with_vision_tokens
from jaxrl_llm.sharding.mesh import mesh_context, slice_of

log = logging.getLogger("jaxrl_llm")
_CACHE: dict[tuple, "ProgramMemory"] = {}  # (fingerprint, program, plan of it) -> analysis


def device_memory(spec: RunSpec) -> tuple[int | None, str]:
    """(bytes per device or None, where the number comes from)."""
    if spec.trainer.device_memory_gb is not None:
        return int(spec.trainer.device_memory_gb * GiB), "trainer.device_memory_gb"
    if target_memory_bytes() is not None:
        return target_memory_bytes(), "the target chip's published HBM"
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{jax.local_devices()[0].platform} bytes_limit"
    return None, f"{jax.default_backend()} reports none; set trainer.device_memory_gb"


class Planner:
    """Compiles the step's programs for a spec and mesh; caches analyses per process."""

    def __init__(self, spec: RunSpec, mesh: Mesh, tokenizer: Tokenizer):
        self.spec, self.mesh = spec, mesh
        self.ctx: Context = make_context(spec, mesh, tokenizer)
        self.state_bytes = device_state_bytes(self.ctx)
        # the engine's KV pool is sized from what the run holds while it samples, not from this host's memory
        with planning_in_use(sum(self.state_bytes.values())):
            self.programs: list[Program] = [p for p in (build(self.ctx) for build in PROGRAM_BUILDERS) if p is not None]
        # the sampler's KV pool lives for its rollout only (sampler/engine/scheduler.py): it is resident
        # during the other programs where a pipelined rollout runs beside them on the same devices
        # (and so are its decode weight copies, `Program.copy_bytes`)
        if spec.sync.weight_copies:
            self.state_bytes["kv_pool"] = sum(p.kv_bytes for p in self.programs if p.name == "sample")
            self.state_bytes["decode_weights"] = sum(p.copy_bytes for p in self.programs if p.name == "sample")
        # what the programs depend on (not the run dir, data files or logging): equal runs share probes
        self._fingerprint = (repr((spec.model, spec.actor, spec.actor_optim, spec.ref, spec.train_sampling, spec.critic,
                                   spec.critic_model, spec.critic_optim, spec.advantage, spec.rollout_correction,
                                   spec.sync, spec.rollout_engine, spec.distillation, _without_micro(spec.plan))),
                             tuple(dict(mesh.shape).items()),
                             # the devices' kind too: a v5e and a v6e slice number their chips alike
                             tuple((d.platform, d.device_kind, d.id, slice_of(d)) for d in mesh.devices.flat))

    def analyse(self, program: Program, plan: BatchPlan) -> ProgramMemory:
        micro = None if program.micro_pass is None else plan.micro_of(program.micro_pass)
        key = (self._fingerprint, program.name, micro)
        if key in _CACHE:
            return _CACHE[key]
        start = time.perf_counter()
        out = self._analyse(program, plan, micro)
        _CACHE[key] = out
        # a large model's programs take minutes to compile (a TPU target: more): say what is done
        log.info("memory plan: compiled %s (micro-batch %s) in %.0f s", program.name,
                 "-" if out.micro is None else out.micro, time.perf_counter() - start)
        return out

    def _analyse(self, program: Program, plan: BatchPlan, micro: MicroBatching | None) -> ProgramMemory:
        lowered = program.lower(plan)
        resident = sum(b for s, b in self.state_bytes.items() if s not in program.state_args) + program.held_bytes
        # as arguments the states are on device, an offloaded reference included
        params = sum(bytes_per_device(self.ctx.states[s]) for s in program.state_args if s.endswith("_params"))
        opt = sum(bytes_per_device(self.ctx.states[s]) for s in program.state_args if s.endswith("_opt"))
        size = None
        if micro is not None and not micro.auto and program.micro_pass is not None:
            size = micro.sequences_per_device(_rows_per_device(plan, program.micro_pass), self.ctx.seq_len)
        try:
            compiled = lowered.compile()
        except Exception as err:  # the TPU compiler refuses a program over its HBM
            required = exhausted_bytes(err)
            if required is None:
                raise
            # its temporaries alone exceed the chip: not compiled, so arguments as the states it reads
            flops = _flops(lowered) / self.mesh.size * program.trips(plan) + program.extra_flops(plan)
            out = ProgramMemory(
                name=program.name, argument_bytes=params + opt + program.kv_bytes, output_bytes=0, alias_bytes=0,
                temp_bytes=required, code_bytes=0, resident_bytes=resident, params_bytes=params, opt_state_bytes=opt,
                kv_bytes=program.kv_bytes, flops=flops, micro=size, keys=program.keys(plan),
                note="the compiler ran out of device memory")
            return out
        mem = compiled.memory_analysis()
        text = compiled.as_text() or ""  # read once: the costs' collectives and the kernels
        # XLA counts each loop body once: the layer scan's (one layer, so add the others), then the trips
        body = _flops(compiled) + (program.layers - 1) * layer_flops(program, plan, lowered, self.mesh.size)
        flops = body * program.trips(plan) + program.extra_flops(plan)
        out = ProgramMemory(
            name=program.name, argument_bytes=int(mem.argument_size_in_bytes),
            output_bytes=int(mem.output_size_in_bytes),
            alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
            code_bytes=int(mem.generated_code_size_in_bytes), resident_bytes=resident, params_bytes=params,
            opt_state_bytes=opt, kv_bytes=program.kv_bytes, flops=flops, micro=size, keys=program.keys(plan),
            counted=compiled_cost(compiled, text), kernels=self._kernels(text),
            outside_loops_hbm=(outside_loops_bytes(text) if program.prologue_once and target_platform() == "tpu"
                               else None),
            layer_hbm=layer_loop_bytes(text) if program.layers > 1 and target_platform() == "tpu" else None)
        return out

    def _kernels(self, text: str) -> tuple[tuple[str, int], ...]:
        """Our kernels' custom calls in a compiled program's `text` (none on a CPU, where the kernels are
        not used)."""
        platform = {"tpu": "tpu", "gpu": "cuda", "cuda": "cuda"}.get(self.mesh.devices.flat[0].platform)
        return () if platform is None else tuple(sorted(kernel_calls(text, platform).items()))

    def costed(self, program: Program, plan: BatchPlan) -> ProgramMemory:
        """`analyse`'s row with the program's whole cost (planning/roofline.py): the compiled counts with one
        layer's count added for the other layers, then its loops' trips (`Program.total_cost`). One layer's
        FLOPs and link bytes come from the program compiled again with each scan trip running its layer twice
        (`ModelConfig.scan_repeat`), its HBM bytes on a TPU target from the program's own layer loops
        (`ProgramMemory.layer_hbm`). A program that did not compile has none."""
        row = self.analyse(program, plan)
        if row.counted is None:
            return row
        key = (self._fingerprint, program.name, None if program.micro_pass is None else plan.micro_of(
            program.micro_pass), "cost")
        if key not in _CACHE:
            layer = Cost()
            if program.layers > 1:
                # the layer twice a trip: one layer more than the count. (Not `lax.scan(unroll=2)`: that is
                # another program, whose two-layer weight slabs the TPU compiler stages differently.)
                try:
                    more = compiled_cost(program.lower(plan, repeat=2).compile()) - row.counted
                    if row.layer_hbm is not None:  # the program's own layer bytes (hbm_bytes.layer_loop_bytes)
                        more = dataclasses.replace(more, hbm_bytes=row.layer_hbm)
                    layer = more.at_least_zero()
                except Exception as err:  # the TPU compiler refuses it for lack of HBM
                    if exhausted_bytes(err) is None:
                        raise
                    log.warning("memory plan: %s with its layer twice per scan trip did not compile (%s); its FLOPs "
                                "and link bytes count one layer", program.name, str(err).splitlines()[0][:120])
                    layer = Cost(hbm_bytes=row.layer_hbm or 0.0)
            once = Cost(hbm_bytes=row.outside_loops_hbm or 0.0)  # a call's prologue: not a trip's work
            body = (row.counted - once).at_least_zero() + layer * (program.layers - 1)
            if program.pool_pages > 2:
                # XLA's generic cost model (CPU, GPU) charges an in-place scatter or a gather on the KV pool
                # with the whole pool (measured on CPU: a 256-row write into a 400 MB pool counted 800 MB);
                # the TPU's charges the rows. What a layer's count grows with the pool is taken out (the
                # rollout cost counts the K / V rows it reads and writes itself): the step compiled on half
                # the pages gives it
                half = compiled_cost(program.lower(plan, pool_pages=program.pool_pages // 2).compile())
                per_layer = max(row.counted.hbm_bytes - half.hbm_bytes, 0.0) * 2
                body = (body - Cost(hbm_bytes=per_layer * program.layers)).at_least_zero()
            if program.total_cost is not None:
                cost = program.total_cost(plan, body) + once
            else:
                cost = body * program.trips(plan) + Cost(flops=program.extra_flops(plan)) + once
            model_flops = None if program.model_flops is None else program.model_flops(plan)
            _CACHE[key] = dataclasses.replace(row, cost=cost, flops=cost.flops, model_flops=model_flops)
        return _CACHE[key]

    def resolve_auto(self, plan: BatchPlan, limit: int | None) -> tuple[BatchPlan, list[tuple[str, int]]]:
        """`plan` with each 'auto' micro-batch set to the largest fitting divisor of its rows (1 where none
        fits: `MemoryPlan.check` then names it)."""
        picked = []
        for name in plan.auto_passes:
            program = next((p for p in self.programs if p.micro_pass == name), None)
            rows = _rows_per_device(plan, name)
            divisors = [d for d in range(1, rows + 1) if rows % d == 0]
            if program is None or limit is None:  # a pass this step does not run / nothing to fit
                best = divisors[-1]
            else:
                best = self._largest_fitting(program, plan, name, divisors, limit)
            plan = plan.with_micro(name, best)
            picked.append((name, best))
        return plan, picked

    def _largest_fitting(self, program: Program, plan: BatchPlan, name: str, divisors: list[int], limit: int) -> int:
        fits = lambda d: self.analyse(program, plan.with_micro(name, d)).fits(limit)  # noqa: E731
        lo, hi = 0, len(divisors) - 1  # bisection: the answer is the last divisor that fits
        if not fits(divisors[0]):
            return divisors[0]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(divisors[mid]):
                lo = mid
            else:
                hi = mid - 1
        return divisors[lo]


_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED.*?required for [^(]*\(([\d.]+)([KMGT]?)\)", re.S)


def exhausted_bytes(err: BaseException) -> int | None:
    """The bytes a compiler's out-of-memory refusal says the program's temporaries need
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
    (24.17G) exceeds ..."), or None when `err` is not such a refusal."""
    match = _EXHAUSTED.search(str(err))
    if not match:
        return None
    return int(float(match.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": GiB, "T": 1 << 40}[match.group(2)])


def _flops(stage: jax.stages.Lowered | jax.stages.Compiled) -> float:
    cost = stage.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per computation
    return float((cost or {}).get("flops", 0.0))


def layer_flops(program: Program, plan: BatchPlan, lowered: jax.stages.Lowered, devices: int) -> float:
    """One layer's FLOPs per device in one trip of the program's loops (forward, and backward in an update).

    The layers run under a scan whose body XLA's cost analysis counts once, so the compiled count
    holds one layer. The same program lowered with each trip running its layer twice counts two: the
    difference is a layer. Read from the lowered modules (no second compile), which are not yet
    partitioned: their count is the whole mesh's, split evenly over its devices."""
    if program.layers < 2:
        return 0.0
    return max(_flops(program.lower(plan, repeat=2)) - _flops(lowered), 0.0) / devices


def _rows_per_device(plan: BatchPlan, name: str) -> int:
    """Rows one device holds in a pass: the whole batch's (no-grad passes) or a mini-batch's (updates)."""
    return getattr(plan, name).per_device if name in ("actor", "critic") else plan.sequences_per_device


def _without_micro(plan: BatchPlan) -> BatchPlan:
    """The plan less its micro-batch sizes (each program's cache key carries its own)."""
    roles = {r: dataclasses.replace(getattr(plan, r), micro=None) for r in ("actor", "critic") if getattr(plan, r)}
    return dataclasses.replace(plan, **roles, ref_log_prob=None, old_log_prob=None, values=None)


def plan_memory(spec: RunSpec, mesh: Mesh, tokenizer: Tokenizer, *, check: bool = True,
                peak_flops: float | None = None, target: TpuTarget | None = None,
                costs: bool | Collection[str] = False, hbm_bandwidth: float | None = None,
                chip: Chip | None = None) -> MemoryPlan:
    """The step's memory plan; with `check`, raises MemoryPlanError when a program does not fit.

    peak_flops: FLOP/s per device for the time estimate; default: the published peak of the device
    (bookkeeping/metrics.py `device_peak_flops`: the chip table, or a measured matmul on CPU).
    target: the TPU slice `mesh` is built over (compile-only devices): its HBM and peak apply.
    costs: each program's whole cost and roofline estimate (`Planner.costed`: one more compile per
    program), or the named programs' only (the device kit times one program); hbm_bandwidth: bytes/s per
    device for it where the chip table has no row (a CPU); chip: the figures to estimate against instead of
    the devices' own (bench/roofline_check.py: an H200 run's programs compiled here). Every program is traced
    on `mesh` (`mesh_context`), as the run traces it."""
    with planning_context(mesh, target):
        return _plan(spec, mesh, tokenizer, check, peak_flops, target, costs, hbm_bandwidth, chip)


def planning_context(mesh: Mesh, target: TpuTarget | None) -> contextlib.ExitStack:
    """What a plan's programs are traced in: `mesh` (`mesh_context`) and, for a TPU slice, that target
    (its HBM and trace-time choices: platform/target.py)."""
    stack = contextlib.ExitStack()
    if target is not None:
        stack.enter_context(compiling_for(CompileTarget("tpu", target.chip.hbm_bytes)))
    stack.enter_context(mesh_context(mesh))
    return stack


def planning_setup(cfg: ConfigDict, topology: str | None = None, num_slices: int | None = None
                   ) -> tuple[TpuTarget | None, Mesh, Tokenizer]:
    """(the TPU slice `topology` names, default `trainer.plan_topology`, or None; the run's mesh over it or
    the local devices; the run's tokenizer) of a validated config, as a plan of it compiles."""
    from jaxrl_llm.config import resolve_data
    from jaxrl_llm.hf import load_tokenizer
    from jaxrl_llm.sharding import make_mesh

    topology = topology or cfg.trainer.plan_topology
    target = None
    if topology:
        target = tpu_target(topology, num_slices or int(cfg.trainer.plan_num_slices))
    mesh = make_mesh(cfg.mesh, devices=None if target is None else target.devices)
    tokenizer = resolve_data(cfg).tokenizer  # validation sets it (model.path by default)
    if tokenizer is None:
        raise ValueError("data.tokenizer=None: the memory plan needs a validated config")
    # a tiny vision-language policy's tokenizer gains its vision tokens, as the run's does (roles/vision.py)
    return target, mesh, with_vision_tokens(cfg.actor_rollout_ref.model.path, load_tokenizer(tokenizer))


def _plan(spec: RunSpec, mesh: Mesh, tokenizer: Tokenizer, check: bool, peak_flops: float | None,
          target: TpuTarget | None, costs: bool | Collection[str], hbm_bandwidth: float | None,
          chip: Chip | None) -> MemoryPlan:
    from jaxrl_llm.bookkeeping.metrics import device_peak_flops

    limit, source = device_memory(spec)

    def attempt(s: RunSpec) -> tuple[Planner, BatchPlan, list[tuple[str, int]], tuple[ProgramMemory, ...]]:
        planner = Planner(s, mesh, tokenizer)
        plan, picked = planner.resolve_auto(s.plan, limit)
        return planner, plan, picked, tuple(planner.analyse(p, plan) for p in planner.programs)

    def excess(a: tuple[Any, Any, Any, tuple[ProgramMemory, ...]]) -> int:
        """Bytes over the limit, summed over the programs (one for a program the compiler refused)."""
        assert limit is not None
        return sum(max(p.total_bytes - limit, 0 if p.note is None else 1) for p in a[3])

    fitted = fit_with_levers(spec, spec.trainer.memory_levers if limit is not None else (), attempt, excess)
    planner, plan, picked, rows = fitted.attempt
    if costs:
        names = {p.name for p in planner.programs}
        costed = names if costs is True else set(costs)
        if costed - names:
            raise ValueError(f"costs names programs this step does not run: {sorted(costed - names)}")
        rows = tuple(planner.costed(p, plan) if p.name in costed else row
                     for p, row in zip(planner.programs, rows, strict=True))
    peak_source = "the given peak"
    chip = chip or chip_for(mesh.devices.flat[0])
    if peak_flops is None and chip is not None:
        dtype = spec.actor.compute_dtype
        peak_flops, peak_source = chip.peak_flops(dtype), f"the published {dtype} peak of {chip.name}"
    if peak_flops is None:
        peak_flops, peak_source = device_peak_flops(mesh.devices.flat[0], spec.actor.compute_dtype)
    result = MemoryPlan(rows, limit, source, peak_flops, plan, tuple(picked),
                        target=None if target is None else target.describe(), peak_source=peak_source,
                        chip=chip, hbm_bandwidth=hbm_bandwidth, num_devices=mesh.size,
                        hosts=hosts_lines(mesh, plan, rows), levers=fitted.pulled, levers_left=fitted.left,
                        spec=dataclasses.replace(fitted.spec, plan=plan))
    if check:
        result.check()
    return result


def plan_for_config(cfg: ConfigDict, topology: str | None = None, num_slices: int | None = None, *,
                    check: bool = True, costs: bool = True) -> MemoryPlan:
    """The memory plan of a validated config, without loading any weight or writing anything: on the
    local devices, or compiled for the TPU slice `topology` (default: `trainer.plan_topology`), with
    each program's roofline estimate (`costs`). Raises MemoryPlanError (a ConfigError) when a program
    does not fit, after printing the table (`check=False`: returns the plan, fitting or not)."""
    from jaxrl_llm.config import resolve as resolve_spec
    from jaxrl_llm.platform.compile_cache import use_compilation_cache
    from jaxrl_llm.sharding import batch_axis_size

    target, mesh, tokenizer = planning_setup(cfg, topology, num_slices)
    if target is None:  # a second plan of the same config compiles nothing; a TPU topology's compile-only
        # client cannot load a cached program ("PjRtCompiler must be constructed with a Client"), so it compiles
        use_compilation_cache(cfg.trainer.compilation_cache_dir)
    spec = resolve_spec(cfg, dp_size=batch_axis_size(mesh))
    result = plan_memory(spec, mesh, tokenizer, check=False, target=target, costs=costs)
    if not check:
        return result
    try:
        result.check()
    except ConfigError:
        print(result.table())
        raise
    return result


def check_plan_topology(spec: RunSpec, mesh: Mesh) -> None:
    """`trainer.plan_topology` plans a TPU slice from any host (--plan); a run accepts it only on that
    slice's devices (its memory plan then compiles for them as they are)."""
    from jaxrl_llm.platform import accelerator_chip, chip_for, parse_accelerator_type

    topology = spec.trainer.plan_topology
    assert topology is not None
    _, devices = parse_accelerator_type(topology)
    device = mesh.devices.flat[0]
    if mesh.size != devices * spec.trainer.plan_num_slices or chip_for(device) != accelerator_chip(topology):
        raise ConfigError(f"trainer.plan_topology={spec.trainer.plan_topology} is for launch/train.py --plan on any "
                          f"host; this run has {mesh.size} {device.device_kind} device(s): unset it")
