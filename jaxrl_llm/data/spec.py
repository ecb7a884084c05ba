"""`DataSpec`: the typed, resolved `data.*` settings this package reads (built once from the config
by `jaxrl_llm.config.resolve`; nothing here reads a config tree or re-defaults a key)."""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_llm.data.domains import DomainSpec

# the data keys data.val_overrides may set for the validation files
VAL_OVERRIDABLE = ("prompt_key", "messages_key", "ground_truth_key", "system_prompt", "default_data_source",
                   "apply_chat_template", "chat_template")


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where prompts come from and how they are tokenised and batched (keys: docs/config.md, `data.*`)."""

    train_files: tuple[str, ...] | None
    val_files: tuple[str, ...] | None
    tokenizer: str | None
    prompt_key: str
    messages_key: str
    apply_chat_template: bool
    max_prompt_length: int
    train_batch_size: int
    val_batch_size: int | None  # None: the whole validation set in one batch
    return_raw_chat: bool
    truncation: str
    filter_overlong_prompts: bool
    filter_overlong_prompts_workers: int
    shuffle: bool
    seed: int | None
    train_max_samples: int
    val_max_samples: int
    dataloader_num_workers: int
    custom_cls_path: str | None
    custom_cls_name: str | None
    system_prompt: str | None = None  # put first in prompts without a system message
    chat_template: str | None = None  # the Jinja text (read from its file by resolve) replacing the tokenizer's
    # data.val_overrides: (key, value) of the keys validation reads otherwise (VAL_OVERRIDABLE; chat_template
    # as its text, or "native")
    val_overrides: tuple[tuple[str, Any], ...] = ()
    ground_truth_key: str | None = None  # None: reward_model.ground_truth or a ground_truth column
    default_data_source: str | None = None  # rows without a data_source column
    # rows are scored by the built-in rule scorers (no custom_reward_function, no reward model):
    # every row needs a ground truth and a data_source they know, checked when the data is loaded
    builtin_scorers: bool = False
    extra_info_keys: tuple[str, ...] = ()  # columns copied into each row's extra_info
    skip_bad_rows: bool = False  # a row that cannot be read is left out and counted, not an error
    domains: DomainSpec = DomainSpec()  # data.domains.*: each row's domain, the batch's share of each
    image_key: str = "images"  # data.image_key: each row's images (data/images.py); "" = none read
    video_key: str = "videos"  # data.video_key: a row with videos is refused

    def for_split(self, split: str) -> DataSpec:
        """These settings as `split`'s rows are read (validation: with data.val_overrides)."""
        if split != "val" or not self.val_overrides:
            return self
        return dataclasses.replace(self, **dict(self.val_overrides), val_overrides=())

    def files(self, split: str) -> tuple[str, ...] | None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return self.train_files if split == "train" else self.val_files

    def max_samples(self, split: str) -> int:
        return self.train_max_samples if split == "train" else self.val_max_samples


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """A synthetic task written into the run dir at start (`data.synthetic.*`)."""

    task: str
    n_train: int
    n_val: int
    difficulty: int
    answer_format: str
    seed: int
    train_path: str
    val_path: str


@dataclasses.dataclass(frozen=True)
class SftSpec:
    """The `sft.*` settings (config/tree_sft.py): SFT rows, their batches and the RL run's SFT warm-up."""

    response_key: str = "response"
    prompt_key: str | None = None  # None: data.prompt_key
    messages_key: str | None = None  # None: data.messages_key
    prompt_dict_keys: tuple[str, ...] = ()
    response_dict_keys: tuple[str, ...] = ()
    multiturn: bool = False
    tools_key: str = "tools"
    enable_thinking_key: str = "enable_thinking"
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    max_length: int = 1024
    micro_batch_size_per_device: int = 4
    use_dynamic_bsz: bool = False
    max_token_len_per_device: int = 8192
    warmup_steps: int = 0
    warmup_files: tuple[str, ...] | None = None
