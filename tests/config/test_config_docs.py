"""docs/config.md is generated from the config tree and must be current."""
import pathlib

from jaxrl_llm.config import TREE, iter_fields, render_config_docs

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_are_current():
    assert DOC.read_text() == render_config_docs(), "docs/config.md is stale: run python scripts/gen_config_docs.py"


def test_every_key_documented_once_with_its_default():
    text = render_config_docs()
    for key, f in iter_fields(TREE):
        rows = [line for line in text.splitlines() if line.startswith(f"| `{key}` | ")]
        assert len(rows) == 1, key
        assert len(f.doc) > 15 and "\n" not in f.doc, key
