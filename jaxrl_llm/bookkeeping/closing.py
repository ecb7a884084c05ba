"""Closing a run's resources (stores, sinks, workers): each one even when another fails."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

log = logging.getLogger("jaxrl_llm")


def close_all(closers: Iterable[Callable[[], object]], *, quiet: bool) -> None:
    """Calls every closer; the first failure is raised after all ran (`quiet`: only logged)."""
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except Exception as err:  # (the others must still close)
            log.warning("while closing: %s: %s", type(err).__name__, err)
            first = first or err
    if first is not None and not quiet:
        raise first
