"""`launch/train.py` with one injected fault, for tests/reliability: with JAXRL_TEST_KILL_IN_SAVE=S
the process SIGKILLs itself right after the asynchronous checkpoint save of step S has started,
while orbax is still writing `S.orbax-checkpoint-tmp` (the moment a kill -9 from outside would only
hit by luck: a tiny model's save takes milliseconds). Before dying it prints what the checkpoints
folder holds, so the test can check that the save was really in flight."""
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


if __name__ == "__main__":
    if os.environ.get("JAXRL_TEST_KILL_IN_SAVE"):
        _install_kill_in_save(int(os.environ["JAXRL_TEST_KILL_IN_SAVE"]))
    sys.argv[0] = str(ROOT / "launch" / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
