"""jaxrl_llm: pure-JAX reinforcement-learning post-training for LLMs.

The public facade lives in `jaxrl_llm.api`; names are resolved lazily so that importing the package
is cheap and one subpackage's import cost is paid only when it is used.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on first use
    from jaxrl_llm.api import Model, SamplingParams, Trainer, export_hf, generate, load_model, load_tokenizer

__version__ = "0.1.0"

# facade name -> module that defines it
_FACADE = {
    "load_model": "jaxrl_llm.api",
    "load_tokenizer": "jaxrl_llm.api",
    "export_hf": "jaxrl_llm.api",
    "Model": "jaxrl_llm.api",
    "generate": "jaxrl_llm.api",
    "SamplingParams": "jaxrl_llm.api",
    "Trainer": "jaxrl_llm.api",
}

__all__ = ["Model", "SamplingParams", "Trainer", "__version__", "export_hf", "generate", "load_model",
           "load_tokenizer"]


def __getattr__(name: str) -> Any:
    module = _FACADE.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxrl_llm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
