"""Name-keyed registries: algorithms are looked up by the string a veRL config uses.

A registry owns its names and what each entry needs. An entry declares its capabilities where it
is registered (`@register_adv_est("grpo", needs_group_ids=True)`), and the config validator, the
derived defaults and the trainer ask the registry instead of keeping their own lists:

    ADV_ESTIMATORS.capabilities("gae")            # {"needs_group_ids": False, "needs_values": True, ...}
    ADV_ESTIMATORS.capability("remax", "needs_reward_baselines")   # True
    ADV_ESTIMATORS.names(needs_group_ids=True)    # the estimators that compare samples of a prompt
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Generic, Mapping, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A dict of functions keyed by user-facing name, filled by a decorator.

    `capabilities` declares the metadata keys every entry carries and their defaults; `register`
    accepts only those keys, so a misspelt capability fails at import. `get` raises one clear error
    listing the valid names, so a typo in a config fails early.
    """

    def __init__(self, kind: str, capabilities: Mapping[str, Any] | None = None):
        self.kind = kind
        self._defaults: dict[str, Any] = dict(capabilities or {})
        self._fns: dict[str, F] = {}
        self._caps: dict[str, Mapping[str, Any]] = {}

    def register(self, *names: str, **capabilities: Any) -> Callable[[F], F]:
        unknown = set(capabilities) - set(self._defaults)
        if unknown:
            raise ValueError(f"{self.kind} {names}: unknown capabilities {sorted(unknown)}; "
                             f"declared: {sorted(self._defaults)}")
        caps = MappingProxyType({**self._defaults, **capabilities})

        def decorator(fn: F) -> F:
            for name in names:
                if name in self._fns and self._fns[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered to {self._fns[name]}")
                self._fns[name] = fn
                self._caps[name] = caps
            return fn

        return decorator

    def _check(self, name: str) -> None:
        if name not in self._fns:
            raise ValueError(f"Unknown {self.kind} {name!r}; valid names: {sorted(self._fns)}")

    def get(self, name: str) -> F:
        self._check(name)
        return self._fns[name]

    def capabilities(self, name: str) -> Mapping[str, Any]:
        """Every declared capability of `name` (defaults filled in), read-only."""
        self._check(name)
        return self._caps[name]

    def capability(self, name: str, key: str) -> Any:
        if key not in self._defaults:
            raise KeyError(f"{self.kind} registry has no capability {key!r}; declared: {sorted(self._defaults)}")
        return self.capabilities(name)[key]

    def names(self, **where: Any) -> list[str]:
        """Sorted names; with `where` (e.g. `needs_group_ids=True`) only the entries matching all of it."""
        for key in where:
            if key not in self._defaults:
                raise KeyError(f"{self.kind} registry has no capability {key!r}; "
                               f"declared: {sorted(self._defaults)}")
        return sorted(n for n, caps in self._caps.items() if all(caps[k] == v for k, v in where.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._fns
