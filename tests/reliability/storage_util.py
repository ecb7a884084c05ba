"""Helpers of the storage / checkpoint-safety / run-record tests: a tiny run config (configs/tiny.py
on one device) and the SmolLM2 tokenizer parsed once per process."""
from __future__ import annotations

import functools
from typing import Any

import tiny_runs

import jaxrl_llm.hf as hf



@functools.lru_cache(maxsize=None)
def cached_tokenizer(path: str) -> Any:
    from jaxrl_llm.hf.tokenizer import load_tokenizer

    return load_tokenizer(path)


def use_cached_tokenizer(monkeypatch: Any) -> None:
    """Parsing the GGUF tokenizer takes seconds; every Trainer of a test process shares one."""
    monkeypatch.setattr(hf, "load_tokenizer", cached_tokenizer)


def tiny_config(run_dir: str, **overrides: Any) -> Any:
    """configs/tiny.py (a random 2-layer Llama, synthetic `add` task) on one device, in `run_dir`."""
    return tiny_runs.tiny_config(run_dir, **{"data.synthetic.n_train": 32, "mesh.data": 1, "mesh.fsdp": 1,
                                             "mesh.tensor": 1, **overrides})