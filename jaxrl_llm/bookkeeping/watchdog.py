"""Lost workers: in a run of several JAX processes, a process that dies (a kill -9, a host gone, an OOM kill)
leaves the others blocked in the next collective until jax's coordination service aborts them (SIGABRT after
its heartbeat timeout, about a minute, with no line saying which process or what was saved). Each process
here runs a `WorkerWatchdog`: a daemon thread that bumps this process's counter in the coordination
service's key-value store every few seconds and watches the others'. A peer whose counter has not moved
for `trainer.worker_timeout_s` seconds (timed on this host's clock, so clocks need not agree), or a
coordination service that stops answering, ends this process at once with one line naming the lost
process and the last committed checkpoint, and `PREEMPTED_EXIT_CODE` (75), which `launch/tpu_pod.sh --run`
relaunches; the relaunch resumes from that checkpoint.

The thread keeps beating while the main thread compiles or waits in a collective, so a slow step is not a
lost worker. A worker hung with its process alive (a deadlock in user code, a stuck device) keeps beating
and is not detected here: the other processes then wait in the collective it never joins.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import jax

from jaxrl_llm.bookkeeping.preemption import PREEMPTED_EXIT_CODE

log = logging.getLogger("jaxrl_llm")
_KEY = "jaxrl_llm/alive/{}"


def _client() -> Any:
    from jax._src import distributed  # the client has no public accessor; private, so guarded

    return getattr(distributed.global_state, "client", None)


class WorkerWatchdog:
    """`start()` / `stop()` around a multi-process run; a no-op with one process. `committed()` says the last
    committed checkpoint (for the exit line); `exit` ends the process (tests replace it)."""

    def __init__(self, timeout_s: float, committed: Callable[[], str], *,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.timeout_s = float(timeout_s)
        self.committed = committed
        self._exit = exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._interval = min(2.0, self.timeout_s / 5)  # between beats

    def start(self) -> "WorkerWatchdog":
        client = _client()
        if jax.process_count() == 1 or client is None:
            return self
        self._thread = threading.Thread(target=self._run, args=(client,), name="jaxrl_llm-watchdog", daemon=True)
        self._thread.start()
        return self

    def wait_for_verdict(self) -> None:
        """After a collective failed (gloo on CPU reports a dead peer at once, as a `JaxRuntimeError`): gives the
        thread up to `worker_timeout_s` and a beat to find the lost peer, which ends the process with its line
        (not the collective's traceback and the coordination service's abort); returns when none is lost."""
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 2 * self._interval + 1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self, client: Any) -> None:
        me, count = jax.process_index(), jax.process_count()
        seen: dict[int, tuple[str | None, float]] = {p: (None, time.monotonic()) for p in range(count) if p != me}
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                client.key_value_set(_KEY.format(me), str(beat), allow_overwrite=True)
                values = {p: _try_get(client, _KEY.format(p)) for p in seen}
            except Exception as err:  # the coordination service (process 0's host) is gone
                self._lost(0, f"the coordination service stopped answering ({type(err).__name__})")
                return
            now = time.monotonic()
            for p, value in values.items():
                last, since = seen[p]
                if value != last:
                    seen[p] = (value, now)
                elif now - since > self.timeout_s:
                    self._lost(p, f"it has not reported for {now - since:.0f} s")
                    return
            self._stop.wait(self._interval)

    def _lost(self, process: int, why: str) -> None:
        if self._stop.is_set():
            return
        try:
            committed = self.committed()
        except Exception as err:  # the storage may be what failed
            committed = f"unknown ({type(err).__name__})"
        print(f"lost worker: process {process} of {jax.process_count()} ({why}; trainer.worker_timeout_s="
              f"{self.timeout_s:g}); the last committed checkpoint is step {committed}; exiting "
              f"{PREEMPTED_EXIT_CODE} so that the relaunch resumes from it", flush=True)
        self._exit(PREEMPTED_EXIT_CODE)


def _try_get(client: Any, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as err:
        if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
            return None  # not started yet
        raise
