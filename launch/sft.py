"""Supervised fine-tuning (SFT) from a config file, veRL's SFT YAML or veRL's SFT command-line keys.

    python launch/sft.py                                   # configs/sft_tiny.py: the tiny model, CPU-sized
    python launch/sft.py --config=configs/sft_gsm8k.py -- trainer.total_epochs=2 sft.max_length=1024
    python launch/sft.py --import_config=sft_trainer.yaml --dry_run   # veRL's sft_trainer(_engine).yaml
    python launch/sft.py --config=configs/sft_gsm8k.py -- data.micro_batch_size_per_gpu=4 \
        model.partial_pretrain=~/models/Qwen2.5-0.5B-Instruct optim.lr=1e-4 data.response_key=answer

Overrides after `--` are keys of ours (docs/config.md; the `sft` section and the RL keys an SFT run
reads) or veRL's SFT keys (`data.micro_batch_size_per_gpu`, `model.partial_pretrain`, `optim.lr`, ...),
mapped by jaxrl_llm/config/importers/verl_sft.py exactly as in a veRL SFT YAML file. The loop is
`jaxrl_llm.sft.SftTrainer(config).fit()` (docs/sft_dpo_eval.md). A bad input ends the run with one line,
`config error: ...` or `data error: ...`; SIGTERM checkpoints and exits 75 as RL runs do.
"""
from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from jaxrl_llm.config import default_config
from jaxrl_llm.config.importers.verl_sft import sft_config
from jaxrl_llm.entry import run_app

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "sft_tiny.py")
_CONFIG = config_flags.DEFINE_config_file("config", os.path.normpath(_DEFAULT_CONFIG),
                                          "Config file with get_config() (configs/sft_*.py).", lock_config=False)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the resolved config and the SFT batch arithmetic, read and "
                                               "tokenize the data (every row checked), then exit.")
_IMPORT = flags.DEFINE_string("import_config", None, "A veRL SFT config (sft_trainer.yaml or "
                                                     "sft_trainer_engine.yaml layout), applied onto --config (default: "
                                                     "the default tree).")
_FLAG_OVERRIDES: list[str] = []


def main(argv: list[str]) -> None:
    from jaxrl_llm.sft import SftTrainer
    from jaxrl_llm.sft.launch import launch_trainer

    # a file or overrides without --config start from the default tree (as launch/train.py)
    base = _CONFIG.value if flags.FLAGS["config"].present or not (argv[1:] or _IMPORT.value) else default_config()
    launch_trainer(argv, base=base, import_path=_IMPORT.value, flag_overrides=_FLAG_OVERRIDES, to_config=sft_config,
                   make_trainer=SftTrainer, dry_run=_DRY_RUN.value)


if __name__ == "__main__":
    run_app(main, _FLAG_OVERRIDES)
