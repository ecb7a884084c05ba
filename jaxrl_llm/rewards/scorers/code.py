"""Code scorer: runs a dataset row's test cases against the program in a response, in the sandbox
(`jaxrl_llm.sandbox`, one child process per test case); score = fraction of tests passed.

The program is the last ```python fenced block of the response (else the last ``` block, else the
whole response). `ground_truth` (a mapping, or a JSON string of one, as veRL stores it) is either

- stdin / stdout pairs (the APPS / TACO / CodeContests shape veRL's prime_code reads):
  `{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`. A case passes when the program exits
  normally and its stdout equals the expected output up to trailing whitespace on each line and
  leading / trailing blank lines. A list of lines is accepted for an input or an output.
- open-r1's `verification_info`: `{"language": "python", "test_cases": [{"input": ..., "output": ...}, ...]}`
  (stdin / stdout pairs as above; another language is refused).
- assert-style tests: `{"asserts": ["assert add(1, 2) == 3", ...]}`. Each assert runs after the
  program (in the same process, its own process per assert); it passes when the run exits normally.

- ROLL's code rows: `{"case_type": ..., "test_cases": [...], ...}` (rewards/scorers/roll_code.py).

Call-based APPS rows (`fn_name`) are not supported (ValueError). Limits per test case: 4 s of CPU,
8 s of wall clock, 512 MB of address space (`SandboxLimits` via the `limits` argument).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from jaxrl_llm.rewards.scorers.roll_code import is_roll_tests, parse_roll_tests
from jaxrl_llm.sandbox import SandboxLimits, run_python

SOURCES = ("code", "codecontests", "apps", "codeforces", "taco")
DEFAULT_LIMITS = SandboxLimits(cpu_s=4, memory_mb=512, wall_s=8.0, max_output_chars=1 << 16)
_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else response


def _text(value: Any) -> str:
    return "\n".join(str(v) for v in value) + "\n" if isinstance(value, list) else str(value)


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


def parse_tests(ground_truth: Any) -> dict:
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, Mapping):
        raise ValueError("code scorer: ground_truth must be a mapping (or its JSON) with inputs/outputs or asserts")
    if is_roll_tests(tests):  # a ROLL code row: its case_type / test_cases columns
        return parse_roll_tests(tests)
    if tests.get("fn_name"):
        raise ValueError("code scorer: call-based tests (fn_name) are not supported; use inputs/outputs or asserts")
    if isinstance(tests.get("test_cases"), list):  # open-r1's verification_info
        if tests.get("language", "python") != "python":
            raise ValueError(f"code scorer: verification_info.language={tests['language']!r}: only python runs in "
                             "the sandbox")
        cases = tests["test_cases"]
        if not all(isinstance(c, Mapping) and "input" in c and "output" in c for c in cases):
            raise ValueError("code scorer: each verification_info.test_cases entry needs 'input' and 'output'")
        tests = {"inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases]}
    if "asserts" in tests:
        if not isinstance(tests["asserts"], list):
            raise ValueError("code scorer: ground_truth.asserts must be a list of assert statements")
        return {"asserts": [str(a) for a in tests["asserts"]]}
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError("code scorer: ground_truth needs equally long 'inputs' and 'outputs' lists, or 'asserts'")
    return {"inputs": [_text(i) for i in inputs], "outputs": [_text(o) for o in outputs]}


def run_tests(program: str, tests: Mapping[str, Any], limits: SandboxLimits = DEFAULT_LIMITS) -> list[bool]:
    """Pass / fail per test case (`tests` as `parse_tests` returns them)."""
    program = str(tests.get("prefix", "")) + program
    if "asserts" in tests:
        return [run_python(program + "\n\n" + a + "\n", limits=limits).ok for a in tests["asserts"]]
    results = []
    for stdin, expected in zip(tests["inputs"], tests["outputs"]):
        res = run_python(program, stdin=stdin, limits=limits)
        results.append(res.ok and _normalise(res.stdout) == _normalise(expected))
    return results


def compute_score(solution_str: str, ground_truth: Any, limits: SandboxLimits = DEFAULT_LIMITS) -> float:
    """Fraction of the row's test cases the response's program passes (0.0 when it has none); for a ROLL row,
    1.0 when it passes them all, else 0.0."""
    tests = parse_tests(ground_truth)
    results = run_tests(extract_program(solution_str), tests, limits)
    if tests.get("all_or_nothing"):
        return float(bool(results) and all(results))
    return sum(results) / len(results) if results else 0.0


__all__ = ["DEFAULT_LIMITS", "SOURCES", "compute_score", "extract_program", "parse_tests", "run_tests"]
