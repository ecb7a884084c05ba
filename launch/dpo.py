"""Direct preference optimisation (DPO / IPO / hinge) from a config file, TRL's DPOConfig YAML or flags, or
a Trinity-RFT DPO file.

    python launch/dpo.py                                   # configs/dpo_tiny.py: the tiny model, CPU-sized
    python launch/dpo.py --config=configs/dpo_tiny.py -- dpo.beta=0.2 dpo.loss_type=ipo
    python launch/dpo.py --import_config=dpo_config.yaml --dry_run     # `trl dpo --config FILE`, or Trinity's
    python launch/dpo.py --config=configs/dpo_tiny.py -- --beta=0.1 --per_device_train_batch_size=2  # TRL flags

Overrides after `--` are keys of ours (docs/config.md; the `dpo` section and the keys an SFT run reads)
or TRL `--name=value` flags (jaxrl_llm/config/importers/dpo.py). The loop is
`jaxrl_llm.dpo.DpoTrainer(config).fit()` (docs/sft_dpo_eval.md). A bad input ends the run with one
line, `config error: ...` or `data error: ...`; SIGTERM checkpoints and exits 75 as RL runs do.
"""
from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from jaxrl_llm.config import default_config
from jaxrl_llm.config.importers.dpo import dpo_config
from jaxrl_llm.entry import run_app

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "dpo_tiny.py")
_CONFIG = config_flags.DEFINE_config_file("config", os.path.normpath(_DEFAULT_CONFIG),
                                          "Config file with get_config() (configs/dpo_*.py).", lock_config=False)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the resolved config and the batch arithmetic, read and "
                                               "tokenize the pairs (every row checked), then exit.")
_IMPORT = flags.DEFINE_string("import_config", None, "A TRL DPOConfig YAML file or a Trinity-RFT file with "
                                                     "algorithm_type dpo, applied onto --config (default: the default "
                                                     "tree).")
_FLAG_OVERRIDES: list[str] = []


def main(argv: list[str]) -> None:
    from jaxrl_llm.dpo import DpoTrainer
    from jaxrl_llm.sft.launch import launch_trainer

    # a file or overrides without --config start from the default tree (as launch/train.py)
    base = _CONFIG.value if flags.FLAGS["config"].present or not (argv[1:] or _IMPORT.value) else default_config()
    launch_trainer(argv, base=base, import_path=_IMPORT.value, flag_overrides=_FLAG_OVERRIDES, to_config=dpo_config,
                   make_trainer=DpoTrainer, dry_run=_DRY_RUN.value)


if __name__ == "__main__":
    run_app(main, _FLAG_OVERRIDES)
