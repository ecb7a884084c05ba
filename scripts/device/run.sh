#!/usr/bin/env bash
# One call on the lent GPU (about 8 minutes): installs the carried wheels offline, then runs
# bench/device_check.py, whose sections each run in their own process with a deadline and write
# $OUT/<section>.json plus one summary line. Prepare here first: bash scripts/device/fetch_wheels.sh
#   device run: command="bash scripts/device/run.sh", carry=[".whl"], timeout_s=600
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/device_check}
mkdir -p "$out"
if compgen -G ".whl/*" > /dev/null; then
  python -m pip install -q --no-index --no-deps .whl/* 2>&1 | tail -3
fi
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/nvidia_smi.txt" 2>&1 || true
JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} python bench/device_check.py --out "$out" --budget_s "${BUDGET_S:-480}"
