"""What the entry points (launch/*.py) share: what counts as a bad input (reported in one line naming it,
no traceback) and how a script's `--config.a.b=v` flags reach its config (`run_app`)."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that report a bad input (config, data, model folder, reward code), not a bug."""
    from jaxrl_llm.agents import AgentConfigError
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.data import DataError
    from jaxrl_llm.hf.tokenizer import TokenizerError
    from jaxrl_llm.models import UnsupportedArchitectureError
    from jaxrl_llm.platform import TpuPlanError
    from jaxrl_llm.rewards import RewardFunctionError, UnknownDataSourceError

    return (AgentConfigError, ConfigError, DataError, RewardFunctionError, TokenizerError, TpuPlanError,
            UnknownDataSourceError, UnsupportedArchitectureError)


def user_error_line(err: BaseException) -> str:
    """`data error: <file> line N: ...` for data files, `config error: <key>: ...` for the rest."""
    from jaxrl_llm.data import DataError

    kind = "data error" if isinstance(err, DataError) else "config error"
    return f"{kind}: " + " ".join(str(err).split("\n"))


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """A bad input inside ends the process with its one line (`user_error_line`), exit status 1."""
    try:
        yield
    except user_errors() as err:
        sys.exit(user_error_line(err))


def run_app(main: Callable[[list[str]], None], flag_overrides: list[str]) -> None:
    """Runs `main` under absl with the `--config.a.b=v` flags taken out of argv first (into
    `flag_overrides`: config_flags would reject keys the config file lacks) and the rest parsed by absl."""
    from absl import app

    from jaxrl_llm.config import split_config_flag_overrides

    argv, overrides = split_config_flag_overrides(sys.argv)
    flag_overrides[:] = overrides
    sys.argv = argv  # config_flags reads sys.argv itself when the --config flag is parsed
    app.run(main, argv=argv)


@contextlib.contextmanager
def storage_failures_exit() -> Iterator[None]:
    """A run's storage that fails for good ends the process with one line and exit 74 (sysexits' I/O error;
    a crash is 1, a preemption 75): `checkpoint error: ...` for an async save that failed (a full disk, a
    bucket refusing writes), `storage error: ...` for any other write or read of the run dir."""
    from jaxrl_llm.checkpoint import CHECKPOINT_ERROR_EXIT_CODE, CheckpointSaveError
    from jaxrl_llm.storage import STORAGE_ERROR_EXIT_CODE, StorageError

    try:
        yield
    except CheckpointSaveError as err:
        print(f"checkpoint error: {err}", file=sys.stderr, flush=True)
        sys.exit(CHECKPOINT_ERROR_EXIT_CODE)
    except StorageError as err:
        print(f"storage error: {err}", file=sys.stderr, flush=True)
        sys.exit(STORAGE_ERROR_EXIT_CODE)
