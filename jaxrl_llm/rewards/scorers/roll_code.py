"""ROLL's code rows (its CodeSandboxRewardWorker, local mode) as the code scorer's tests. A row's ground truth
is the dict of its `case_type`, `test_cases` (a list, or its JSON) and `test_case_function` columns
(data.domains.ground_truth_columns; the ROLL importer sets it for the code domain). By case_type:

    assert, pytest   each case's assert_code runs after the program; code defining test_* functions is
                     followed by a call of each, in order (ROLL's test runner)
    check_based      the first case: its import_prefix before the program; for each line after the first of
                     its assert_code: the first line, that line, then check(<entry_point>) (HumanEval's form)
    anything else    stdin / expected_stdout pairs (LiveCodeBench's)

The reward is ROLL's: 1 when every case passes, else 0. ROLL's `text` cases (asserts over the response's
text rather than a program) are not supported.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_TEST_FN = re.compile(r"^\s*def (test_\w+)\s*\(", re.MULTILINE)


def is_roll_tests(tests: Mapping[str, Any]) -> bool:
    return "case_type" in tests and "test_cases" in tests


def _with_runner(assert_code: str) -> str:
    """pytest-style code with a call of each test function it defines (ROLL's runner)."""
    names = _TEST_FN.findall(assert_code)
    return assert_code if not names else assert_code + "\n\n" + "\n".join(f"{name}()" for name in names) + "\n"


def parse_roll_tests(tests: Mapping[str, Any]) -> dict:
    """The code scorer's tests (`asserts` or `inputs` / `outputs`, a program `prefix`, all-or-nothing) of a
    ROLL code row; a ValueError says what is wrong with it."""
    case_type, cases = str(tests.get("case_type") or ""), tests["test_cases"]
    if isinstance(cases, (str, bytes)):
        try:
            cases = json.loads(cases)
        except ValueError as err:
            raise ValueError(f"ROLL code row: test_cases is not JSON ({err})") from None
    if hasattr(cases, "tolist"):  # a parquet list column reads as an array
        cases = cases.tolist()
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"ROLL code row: test_cases must be a non-empty list, got {str(cases)[:80]!r}")
    if case_type == "text":
        raise ValueError("ROLL code row: case_type 'text' (asserts over the response's text) is not supported")
    if case_type in ("assert", "pytest"):
        codes = [c["assert_code"] if isinstance(c, Mapping) else c for c in cases]
        return {"asserts": [_with_runner(str(code)) for code in codes], "all_or_nothing": True}
    if case_type == "check_based":
        case = cases[0]
        if not isinstance(case, Mapping) or "assert_code" not in case:
            raise ValueError("ROLL code row: a check_based case needs assert_code")
        lines = [line for line in str(case["assert_code"]).split("\n") if line != ""]
        call = f"check({case.get('entry_point', 'candidate')})"
        bodies = [f"{lines[0]}\n{line}" for line in lines[1:]] if len(lines) > 1 else lines[:1]
        return {"asserts": [f"{body}\n{call}\n" for body in bodies], "prefix": str(case.get("import_prefix", "")),
                "all_or_nothing": True}
    if not all(isinstance(c, Mapping) and "stdin" in c and "expected_stdout" in c for c in cases):
        raise ValueError(f"ROLL code row: case_type {case_type!r} takes stdin / expected_stdout pairs")
    return {"inputs": [str(c["stdin"]) for c in cases], "outputs": [str(c["expected_stdout"]) for c in cases],
            "all_or_nothing": True}
