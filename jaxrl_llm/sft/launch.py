"""What `launch/sft.py` and `launch/dpo.py` share once their config is built: `--dry_run`, the run, and
the one-line reports of a bad input (exit 1), a failed checkpoint save (exit 74) and SIGTERM during
setup (exit 75), as `launch/train.py` reports them."""
from __future__ import annotations

import sys
from collections.abc import Callable

import ml_collections
import yaml

from jaxrl_llm.entry import user_error_line, user_errors
from jaxrl_llm.sft.trainer import SftTrainer


def run_entry_point(make_trainer: Callable[..., SftTrainer], cfg: ml_collections.ConfigDict, *,
                    dry_run: bool) -> None:
    """Runs (or with `dry_run` checks) the trainer `make_trainer(cfg)` builds."""
    from jaxrl_llm.bookkeeping.preemption import stop_during_setup
    from jaxrl_llm.entry import storage_failures_exit

    try:
        if dry_run:  # the resolved tree, then every row read: a bad row is the last line
            trainer = make_trainer(cfg, dry_run=True)
            print(yaml.safe_dump(trainer.checked.to_dict(), sort_keys=False, default_flow_style=None), end="")
            print(trainer.rows_summary())
            return
        with storage_failures_exit():  # a full disk, a bucket refusing writes: one line, exit 74
            with stop_during_setup():
                trainer = make_trainer(cfg)
            trainer.fit()
    except user_errors() as err:
        sys.exit(user_error_line(err))


def launch_trainer(argv: list[str], *, base: ml_collections.ConfigDict, import_path: str | None,
                   flag_overrides: list[str], to_config: Callable[..., ml_collections.ConfigDict],
                   make_trainer: Callable[..., SftTrainer], dry_run: bool) -> None:
    """The main of launch/sft.py and launch/dpo.py: the config (`to_config(base, items, import_path)`; a bad
    one is one `config error:` line), then `run_entry_point`."""
    from absl import logging as absl_logging

    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.sharding import initialize

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint call at INFO
    initialize()
    try:
        cfg = to_config(base, list(flag_overrides) + argv[1:], import_path)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    run_entry_point(make_trainer, cfg, dry_run=dry_run)
