"""Train (or dry-run) an RL post-training run from a config file.

    python launch/train.py --config=configs/grpo_gsm8k.py --config.actor_rollout_ref.actor.optim.lr=1e-6
    python launch/train.py --config=configs/ppo_gsm8k.py -- data.train_batch_size=256 \
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 trainer.logger=[console,wandb]
    python launch/train.py --config=configs/quickstart.py --dry_run   # print resolved config + batch maths

`--config.a.b=v` and the veRL-style `a.b=v` after `--` go through the same parser
(`jaxrl_llm.config.apply_overrides`): YAML-like values, TRL/ROLL/veRL aliases (`rloo_k`,
`*_per_gpu`, ...), torch-only keys warned about and ignored, unknown keys rejected with a
suggestion. The config is validated before anything is compiled; the loop is
`jaxrl_llm.trainer.Trainer(config).fit()`.
"""
from __future__ import annotations

import os
import sys

import yaml
from absl import app, flags
from ml_collections import config_flags

from jaxrl_llm.config import (ConfigError, apply_overrides, mesh_dp_size, resolve_batch_plan,
                              split_config_flag_overrides, validate_config)

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "quickstart.py")
_CONFIG = config_flags.DEFINE_config_file("config", os.path.normpath(_DEFAULT_CONFIG),
                                          "Config file with get_config() (configs/*.py).", lock_config=False)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the resolved config and the batch arithmetic, then exit.")

# `--config.a.b=v` flags, taken out of argv before absl parses it (see split_config_flag_overrides).
_FLAG_OVERRIDES: list[str] = []


def resolve(config, overrides: list[str]):
    """Applies overrides, validates on this host's devices; returns (resolved config, dp size)."""
    import jax

    cfg = apply_overrides(config, overrides)
    num_devices = jax.device_count()
    cfg = validate_config(cfg, num_devices=num_devices)
    return cfg, mesh_dp_size(cfg, num_devices)


def main(argv: list[str]) -> None:
    from absl import logging as absl_logging

    from jaxrl_llm.sharding import initialize

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint call at INFO
    initialize()  # jax.distributed on TPU pods / multi-node GPU, before any other JAX call
    overrides = _FLAG_OVERRIDES + [a for a in argv[1:] if a != "--"]
    try:
        cfg, dp_size = resolve(_CONFIG.value, overrides)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    if _DRY_RUN.value:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None), end="")
        print(resolve_batch_plan(cfg, dp_size).summary(cfg.trainer.total_training_steps, cfg.trainer.total_epochs))
        return
    from jaxrl_llm.trainer import Trainer  # imported only for a real run: parsing needs none of it

    Trainer(cfg).fit()


def run() -> None:
    argv, overrides = split_config_flag_overrides(sys.argv)
    _FLAG_OVERRIDES[:] = overrides
    sys.argv = argv  # config_flags reads sys.argv itself when the --config flag is parsed
    app.run(main, argv=argv)


if __name__ == "__main__":
    run()
