"""The RL loop: rollout -> experience -> update; metrics; validation; checkpoints.

`Trainer(config).fit()` (trainer.py) is the entry point; `train_step` reads top to bottom.
"""
from jaxrl_llm.trainer.trainer import Trainer

__all__ = ["Trainer"]
