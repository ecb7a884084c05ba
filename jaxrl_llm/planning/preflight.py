"""What a start checks before it loads weights, run on its own for `launch/train.py --dry_run`: the
tokenizer (and data.chat_template) loads, the first rows of each data file read and tokenise as a
start reads them (columns, ground truth and data_source for the built-in scorers, prompt lengths),
multi-turn tool and interaction configs load (their classes imported and constructed), and the
reward function and manager build. A bad one raises the error a start would
(`AgentConfigError`, `RewardFunctionError`, `TokenizerError`, ...), so a dry run that passes means the
run gets as far as loading its model."""
from __future__ import annotations

import copy

import ml_collections

from jaxrl_llm.config import ConfigError, resolve, resolve_data
from jaxrl_llm.data.spec import DataSpec
from jaxrl_llm.hf.tokenizer import Tokenizer


def run_tokenizer(data: DataSpec) -> Tokenizer:
    """The run's tokenizer (`data.tokenizer`, which validation derives from the model path)."""
    from jaxrl_llm.hf import load_tokenizer

    if data.tokenizer is None:  # derived from actor_rollout_ref.model.path, except for tiny: models
        raise ConfigError("data.tokenizer: none given, and a tiny: model path names no tokenizer")
    tokenizer = load_tokenizer(data.tokenizer)
    if data.chat_template is None:
        return tokenizer
    tokenizer = copy.copy(tokenizer)  # the loaded instance is shared (cached): never changed in place
    tokenizer.chat_template = data.chat_template
    try:  # a template that does not render fails here, before anything is loaded
        tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1 = ?"}], add_generation_prompt=True,
                                      tokenize=False)
    except Exception as err:  # jinja2's TemplateError and what the template itself raises
        raise ConfigError(f"data.chat_template: the template does not render a one-message chat ({err})") from None
    return tokenizer


def check_data_rows(data: DataSpec, tokenizer: Tokenizer, rows: int = 64) -> None:
    """The first `rows` rows of the train and validation files, read and tokenised as a start reads
    every row (a bad row raises the DataError the start would, naming file and row). Synthetic
    tasks (written at start) and custom dataset classes are left to the start."""
    from jaxrl_llm.data.prompts import records_from_rows, split_tokenizer
    from jaxrl_llm.data.sources import as_path_list, read_files

    if data.custom_cls_path:
        return
    for split in ("train", "val"):
        files = data.files(split)
        if not files:
            continue
        found, refs = read_files(as_path_list(files, f"data.{split}_files"))
        settings = data.for_split(split)  # validation with data.val_overrides
        records_from_rows(found[:rows], refs[:rows], split_tokenizer(settings, data, tokenizer), settings)


def preflight(cfg: ml_collections.ConfigDict, *, dp_size: int) -> None:
    """Runs the start's checks on the validated `cfg` (`dp_size`: the run's data-parallel size)."""
    from jaxrl_llm.rewards import build_reward_manager

    spec = resolve(cfg, dp_size=dp_size)
    data = resolve_data(cfg)
    tokenizer = run_tokenizer(data)
    if cfg.data.synthetic.task is None:
        check_data_rows(data, tokenizer)
    if spec.multi_turn is not None:
        from jaxrl_llm.rollout.multi_turn import MultiTurn

        MultiTurn(spec.multi_turn, tokenizer)
    build_reward_manager(spec.reward).close()
