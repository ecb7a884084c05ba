"""Loading user code from a file: `custom_reward_function.path` / `.name` (and `data.custom_cls`).

The file is imported as a fresh module under a name derived from its path, so two different
files with the same basename do not collide and the module can be re-imported in a worker
process from the path alone (see `ScorerSpec`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any


class RewardFunctionError(ValueError):
    """A user reward function (or dataset class) cannot be loaded."""


def _module_name(path: str) -> str:
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0].replace("-", "_").replace(".", "_")
    return f"jaxrl_llm_user_{stem}_{digest}"


def load_from_file(path: str, name: str, key: str = "custom_reward_function") -> Any:
    """The attribute `name` of the Python file `path`; `key` names the config section in errors."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise RewardFunctionError(f"{key}.path: no such file {path}")
    module_name = _module_name(path)
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise RewardFunctionError(f"{key}.path: cannot import {path} (not a Python file?)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # lets pickle find functions defined in the file
        try:
            spec.loader.exec_module(module)
        except KeyboardInterrupt:
            del sys.modules[module_name]
            raise
        except BaseException as err:  # even sys.exit() at import is a bad file, not an exit
            del sys.modules[module_name]
            raise RewardFunctionError(f"{key}.path: importing {path} failed: {type(err).__name__}: {err}") from err
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise RewardFunctionError(f"{key}.name: {path} has no attribute {name!r} (callables there: {public})")
    return getattr(module, name)


@dataclasses.dataclass(frozen=True)
class ScorerSpec:
    """Which compute_score to use, by name, so a worker process can load it itself.

    `path=None` means `jaxrl_llm.rewards.default_compute_score`. `kwargs`
    (`custom_reward_function.reward_kwargs`, as sorted (key, value) pairs) are bound to the function.
    """

    path: str | None = None
    name: str = "compute_score"
    kwargs: tuple[tuple[str, Any], ...] = ()

    def load(self) -> Callable[..., Any]:
        if self.path is None:
            from jaxrl_llm.rewards.scorers import default_compute_score

            fn = default_compute_score
        else:
            fn = load_from_file(self.path, self.name)
            if not callable(fn):
                raise RewardFunctionError(f"custom_reward_function.name: {self.path}:{self.name} is not callable")
        return functools.partial(fn, **dict(self.kwargs)) if self.kwargs else fn
