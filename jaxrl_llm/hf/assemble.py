"""Build our params tree from any source of HF-named tensors, one parameter at a time.

A source answers `shape(hf_name) -> tuple | None` (None: absent) and `read(hf_name) -> np.ndarray`
in HF layout. Every name and shape is checked before any data is read, so a bad checkpoint fails
with one clear error naming the tensor. Each parameter is assembled in one host buffer (a stacked
layer parameter is filled layer by layer), cast to the target dtype and placed on its device(s);
then the buffer is dropped, so peak host memory is one parameter, not a second copy of the model.

`shardings` places each parameter directly onto a target sharding: either a pytree with the
params' structure whose leaves are `jax.sharding.Sharding`, or a callable
`(path: tuple[str, ...], shape, dtype) -> Sharding`. The sharding helper builds these from
`param_logical_axes`; this module only applies them.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import DType
from jaxrl_llm.hf.names import MissingTensorError, get_path, set_path, tensor_specs
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.dtypes import as_jnp_dtype
from jaxrl_llm.models.param_init import init_head_params

Shardings = Any  # pytree of jax.sharding.Sharding | Callable[[tuple, tuple, Any], Sharding] | None


class TensorSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...] | None: ...
    def read(self, name: str) -> np.ndarray: ...


def _sharding_for(shardings: Shardings, path: tuple[str, ...], shape, dtype):
    if shardings is None:
        return None
    if callable(shardings):
        return shardings(path, shape, dtype)
    return get_path(shardings, path)


def place(host: np.ndarray, sharding) -> jax.Array:
    """Host array -> device array, each device receiving only its own slice when sharded."""
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def assemble_params(cfg: ModelConfig, source: TensorSource, *, head: str = "lm",
                    num_labels: int = 1, dtype: DType = jnp.float32, shardings: Shardings = None,
                    rng: jax.Array | None = None,
                    transform: Callable[[str, np.ndarray], np.ndarray] | None = None) -> dict:
    """Our params from `source`. Fresh head params (value head) come from `rng` (default key 0).

    `transform(hf_name, array)` may adjust a tensor after reading (GGUF's q/k un-permutation).
    """
    specs = tensor_specs(cfg, head=head, num_labels=num_labels)
    present: dict[tuple[str, ...], bool] = {}
    for spec in specs:  # validate everything before reading any data
        shapes = {n: source.shape(n) for _, n in spec.units(cfg)}
        missing = [n for n, shape in shapes.items() if shape is None]
        if missing and spec.optional and len(missing) == len(shapes):
            present[spec.path] = False
            continue
        if missing:
            raise MissingTensorError(f"checkpoint is missing tensor {missing[0]!r}")
        for n, shape in shapes.items():
            if shape is not None:
                spec.check(n, shape)
        present[spec.path] = True

    np_dtype = np.dtype(as_jnp_dtype(dtype))
    fresh = init_head_params(cfg, rng if rng is not None else jax.random.key(0), head=head,
                             num_labels=num_labels, dtype=dtype)
    params: dict = {}
    for spec in specs:
        if not present[spec.path]:
            value = np.asarray(get_path(fresh, spec.path))
            set_path(params, spec.path, place(value, _sharding_for(
                shardings, spec.path, value.shape, value.dtype)))
            continue
        host = np.empty(spec.our_shape(cfg), np_dtype)
        for index, name in spec.units(cfg):
            tensor = source.read(name)
            if transform is not None:
                tensor = transform(name, tensor)
            host[index] = spec.to_ours(tensor).astype(np_dtype)
        sharding = _sharding_for(shardings, spec.path, host.shape, host.dtype)
        set_path(params, spec.path, place(host, sharding))
        del host
    return params
