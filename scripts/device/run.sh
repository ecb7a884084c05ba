#!/usr/bin/env bash
# One call on the lent GPU (about 8 minutes): installs the carried wheels offline, then runs
# bench/device_check.py, whose sections each run in their own process with a deadline and write
# $OUT/<section>.json plus one summary line. Prepare here first: bash scripts/device/fetch_wheels.sh
#   device run: command="bash scripts/device/run.sh", carry=[".whl"], timeout_s=600
# The image's python3 holds JAX 0.11 + CUDA 13; the wheels go to a folder of their own on PYTHONPATH
# (the image's environment is left as it is) and the repo is imported from the checkout.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/device_check}
mkdir -p "$out"
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
    --target /tmp/site .whl/*.whl .whl/*.tar.gz 2>&1 | tail -3
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
# every section's and every rerun's compiled programs on this machine (it stays warm between calls): a section
# run again after a deadline, or a program another section compiled, is read back, not compiled (device minutes)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxrl_llm_xla}
# the tiny configs' tokenizer without the 93 MB SmolLM2 package (scripts/device/fetch_wheels.sh)
[ -d .whl/smollm2_tokenizer ] && export JAXRL_LLM_TINY_TOKENIZER=$PWD/.whl/smollm2_tokenizer
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/nvidia_smi.txt" 2>&1 || true
JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} "$py" bench/device_check.py --out "$out" --budget_s "${BUDGET_S:-480}" ${DEVICE_CHECK_ARGS:-} \
  2>&1 | tee "$out/log.txt"
