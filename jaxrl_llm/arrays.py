"""Array type aliases shared across packages (a leaf module: it imports only jax and numpy)."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike

# Values that may be a device array or a host (numpy) copy: rollout metadata kept on the host, the
# paged engine's results (built on the host), inputs a jitted program accepts either way.
HostOrDevice = jax.Array | np.ndarray

# A pytree of arrays (parameters, optimizer states, gradients, a pass's outputs). JAX pytrees have no
# static type, so this stays `Any` to the checker; the name says what is expected.
ArrayTree = Any
# A model's parameters: nested dicts with array leaves (`{"embed": ..., "layers": {...}}`; with LoRA
# `{"lora": adapters}`). An `ArrayTree` to the checker too (optax and orbax hand back untyped trees).
Params = ArrayTree
# A dtype as our functions accept it: a name ("bfloat16"), a numpy / jnp dtype or scalar type.
DType = DTypeLike
# Where each leaf of an `ArrayTree` lives: the same tree with a `jax.sharding.Sharding` per leaf
# (parameter and optimizer-state shardings, what `jit`'s in/out_shardings take).
ShardingTree = Any
# The logical axis names of each parameter: the params' tree with a tuple of names (or None) per leaf
# (models/param_init.py), what sharding/rules.py maps onto mesh axes.
LogicalAxesTree = Any
