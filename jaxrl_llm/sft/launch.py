"""What `launch/sft.py` and `launch/dpo.py` share once their config is built: `--dry_run`, the run, and
the one-line reports of a bad input (exit 1), a failed checkpoint save (exit 74) and SIGTERM during
setup (exit 75), as `launch/train.py` reports them."""
from __future__ import annotations

import sys
from collections.abc import Callable

import ml_collections
import yaml

from jaxrl_llm.sft.trainer import SftTrainer
from jaxrl_llm.user_errors import user_error_line, user_errors


def run_entry_point(make_trainer: Callable[..., SftTrainer], cfg: ml_collections.ConfigDict, *,
                    dry_run: bool) -> None:
    """Runs (or with `dry_run` checks) the trainer `make_trainer(cfg)` builds."""
    from jaxrl_llm.bookkeeping.preemption import stop_during_setup
    from jaxrl_llm.checkpoint import CHECKPOINT_ERROR_EXIT_CODE, CheckpointSaveError

    try:
        if dry_run:  # the resolved tree, then every row read: a bad row is the last line
            trainer = make_trainer(cfg, dry_run=True)
            print(yaml.safe_dump(trainer.checked.to_dict(), sort_keys=False, default_flow_style=None), end="")
            print(trainer.rows_summary())
            return
        with stop_during_setup():
            trainer = make_trainer(cfg)
        trainer.fit()
    except user_errors() as err:
        sys.exit(user_error_line(err))
    except CheckpointSaveError as err:
        print(f"checkpoint error: {err}", file=sys.stderr, flush=True)
        sys.exit(CHECKPOINT_ERROR_EXIT_CODE)
