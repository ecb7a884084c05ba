"""Typed reward settings (built once by `jaxrl_llm.config.resolve`; nothing here reads a config tree)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_llm.rewards.custom import ScorerSpec
from jaxrl_llm.rewards.named import NamedRewards


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
    no_verdict_ok: bool = False  # a scorer may return None or lack a data source's scorer (beside a judge)
    named: NamedRewards | None = None  # open-r1's reward functions by name (custom_reward_function.reward_funcs)


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
    """`reward_model.judge.*`: how a generative reward model is prompted and read (roles/judge.py)."""

    template: str
    system_prompt: str | None
    parser: str  # a built-in name (rewards/judge_parsers.py) or 'file.py:function'
    min_score: float
    max_score: float
    default_score: float
    max_new_tokens: int
    temperature: float
    max_prompt_length: int
    combine: str  # judge | sum | fallback
    rule_weight: float
    judge_weight: float
    on_rollout_devices: bool
    top_p: float = 1.0  # nucleus sampling of the verdict (1 = off)
    top_k: int = -1  # top-k sampling of the verdict (-1 = off)
    data_sources: tuple[str, ...] = ()  # the rows the judge grades (by data_source); () = every row
    rubric_key: str | None = None  # the extra_info key holding a row's rubric ({rubric} in the template)
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()  # passed to the judge's chat template

    def grades(self, data_sources: Any) -> np.ndarray:
        """bool [N]: the rows (by their data_source) this judge grades."""
        sources = [str(s) for s in data_sources]
        if not self.data_sources:
            return np.ones(len(sources), bool)
        return np.asarray([s in self.data_sources for s in sources], bool)


@dataclasses.dataclass(frozen=True)
class RewardModelSpec:
    """`reward_model.*` for a score-head model, or a judge (style generative); built by
    `jaxrl_llm.config.resolve`."""

    path: str
    input_tokenizer: str | None
    max_length: int | None
    micro_batch_size_per_device: int | None
    style: str = "discriminative"  # discriminative | generative
    judge: JudgeSpec | None = None  # style generative
    dtype: str = "float32"  # the judge's params and compute dtype (actor_rollout_ref.model.dtype)
