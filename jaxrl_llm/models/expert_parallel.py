"""Expert parallelism: the routed experts of a mixture-of-experts layer split over the mesh's `expert`
axis, each device holding num_experts / expert of them (the `expert` sharding rule of
jaxrl_llm/sharding/rules.py), and the tokens moved to their experts and back.

Tokens are split over the batch axes (data, fsdp, expert), so the devices of one expert group hold
different tokens and different experts. The exchange is an all-gather then a reduce-scatter over
`expert` (a `shard_map` manual over the batch axes; `tensor` stays automatic):

1. each device all-gathers its group's tokens and their routing (the router ran before, on each
   device's own tokens, so the router's statistics and gradients need no exchange);
2. it runs the dropless grouped matmul (models/moe_experts.py, `held_expert_ffn`) on the assignments to the
   experts it holds, laying out those only (`_own_expert_ffn`), so compute and the layout's buffers stay
   tokens x top-k / expert per device;
3. a reduce-scatter over `expert` sums each token's contributions from the devices that hold its k
   experts and hands every device back its own tokens.

With fsdp, each device's share of the experts is further split over `fsdp` along the hidden size (the
sharding rules' placement of the experts' `embed` dim) and all-gathered here per use (ZeRO-3, as the
other weights); gradients come back reduce-scattered.

We chose gather / scatter over all-to-all: with top-k routing a token goes to k of the E experts, so
an all-to-all moves k copies of a token where the all-gather moves expert - 1; for the small expert
groups a host holds (2-8 devices, top-2 to top-8) the volumes are of one order, and the gathered
layout is static and dropless with no capacity to size. Under context parallelism the tokens are
split over 'context' as well (each device routes and runs its own). A batch whose token count the
batch axes do not divide (a generation of one prompt) runs replicated: every device routes all tokens, computes its
experts' share and the shares are summed (psum).

The experts' width split over `tensor` stays split inside (gate / up compute their slice, down a
partial sum, added over `tensor` after the grouped matmul), so the shard_map is manual over every
axis and no collective runs inside the grouped matmul's loop. With `expert` = 1 the same program
runs each device's own tokens through all experts, gathered over fsdp (ZeRO-3, as the dense MLPs),
rather than leaving XLA to place a sharded expert matmul inside the blocked kernel's per-block
`lax.cond`: a collective inside a conditional is what deadlocked XLA:CPU's devices in the fused
log-prob head (losses/logprob.py), and each device's blocks differ here.

Batch-invariant mode (models/invariant.py): summing each device's partial mix over `expert` would add a
token's k expert outputs in another order than one device's tree over them. Each device instead returns
the k outputs unweighted (`ExpertSlots`, zeros in the slots it does not hold), the exchange adds one value
and zeros per slot (exact in any order), and the token's home device mixes them with one device's
expression (`mix_slots`); the `tensor` split is gathered (no partial sums cross devices).

The mesh comes from the tracing context (`sharding.mesh_context`, entered by the trainer, the
samplers, the memory plan and `jrl` models). Without one, the experts run as one grouped matmul.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_llm.arrays import DType
from jaxrl_llm.models import invariant
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.moe import Routing
from jaxrl_llm.models.moe_experts import down_bias, expert_ffn, held_expert_ffn, held_expert_slots, mix_slots
from jaxrl_llm.models.param_axes import EXPERT_AXES, EXPERT_BIAS_AXES
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sharding.mesh import BATCH_AXES, CONTEXT_AXIS, TENSOR_AXIS
from jaxrl_llm.sharding.rules import logical_to_spec

Array = jax.Array

EXPERT_AXIS = "expert"


def _manual_spec(matrix: Array, name: str, mesh: Mesh | AbstractMesh, manual: tuple[str, ...], ways: int
                 ) -> tuple[P, dict[int, tuple]]:
    """The sharding rules' spec of one expert matrix (`name`: a projection, or "<projection>/bias") reduced
    to the shard_map's manual axes, and the dims after the expert dim that those axes split (all-gathered in
    the body before use, `tensor` excepted: see `routed_experts`)."""
    proj, _, bias = name.partition("/")
    axes = (EXPERT_BIAS_AXES if bias else EXPERT_AXES)[proj]
    spec = logical_to_spec(axes, matrix.shape, mesh, where=f"experts/{name}")
    dims = [tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in manual) for axes in spec]
    if dims[0] not in (((EXPERT_AXIS,),) if ways > 1 else ((), (EXPERT_AXIS,))):
        raise ValueError(f"experts/{name}: the sharding rules place the expert dim on {spec[0]!r}; expert "
                         f"parallelism needs it on {EXPERT_AXIS!r} alone")
    return P(*(d[0] if len(d) == 1 else (d or None) for d in dims)), {i: d for i, d in enumerate(dims) if i and d}


def expert_ways(cfg: ModelConfig, mesh: Mesh | AbstractMesh | None = None) -> int:
    """How many ways the experts are split: the `expert` size of `mesh` (default: the context mesh),
    1 without one or when it does not divide num_experts (the weights then stay replicated over it)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    ways = 1 if mesh.empty else dict(mesh.shape).get(EXPERT_AXIS, 1)
    return ways if ways > 1 and cfg.num_experts % ways == 0 else 1


def routed_experts(experts: dict, tokens: Array, routing: Routing, cfg: ModelConfig, *, dtype: DType) -> Array:
    """fp32 [N, H]: the routed experts' mixed outputs for tokens [N, H]. On a mesh of several devices
    they run in a `shard_map` manual over the batch axes and `tensor` (module doc): expert parallel
    when the mesh has an `expert` axis, else each device runs its own tokens through all experts
    (gathered over fsdp). Without a mesh: `expert_ffn` on all experts."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    if math.prod(sizes.values()) <= 1:
        return expert_ffn(experts, tokens, routing, cfg, dtype=dtype)
    ways = expert_ways(cfg, mesh)
    # the token axes: the batch axes, and 'context' where it splits the tokens (context parallelism)
    batch = tuple(a for a in BATCH_AXES if a in sizes) + ((CONTEXT_AXIS,) if sizes.get(CONTEXT_AXIS, 1) > 1 else ())
    manual = batch + ((TENSOR_AXIS,) if TENSOR_AXIS in sizes else ())
    split = tokens.shape[0] % math.prod(sizes[a] for a in batch) == 0
    rows = P(batch) if split else P()
    matrices = {name: experts[name]["kernel"] for name in EXPERT_AXES}
    matrices.update({f"{name}/bias": experts[name]["bias"] for name in EXPERT_AXES if "bias" in experts[name]})
    placed = {name: _manual_spec(w, name, mesh, manual, ways) for name, w in matrices.items()}
    held = cfg.num_experts // ways
    # the experts' width split over `tensor` stays split: gate / up give their slice of the SwiGLU, down
    # a partial sum, added over `tensor` once after the grouped matmul (no collective inside its loop)
    # (batch-invariant mode gathers the `tensor` split too: each device sums a row's whole width itself, in the
    # kernel's order, and no partial sum crosses devices; models/invariant.py. Split over `expert`, it sends a
    # token's k outputs home unweighted and unmixed, where one device's expression mixes them: `ExpertSlots`)
    exact = invariant.enabled()
    partial = not exact and TENSOR_AXIS in placed["down_proj"][1].get(1, ())

    def gathered(name: str, w: Array) -> Array:  # fsdp's share of a matrix; rounded first: half the bytes in bf16
        for dim, axes in placed[name][1].items():
            axes = tuple(a for a in axes if exact or a != TENSOR_AXIS)
            if axes:
                w = _gather_rounded(w, axes, dim, dtype)
        return w

    def body(x: Array, ids: Array, weights: Array, matrices: dict) -> Array:
        x = x.astype(dtype)  # (it entered in `_collective_dtype`)
        home_weights = weights  # this device's own tokens' (batch-invariant mode mixes them here)
        if split and ways > 1:  # this expert group's tokens, in expert-index order (undone by the reduce-scatter)
            x, ids, weights = (lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True) for a in (x, ids, weights))
        held_experts: dict = {}
        for name, w in matrices.items():
            proj, _, leaf = name.partition("/")
            held_experts.setdefault(proj, {})[leaf or "kernel"] = gathered(name, w)
        if ways > 1:
            local = ids - lax.axis_index(EXPERT_AXIS) * held
            mine = (local >= 0) & (local < held)
            ids, weights = jnp.where(mine, local, held), jnp.where(mine, weights, 0.0)

        def home(a: Array) -> Array:  # the devices' shares summed over `expert`, each token back on its device
            return lax.psum_scatter(a, EXPERT_AXIS, scatter_dimension=0, tiled=True) if split else lax.psum(
                a, EXPERT_AXIS)

        if exact and ways > 1:  # each of a token's k slots is one device's: summing it over `expert` adds zeros
            slots = held_expert_slots(held_experts, x, ids, cfg, dtype=dtype)
            return mix_slots(home_weights, jax.tree.map(home, slots))
        # the output bias joins once the `tensor` partial sums are added
        out_bias = {"down_proj": held_experts["down_proj"]}
        held_experts["down_proj"] = {"kernel": held_experts["down_proj"]["kernel"]}
        out = held_expert_ffn(held_experts, x, ids, weights, cfg, dtype=dtype)
        if partial:
            out = lax.psum(out, TENSOR_AXIS)
        out = out + down_bias(out_bias, jnp.minimum(ids, held - 1), weights, dtype)
        return out if ways == 1 else home(out)

    # check_vma=False: the blocked kernel's lax.cond / custom_vjp are not written for varying-axis types;
    # the transposes (all_gather -> reduce-scatter, replicated weights -> psum) are the ones wanted
    specs = {name: spec for name, (spec, _) in placed.items()}
    run = jax.shard_map(body, in_specs=(rows, rows, rows, specs), out_specs=rows, axis_names=set(manual),
                        check_vma=False)
    # the cotangent of the tokens (replicated over `tensor`) is psum-ed over it: fp32 on CPU (`_collective_dtype`)
    return run(tokens.astype(_collective_dtype(tokens.dtype)), routing.ids, routing.weights, matrices)


def _collective_dtype(dtype: DType) -> DType:
    """The dtype the collectives of the routed experts' backward (a shard_map's transpose) reduce in: fp32 on CPU,
    whose all-reduce promotion pass aborts on a bf16 all-reduce / reduce-scatter whose reducer Shardy wrapped
    ("Invalid binary instruction opcode copy", seen with a bf16 MoE update on 8 CPU devices); elsewhere `dtype`."""
    return jnp.float32 if target_platform() == "cpu" else dtype


def _gather_rounded_fwd(w: Array, axes: tuple[str, ...], dim: int, dtype: DType) -> Array:
    return lax.all_gather(w.astype(dtype), axes, axis=dim, tiled=True)


_gather_rounded = jax.custom_vjp(_gather_rounded_fwd, nondiff_argnums=(1, 2, 3))


def _gather_rounded_bwd(axes: tuple[str, ...], dim: int, dtype: DType, like: Array, g: Array) -> tuple[Array]:
    summed = lax.psum_scatter(g.astype(_collective_dtype(dtype)), axes, scatter_dimension=dim, tiled=True)
    return (summed.astype(like.dtype),)


# a device's share of a weight gathered over `axes` in the compute dtype (half the bytes in bf16); its gradient
# reduce-scattered back in `_collective_dtype`
_gather_rounded.defvjp(lambda w, axes, dim, dtype: (_gather_rounded_fwd(w, axes, dim, dtype), jnp.zeros((), w.dtype)),
                       _gather_rounded_bwd)
