"""Helpers of the storage / checkpoint-safety / run-record tests: a tiny run config (configs/tiny.py
on one device) and the SmolLM2 tokenizer parsed once per process."""
from __future__ import annotations

import functools
import importlib.util
import pathlib
from typing import Any

import jaxrl_llm.hf as hf

ROOT = pathlib.Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=None)
def cached_tokenizer(path: str) -> Any:
    from jaxrl_llm.hf.tokenizer import load_tokenizer

    return load_tokenizer(path)


def use_cached_tokenizer(monkeypatch: Any) -> None:
    """Parsing the GGUF tokenizer takes seconds; every Trainer of a test process shares one."""
    monkeypatch.setattr(hf, "load_tokenizer", cached_tokenizer)


def tiny_config(run_dir: str, **overrides: Any) -> Any:
    """configs/tiny.py (a random 2-layer Llama, synthetic `add` task) on one device, in `run_dir`."""
    spec = importlib.util.spec_from_file_location("tiny_config", ROOT / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.trainer.default_local_dir = str(run_dir)
    cfg.data.synthetic.n_train = 32
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 1, 1
    for key, value in overrides.items():
        section = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            section = section[p]
        section[leaf] = value
    return cfg
