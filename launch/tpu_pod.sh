#!/usr/bin/env bash
# Create, set up, run on and delete a Cloud TPU VM slice (single host or pod) for jaxrl_llm.
#
#   launch/tpu_pod.sh --create --setup                        # new slice with the repo installed
#   launch/tpu_pod.sh --run -- --config=configs/grpo_gsm8k.py --config.trainer.total_epochs=1
#   launch/tpu_pod.sh --delete
#   launch/tpu_pod.sh --dry-run --create --setup --run -- ...  # print the commands, run nothing
#
# Every worker of the slice runs the same `python3 launch/train.py ...`; jaxrl_llm.sharding.initialize()
# finds the other workers from the TPU metadata and builds one global mesh. See docs/multihost.md.
#
# Settings (flag, or env var, then default):
#   --name     TPU_NAME      jaxrl-llm
#   --zone     TPU_ZONE      us-central2-b
#   --type     TPU_TYPE      v4-16                 (accelerator type; v4-16 = 2 hosts x 4 chips)
#   --version  TPU_VERSION   tpu-ubuntu2204-base   (TPU VM software version)
#   --project  TPU_PROJECT   (gcloud's default project)
#   --repo     JAXRL_REPO    (git URL to clone on the workers; default: ship this checkout's HEAD)
# Actions run in this order whatever the order given: --create, --setup, --run, --delete.
# Everything after `--run --` is passed to launch/train.py, so put `--run -- ...` last.
set -euo pipefail

NAME="${TPU_NAME:-jaxrl-llm}"
ZONE="${TPU_ZONE:-us-central2-b}"
TYPE="${TPU_TYPE:-v4-16}"
VERSION="${TPU_VERSION:-tpu-ubuntu2204-base}"
PROJECT="${TPU_PROJECT:-}"
REPO="${JAXRL_REPO:-}"
REMOTE_DIR="jaxrl_llm"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN=0 DO_CREATE=0 DO_SETUP=0 DO_RUN=0 DO_DELETE=0
TRAIN_ARGS=()

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { echo "tpu_pod.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name|--zone|--type|--version|--project|--repo)
      [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"
      case "$1" in
        --name) NAME="$2" ;; --zone) ZONE="$2" ;; --type) TYPE="$2" ;;
        --version) VERSION="$2" ;; --project) PROJECT="$2" ;; --repo) REPO="$2" ;;
      esac
      shift 2 ;;
    --create) DO_CREATE=1; shift ;;
    --setup) DO_SETUP=1; shift ;;
    --delete) DO_DELETE=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --run)
      DO_RUN=1; shift
      if [[ $# -gt 0 && "$1" == "--" ]]; then shift; TRAIN_ARGS=("$@"); shift $#; fi ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (train arguments go after '--run --')" ;;
  esac
done
(( DO_CREATE + DO_SETUP + DO_RUN + DO_DELETE > 0 )) || { usage >&2; die "give at least one of --create, --setup, --run, --delete"; }

# Prints a command readably (quoting only words that need it), or runs it.
show() {
  local out="" word
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:=,@%+~-]+$ ]]; then out+=" $word"; else out+=" ${word@Q}"; fi
  done
  echo "+${out}"
}
run() { show "$@"; (( DRY_RUN )) || "$@"; }

GCLOUD_COMMON=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && GCLOUD_COMMON+=(--project="$PROJECT")
on_all_workers() { run gcloud compute tpus tpu-vm ssh "$NAME" "${GCLOUD_COMMON[@]}" --worker=all --command "$1"; }

if (( DO_CREATE )); then
  run gcloud compute tpus tpu-vm create "$NAME" "${GCLOUD_COMMON[@]}" \
    --accelerator-type="$TYPE" --version="$VERSION"
fi

if (( DO_SETUP )); then
  install="cd $REMOTE_DIR && python3 -m pip install -U pip && python3 -m pip install -e \".[tpu]\""
  if [[ -n "$REPO" ]]; then
    on_all_workers "(test -d $REMOTE_DIR/.git && git -C $REMOTE_DIR pull --ff-only || git clone $(printf %q "$REPO") $REMOTE_DIR) && $install"
  else
    # Ship the committed HEAD of this checkout (uncommitted edits are not included).
    if (( ! DRY_RUN )) && [[ -n "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no)" ]]; then
      echo "tpu_pod.sh: warning: uncommitted changes are not shipped (git archive HEAD)" >&2
    fi
    archive="/tmp/${NAME}-jaxrl_llm.tar.gz"
    run git -C "$REPO_ROOT" archive --format=tar.gz -o "$archive" HEAD
    run gcloud compute tpus tpu-vm scp "$archive" "$NAME:~/jaxrl_llm.tar.gz" "${GCLOUD_COMMON[@]}" --worker=all
    on_all_workers "mkdir -p $REMOTE_DIR && tar -xzf jaxrl_llm.tar.gz -C $REMOTE_DIR && $install"
  fi
fi

if (( DO_RUN )); then
  remote="cd $REMOTE_DIR && python3 launch/train.py"
  for word in "${TRAIN_ARGS[@]}"; do remote+=" $(printf %q "$word")"; done
  on_all_workers "$remote"
fi

if (( DO_DELETE )); then
  run gcloud compute tpus tpu-vm delete "$NAME" "${GCLOUD_COMMON[@]}" --quiet
fi
