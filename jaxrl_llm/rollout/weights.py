"""`PolicyWeights`: what rollouts read of the policy, handed over by the trainer as three callables,
so rollouts never import the roles (jaxrl_llm/roles) that own and update those arrays."""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxrl_llm.arrays import ArrayTree


@dataclasses.dataclass(frozen=True)
class PolicyWeights:
    """sampling(): the params sampling reads now (the actor's own arrays; with LoRA the base with its
    adapters applied). donated(): the arrays the next update donates (with LoRA the adapters only),
    which a rollout that outlives that update must copy. rebuild(copy): the sampling params from such
    a copy (with LoRA: the shared frozen base plus the copied adapters)."""

    sampling: Callable[[], ArrayTree]
    donated: Callable[[], ArrayTree]
    rebuild: Callable[[ArrayTree], ArrayTree]
