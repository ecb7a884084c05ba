"""Name-keyed registries: algorithms are looked up by the string a veRL config uses."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A dict of functions keyed by user-facing name, filled by a decorator.

    `get` raises one clear error listing the valid names, so a typo in a config fails early.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            for name in names:
                if name in self._fns and self._fns[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered to {self._fns[name]}")
                self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        if name not in self._fns:
            raise ValueError(f"Unknown {self.kind} {name!r}; valid names: {sorted(self._fns)}")
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns
