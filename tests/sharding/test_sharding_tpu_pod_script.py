"""launch/tpu_pod.sh --dry-run prints the gcloud commands it would run, in order."""
import os
import pathlib
import shlex
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "launch" / "tpu_pod.sh"


def dry_run(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAXRL_REPO"))}
    full_env.update(env or {})
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], env=full_env,
                          capture_output=True, text=True, timeout=30)
    lines = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]
    return proc, lines


def test_create_setup_run_delete_commands():
    proc, cmds = dry_run("--name", "pod1", "--zone", "europe-west4-a", "--type", "v5litepod-16",
                         "--project", "my-proj", "--delete", "--create", "--setup", "--run", "--",
                         "--config=configs/grpo_gsm8k.py", "--config.actor_rollout_ref.actor.optim.lr=1e-6",
                         "data.train_files=a b.parquet")
    assert proc.returncode == 0, proc.stderr
    common = ["--zone=europe-west4-a", "--project=my-proj"]
    assert cmds[0] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pod1", *common,
                       "--accelerator-type=v5litepod-16", "--version=tpu-ubuntu2204-base"]
    assert cmds[1][:3] == ["git", "-C", str(SCRIPT.parents[1])] and cmds[1][-1] == "HEAD"
    archive = cmds[1][cmds[1].index("-o") + 1]
    assert cmds[2] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", archive, "pod1:~/jaxrl_llm.tar.gz",
                       *common, "--worker=all"]
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1", *common, "--worker=all", "--command"]
    assert cmds[3][:-1] == ssh
    assert "tar -xzf jaxrl_llm.tar.gz -C jaxrl_llm" in cmds[3][-1]
    assert cmds[3][-1].endswith('cd jaxrl_llm && python3 -m pip install -U pip && python3 -m pip install -e ".[tpu]"')
    assert cmds[4][:-1] == ssh
    # the remote command re-splits into exactly the train arguments given
    remote = shlex.split(cmds[4][-1])
    assert remote[:4] == ["cd", "jaxrl_llm", "&&", "python3"]
    assert remote[4:] == ["launch/train.py", "--config=configs/grpo_gsm8k.py",
                          "--config.actor_rollout_ref.actor.optim.lr=1e-6", "data.train_files=a b.parquet"]
    assert cmds[5] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "pod1", *common, "--quiet"]
    assert len(cmds) == 6


def test_env_settings_and_git_clone_setup():
    proc, cmds = dry_run("--setup", env={"TPU_NAME": "envpod", "TPU_ZONE": "us-east5-a",
                                         "JAXRL_REPO": "https://example.com/jaxrl_llm.git"})
    assert proc.returncode == 0, proc.stderr
    assert len(cmds) == 1
    assert cmds[0][:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "envpod", "--zone=us-east5-a", "--worker=all"]
    assert "git clone https://example.com/jaxrl_llm.git jaxrl_llm" in cmds[0][-1]


@pytest.mark.parametrize("args, message", [
    ((), "give at least one of --create, --setup, --run, --delete"),
    (("--create", "--bogus"), "unknown argument '--bogus'"),
    (("--create", "--zone"), "--zone needs a value"),
])
def test_usage_errors(args, message):
    proc, cmds = dry_run(*args)
    assert proc.returncode == 2 and message in proc.stderr and cmds == []


def test_spot_uses_a_queued_resource_and_previews_the_relaunch():
    proc, cmds = dry_run("--name", "sp", "--zone", "us-east5-a", "--type", "v5litepod-16", "--spot",
                         "--delete", "--create", "--run", "--", "--config=configs/grpo_gsm8k.py")
    assert proc.returncode == 0, proc.stderr
    common = ["--zone=us-east5-a"]
    create = ["gcloud", "compute", "tpus", "queued-resources", "create", "sp", "--node-id=sp", *common,
              "--accelerator-type=v5litepod-16", "--runtime-version=tpu-ubuntu2204-base", "--spot"]
    describe = ["gcloud", "compute", "tpus", "queued-resources", "describe", "sp", *common,
                "--format=value(state.state)"]
    delete = ["gcloud", "compute", "tpus", "queued-resources", "delete", "sp", *common, "--force", "--quiet"]
    train = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "sp", *common, "--worker=all", "--command",
             "cd jaxrl_llm && python3 launch/train.py --config=configs/grpo_gsm8k.py"]
    assert cmds == [create, describe, train, delete]  # create, wait until ACTIVE, train, delete
    preview = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("~ ")]
    assert "exit 75" in proc.stdout
    assert preview[:3] == [describe, delete, create] and preview[-1] == train
    assert any("tar -xzf" in c[-1] for c in preview[3:-1])  # set up again before the relaunch


def test_exit_code_is_the_trainers():
    from jaxrl_llm.bookkeeping.preemption import PREEMPTED_EXIT_CODE

    assert f"PREEMPTED_EXIT={PREEMPTED_EXIT_CODE}" in SCRIPT.read_text()


# A stand-in for gcloud: logs every call; `ssh ... --command '...train.py...'` exits with the next
# code of ssh_codes, `describe` prints the next line of states (GONE: exits 1, as gcloud does for a
# missing resource); everything else succeeds.
FAKE_GCLOUD = r'''#!/usr/bin/env bash
echo "$*" >> "$FAKE_DIR/calls"
pop() { local first; first="$(head -n 1 "$FAKE_DIR/$1")"; sed -i 1d "$FAKE_DIR/$1"; echo "$first"; }
case "$*" in
  *" ssh "*launch/train.py*) exit "$(pop ssh_codes)" ;;
  *" describe "*) state="$(pop states)"; [[ "$state" == GONE ]] && exit 1; echo "$state" ;;
esac
exit 0
'''


def fake_run(tmp_path, args, ssh_codes, states):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    (tmp_path / "ssh_codes").write_text("".join(f"{c}\n" for c in ssh_codes))
    (tmp_path / "states").write_text("".join(f"{s}\n" for s in states))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAXRL_REPO"))}
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", "FAKE_DIR": str(tmp_path), "TPU_POLL_S": "0",
                "JAXRL_REPO": "https://example.com/jaxrl_llm.git"})
    proc = subprocess.run(["bash", str(SCRIPT), "--name", "p", "--zone", "z", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    return proc, calls


def _kind(call):
    """'train', 'setup', or the gcloud verb ('describe', 'create', ...)."""
    if " ssh " in call:
        return "train" if "launch/train.py" in call else "setup"
    return call.split()[3]


def test_run_relaunches_after_preemption_on_a_recreated_spot_slice(tmp_path):
    proc, calls = fake_run(tmp_path, ["--spot", "--run", "--", "--config=configs/grpo_gsm8k.py"],
                           ssh_codes=[75, 0], states=["SUSPENDED", "WAITING_FOR_RESOURCES", "ACTIVE"])
    assert proc.returncode == 0, proc.stderr
    assert [_kind(c) for c in calls] == ["train", "describe", "delete", "create", "describe", "describe",
                                         "setup", "train"]
    assert calls[0] == calls[-1]  # the very same command, which resumes by itself
    assert "queued-resources create p --node-id=p" in calls[3] and calls[3].endswith("--spot")
    assert "training stopped (exit 75, slice SUSPENDED): relaunch 1 of at most 20" in proc.stderr


def test_run_relaunches_when_the_slice_is_gone_or_only_the_job_was_preempted(tmp_path):
    # a TPU VM slice that vanished (gcloud describe fails), then a second preemption with the slice up
    proc, calls = fake_run(tmp_path, ["--run", "--", "x=1"], ssh_codes=[255, 75, 0],
                           states=["GONE", "CREATING", "READY", "READY"])
    assert proc.returncode == 0, proc.stderr
    assert [_kind(c) for c in calls] == ["train", "describe", "create", "describe", "describe", "setup",
                                         "train", "describe", "train"]
    assert "tpu-vm create p" in calls[2]


def test_run_does_not_relaunch_a_real_failure_and_stops_after_max_restarts(tmp_path):
    (tmp_path / "a").mkdir()
    proc, calls = fake_run(tmp_path / "a", ["--run", "--", "x=1"], ssh_codes=[3], states=["READY"])
    assert proc.returncode == 3
    assert [_kind(c) for c in calls] == ["train", "describe"]
    assert "training failed (exit 3) on a READY slice; not relaunching" in proc.stderr

    (tmp_path / "b").mkdir()
    proc, calls = fake_run(tmp_path / "b", ["--max-restarts", "1", "--run", "--", "x=1"], ssh_codes=[75, 75],
                           states=["READY", "READY"])
    assert proc.returncode == 75
    assert [_kind(c) for c in calls] == ["train", "describe", "train", "describe"]
    assert "after 1 relaunches (--max-restarts)" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (("--run", "--max-restarts", "many"), "--max-restarts needs a whole number"),
    (("--run", "--poll", "-1"), "--poll needs a whole number of seconds"),
])
def test_restart_setting_errors(args, message):
    proc, cmds = dry_run(*args)
    assert proc.returncode == 2 and message in proc.stderr and cmds == []
