"""`JobRunner`: host calls (tool executions, environment steps) on a bounded pool of daemon threads,
each with a wall-clock timeout from the moment it starts.

    runner = JobRunner(max_workers=8, timeout_s=30)
    runner.submit(key, fn)                 # fn() runs on a worker
    for key, status, value in runner.poll(wait_s=0.05):   # status: "ok" | "error" | "timeout"
        ...                                # value: fn's result, its exception, or None
    runner.close()

Both multi-turn drivers use it: the round-based one submits a round's calls and polls until all
are resolved; the streaming one (agents/streaming.py) polls between decode calls, so a slow tool
holds only its own trajectory.

A job running past `timeout_s` is reported as "timeout" at once; Python cannot kill a thread, so
its worker is abandoned (a daemon, it never holds up interpreter exit) and its late result is
dropped; a tool that can hang must bound itself, as the sandbox does. While every worker is
stuck that way, the jobs still queued time out too, rather than wait behind a hung call; a stuck
worker that comes back takes jobs again.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

JOB_STATUSES = ("ok", "error", "timeout")
JobKey = TypeVar("JobKey", bound=Hashable)  # how the caller names its jobs


class JobRunner(Generic[JobKey]):
    def __init__(self, max_workers: int, timeout_s: float) -> None:
        if max_workers < 1 or timeout_s <= 0:
            raise ValueError(f"JobRunner: max_workers={max_workers} must be >= 1 and timeout_s={timeout_s} > 0")
        self.max_workers, self.timeout_s = int(max_workers), float(timeout_s)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._fns: dict[JobKey, Callable[[], Any]] = {}
        self._queued: set[JobKey] = set()
        self._started: dict[JobKey, float] = {}  # running jobs -> start time
        self._stuck: set[JobKey] = set()  # timed out but still running (their workers are lost)
        self._workers = 0
        self._closed = threading.Event()

    @property
    def unresolved(self) -> int:
        """Jobs submitted and not yet returned by `poll`."""
        return len(self._fns)

    def submit(self, key: JobKey, fn: Callable[[], Any]) -> None:
        with self._lock:
            if key in self._fns:
                raise ValueError(f"JobRunner: job {key!r} is already running")
            self._fns[key] = fn
            self._queued.add(key)
            if self._workers < self.max_workers:
                self._workers += 1
                threading.Thread(target=self._work, name="agent-job", daemon=True).start()
        self._todo.put(key)

    def _work(self) -> None:
        while not self._closed.is_set():
            try:
                key = self._todo.get(timeout=0.05)
            except queue.Empty:
                continue
            with self._lock:
                if key not in self._queued:  # timed out while queued
                    continue
                self._queued.discard(key)
                self._started[key] = time.monotonic()
                fn = self._fns[key]
            try:
                self._done.put((key, "ok", fn()))
            except Exception as err:  # handed to the caller, who decides
                self._done.put((key, "error", err))

    def poll(self, wait_s: float = 0.0) -> list[tuple[JobKey, str, Any]]:
        """Jobs resolved since the last call: (key, status, value); waits up to `wait_s` for the first."""
        out: list[tuple[JobKey, str, Any]] = []
        try:
            item = self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait()
            while True:
                out.append(item)
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            resolved = []
            for key, status, value in out:
                self._started.pop(key, None)
                if key in self._stuck:  # its timeout was reported already; the worker is back
                    self._stuck.discard(key)
                    continue
                resolved.append((key, status, value))
            now = time.monotonic()
            for key, start in list(self._started.items()):
                if key not in self._stuck and now - start > self.timeout_s:
                    self._stuck.add(key)
                    resolved.append((key, "timeout", None))
            if self._queued and len(self._stuck) >= self._workers:  # nobody left to run them
                resolved += [(key, "timeout", None) for key in self._queued]
                self._queued.clear()
            for key, _, _ in resolved:
                del self._fns[key]
        return resolved

    def run_all(self, fns: dict[JobKey, Callable[[], Any]]) -> dict[JobKey, tuple[str, Any]]:
        """Submits `fns` and waits until each is resolved: key -> (status, value)."""
        for key, fn in fns.items():
            self.submit(key, fn)
        results: dict[JobKey, tuple[str, Any]] = {}
        while len(results) < len(fns):
            results.update((key, (status, value)) for key, status, value in self.poll(wait_s=0.02) if key in fns)
        return results

    def close(self) -> None:
        """Idle workers exit; stuck ones finish in the background and exit after."""
        self._closed.set()


__all__ = ["JOB_STATUSES", "JobRunner"]
