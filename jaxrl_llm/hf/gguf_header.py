"""The metadata key/values at the head of a GGUF file (llama.cpp format, versions 2 and 3), read
up to a wanted key without parsing the tensor table or the tokenizer arrays: `gguf.GGUFReader`
takes seconds on a 49k-token vocabulary, this takes microseconds for `general.architecture`.

Layout (little-endian): magic b"GGUF", u32 version, u64 tensor count, u64 key/value count, then
per key/value: u64 key length + key bytes, u32 value type, the value (strings: u64 length + bytes;
arrays: u32 element type + u64 count + elements).
"""
from __future__ import annotations

import struct
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """Not a GGUF file, a version this reader does not know, or a truncated header."""


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFHeaderError("truncated GGUF header")
    return data


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]
    if kind == _STRING:
        (length,) = struct.unpack("<Q", _read(f, 8))
        if not keep:
            f.seek(length, 1)
            return None
        return _read(f, length).decode("utf-8", errors="replace")
    if kind == _ARRAY:
        elem, count = struct.unpack("<IQ", _read(f, 12))
        if elem in _SCALARS and not keep:
            f.seek(struct.calcsize(_SCALARS[elem]) * count, 1)
            return None
        values = [_value(f, elem, keep) for _ in range(count)]
        return values if keep else None
    raise GGUFHeaderError(f"unknown GGUF value type {kind}")


def read_gguf_metadata(path: str, wanted: tuple[str, ...]) -> dict[str, Any]:
    """The values of the `wanted` metadata keys found in the file (stops once all are read)."""
    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFHeaderError("not a GGUF file (bad magic)")
        version, _, num_kv = struct.unpack("<IQQ", _read(f, 20))
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} is not supported (2 or 3)")
        for _ in range(num_kv):
            (length,) = struct.unpack("<Q", _read(f, 8))
            key = _read(f, length).decode("utf-8", errors="replace")
            (kind,) = struct.unpack("<I", _read(f, 4))
            keep = key in wanted
            value = _value(f, kind, keep)
            if keep:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found
