"""Helper of the storage / checkpoint-safety / run-record tests: a tiny run config (configs/tiny.py
on one device). The SmolLM2 tokenizer is parsed once per process by `hf.load_tokenizer` itself."""
from __future__ import annotations

from typing import Any

import tiny_runs


def tiny_config(run_dir: str, **overrides: Any) -> Any:
    """configs/tiny.py (a random 2-layer Llama, synthetic `add` task) on one device, in `run_dir`."""
    return tiny_runs.tiny_config(run_dir, **{"data.synthetic.n_train": 32, "mesh.data": 1, "mesh.fsdp": 1,
                                             "mesh.tensor": 1, **overrides})