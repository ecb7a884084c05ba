"""What the entry points (launch/*.py) treat as a bad input: one line naming it, no traceback."""
from __future__ import annotations


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
