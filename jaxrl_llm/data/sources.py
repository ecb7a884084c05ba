"""Reading prompt files: parquet, jsonl, json and csv into plain Python row dicts.

Every row keeps where it came from (`RowRef`: file and row number, 1-based line numbers for jsonl)
so that later errors (missing column, overlong prompt, bad prompt type) can name it. Bad input is
one `DataError` naming the file and the problem; nothing is half-read.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Sequence
from typing import Any

from jaxrl_llm import storage

SUPPORTED_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


class DataError(ValueError):
    """Bad data input: names the file (and row) and what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class RowRef:
    """Where a row came from; `row` is 0-based, `line` is the 1-based jsonl line when known."""

    path: str
    row: int
    line: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}" if self.line is not None else f"row {self.row}"
        return f"{self.path} {where}"


def as_path_list(files: str | os.PathLike | Sequence[str | os.PathLike] | None, key: str) -> list[str]:
    """`data.train_files` / `data.val_files` as a list of paths (one path or a list is accepted)."""
    if files is None:
        raise DataError(f"{key} is not set")
    if isinstance(files, (str, os.PathLike)):
        paths = [os.fspath(files)]
    else:
        paths = [os.fspath(f) for f in files]
    if not paths:
        raise DataError(f"{key} is an empty list")
    return [os.path.expanduser(p) for p in paths]


def _read_parquet(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet file ({err})") from err
    return table.to_pylist()


def read_text(path: str) -> str:
    """The file as UTF-8 text (a leading BOM dropped); other bytes are a DataError naming the line."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path} line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); "
                        "save the file as UTF-8") from None


def _read_jsonl(path: str) -> tuple[list[dict[str, Any]], list[int]]:
    rows, lines = [], []
    # split on "\n" only: str.splitlines would also split inside strings at U+2028 and friends
    for line_no, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {line_no}: malformed JSON ({err.msg})") from err
        if not isinstance(row, dict):
            raise DataError(f"{path} line {line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(line_no)
    return rows, lines


def _read_json(path: str) -> tuple[list[dict[str, Any]], list[int] | None]:
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # many ".json" files are really JSON lines
            return _read_jsonl(path)
        raise DataError(f"{path} line {err.lineno}: malformed JSON ({err.msg})") from err
    if isinstance(data, dict):
        # {"data": [...]} or a columnar {"col": [..], ...} layout
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(data) == 1 and lists and all(isinstance(r, dict) for r in lists[0]):
            data = lists[0]
        elif lists and len(lists) == len(data) and len({len(v) for v in lists}) == 1:
            keys = list(data)
            data = [dict(zip(keys, vals)) for vals in zip(*(data[k] for k in keys))]
        else:
            raise DataError(f"{path}: expected a JSON list of objects (or columns of equal length)")
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: expected a JSON object, got {type(row).__name__}")
    return data, None


def _read_csv(path: str) -> list[dict[str, Any]]:
    import pandas as pd

    try:
        frame = pd.read_csv(io.StringIO(read_text(path)), keep_default_na=False)
    except pd.errors.EmptyDataError as err:
        raise DataError(f"{path}: empty dataset (no rows)") from err
    except (pd.errors.ParserError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot parse csv ({err})") from err
    return frame.to_dict(orient="records")


def read_rows(path: str) -> tuple[list[dict[str, Any]], list[RowRef]]:
    """All rows of one file plus their `RowRef`s. Raises `DataError` for a missing/empty/bad file.
    A bucket URL is read from a temporary local copy; rows and errors still name the URL."""
    if storage.is_url(path):
        return _read_remote(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; list its files in data.train_files / data.val_files")
    suffix = os.path.splitext(path)[1].lower()
    lines: list[int] | None = None
    if suffix == ".parquet":
        rows = _read_parquet(path)
    elif suffix == ".jsonl":
        rows, lines = _read_jsonl(path)
    elif suffix == ".json":
        rows, lines = _read_json(path)
    elif suffix == ".csv":
        rows = _read_csv(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected one of {SUPPORTED_SUFFIXES}")
    if not rows:
        raise DataError(f"{path}: empty dataset (no rows)")
    refs = [RowRef(path, i, lines[i] if lines is not None else None) for i in range(len(rows))]
    return rows, refs


def _read_remote(url: str) -> tuple[list[dict[str, Any]], list[RowRef]]:
    if not storage.exists(url):
        raise DataError(f"{url}: no such file")
    with storage.local_copy(url) as local:
        try:
            rows, refs = read_rows(local)
        except DataError as err:
            raise DataError(str(err).replace(local, url)) from None
    return rows, [dataclasses.replace(ref, path=url) for ref in refs]


def read_files(paths: Sequence[str]) -> tuple[list[dict[str, Any]], list[RowRef]]:
    """Rows of several files, concatenated in order."""
    rows: list[dict[str, Any]] = []
    refs: list[RowRef] = []
    for path in paths:
        r, f = read_rows(path)
        rows.extend(r)
        refs.extend(f)
    return rows, refs
