"""Preemption: a SIGTERM (a spot VM's or a scheduler's notice) or SIGINT (Ctrl-C) during
`Trainer.fit()` lets the current RL step finish, saves a checkpoint at that step, waits for it to
commit, prints `preempted at step N; checkpoint saved` and exits with `PREEMPTED_EXIT_CODE`. The
same command with `trainer.resume_mode=auto` (the default) then continues from that step and gives
exactly the run that was never interrupted. A second signal of the same kind acts as it normally
would (SIGINT: KeyboardInterrupt, SIGTERM: the process ends), to abort without a checkpoint.

Several processes (TPU pod workers, multi-node GPU, several CPU processes) must stop at the same
step and save the same checkpoint, even when only some of them get the signal:

* when `jax.distributed` runs its preemption service (it does by default on every platform, CPU
  with gloo included), jax owns SIGTERM: its notifier catches the signal and its sync protocol
  propagates the notice to every process. Every step, every process asks
  `multihost_utils.reached_preemption_sync_point(step)` (the call orbax's
  `CheckpointManager.reached_preemption(step)` makes too);
* SIGINT, and SIGTERM when that service is disabled (`jax_enable_preemption_service=False`), are
  caught here, in each process that receives them;
* the local answers are then combined by a collective (`process_allgather` of one flag, every
  step): all processes see the same "any process was told to stop" and stop at the same step. jax's
  protocol alone picks "the furthest step any process reported + 1", which a process with short
  steps can pass before the notice reaches it; the collective removes that race.

One process: no collective; SIGTERM and SIGINT are caught here.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from types import FrameType
from typing import Any, Iterator

import jax
import numpy as np

log = logging.getLogger("jaxrl_llm")

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". launch/tpu_pod.sh
# --run relaunches the same command when a run exits with it.
PREEMPTED_EXIT_CODE = 75


class Preempted(SystemExit):
    """Raised by `Trainer.fit()` once the preemption checkpoint is committed (`saved`), or when the signal came
    before the first step of this launch, so there was nothing new to save. A `SystemExit`, so an uncaught one
    ends a script with `PREEMPTED_EXIT_CODE` and no traceback, and `except Exception` in user code does not
    swallow it."""

    def __init__(self, step: int, reason: str, saved: bool = True):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.reason = reason
        self.saved = saved

    def __str__(self) -> str:
        if not self.saved:
            return f"stopped before training step {self.step + 1} ({self.reason}); nothing to save"
        return f"preempted at step {self.step} ({self.reason}); checkpoint saved"


@contextlib.contextmanager
def stop_during_setup() -> Iterator[None]:
    """Around a run's setup (loading models and data, compiling, restoring), before `PreemptionGuard` takes
    over: SIGTERM / SIGINT stop the process at once with `PREEMPTED_EXIT_CODE` (there is nothing to save yet;
    `finally` blocks on the way out still run), so that `launch/tpu_pod.sh --run` relaunches a job whose
    slice got a maintenance notice during a long load. With jax's preemption service (several processes) it
    owns SIGTERM: the notice is kept and the first step's sync point stops every process together."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    service = jax.process_count() > 1 and jax_preemption_service_active()

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        print(f"received {name} during setup: stopping (nothing to save yet)", flush=True)
        raise Preempted(-1, f"{name} during setup", saved=False)

    previous = {sig: signal.signal(sig, handle) for sig in ([signal.SIGINT] if service
                                                           else [signal.SIGINT, signal.SIGTERM])}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def jax_preemption_service_active() -> bool:
    """True when `jax.distributed` is initialized with its preemption sync manager (it then owns
    SIGTERM through a C++ handler that Python's `signal.getsignal` does not see)."""
    if not jax.distributed.is_initialized():
        return False
    try:
        from jax._src import distributed  # the manager has no public accessor; private, so guarded
    except ImportError:
        return False
    return getattr(distributed.global_state, "preemption_sync_manager", None) is not None


class PreemptionGuard:
    """Context manager around a training loop; `stop_requested(step)` after each step says (the
    same on every process) whether to checkpoint and stop at that step.

        with PreemptionGuard() as guard:
            while ...:
                step()
                if guard.stop_requested(step):
                    save, wait, raise Preempted(step, guard.reason)
    """

    def __init__(self) -> None:
        self._received: str | None = None  # name of the first signal caught by this process
        self._previous: dict[int, Any] = {}
        self._jax_service = False
        self._multi = False
        self.reason = ""

    def __enter__(self) -> "PreemptionGuard":
        self._multi = jax.process_count() > 1
        self._jax_service = self._multi and jax_preemption_service_active()
        signals = [signal.SIGINT] if self._jax_service else [signal.SIGINT, signal.SIGTERM]
        if threading.current_thread() is not threading.main_thread():
            # Python only lets the main thread install handlers; jax's SIGTERM notifier still works
            log.warning("training outside the main thread: SIGTERM/SIGINT do not checkpoint before stopping")
            return self
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._received is None:
            self._received = name
        # the next signal of this kind acts as it did before the guard: an explicit abort
        previous = self._previous.pop(signum, None)
        if previous is not None:
            signal.signal(signum, previous)
        print(f"received {name}: finishing the current step, then saving a checkpoint "
              f"(send {name} again to stop at once)", flush=True)

    def stop_requested(self, step: int) -> bool:
        """Whether to stop after `step`. Multi-process: a collective, so every process must call it
        after every step, with the same step."""
        local = self._received is not None
        reason = f"{self._received} received" if local else ""
        if self._jax_service:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                local, reason = True, reason or "jax preemption sync point"
        if self._multi:
            from jax.experimental import multihost_utils

            flags = np.asarray(multihost_utils.process_allgather(np.int32(local))).reshape(-1)
            if flags.any() and not local:
                reason = "process " + ",".join(str(int(i)) for i in np.flatnonzero(flags)) + " stopping"
            local = bool(flags.any())
        if local:
            self.reason = reason
        return local
