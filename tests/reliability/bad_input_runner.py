"""Runs `launch/train.py` once per case, as `python launch/train.py ARGS` would, but each run in a
forked child of one warm interpreter: the imports (jax, transformers, orbax, the package) are
paid once instead of once per case. A child has its own process, exit status, stdout and stderr
(file descriptors 1 and 2 redirected), and an uncaught exception prints its traceback and exits 1,
exactly as the interpreter does for a script.

    python bad_input_runner.py CASES.json RESULTS.json [WARM_TOKENIZER_DIR]

CASES.json: [{"name": ..., "argv": [...]}, ...]; RESULTS.json: [{"name", "code", "stdout", "stderr",
"seconds"}, ...] in the same order. The parent never touches the JAX backend, so forking is safe.
WARM_TOKENIZER_DIR: an HF tokenizer folder the parent loads once (with transformers directly, not
through jaxrl_llm's cache), so that transformers' lazy imports are not paid in every child.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = ROOT / "launch" / "train.py"


def _load_train_module():
    spec = importlib.util.spec_from_file_location("jaxrl_llm_launch_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _child(train, argv: list[str], out_path: str, err_path: str) -> None:
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 0
    try:
        sys.argv = [str(TRAIN), *argv]
        train.run()
    except SystemExit as exit_:  # what the interpreter does with sys.exit(...) at top level
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # an uncaught exception: traceback and status 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    cases_path, results_path = sys.argv[1], sys.argv[2]
    cases = json.loads(pathlib.Path(cases_path).read_text())
    os.chdir(ROOT)
    train = _load_train_module()
    import pandas  # noqa: F401  (csv files)
    import pyarrow.parquet  # noqa: F401
    import transformers

    import jaxrl_llm.data
    import jaxrl_llm.hf
    import jaxrl_llm.trainer  # noqa: F401

    if len(sys.argv) > 3:
        transformers.AutoTokenizer.from_pretrained(sys.argv[3])

    scratch = pathlib.Path(results_path).parent
    results = []
    for i, case in enumerate(cases):
        out_path, err_path = scratch / f"case{i}.out", scratch / f"case{i}.err"
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(train, case["argv"], str(out_path), str(err_path))
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        results.append({"name": case["name"], "code": code, "stdout": out_path.read_text(errors="replace"),
                        "stderr": err_path.read_text(errors="replace"), "seconds": time.monotonic() - start})
    pathlib.Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
