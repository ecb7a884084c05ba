"""The RL loop: rollout -> experience -> update; metrics; validation; checkpoints.

`Trainer(config).fit()` (trainer.py) is the entry point; `train_step` reads top to bottom.
`Trainer` is imported lazily, so the package can be imported without the loop's
dependencies (data, rewards, sampler).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxrl_llm.trainer.trainer import Trainer

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from jaxrl_llm.trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'jaxrl_llm.trainer' has no attribute {name!r}")
