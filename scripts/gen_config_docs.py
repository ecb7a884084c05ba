"""Writes docs/config.md from the config tree (jaxrl_llm/config/tree.py).

    python scripts/gen_config_docs.py          # regenerate
    python scripts/gen_config_docs.py --check  # exit 1 if docs/config.md is stale
"""
from __future__ import annotations

import argparse
import pathlib
import sys

from jaxrl_llm.config import render_config_docs

DOC_PATH = pathlib.Path(__file__).resolve().parent.parent / "docs" / "config.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the file differs instead of writing it")
    args = parser.parse_args()
    text = render_config_docs()
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
