"""The device mesh: axes ('data', 'fsdp', 'context', 'expert', 'tensor') with sizes from the config's `mesh` section.

`data` replicates parameters and splits the batch, `fsdp` splits both the batch and the parameters
(ZeRO-3 style: weights are all-gathered per use), `expert` splits a mixture-of-experts model's experts
(each device holds num_experts / expert of them; tokens go to their experts and back:
models/expert_parallel.py), `context` splits each row's tokens in the training forward / backward and
the no-grad scoring passes (context parallelism: the devices of a `context` group share rows and
params, each holds 1/context of every activation; attention by ring, all-to-all or gathered keys /
values: models/context_parallel.py)
and, for everything else, the batch like `data`; `tensor` splits heads / MLP / vocab (Megatron
style). At most one size may be -1, meaning "all remaining devices".
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ContextManager, TypeVar

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxrl_llm.platform.chips import Device

logger = logging.getLogger(__name__)
T = TypeVar("T")

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "context", "expert", "tensor")
# The batch dimension is split over these axes (data parallel x fully-sharded data parallel x the
# expert axis, which is data parallel for every weight but the experts').
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
DEFAULT_MESH_SIZES: dict[str, int] = {"data": 1, "fsdp": -1, "context": 1, "expert": 1, "tensor": 1}
# The training passes' token axis is split over this one (context parallelism: models/decoder.py)
CONTEXT_AXIS = "context"
# attention heads, MLP columns and the pool's kv heads are split over this one (tensor parallelism)
TENSOR_AXIS = "tensor"
# the config's `mesh` keys that are not axes
MESH_SETTINGS: tuple[str, ...] = ("rollout_devices", "context_attention")


def _mesh_items(mesh_cfg: Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """Reads a dict / ml_collections.ConfigDict / None into {key: value} (defaults filled in)."""
    if mesh_cfg is None:
        return dict(DEFAULT_MESH_SIZES)
    if hasattr(mesh_cfg, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        mesh_cfg = getattr(mesh_cfg, "to_dict")()
    if not isinstance(mesh_cfg, Mapping):
        raise ValueError(f"mesh: expected a mapping with keys {MESH_AXES}, got {type(mesh_cfg).__name__}")
    # the split mesh's key (sharding/split.py) and how a context group attends are no axes of this mesh
    mesh_cfg = {k: v for k, v in mesh_cfg.items() if k not in MESH_SETTINGS}
    unknown = sorted(set(mesh_cfg) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh.{unknown[0]}: unknown mesh axis (known: {', '.join(MESH_AXES)})")
    items = dict(DEFAULT_MESH_SIZES)
    items.update(mesh_cfg)
    return items


def resolve_mesh_shape(mesh_cfg: Mapping[str, Any] | Any | None, num_devices: int) -> dict[str, int]:
    """Returns {'data': d, 'fsdp': f, 'expert': e, 'tensor': t} with -1 resolved; ValueError naming the
    bad key."""
    items = _mesh_items(mesh_cfg)
    sizes: dict[str, int] = {}
    for key in MESH_AXES:
        value = items[key]
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ValueError(f"mesh.{key}={value!r}: must be a positive int or -1 (= the remaining devices)")
        sizes[key] = value
    wildcards = [k for k in MESH_AXES if sizes[k] == -1]
    if len(wildcards) > 1:
        raise ValueError(
            f"mesh.{wildcards[1]}=-1: only one mesh axis may be -1 (also mesh.{wildcards[0]}=-1)")
    for key in MESH_AXES:  # name the first key that cannot fit on its own
        if sizes[key] != -1 and num_devices % sizes[key]:
            raise ValueError(f"mesh.{key}={sizes[key]} does not divide the {num_devices} available devices")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    described = " x ".join(f"mesh.{k}={sizes[k]}" for k in MESH_AXES if sizes[k] != -1)
    if num_devices % fixed:
        raise ValueError(f"{described} = {fixed} does not divide the {num_devices} available devices")
    if wildcards:
        sizes[wildcards[0]] = num_devices // fixed
    return sizes


def slice_of(device: Device) -> int:
    """The multislice slice a device is in (0 for a device of a single slice, which may not say)."""
    return getattr(device, "slice_index", 0) or 0


def make_mesh(mesh_cfg: Mapping[str, Any] | Any | None = None,
              devices: Sequence[Device] | None = None) -> Mesh:
    """Builds the ('data', 'fsdp', 'expert', 'tensor') mesh over `devices` (default: all global devices).

    `mesh_cfg` is the config's `mesh` section (dict or ConfigDict; missing keys default to
    data=1, fsdp=-1, expert=1, tensor=1). When the sizes multiply to fewer devices than available (no -1),
    the mesh uses the first ones, so `{'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 1}` is a 1-device mesh.
    Axes are `Auto`: shardings propagate through jit from the inputs and constraints.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[k] for k in MESH_AXES)
    if math.prod(shape) < len(devices):
        logger.warning("mesh %s uses %d of %d devices", sizes, math.prod(shape), len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    slices = len({slice_of(d) for d in devices})
    if slices > 1 and math.prod(shape) == len(devices):
        # multislice: the slices joined over the data-centre network along the outermost axis they divide
        # (data, else fsdp), every other axis inside a slice on its ICI (MaxText's dcn_data_parallelism)
        outer = next((i for i, size in enumerate(shape) if size % slices == 0), None)
        if outer is None:
            raise ValueError(f"mesh {sizes}: no axis divides into the {slices} slices (make 'data' or 'fsdp' a "
                             "multiple of the slice count)")
        dcn = tuple(slices if i == outer else 1 for i in range(len(shape)))
        ici = tuple(size // d for size, d in zip(shape, dcn))
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
    # jax.make_mesh orders devices for the physical topology (rings on TPU, NVLink islands on GPU).
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)


def mesh_context(mesh: Mesh | Any | None) -> ContextManager[Any]:
    """The mesh programs traced inside this context see as `jax.sharding.get_abstract_mesh()`: what the
    model's expert-parallel layers split over (models/expert_parallel.py). Entered by every entry
    point that traces the model on a mesh (trainer, samplers, memory plan, `jrl` functions); a jitted
    program that gets its mesh as an argument enters it in its own body. None: no context."""
    if mesh is None:
        return contextlib.nullcontext()
    abstract = mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh  # an AbstractMesh as it is
    return jax.sharding.use_abstract_mesh(abstract)


def on_own_mesh(method: Callable[..., T]) -> Callable[..., T]:
    """A method of an object with a `.mesh` run inside `mesh_context(self.mesh)`."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> T:
        with mesh_context(self.mesh):
            return method(self, *args, **kwargs)

    return run


def context_parallel_size() -> int:
    """The traced program's mesh's 'context' axis size (1 without a mesh in context: mesh_context)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def mesh_axis_sizes(mesh: Mesh | Any) -> dict[str, int]:
    """{axis name: size} for a concrete `Mesh` or an `AbstractMesh`."""
    return dict(mesh.shape)


def batch_axes(mesh: Mesh | Any) -> tuple[str, ...]:
    """The mesh's axes among BATCH_AXES (a mesh built by hand may lack some), in order."""
    sizes = mesh_axis_sizes(mesh)
    return tuple(a for a in BATCH_AXES if a in sizes)


def row_split_axes(sizes: Mapping[str, int], rows: int) -> tuple[str, ...] | None:
    """The batch axes (those > 1) a dimension of `rows` rows splits over in a `shard_map`'s PartitionSpec, or
    None (whole on every device) where there are none or their product does not divide `rows`."""
    axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    return axes if axes and rows % math.prod(sizes[a] for a in axes) == 0 else None


def batch_axis_size(mesh: Mesh | Any) -> int:
    """How many ways the batch dimension is split (data x fsdp x expert)."""
    sizes = mesh_axis_sizes(mesh)
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)
