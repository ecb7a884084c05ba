#!/usr/bin/env bash
# Create, set up, run on and delete a Cloud TPU VM slice (single host or pod) for jaxrl_llm.
#
#   launch/tpu_pod.sh --create --setup                        # new slice with the repo installed
#   launch/tpu_pod.sh --run -- --config=configs/grpo_gsm8k.py --config.trainer.total_epochs=1
#   launch/tpu_pod.sh --delete
#   launch/tpu_pod.sh --spot --create --setup --run -- ...    # Spot capacity, relaunched after preemptions
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
#   --spot     TPU_SPOT=1    Spot (preemptible) capacity, requested as a queued resource named like
#                            the slice (`gcloud compute tpus queued-resources create ... --spot`);
#                            --delete then deletes the queued resource and its slice
#   --max-restarts TPU_MAX_RESTARTS  20   relaunches --run may make after preemptions
#   --poll     TPU_POLL_S    60            seconds between two looks at the slice's state
#
# --run relaunches after a preemption. When the training command ends with exit code 75 (a
# preemption: the run saved a checkpoint, jaxrl_llm/bookkeeping/preemption.py) or the slice is no
# longer READY (ACTIVE for a queued resource), it polls the slice's state; a slice that was lost
# (PREEMPTED, TERMINATED, STOPPED, SUSPENDED, FAILED, or gone) is deleted and created again and
# set up again (--setup's commands); once the slice is back it runs the same command, which resumes
# from the latest checkpoint by itself (trainer.resume_mode=auto, the default). Keep the run
# directory in a bucket (trainer.default_local_dir=gs://...): a recreated slice has empty disks.
# Any other failure on a healthy slice ends the script with that exit code.
# With --dry-run, '+ ' lines are the commands run in order; '~ ' lines are those run only after a
# preemption.
# Actions run in this order whatever the order given: --create, --setup, --run, --delete.
# Everything after `--run --` is passed to launch/train.py, so put `--run -- ...` last.
set -euo pipefail

NAME="${TPU_NAME:-jaxrl-llm}"
ZONE="${TPU_ZONE:-us-central2-b}"
TYPE="${TPU_TYPE:-v4-16}"
VERSION="${TPU_VERSION:-tpu-ubuntu2204-base}"
PROJECT="${TPU_PROJECT:-}"
REPO="${JAXRL_REPO:-}"
SPOT="${TPU_SPOT:-0}"
MAX_RESTARTS="${TPU_MAX_RESTARTS:-20}"
POLL="${TPU_POLL_S:-60}"
PREEMPTED_EXIT=75  # jaxrl_llm.bookkeeping.preemption.PREEMPTED_EXIT_CODE
REMOTE_DIR="jaxrl_llm"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN=0 DO_CREATE=0 DO_SETUP=0 DO_RUN=0 DO_DELETE=0
TRAIN_ARGS=()

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { echo "tpu_pod.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name|--zone|--type|--version|--project|--repo|--max-restarts|--poll)
      [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"
      case "$1" in
        --name) NAME="$2" ;; --zone) ZONE="$2" ;; --type) TYPE="$2" ;;
        --version) VERSION="$2" ;; --project) PROJECT="$2" ;; --repo) REPO="$2" ;;
        --max-restarts) MAX_RESTARTS="$2" ;; --poll) POLL="$2" ;;
      esac
      shift 2 ;;
    --spot) SPOT=1; shift ;;
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
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "--max-restarts needs a whole number, got '$MAX_RESTARTS'"
[[ "$POLL" =~ ^[0-9]+$ ]] || die "--poll needs a whole number of seconds, got '$POLL'"

# Prints a command readably (quoting only words that need it), or runs it. SHOW_PREFIX marks the
# commands of the dry run's preemption preview.
SHOW_PREFIX="+"
show() {
  local out="" word
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:=,@%+~-]+$ ]]; then out+=" $word"; else out+=" ${word@Q}"; fi
  done
  echo "${SHOW_PREFIX}${out}"
}
run() { show "$@"; (( DRY_RUN )) || "$@"; }

GCLOUD_COMMON=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && GCLOUD_COMMON+=(--project="$PROJECT")
on_all_workers() { run gcloud compute tpus tpu-vm ssh "$NAME" "${GCLOUD_COMMON[@]}" --worker=all --command "$1"; }

create_slice() {
  if (( SPOT )); then
    run gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" "${GCLOUD_COMMON[@]}" \
      --accelerator-type="$TYPE" --runtime-version="$VERSION" --spot
  else
    run gcloud compute tpus tpu-vm create "$NAME" "${GCLOUD_COMMON[@]}" \
      --accelerator-type="$TYPE" --version="$VERSION"
  fi
}

delete_slice() {
  if (( SPOT )); then
    run gcloud compute tpus queued-resources delete "$NAME" "${GCLOUD_COMMON[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$NAME" "${GCLOUD_COMMON[@]}" --quiet
  fi
}

# The slice's state: READY / CREATING / PREEMPTED / ... for a TPU VM, ACTIVE /
# WAITING_FOR_RESOURCES / SUSPENDED / ... for a queued resource, GONE when it does not exist.
state_command() {
  if (( SPOT )); then
    STATE_CMD=(gcloud compute tpus queued-resources describe "$NAME" "${GCLOUD_COMMON[@]}" --format="value(state.state)")
  else
    STATE_CMD=(gcloud compute tpus tpu-vm describe "$NAME" "${GCLOUD_COMMON[@]}" --format="value(state)")
  fi
}
slice_state() {
  local state
  state_command
  show "${STATE_CMD[@]}" >&2
  state="$("${STATE_CMD[@]}" 2>/dev/null)" || state=""
  echo "${state:-GONE}"
}
is_up() { [[ "$1" == READY || "$1" == ACTIVE ]]; }
is_lost() { [[ "$1" =~ ^(PREEMPTED|TERMINATED|STOPPED|SUSPENDED|FAILED|GONE)$ ]]; }

setup_workers() {
  local install="cd $REMOTE_DIR && python3 -m pip install -U pip && python3 -m pip install -e \".[tpu]\""
  if [[ -n "$REPO" ]]; then
    on_all_workers "(test -d $REMOTE_DIR/.git && git -C $REMOTE_DIR pull --ff-only || git clone $(printf %q "$REPO") $REMOTE_DIR) && $install"
  else
    # Ship the committed HEAD of this checkout (uncommitted edits are not included).
    if (( ! DRY_RUN )) && [[ -n "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no)" ]]; then
      echo "tpu_pod.sh: warning: uncommitted changes are not shipped (git archive HEAD)" >&2
    fi
    local archive="/tmp/${NAME}-jaxrl_llm.tar.gz"
    run git -C "$REPO_ROOT" archive --format=tar.gz -o "$archive" HEAD
    run gcloud compute tpus tpu-vm scp "$archive" "$NAME:~/jaxrl_llm.tar.gz" "${GCLOUD_COMMON[@]}" --worker=all
    on_all_workers "mkdir -p $REMOTE_DIR && tar -xzf jaxrl_llm.tar.gz -C $REMOTE_DIR && $install"
  fi
}

# Polls until the slice is up; a lost slice is deleted (if it still exists) and created again,
# then set up again. A failed delete/create is retried at the next poll.
wait_for_slice() {
  local state="$1" recreated=0
  until is_up "$state"; do
    if is_lost "$state"; then
      echo "tpu_pod.sh: slice $NAME is $state: creating it again" >&2
      if [[ "$state" != GONE ]]; then delete_slice || echo "tpu_pod.sh: delete failed; retrying" >&2; fi
      create_slice || echo "tpu_pod.sh: create failed; retrying" >&2
      recreated=1
    fi
    sleep "$POLL"
    state="$(slice_state)"
  done
  if (( recreated )); then setup_workers; fi
}

train_command() {
  TRAIN_REMOTE="cd $REMOTE_DIR && python3 launch/train.py"
  local word
  for word in "${TRAIN_ARGS[@]}"; do TRAIN_REMOTE+=" $(printf %q "$word")"; done
}

# The training command, relaunched after each preemption (at most MAX_RESTARTS times).
run_training() {
  local restarts=0 rc state
  train_command
  while true; do
    rc=0
    on_all_workers "$TRAIN_REMOTE" || rc=$?
    (( rc == 0 )) && return 0
    state="$(slice_state)"
    if (( rc != PREEMPTED_EXIT )) && is_up "$state"; then
      echo "tpu_pod.sh: training failed (exit $rc) on a $state slice; not relaunching" >&2
      return "$rc"
    fi
    if (( restarts >= MAX_RESTARTS )); then
      echo "tpu_pod.sh: stopped (exit $rc, slice $state) after $restarts relaunches (--max-restarts)" >&2
      return "$rc"
    fi
    restarts=$((restarts + 1))
    echo "tpu_pod.sh: training stopped (exit $rc, slice $state): relaunch $restarts of at most $MAX_RESTARTS" >&2
    wait_for_slice "$state"
  done
}

# --dry-run --run: the commands a preemption leads to, marked '~ '.
preview_preemption() {
  echo "# after a preemption (exit $PREEMPTED_EXIT, or the slice not READY): poll every ${POLL}s; if the slice was lost:"
  SHOW_PREFIX="~"
  state_command
  show "${STATE_CMD[@]}"
  delete_slice
  create_slice
  setup_workers
  on_all_workers "$TRAIN_REMOTE"
  SHOW_PREFIX="+"
}

if (( DO_CREATE )); then
  create_slice
  if (( SPOT )); then  # a queued request is filled later: poll until it is ACTIVE
    if (( DRY_RUN )); then state_command; show "${STATE_CMD[@]}"; else wait_for_slice "$(slice_state)"; fi
  fi
fi

if (( DO_SETUP )); then
  setup_workers
fi

if (( DO_RUN )); then
  if (( DRY_RUN )); then
    train_command
    on_all_workers "$TRAIN_REMOTE"
    preview_preemption
  else
    rc=0
    run_training || rc=$?
    (( rc == 0 )) || exit "$rc"
  fi
fi

if (( DO_DELETE )); then
  delete_slice
fi
