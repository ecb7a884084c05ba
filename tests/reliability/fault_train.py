"""`launch/train.py` with one injected fault, for tests/reliability: with JAXRL_TEST_KILL_IN_SAVE=S
the process SIGKILLs itself right after the asynchronous checkpoint save of step S has started,
while orbax is still writing `S.orbax-checkpoint-tmp` (the moment a kill -9 from outside would only
hit by luck: a tiny model's save takes milliseconds). Before dying it prints what the checkpoints
folder holds, so the test can check that the save was really in flight. With
JAXRL_TEST_FULL_DISK_AT_SAVE=S the save of step S fails with ENOSPC in orbax's background thread; with
JAXRL_TEST_SIGTERM_AT=setup|validation the process gets SIGTERM while it sets up or first validates; with
JAXRL_TEST_HANG_AT="PHASE of step N" process 1 of a multi-process run hangs, alive, as its main thread is about
to enter that phase (a deadlock in user code: the thread waits on an event no one sets)."""
import os
import pathlib
import runpy
import signal
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _install_kill_in_save(kill_step: int) -> None:
    from jaxrl_llm import checkpoint

    save = checkpoint.CheckpointStore.save

    def save_then_die(self, step, *args, **kwargs):
        save(self, step, *args, **kwargs)
        if step == kill_step:
            listing = sorted(os.listdir(self.directory))
            print(f"killing during save of step {step}: checkpoints holds {listing}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.CheckpointStore.save = save_then_die


def _install_full_disk_at_save(step: int) -> None:
    """The asynchronous save of `step` fails in orbax's background thread with ENOSPC, when it commits its
    folder (as a full disk fails tensorstore's writes there: the same error path, found at the next call)."""
    import errno

    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_or_fail(self):
        if f"{os.sep}{step}.orbax-checkpoint-tmp" in str(self.get()):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.get()))
        return await finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_fail


def _install_sigterm_at(moment: str) -> None:
    """The process sends itself SIGTERM during setup (`setup`: once the run's models are built, before the
    trainer exists) or as the first validation starts (`validation`): the moments a maintenance notice
    meets a long load or a first evaluation."""
    from jaxrl_llm.trainer import trainer as trainer_module

    if moment == "setup":
        build = trainer_module.build_run

        def build_then_signal(config):
            run = build(config)
            print("sending SIGTERM during setup", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return run

        trainer_module.build_run = build_then_signal
    else:
        validate = trainer_module.Trainer.validate

        def signal_then_validate(self):
            print("sending SIGTERM as the first validation starts", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return validate(self)

        trainer_module.Trainer.validate = signal_then_validate


def _install_hang_at(label: str) -> None:
    import threading

    import jax

    from jaxrl_llm.bookkeeping.watchdog import WorkerWatchdog

    mark = WorkerWatchdog.mark

    def hang_or_mark(self, phase_label):
        if jax.process_index() == 1 and phase_label == label:
            print(f"hanging before {label}", flush=True)
            threading.Event().wait()
        return mark(self, phase_label)

    WorkerWatchdog.mark = hang_or_mark


if __name__ == "__main__":
    if os.environ.get("JAXRL_TEST_HANG_AT"):
        _install_hang_at(os.environ["JAXRL_TEST_HANG_AT"])
    if os.environ.get("JAXRL_TEST_SIGTERM_AT"):
        _install_sigterm_at(os.environ["JAXRL_TEST_SIGTERM_AT"])
    if os.environ.get("JAXRL_TEST_KILL_IN_SAVE"):
        _install_kill_in_save(int(os.environ["JAXRL_TEST_KILL_IN_SAVE"]))
    if os.environ.get("JAXRL_TEST_FULL_DISK_AT_SAVE"):
        _install_full_disk_at_save(int(os.environ["JAXRL_TEST_FULL_DISK_AT_SAVE"]))
    sys.argv[0] = str(ROOT / "launch" / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
