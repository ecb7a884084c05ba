"""Typed reward settings (built once by `jaxrl_llm.config.resolve`; nothing here reads a config tree)."""
from __future__ import annotations

import dataclasses

from jaxrl_llm.rewards.custom import ScorerSpec


@dataclasses.dataclass(frozen=True)
class OverlongSpec:
    """DAPO soft overlong punishment (`reward_model.reward_kwargs.overlong_buffer_cfg`)."""

    enable: bool
    len: int
    penalty_factor: float
    log: bool


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """Everything the reward manager needs (built by `jaxrl_llm.config.resolve`)."""

    reward_manager: str  # naive | prime
    scorer: ScorerSpec
    timeout_s: float
    num_workers: int
    max_resp_len: int | None
    overlong: OverlongSpec
    missing_eos_penalty: float | None


@dataclasses.dataclass(frozen=True)
class RewardModelSpec:
    """`reward_model.*` for a score-head model (built by `jaxrl_llm.config.resolve`)."""

    path: str
    input_tokenizer: str | None
    max_length: int | None
    micro_batch_size_per_device: int | None
