"""`load_any(path)`: one entry point that dispatches on what `path` is.

Loaders are tried in registration order; the trainer's checkpoint loader plugs in with
`register_loader("checkpoint", can_load, load)` (inserted first, so it wins over the defaults).
Every loader takes `(path, **kw)` and returns `(ModelConfig, params)`.
"""
from __future__ import annotations

import pathlib
from typing import Any, Callable

from jaxrl_llm.hf.gguf_load import load_gguf
from jaxrl_llm.hf.hf_folder import load_hf_folder
from jaxrl_llm.models.config import ModelConfig

Loader = Callable[..., tuple[ModelConfig, dict]]
_LOADERS: list[tuple[str, Callable[[pathlib.Path], bool], Loader]] = [
    ("hf_folder", lambda p: p.is_dir() and (p / "config.json").is_file(), load_hf_folder),
    ("gguf", lambda p: p.is_file() and p.suffix == ".gguf", load_gguf),
]


def register_loader(name: str, can_load: Callable[[pathlib.Path], bool], load: Loader) -> None:
    """Add (or replace) a loader; new loaders are tried before the built-in ones."""
    _LOADERS[:] = [entry for entry in _LOADERS if entry[0] != name]
    _LOADERS.insert(0, (name, can_load, load))


def load_any(path: str | pathlib.Path, **kw: Any) -> tuple[ModelConfig, dict]:
    """(cfg, params) from an HF folder, a .gguf file, or anything a registered loader accepts."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    for _name, can_load, load in _LOADERS:
        if can_load(p):
            return load(p, **kw)
    if p.is_dir():
        raise FileNotFoundError(f"no config.json in model folder {str(p)!r}")
    kinds = ", ".join(name for name, _, _ in _LOADERS)
    raise ValueError(f"cannot load {str(p)!r}: not one of the known kinds ({kinds})")
