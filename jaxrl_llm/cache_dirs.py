"""Where jaxrl_llm keeps what it builds once per host and reads back on later launches: XLA's compiled
programs (platform/compile_cache.py), tokenizers built from GGUF files (hf/tokenizer.py) and the CPU decode
kernel's library (sampler/native). One root for all three, so one variable moves them together (a
read-only home, a shared scratch disk)."""
from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """`$JAXRL_LLM_CACHE_DIR`, else `<$XDG_CACHE_HOME or ~/.cache>/jaxrl_llm` (the XDG base-directory
    convention, as pip and Hugging Face follow it)."""
    named = os.environ.get("JAXRL_LLM_CACHE_DIR")
    if named:
        return pathlib.Path(named).expanduser()
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "jaxrl_llm"
