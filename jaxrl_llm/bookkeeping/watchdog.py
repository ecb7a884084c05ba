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
lost worker. A worker hung with its process alive (a deadlock in user code, a stuck device call) keeps
beating; it is found by where its main thread is instead. The trainer calls `mark(label)` as its main thread
enters each phase of a step (`gen of step 3`, `update_actor of step 3`, `save of step 3`, ...); every process
runs the same phases in the same order (one SPMD program), so the count of marks passed says how far each
has got, and the thread publishes it beside its beat. A process that stays at a count while another went
past it, for `trainer.worker_hang_timeout_s`, is hung: every process (the hung one's own thread included)
exits 75 with one line naming it, the phase it stays in and the last committed checkpoint. The clock starts
when the first peer passes it, not when it entered the phase, so a long phase all processes share (a
compile, a validation) is not a hang. A stall of every process at once (a device that stops answering
everywhere) moves no one past another and is not detected here.
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
    """`start()` / `stop()` around a multi-process run; a no-op with one process. The main thread calls `mark`
    at each phase. `committed()` says the last committed checkpoint (for the exit line); `exit` ends the
    process (tests replace it)."""

    def __init__(self, timeout_s: float, committed: Callable[[], str], *, hang_timeout_s: float = 0.0,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.timeout_s = float(timeout_s)
        self.hang_timeout_s = float(hang_timeout_s)
        self.committed = committed
        self._exit = exit
        self._stop = threading.Event()
        self._verdict = threading.Event()  # set once the thread has decided to end the process
        self._thread: threading.Thread | None = None
        self._interval = min(2.0, self.timeout_s / 5)  # between beats
        self._progress: tuple[int, str] = (0, "the start of the loop")  # (marks passed, the last one's label)

    def mark(self, label: str) -> None:
        """The main thread enters `label` (a phase, named with its step). One tuple swap: the thread reads it
        whole."""
        self._progress = (self._progress[0] + 1, label)

    def start(self) -> "WorkerWatchdog":
        client = _client()
        if jax.process_count() == 1 or client is None:
            return self
        self._thread = threading.Thread(target=self._run, args=(client,), name="jaxrl_llm-watchdog", daemon=True)
        self._thread.start()
        return self

    def wait_for_verdict(self) -> None:
        """After a step failed (gloo on CPU reports a dead peer at once, as a `JaxRuntimeError` from a jitted
        collective or a `ValueError` from a host-side one; the trainer calls this on any error): gives the
        thread up to `worker_timeout_s` and a beat to find the lost peer, which ends the process with its line
        (not the collective's traceback and the coordination service's abort); returns when none is lost. Once
        the thread has reached a verdict this waits for its exit however long the line takes (the last committed
        step read from a slow bucket, process 0's grace for the others): returning then would send the main
        thread into jax's exit handlers, whose `distributed.shutdown` waits on the lost peer and aborts."""
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 2 * self._interval + 1)
            if self._verdict.is_set():
                self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self, client: Any) -> None:
        me, count = jax.process_index(), jax.process_count()
        seen: dict[int, tuple[str | None, float]] = {p: (None, time.monotonic()) for p in range(count) if p != me}
        places = _Places()
        beat = 0
        while not self._stop.is_set():
            beat += 1
            marks, label = self._progress
            try:
                client.key_value_set(_KEY.format(me), f"{beat} {marks} {label}", allow_overwrite=True)
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
            if self.hang_timeout_s > 0:
                places.update({me: (marks, label), **{p: _place(v) for p, v in values.items() if v is not None}},
                              now)
                hung = places.hung(now, self.hang_timeout_s)
                if hung is not None:
                    self._hung(me, *hung)
                    return
            self._stop.wait(self._interval)

    def _last_committed(self) -> str:
        try:
            return self.committed()
        except Exception as err:  # the storage may be what failed
            return f"unknown ({type(err).__name__})"

    def _lost(self, process: int, why: str) -> None:
        if self._stop.is_set():
            return
        self._verdict.set()
        print(f"lost worker: process {process} of {jax.process_count()} ({why}; trainer.worker_timeout_s="
              f"{self.timeout_s:g}); the last committed checkpoint is step {self._last_committed()}; exiting "
              f"{PREEMPTED_EXIT_CODE} so that the relaunch resumes from it", flush=True)
        self._leave()

    def _hung(self, me: int, process: int, label: str, waited_s: float, ahead: int, ahead_label: str) -> None:
        if self._stop.is_set():
            return
        self._verdict.set()
        who = f"process {process} of {jax.process_count()}" + (" (this process)" if process == me else "")
        print(f"hung worker: {who} has stayed in '{label}' for {waited_s:.0f} s since process {ahead} went on to "
              f"'{ahead_label}' (trainer.worker_hang_timeout_s={self.hang_timeout_s:g}); the last committed "
              f"checkpoint is step {self._last_committed()}; exiting {PREEMPTED_EXIT_CODE} so that the relaunch "
              "resumes from it", flush=True)
        self._leave()

    def _leave(self) -> None:
        """Exits 75. Process 0 hosts the coordination service: gone, it aborts every other process's jax client
        (SIGABRT, no line), so it first gives the others two beats to reach their own verdict and exit."""
        if jax.process_index() == 0:
            time.sleep(2 * self._interval + 0.5)
        self._exit(PREEMPTED_EXIT_CODE)


def _place(value: str) -> tuple[int, str] | None:
    """(marks passed, label) from a published `beat marks label`; None from a process not yet marking."""
    parts = value.split(" ", 2)
    return (int(parts[1]), parts[2]) if len(parts) == 3 else None


class _Places:
    """Where each process is (marks passed, label), and since when (this host's clock) another process has been
    past it: the hang clock starts when the first peer overtakes, so a phase every process spends long in
    together is not a hang."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[int, str]] = {}
        self.passed_since: dict[int, float] = {}  # process -> when a peer was first seen past its place

    def update(self, places: dict[int, tuple[int, str] | None], now: float) -> None:
        for p, place in places.items():
            if place is None:
                continue
            if self.at.get(p, (None,))[0] != place[0]:
                self.passed_since.pop(p, None)  # it moved: its clock restarts
            self.at[p] = place
        front = max(marks for marks, _ in self.at.values())
        for p, (marks, _) in self.at.items():
            if marks < front:
                self.passed_since.setdefault(p, now)

    def hung(self, now: float, timeout_s: float) -> tuple[int, str, float, int, str] | None:
        """(process, its label, seconds since it was passed, the process furthest on, that one's label) of the
        process passed longest ago, once that is over `timeout_s`; else None."""
        if not self.passed_since:
            return None
        process = min(self.passed_since, key=lambda p: self.passed_since[p])
        waited = now - self.passed_since[process]
        if waited <= timeout_s:
            return None
        ahead = max(self.at, key=lambda p: self.at[p][0])
        return process, self.at[process][1], waited, ahead, self.at[ahead][1]


def _try_get(client: Any, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as err:
        if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
            return None  # not started yet
        raise
