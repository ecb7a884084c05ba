"""`load_any(path)`: one entry point that dispatches on what `path` is.

The built-in loaders (an HF folder, a .gguf file) are declared in `BUILTIN_LOADERS`. Other
packages add theirs with an explicit call, never as an import side effect: the trainer's
checkpoint loader is added by `jaxrl_llm.checkpoint.register_checkpoint_loader()`.
Registered loaders are tried before the built-in ones, newest first. Every loader takes
`(path, **kw)` and returns `(ModelConfig, params)`.
"""
from __future__ import annotations

import pathlib
from typing import Any, Callable, NamedTuple

from jaxrl_llm.hf.gguf_load import load_gguf
from jaxrl_llm.hf.hf_folder import load_hf_folder
from jaxrl_llm.models.config import ModelConfig

Loader = Callable[..., tuple[ModelConfig, dict]]


class LoaderEntry(NamedTuple):
    name: str
    can_load: Callable[[pathlib.Path], bool]
    load: Loader


def _is_hf_folder(p: pathlib.Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def _is_gguf(p: pathlib.Path) -> bool:
    return p.is_file() and p.suffix == ".gguf"


BUILTIN_LOADERS: tuple[LoaderEntry, ...] = (
    LoaderEntry("hf_folder", _is_hf_folder, load_hf_folder),
    LoaderEntry("gguf", _is_gguf, load_gguf),
)
_registered: list[LoaderEntry] = []  # newest first


def register_loader(name: str, can_load: Callable[[pathlib.Path], bool], load: Loader) -> None:
    """Add a loader, tried before the built-in ones (newest first).

    Idempotent: registering the same `(name, can_load, load)` again changes nothing. Registering a
    known name with other functions replaces it (and moves it to the front).
    """
    if any(entry.name == name for entry in BUILTIN_LOADERS):
        raise ValueError(f"loader name {name!r} is built in; pick another name (registered loaders are tried first)")
    entry = LoaderEntry(name, can_load, load)
    if entry in _registered:
        return
    _registered[:] = [e for e in _registered if e.name != name]
    _registered.insert(0, entry)


def unregister_loader(name: str) -> None:
    """Remove a registered loader (no-op when it is not registered); the built-in ones stay."""
    _registered[:] = [e for e in _registered if e.name != name]


def loaders() -> tuple[LoaderEntry, ...]:
    """Every loader in the order `load_any` tries them."""
    return tuple(_registered) + BUILTIN_LOADERS


def load_any(path: str | pathlib.Path, **kw: Any) -> tuple[ModelConfig, dict]:
    """(cfg, params) from an HF folder, a .gguf file, or anything a registered loader accepts."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    for entry in loaders():
        if entry.can_load(p):
            return entry.load(p, **kw)
    names = [entry.name for entry in loaders()]
    if p.is_dir():
        hint = "" if "checkpoint" in names else (
            " (a training checkpoint loads after jaxrl_llm.checkpoint.register_checkpoint_loader())")
        raise FileNotFoundError(f"no config.json in model folder {str(p)!r}{hint}")
    raise ValueError(f"cannot load {str(p)!r}: not one of the known kinds ({', '.join(names)})")
