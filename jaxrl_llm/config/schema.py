"""The machinery under the config tree: `Field` (default + type + one-line doc), the tree walk, the
`ConfigDict` built from it, and per-key type checking.

The tree itself lives in `jaxrl_llm.config.tree`; keeping each default next to its doc string is
what lets `docs/config.md` be generated from the same source (so the docs cannot drift).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ml_collections

from jaxrl_llm.errors import ConfigError as ConfigError  # raised by every config check; defined in a leaf module

AUTO = "auto"  # a micro-batch size picked by the memory plan (planning/memory.py)


@dataclasses.dataclass(frozen=True)
class Field:
    """One config leaf.

    default: the value in `default_config()`.
    doc: one line: meaning, where it comes from (veRL / TRL / paper), derived default if any.
    types: accepted Python types (None is also accepted when `nullable`).
    nullable: None is a valid value (the default when `default is None`).
    open: a free-form dict: any sub-keys are accepted and passed through.
    choices: the accepted names: a tuple, or a function returning them (a registry's names, read
        when the config is validated, so names registered later count).
    gt / ge / lt / le: bounds of a number; `also`: values accepted outside them (e.g. -1 = off).
    None (and 'auto' where a key takes it) is never checked against choices or bounds.
    """

    default: Any
    doc: str
    types: tuple[type, ...]
    nullable: bool
    open: bool = False
    choices: tuple[str, ...] | Callable[[], Sequence[str]] | None = None
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    also: tuple[Any, ...] = ()

    def names(self) -> tuple[str, ...] | None:
        """The accepted names (None: any value of the type)."""
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def range_text(self) -> str | None:
        """The bounds as one phrase ('> 0', 'in [0, 1]', '> 0 or -1'), None without bounds."""
        low = f"> {_num(self.gt)}" if self.gt is not None else f">= {_num(self.ge)}" if self.ge is not None else None
        high = f"< {_num(self.lt)}" if self.lt is not None else f"<= {_num(self.le)}" if self.le is not None else None
        if low is None and high is None:
            return None
        if low is not None and high is not None:
            text = (f"in {'(' if self.gt is not None else '['}{low.split()[-1]}, {high.split()[-1]}"
                    f"{')' if self.lt is not None else ']'}")
        else:
            text = low or high or ""
        return text + "".join(f" or {v}" for v in self.also)

    def check_value(self, key: str, value: Any) -> None:
        """ConfigError naming `key` when `value` is not one of the choices or outside the bounds."""
        if value is None or value == AUTO or isinstance(value, bool):
            return
        allowed = self.names()
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{key}={value!r}: unknown name; valid: {', '.join(sorted(allowed))}")
        if isinstance(value, str) and allowed is None and self.range_text() is not None:  # a number or a word
            if value not in self.also:
                raise ConfigError(f"{key}={value!r}: must be {self.range_text()}")
            return
        if self.range_text() is None or value in self.also or not isinstance(value, (int, float)):
            return
        ok = ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
              and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))
        if not ok:
            raise ConfigError(f"{key}={value!r}: must be {self.range_text()}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def field(default: Any, doc: str, *, types: type | tuple[type, ...] | None = None,
          nullable: bool | None = None, open: bool = False,  # (veRL-free name)
          choices: tuple[str, ...] | Callable[[], Sequence[str]] | None = None, gt: float | None = None,
          ge: float | None = None, lt: float | None = None, le: float | None = None, also: tuple[Any, ...] = ()
          ) -> Field:
    """Declares a leaf; `types` is inferred from the default unless the default is None."""
    if types is None:
        if default is None:
            raise TypeError(f"field with default None needs explicit types (doc: {doc!r})")
        types = (type(default),)
    elif isinstance(types, type):
        types = (types,)
    if float in types and int not in types:
        types = types + (int,)  # 1 is a fine learning-rate-like float; converted on validation
    return Field(default=default, doc=doc, types=tuple(types),
                 nullable=(default is None) if nullable is None else nullable, open=open, choices=choices,
                 gt=gt, ge=ge, lt=lt, le=le, also=tuple(also))


Tree = Mapping[str, Any]  # nested: str -> Field | Tree


def iter_fields(tree: Tree, prefix: str = "") -> Iterator[tuple[str, Field]]:
    """Yields (dotted key, Field) for every leaf, in declaration order."""
    for name, node in tree.items():
        key = f"{prefix}{name}"
        if isinstance(node, Field):
            yield key, node
        else:
            yield from iter_fields(node, key + ".")


def iter_sections(tree: Tree, prefix: str = "") -> Iterator[str]:
    """Yields the dotted key of every section (non-leaf node)."""
    for name, node in tree.items():
        if not isinstance(node, Field):
            key = f"{prefix}{name}"
            yield key
            yield from iter_sections(node, key + ".")


def _copy_default(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        return type(value)(value)
    return value


def tree_to_dict(tree: Tree) -> dict[str, Any]:
    """The nested dict of defaults."""
    out: dict[str, Any] = {}
    for name, node in tree.items():
        out[name] = _copy_default(node.default) if isinstance(node, Field) else tree_to_dict(node)
    return out


def build_config(tree: Tree) -> ml_collections.ConfigDict:
    """A ConfigDict of the defaults. Not type-safe at assignment (int/float, str/list unions and
    None-valued keys are common in veRL command lines); `validate_config` checks types per key."""
    return ml_collections.ConfigDict(tree_to_dict(tree), type_safe=False)


def type_name(f: Field) -> str:
    names = [t.__name__ for t in f.types if not (t is int and float in f.types)]
    if f.nullable:
        names.append("None")
    return " | ".join(names)


def check_type(key: str, value: Any, f: Field) -> Any:
    """Returns the value converted to the field's type (int -> float, tuple -> list), or raises."""
    if value is None:
        if f.nullable:
            return None
        raise ConfigError(f"{key}: must not be None (expected {type_name(f)})")
    if f.open:
        if isinstance(value, ml_collections.ConfigDict):
            return value
        if isinstance(value, Mapping):
            return dict(value)
        raise ConfigError(f"{key}={value!r}: expected a dict")
    if isinstance(value, bool) and bool not in f.types:
        raise ConfigError(f"{key}={value!r}: expected {type_name(f)}, got a bool")
    if isinstance(value, tuple) and list in f.types:
        value = list(value)
    if isinstance(value, f.types):
        if f.types[0] is float and isinstance(value, int):
            return float(value)
        return value
    if isinstance(value, float) and int in f.types and float not in f.types and value.is_integer():
        return int(value)
    raise ConfigError(f"{key}={value!r}: expected {type_name(f)}, got {type(value).__name__}")


def get_path(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def require(ok: bool, key: str, cfg: ml_collections.ConfigDict, why: str) -> None:
    """A `ConfigError` naming `key` and its value, saying `why`, unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={get_path(cfg, key)!r}: {why}")


def set_path(cfg: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """Sets `a.b.c`, creating missing sections (used for open dicts)."""
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        if part not in node or node[part] is None:
            node[part] = ml_collections.ConfigDict(type_safe=False)
        node = node[part]
    node[parts[-1]] = value


def has_path(cfg: Any, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not isinstance(node, (Mapping, ml_collections.ConfigDict)) or part not in node:
            return False
        node = node[part]
    return True
