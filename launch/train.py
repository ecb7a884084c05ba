"""Train (or dry-run) an RL post-training run from a config file.

    python launch/train.py --config=configs/grpo_gsm8k.py --config.actor_rollout_ref.actor.optim.lr=1e-6
    python launch/train.py --config=configs/ppo_gsm8k.py -- data.train_batch_size=256 \
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 trainer.logger=[console,wandb]
    python launch/train.py --config=configs/quickstart.py --dry_run   # print resolved config + batch maths
    python launch/train.py --config=configs/quickstart.py --plan      # per-program memory / FLOPs, no weights
    python launch/train.py --config=configs/grpo_gsm8k.py --plan --topology=v5p-64   # compiled for a TPU slice
    python launch/train.py --import_config=ppo_trainer.yaml --dry_run  # a veRL / Trinity-RFT / ROLL / TRL file
    python launch/train.py --config=configs/grpo_gsm8k.py -- --learning_rate=1e-6 --num_generations=8  # TRL flags

`--config.a.b=v` and the veRL-style `a.b=v` after `--` go through the same parser
(`jaxrl_llm.config.apply_overrides`): YAML-like values, TRL/ROLL/veRL aliases (`rloo_k`,
`*_per_gpu`, ...), torch-only keys warned about and ignored, unknown keys rejected with a
suggestion. `--import_config` reads another framework's config (jaxrl_llm.config.importers,
docs/importing.md) onto the `--config` file; a pasted veRL line's `--config-path=DIR
--config-name=NAME` after `--` imports DIR/NAME.yaml the same way. TRL `--name=value` flags after
`--` are translated too; `--config.a.b=v` and `a.b=v` overrides apply last. Without `--config`, a
run starts from the default tree (veRL's defaults) when it imports a file or has overrides or TRL
flags, and from configs/quickstart.py when it has none of them. The config is validated before
anything is compiled; the loop is `jaxrl_llm.trainer.Trainer(config).fit()`. A bad input (config
key, data file and row, model folder, reward file) ends the run with one line, `config error: ...` or
`data error: ...`, and a non-zero exit status, without a traceback.
"""
from __future__ import annotations

import copy
import os
import sys

import yaml
from absl import flags
from ml_collections import config_flags

from jaxrl_llm.config import (
    ConfigError,
    apply_overrides,
    default_config,
    resolve_batch_plan,
)
from jaxrl_llm.config.importers import FORMATS
from jaxrl_llm.config.importers.command_line import resolve_command_line, split_command_line
from jaxrl_llm.config.validate import check_input_paths
from jaxrl_llm.entry import run_app, user_error_line, user_errors
from jaxrl_llm.platform import TpuPlanError

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "quickstart.py")
_CONFIG = config_flags.DEFINE_config_file("config", os.path.normpath(_DEFAULT_CONFIG),
                                          "Config file with get_config() (configs/*.py).", lock_config=False)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the resolved config and the batch arithmetic, run the checks a "
                                                 "start runs short of loading weights (data and model paths, "
                                                 "tokenizer and chat template, the first rows of each data file, "
                                                 "multi-turn tools and interactions, reward function), then exit.")
_PLAN = flags.DEFINE_bool("plan", False, "Compile every program of a step on abstract inputs (no weights) and "
                                         "print its per-device memory and FLOPs (planning/memory.py), then "
                                         "exit: 0 if it fits trainer.device_memory_gb / the device, 1 if not.")
_TOPOLOGY = flags.DEFINE_string("topology", None, "With --plan: compile for this TPU slice instead of the local "
                                                 "devices (v4-8, v5litepod-8 / v5e-8, v5p-64, v6e-8, or v5e:2x2; "
                                                 "needs libtpu: the tpu-plan extra); overrides trainer.plan_topology.")
_LONGEST = flags.DEFINE_bool("longest", False, "With --plan: also find the longest response each program fits per "
                                               "device at one sequence per micro-batch (a bisection of compiles: "
                                               "planning/longest.py; needs a device memory).")
_NUM_SLICES = flags.DEFINE_integer("num_slices", None, "With --topology: slices of it (multislice); overrides "
                                                       "trainer.plan_num_slices.")
_EVAL_ONLY = flags.DEFINE_bool("eval_only", False, "Validate the policy (actor_rollout_ref.model.path: an HF folder, "
                                                   ".gguf or one of our checkpoints) on data.val_files and exit, "
                                                   "without training: veRL's trainer.val_only=true.")
_IMPORT = flags.DEFINE_string("import_config", None, "A veRL / Trinity-RFT / ROLL / TRL config file (YAML), or a "
                                                     "veRL example script (*.sh, read without running it), to run; "
                                                     "applied onto --config (default: the default tree).")
_IMPORT_FORMAT = flags.DEFINE_enum("import_format", None, list(FORMATS),
                                   "Format of --import_config; default: detected from its top-level keys.")

# `--config.a.b=v` flags, taken out of argv before absl parses it (see split_config_flag_overrides).
_FLAG_OVERRIDES: list[str] = []


def main(argv: list[str]) -> None:
    from absl import logging as absl_logging

    from jaxrl_llm.sharding import initialize

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint call at INFO
    initialize()  # jax.distributed on TPU pods / multi-node GPU, before any other JAX call
    try:
        import_path, _, overrides, trl_flags = split_command_line(argv[1:], _IMPORT.value, _IMPORT_FORMAT.value)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    has_config = flags.FLAGS["config"].present
    base = _CONFIG.value if has_config else base_config(import_path, _FLAG_OVERRIDES + overrides, trl_flags)
    extra = list(_FLAG_OVERRIDES)
    if _EVAL_ONLY.value:
        extra.append("trainer.val_only=true")
    if _PLAN.value and _TOPOLOGY.value:
        extra.append(f"trainer.plan_topology={_TOPOLOGY.value}")
    if _PLAN.value and _NUM_SLICES.value:
        extra.append(f"trainer.plan_num_slices={_NUM_SLICES.value}")
    try:
        cfg, dp_size = resolve_command_line(
            base, argv[1:], import_path=_IMPORT.value, import_format=_IMPORT_FORMAT.value, extra_overrides=extra,
            num_devices=planned_devices(base, extra + overrides) if _PLAN.value else None,
            check_paths=not _DRY_RUN.value)
    except (ConfigError, TpuPlanError) as err:
        sys.exit(f"config error: {err}")
    if _DRY_RUN.value:  # the tree first, then the checks: a missing file is the last line (still an error)
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None), end="")
        print(resolve_batch_plan(cfg, dp_size).summary(cfg.trainer.total_training_steps, cfg.trainer.total_epochs))
        try:
            check_input_paths(cfg)
        except ConfigError as err:
            sys.exit(f"config error: {err}")
        from jaxrl_llm.planning.preflight import preflight  # tokenizer, tools, interactions, reward function

        try:
            preflight(cfg, dp_size=dp_size)
        except user_errors() as err:
            sys.exit(user_error_line(err))
        return
    if _PLAN.value:
        try:
            print(plan_for_config(cfg).table())
            if _LONGEST.value:
                from jaxrl_llm.planning.longest import longest_sequences

                print(longest_sequences(cfg).table())
        except user_errors() as err:
            sys.exit(user_error_line(err))
        return
    from jaxrl_llm.bookkeeping.preemption import stop_during_setup
    from jaxrl_llm.entry import storage_failures_exit
    from jaxrl_llm.trainer import Trainer  # imported only for a real run: parsing needs none of it

    try:
        with storage_failures_exit():  # a full disk, a bucket refusing writes: one line, exit 74
            with stop_during_setup():  # SIGTERM while loading / compiling: exit 75 at once (nothing to save)
                trainer = Trainer(cfg)
            trainer.fit()  # its own guard from here: the resume, the first validation, the steps
    except user_errors() as err:  # a bad input: one line naming it, no traceback
        sys.exit(user_error_line(err))


def base_config(import_path: str | None, overrides: list[str], trl_flags: list[str]):
    """The tree a run without --config starts from: with nothing else given, the quickstart (its
    built-in default); with an imported file, pasted overrides or TRL flags, the default tree (veRL's
    defaults, as veRL's own command line starts from them), never the quickstart's synthetic task."""
    if import_path or overrides or trl_flags:
        return default_config()
    return _CONFIG.value


def planned_devices(base, overrides: list[str]) -> int | None:
    """JAX devices of the TPU slice the plan compiles for (`trainer.plan_topology` after the overrides), or
    None for the local devices: the config's batch arithmetic is checked against that many."""
    from jaxrl_llm.platform import parse_accelerator_type

    cfg = apply_overrides(copy.deepcopy(base), [o for o in overrides if o.lstrip("+").startswith("trainer.plan_")])
    if not cfg.trainer.plan_topology:
        return None
    _, devices = parse_accelerator_type(cfg.trainer.plan_topology)
    return devices * int(cfg.trainer.plan_num_slices)


def plan_for_config(cfg):
    """planning/memory.py's `plan_for_config` (imported only for --plan)."""
    from jaxrl_llm.planning.memory import plan_for_config as plan

    return plan(cfg)


def run() -> None:
    run_app(main, _FLAG_OVERRIDES)


if __name__ == "__main__":
    run()
