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
