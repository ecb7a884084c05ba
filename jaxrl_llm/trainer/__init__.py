"""The RL loop: `build_run` (build.py: everything a run holds, built and checked in order) and
`Trainer` (trainer.py: the run plus `fit()`, `step()` and `train_step`, which reads top to bottom:
rollout -> scoring passes -> experience -> updates -> metrics), validation, perf metrics, export.

`Trainer(config).fit()` is the entry point.
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
