"""Reward managers: turn decoded responses into one scalar reward each, plus metrics.

    manager = build_reward_manager(spec.reward)   # a RewardSpec; reward_model.reward_manager: naive | prime
    result = manager.score(responses, data_source, ground_truth, extra_info,
                           response_lengths=..., finished_with_eos=...)
    result.scores             float32[B]  scorer score + shaping (put it on the last response token)
    result.reward_extra_info  {key: array[B]}  "score" (the scorer's score before shaping), the
                              extra keys of dict-valued scores ("acc", "pred", ...), and
                              "overlong_reward" / "overlong" when overlong_buffer_cfg.log
    result.metrics            {name: float}  reward/num_errors, reward/num_timeouts, and shaping stats

Shaping (missing_eos_penalty, DAPO overlong_buffer_cfg) applies under either manager.
Both managers give each scorer call `timeout_s` seconds (`reward_model.reward_kwargs.timeout_s`).
A call that raises anything (`SystemExit` included), returns a non-numeric score, or runs past the
timeout scores 0 and is counted (`reward/num_errors`, `reward/num_timeouts`); the run goes on. Two
exceptions propagate: `UnknownDataSourceError` (a config mistake) and `KeyboardInterrupt` (a
Ctrl-C must still reach the trainer). A NaN / inf score is returned as it is: the trainer counts
it (`reward/num_nonfinite`) and scores it 0, for every reward source alike
(jaxrl_llm/bookkeeping/nonfinite.py).

- `naive` calls the scorer in this process. Its timeout raises inside the call: a SIGALRM timer
  (`signal.setitimer`) on the main thread, and on any other thread (the pipelined rollout's
  background job) a watchdog that raises in the calling thread (`PyThreadState_SetAsyncExc`). Both
  interrupt Python code only: a call stuck inside one C function (a pathological regex, a blocking
  native library) returns only when that function does (off the main thread a `time.sleep` too),
  and a hard crash (segfault, `os._exit`) ends the process. Use `prime` for code that can do that.
- `prime` calls it in a pool of `num_workers` spawned processes. A call past the timeout has its
  worker killed and replaced; a worker that died (while busy or idle) is replaced too. The pool's
  processes are daemons killed at `close()` or interpreter exit, so nothing hangs the process.

Responses should be decoded without special tokens (veRL: skip_special_tokens=True).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.rewards.custom import ScorerSpec
from jaxrl_llm.rewards.named import NamedRewards, named_scores
from jaxrl_llm.rewards.scorers import UnknownDataSourceError
from jaxrl_llm.rewards.shaping import missing_eos_penalty, overlong_penalty
from jaxrl_llm.rewards.spec import OverlongSpec, RewardSpec

logger = logging.getLogger(__name__)

REWARD_MANAGERS = ("naive", "prime")


class RewardResult(NamedTuple):
    scores: np.ndarray
    reward_extra_info: dict[str, np.ndarray]
    metrics: dict[str, float]


class _Failure(NamedTuple):
    kind: str  # "error" | "timeout"
    message: str


class _CallTimeout(BaseException):
    """Raised inside a naive scorer call by the SIGALRM timer; a BaseException so that a user's
    `except Exception` cannot swallow it."""


@contextlib.contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Raises `_CallTimeout` inside the block after `seconds`: a SIGALRM timer on the main thread,
    elsewhere (a pipelined rollout's background thread) a watchdog timer that raises it
    asynchronously in the calling thread (`PyThreadState_SetAsyncExc`)."""
    if not seconds:
        yield
        return
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        with _thread_deadline(float(seconds)):
            yield
        return

    def on_alarm(signum: int, frame: types.FrameType | None) -> None:
        raise _CallTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        try:  # the alarm may fire right here (the call just ended): the handler is restored anyway
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


@contextlib.contextmanager
def _thread_deadline(seconds: float) -> Iterator[None]:
    """`_CallTimeout` in this thread after `seconds`. Like SIGALRM it interrupts Python bytecode,
    not a blocking call: a `time.sleep` or a C function returns first, then the exception is raised.
    A lock orders the watchdog against the block's end: once the block ended no exception is
    queued, and one queued but not delivered by then is withdrawn."""
    target, lock = threading.get_ident(), threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exc(target, _CallTimeout)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["fired"]:
                _set_async_exc(target, None)  # withdraw it if still pending


class _NoVerdict:
    """A scorer's "no verdict" (it returned None, or knows no scorer for the data source): scored NaN
    beside a judge (reward_model.style=generative: combine=fallback fills it in, every mode leaves it
    out of the agreement); only accepted when the manager is built with `no_verdict_ok`."""


NO_VERDICT = _NoVerdict()


def _check_score(result: Any) -> Any:
    """A float, or a dict whose "score" is a number; anything else is an error for that sample.
    A NaN / inf score is passed on: the trainer counts it in `reward/num_nonfinite` and scores it 0
    (jaxrl_llm/bookkeeping/nonfinite.py)."""
    value = result.get("score") if isinstance(result, dict) else result
    if isinstance(value, (bool, int, float, np.number)):
        return result
    raise TypeError(f"compute_score must return a number or a dict with a numeric 'score', got {result!r}")


def _stack(values: list[Any]) -> np.ndarray:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, (bool, int, float, np.number)) for v in present):
        return np.asarray([np.nan if v is None else float(v) for v in values], dtype=np.float32)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


class RewardManager:
    """Scores responses with a veRL `compute_score` and applies shaping (see module docstring)."""

    def __init__(
        self,
        compute_score: ScorerSpec | Callable[..., Any] | None = None,
        *,
        overlong: OverlongSpec | None = None,
        max_resp_len: int | None = None,
        missing_eos_penalty: float | None = None,
        timeout_s: float | None = None,
        no_verdict_ok: bool = False,
        named: NamedRewards | None = None,
    ):
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.no_verdict_ok = no_verdict_ok
        self.named = named
        self.compute_score: Callable[..., Any]
        self.spec: ScorerSpec | None  # None for a plain callable
        if isinstance(compute_score, ScorerSpec) or compute_score is None:
            self.spec = ScorerSpec() if compute_score is None else compute_score
            # load now so a bad custom_reward_function fails at startup, not at the first step
            self.compute_score = self.spec.load()
        else:
            self.spec, self.compute_score = None, compute_score
        self.overlong = overlong if overlong is not None and overlong.enable else None
        if self.overlong is not None:
            if max_resp_len is None:
                raise ValueError("reward_model.reward_kwargs.max_resp_len is required with overlong_buffer_cfg")
            overlong_penalty(np.zeros(1), int(max_resp_len), self.overlong.len, 1.0)  # validates
        self.max_resp_len = max_resp_len
        self.missing_eos_penalty = missing_eos_penalty

    def _call_all(self, calls: list[dict[str, Any]]) -> list[Any]:
        results: list[Any] = []
        for kwargs in calls:
            try:
                with _deadline(self.timeout_s):
                    value = self.compute_score(**kwargs)
                results.append(self._verdict(value))
            except UnknownDataSourceError:
                if not self.no_verdict_ok:
                    raise
                results.append(NO_VERDICT)
            except _CallTimeout:
                results.append(_Failure("timeout", f"scorer call ran over {self.timeout_s}s"))
            except KeyboardInterrupt:
                raise
            except BaseException as err:  # a bad sample (even sys.exit) must not stop the run
                results.append(_Failure("error", f"{type(err).__name__}: {err}"))
        return results

    def _verdict(self, value: Any) -> Any:
        """A scorer's checked result, or NO_VERDICT for None where that is accepted."""
        if value is None and self.no_verdict_ok:
            return NO_VERDICT
        return _check_score(value)

    def score(
        self,
        responses: Sequence[str],
        data_source: Sequence[str],
        ground_truth: Sequence[Any],
        extra_info: Sequence[dict | None] | None = None,
        response_lengths: np.ndarray | None = None,
        finished_with_eos: np.ndarray | None = None,
        sources: Sequence[Any] | None = None,
    ) -> RewardResult:
        """`sources`: where each row came from (the data file and row, `RowRef`), named by the warning of a
        failed scorer call."""
        b = len(responses)
        if extra_info is None:
            extra_info = [None] * b
        for name, seq in (("data_source", data_source), ("ground_truth", ground_truth), ("extra_info", extra_info)):
            if len(seq) != b:
                raise ValueError(f"{name} has {len(seq)} entries for {b} responses")
        calls = [
            {"data_source": ds, "solution_str": r, "ground_truth": gt, "extra_info": ei}
            for r, ds, gt, ei in zip(responses, data_source, ground_truth, extra_info)
        ]
        # named reward functions without accuracy, cosine or length do not read the row's scorer
        results = self._call_all(calls) if self.named is None or self.named.needs_scorer else [0.0] * b

        raw = np.zeros(b, dtype=np.float32)
        extra_keys: dict[str, list[Any]] = {}
        failures = [r for r in results if isinstance(r, _Failure)]
        for i, result in enumerate(results):
            if isinstance(result, _Failure):
                continue
            if result is NO_VERDICT:
                raw[i] = np.nan
                continue
            if isinstance(result, dict):
                raw[i] = float(result["score"])
                for key, value in result.items():
                    if key != "score":
                        extra_keys.setdefault(key, [None] * b)[i] = value
            else:
                raw[i] = float(result)
        if failures:
            first = next(i for i, r in enumerate(results) if isinstance(r, _Failure))
            where = "" if sources is None or sources[first] is None else f"{sources[first]}: "
            logger.warning("reward: %d of %d scorer calls failed (score 0); first: %s%s",
                           len(failures), b, where, failures[0].message)

        scores = raw.copy()
        info = {"score": raw.copy(), **{k: _stack(v) for k, v in extra_keys.items()}}
        metrics = {
            "reward/num_errors": float(sum(f.kind == "error" for f in failures)),
            "reward/num_timeouts": float(sum(f.kind == "timeout" for f in failures)),
        }
        if self.named is not None:  # open-r1's functions, weighted and summed (rewards/named.py)
            scores, each, errors = named_scores(self.named, responses, raw, ground_truth)
            for name, values in each.items():
                info[f"{name}_reward"] = values
                metrics[f"reward/{name}/mean"] = float(np.nanmean(values)) if len(values) else 0.0
            if errors:
                logger.warning("reward: %d reward function calls failed (score 0); first: %s", len(errors), errors[0])
            metrics["reward/num_errors"] += len(errors)
        if self.overlong is not None:
            if response_lengths is None or self.max_resp_len is None:  # the second is checked at construction
                raise ValueError("overlong reward shaping needs response_lengths")
            penalty = overlong_penalty(response_lengths, int(self.max_resp_len), self.overlong.len,
                                       self.overlong.penalty_factor)
            scores += penalty
            if self.overlong.log:
                info["overlong_reward"] = penalty
                info["overlong"] = penalty < 0
                metrics["reward/overlong_reward/mean"] = float(penalty.mean())
                metrics["reward/overlong/frac"] = float((penalty < 0).mean())
        if self.missing_eos_penalty is not None:
            if finished_with_eos is None:
                raise ValueError("missing_eos_penalty needs finished_with_eos")
            penalty = missing_eos_penalty(finished_with_eos, self.missing_eos_penalty)
            scores += penalty
            metrics["reward/missing_eos/frac"] = float((penalty < 0).mean())
        return RewardResult(scores.astype(np.float32), info, metrics)

    def close(self) -> None:
        """Releases worker processes (none for the in-process manager)."""

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _worker_main(conn: multiprocessing.connection.Connection, spec: ScorerSpec) -> None:
    fn = spec.load()
    conn.send(_READY)  # a call's timeout starts once the worker can run it, not while it imports
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_id, kwargs = message
        try:
            reply = (task_id, "ok", fn(**kwargs))
        except UnknownDataSourceError as err:
            reply = (task_id, "unknown", str(err))
        except BaseException as err:  # report anything the user function raises
            reply = (task_id, "error", f"{type(err).__name__}: {err}")
        try:
            conn.send(reply)
        except Exception as err:  # result not picklable
            conn.send((task_id, "error", f"result cannot be sent back: {type(err).__name__}: {err}"))


_READY = ("ready", None, None)
READY_TIMEOUT_S = 120.0  # a spawned worker imports the scorer (and what it imports) before its first call


class _Worker:
    def __init__(self, ctx: Any, spec: ScorerSpec):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, spec), daemon=True)
        self.process.start()
        child.close()
        self.task = -1  # the call it runs (set by _dispatch)
        self.started = 0.0
        self.ready = False

    def wait_ready(self) -> bool:
        """Blocks until the worker has loaded its scorer (workers started together boot in parallel);
        False if it died or did not get there within READY_TIMEOUT_S."""
        if not self.ready and self.conn.poll(READY_TIMEOUT_S):
            try:
                self.ready = self.conn.recv() == _READY
            except (EOFError, OSError):
                return False
        return self.ready

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
    workers.clear()


class PrimeRewardManager(RewardManager):
    """`RewardManager` whose scorer calls run in a process pool with a per-call timeout."""

    def __init__(self, compute_score: ScorerSpec | Callable[..., Any] | None = None, *,
                 timeout_s: float = 10.0, num_workers: int | None = None, **kwargs: Any):
        super().__init__(compute_score, timeout_s=timeout_s, **kwargs)
        self.call_timeout_s = float(timeout_s)
        # a plain callable must be importable by reference in the worker
        self.worker_spec = self.spec if self.spec is not None else _spec_for_callable(self.compute_score)
        self.num_workers = int(num_workers or min(8, os.cpu_count() or 1))
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []  # started on first use
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    @property
    def worker_processes(self) -> tuple[Any, ...]:
        """The pool's worker processes (multiprocessing.Process), started on first use; a worker that
        dies or runs over its timeout is replaced by a new process."""
        return tuple(w.process for w in self._workers)

    def _call_all(self, calls: list[dict[str, Any]]) -> list[Any]:
        while len(self._workers) < min(self.num_workers, len(calls)):
            self._workers.append(_Worker(self._ctx, self.worker_spec))
        results: list[Any] = [None] * len(calls)
        pending = deque(range(len(calls)))
        idle = deque(self._workers)
        busy: dict[Any, _Worker] = {}
        while pending or busy:
            while pending and idle:
                worker = self._dispatch(idle.popleft(), pending.popleft(), calls)
                busy[worker.conn] = worker
            deadline = min(w.started for w in busy.values()) + self.call_timeout_s
            ready = multiprocessing.connection.wait(list(busy), timeout=max(0.0, deadline - time.monotonic()))
            for conn in ready:
                worker = busy.pop(conn)
                try:
                    task_id, status, value = worker.conn.recv()
                except (EOFError, OSError):  # the worker died (os._exit, segfault, ...)
                    results[worker.task] = _Failure("error", "scorer process died")
                    idle.append(self._replace(worker))
                    continue
                if status == "unknown":
                    if not self.no_verdict_ok:
                        raise UnknownDataSourceError(value)
                    results[task_id] = NO_VERDICT
                elif status == "ok":
                    try:
                        results[task_id] = self._verdict(value)
                    except TypeError as err:
                        results[task_id] = _Failure("error", str(err))
                else:
                    results[task_id] = _Failure("error", value)
                idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if now - worker.started >= self.call_timeout_s:
                    results[worker.task] = _Failure("timeout", f"scorer call ran over {self.call_timeout_s}s")
                    del busy[conn]
                    idle.append(self._replace(worker))
        return results

    def _dispatch(self, worker: _Worker, task: int, calls: list[dict[str, Any]]) -> _Worker:
        """Sends call `task` to `worker`, first replacing it when it died while idle (a closed
        pipe would otherwise raise BrokenPipeError here)."""
        if not worker.process.is_alive() or not worker.wait_ready():
            worker = self._replace(worker)
            if not worker.wait_ready():
                raise RuntimeError(f"reward worker did not start within {READY_TIMEOUT_S:.0f} s")
        try:
            worker.conn.send((task, calls[task]))
        except (BrokenPipeError, ConnectionResetError, EOFError):  # it died just now
            worker = self._replace(worker)
            worker.wait_ready()
            worker.conn.send((task, calls[task]))
        worker.task, worker.started = task, time.monotonic()
        return worker

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._ctx, self.worker_spec)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        _kill_all(self._workers)


def _spec_for_callable(fn: Callable[..., Any]) -> ScorerSpec:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", "")
    mod = __import__("sys").modules.get(module) if module else None
    path = getattr(mod, "__file__", None)
    if path is None or "<" in name or "." in name:
        raise ValueError(f"the prime reward manager needs a module-level function, got {fn!r}")
    return ScorerSpec(os.path.abspath(path), name)


def build_reward_manager(spec: RewardSpec) -> RewardManager:
    """The reward manager `spec.reward_manager` names, with its shaping."""
    if spec.reward_manager not in REWARD_MANAGERS:
        raise ValueError(f"reward_model.reward_manager={spec.reward_manager!r} is not one of {REWARD_MANAGERS}")
    if spec.reward_manager == "prime":
        return PrimeRewardManager(spec.scorer, num_workers=spec.num_workers, timeout_s=spec.timeout_s,
                                  overlong=spec.overlong, max_resp_len=spec.max_resp_len,
                                  missing_eos_penalty=spec.missing_eos_penalty, no_verdict_ok=spec.no_verdict_ok,
                                  named=spec.named)
    return RewardManager(spec.scorer, timeout_s=spec.timeout_s, overlong=spec.overlong,
                         max_resp_len=spec.max_resp_len, missing_eos_penalty=spec.missing_eos_penalty,
                         no_verdict_ok=spec.no_verdict_ok, named=spec.named)
