"""`load_any`'s loaders: built-ins declared in one list, others added by an explicit, idempotent call."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_llm import checkpoint
from jaxrl_llm.hf import BUILTIN_LOADERS, load_any, loaders, register_loader, unregister_loader


@pytest.fixture
def clean_loaders():
    """Run without registered loaders and put the session's back afterwards."""
    saved = [entry for entry in loaders() if entry not in BUILTIN_LOADERS]
    for entry in saved:
        unregister_loader(entry.name)
    yield
    for entry in [e for e in loaders() if e not in BUILTIN_LOADERS]:
        unregister_loader(entry.name)
    for entry in reversed(saved):
        register_loader(*entry)


def _names():
    return [entry.name for entry in loaders()]


def test_importing_the_checkpoint_module_registers_nothing():
    code = ("import jaxrl_llm.api, jaxrl_llm.checkpoint; from jaxrl_llm.hf import loaders; "
            "print([e.name for e in loaders()])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parents[2])
    assert out.stdout.strip() == "['hf_folder', 'gguf']"


def test_explicit_checkpoint_registration_is_idempotent(clean_loaders, tmp_path):
    assert _names() == ["hf_folder", "gguf"]
    step = tmp_path / "run" / "checkpoints" / "3"
    (step / "state").mkdir(parents=True)
    (step / "meta").mkdir()
    with pytest.raises(FileNotFoundError, match="register_checkpoint_loader"):
        load_any(tmp_path / "run")  # not a checkpoint source until registered: the error says how
    checkpoint.register_checkpoint_loader()
    assert _names() == ["checkpoint", "hf_folder", "gguf"]
    register_loader("other", lambda p: False, lambda p, **kw: None)
    checkpoint.register_checkpoint_loader()  # again: nothing moves
    assert _names() == ["other", "checkpoint", "hf_folder", "gguf"]
    chosen = [entry for entry in loaders() if entry.can_load(tmp_path / "run")]
    assert chosen[0].name == "checkpoint" and chosen[0].load is checkpoint.load_policy_checkpoint


def test_registered_loaders_come_first_and_builtins_are_protected(clean_loaders, tmp_path):
    (tmp_path / "m.custom").write_text("x")
    register_loader("custom", lambda p: p.suffix == ".custom", lambda p, **kw: ("cfg", {"path": p, **kw}))
    assert load_any(tmp_path / "m.custom", dtype="float32") == ("cfg", {"path": tmp_path / "m.custom",
                                                                        "dtype": "float32"})
    with pytest.raises(ValueError, match="'gguf' is built in"):
        register_loader("gguf", lambda p: True, lambda p, **kw: None)
    unregister_loader("custom")
    with pytest.raises(ValueError, match="not one of the known kinds \\(hf_folder, gguf\\)"):
        load_any(tmp_path / "m.custom")


def _write_gguf(path, embedding: np.ndarray) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", embedding)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_is_parsed_once_until_it_is_rewritten(tmp_path):
    """open_gguf: the config read, the weights read and a reference / judge of the same file share one parse
    (SmolLM2's metadata takes ~4 s to parse); a file rewritten in place is parsed again, never served stale."""
    import os

    from jaxrl_llm.hf.gguf_load import open_gguf

    path = tmp_path / "m.gguf"
    _write_gguf(path, np.zeros((4, 8), np.float32))
    first = open_gguf(path)
    assert open_gguf(str(path)) is first and open_gguf(tmp_path / "." / "m.gguf") is first
    np.testing.assert_array_equal(first.read("model.embed_tokens.weight"), np.zeros((4, 8)))

    _write_gguf(path, np.ones((4, 8), np.float32))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a later write, even on a coarse clock
    second = open_gguf(path)
    assert second is not first
    np.testing.assert_array_equal(second.read("model.embed_tokens.weight"), np.ones((4, 8)))
