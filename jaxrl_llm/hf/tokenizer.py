"""Tokenizer loading from an HF folder or a GGUF file (via transformers, no network)."""
from __future__ import annotations

import functools
import hashlib
import logging
import pathlib
import shutil
import tempfile
from typing import Any, Protocol

from jaxrl_llm.cache_dirs import cache_root

log = logging.getLogger("jaxrl_llm")


class Tokenizer(Protocol):
    """What jaxrl_llm reads of a tokenizer. A transformers tokenizer (what `load_tokenizer` returns)
    satisfies it; tests pass small stand-ins. Token ids and chat renderings stay `Any`: transformers
    returns lists, arrays or encodings depending on its arguments."""

    @property
    def eos_token_id(self) -> int | None: ...
    chat_template: Any  # the Jinja text (or a dict of named templates), None when the tokenizer has none
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token(self) -> str | None: ...
    def __len__(self) -> int: ...
    def __call__(self, text: Any, **kwargs: Any) -> Any: ...
    def encode(self, text: Any, **kwargs: Any) -> Any: ...
    def decode(self, token_ids: Any, **kwargs: Any) -> str: ...
    def batch_decode(self, sequences: Any, **kwargs: Any) -> list[str]: ...
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...
    def convert_ids_to_tokens(self, ids: Any, **kwargs: Any) -> Any: ...
    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...
    def get_vocab(self) -> dict[str, int]: ...
    def add_special_tokens(self, special_tokens_dict: Any, **kwargs: Any) -> int: ...
    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> Any: ...


class TokenizerError(ValueError):
    """No tokenizer can be loaded from the given location (names it)."""


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
    """A transformers tokenizer for an HF folder or a `.gguf` file (its chat template included).

    When the tokenizer defines no pad token, the eos token is used (padding is always defined by
    attention masks in this package, never by the pad id). A file is read once per process and
    modification time (building a GGUF tokenizer takes seconds; it is also kept on disk as an HF
    folder, `tokenizer_cache_dir()`): callers share the instance and must not change it.
    """
    path = pathlib.Path(path).expanduser().resolve()
    stamp = path.stat().st_mtime_ns if path.exists() else None
    return _load_tokenizer_cached(str(path), stamp)


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(path_str: str, stamp: int | None) -> Tokenizer:
    from transformers import AutoTokenizer

    path = pathlib.Path(path_str)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise TokenizerError(f"no tokenizer at {str(path)!r} (expected an HF folder or a .gguf file)")
    try:
        if path.is_dir():
            tok = AutoTokenizer.from_pretrained(str(path))
        else:
            tok = _gguf_tokenizer(path)
    except Exception as err:  # transformers raises many kinds for a bad tokenizer folder
        raise TokenizerError(f"cannot load a tokenizer from {str(path)!r}: {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}") from err
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_cache_dir() -> pathlib.Path:
    """Where tokenizers built from GGUF files are kept as HF folders: `tokenizers` under jaxrl_llm's cache
    root (cache_dirs.py)."""
    return cache_root() / "tokenizers"


def _gguf_tokenizer(path: pathlib.Path) -> Any:
    """The tokenizer of a GGUF file. transformers builds it from the file's metadata, which takes
    seconds (every launch, every worker process); the result is kept as an HF folder keyed by the
    file's path, size and modification time and read from there next time (a tenth of a second).
    A cache that cannot be written (read-only home) is skipped with a debug line."""
    from transformers import AutoTokenizer

    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = tokenizer_cache_dir() / f"{path.stem}-{key}"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:  # written whole in a temporary folder, then renamed: a reader never sees half a folder
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
        tok.save_pretrained(str(staging))
        try:
            staging.rename(cached)
        except OSError:  # another process wrote it first: theirs is the same
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:
        log.debug("tokenizer cache %s not written: %s", cached, err)
    return tok


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`. A template that has no system
    role (Gemma 2's raises "System role not supported") gets the system message folded into the first
    user turn, "system\\n\\nuser", as Gemma 3's own template folds it."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.TemplateError:
        if not (messages and messages[0].get("role") == "system" and len(messages) > 1
                and messages[1].get("role") == "user"):
            raise
    system, user, *rest = messages
    folded = {**user, "content": f"{system['content']}\n\n{user['content']}"}
    return tokenizer.apply_chat_template([folded, *rest], tokenize=False, **kwargs)
