"""`PythonTool`: runs the model's code in the sandbox (`jaxrl_llm.sandbox`) and returns its output.

Config keys (all optional): `cpu_s`, `memory_mb`, `wall_s`, `max_output_chars` (the SandboxLimits
fields) and `use_namespace`. The reply is stdout, then stderr under a "stderr:" line, then a status
line when the program did not finish normally ("status: timeout", ...).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_llm.agents.tool_base import BaseTool, ToolResult
from jaxrl_llm.sandbox import SandboxLimits, run_python

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Runs a Python 3 program and returns what it prints (stdout and stderr). No network.",
        "parameters": {"type": "object",
                       "properties": {"code": {"type": "string", "description": "the program"},
                                      "stdin": {"type": "string", "description": "text on standard input"}},
                       "required": ["code"]},
    },
}
_LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(SandboxLimits))


class PythonTool(BaseTool):
    default_schema = PYTHON_SCHEMA

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None) -> None:
        super().__init__(config, tool_schema)
        unknown = sorted(set(self.config) - set(_LIMIT_KEYS))
        if unknown:
            raise ValueError(f"PythonTool config: unknown keys {unknown}; known: {list(_LIMIT_KEYS)}")
        self.limits = SandboxLimits(**self.config)

    def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResult:
        res = run_python(str(parameters.get("code", "")), stdin=str(parameters.get("stdin", "")),
                         limits=self.limits)
        text = res.stdout
        if res.stderr:
            text += ("\n" if text and not text.endswith("\n") else "") + "stderr:\n" + res.stderr
        if res.status != "ok":
            text += ("\n" if text and not text.endswith("\n") else "") + f"status: {res.status}"
        return ToolResult(text, 0.0, {"error": int(res.status != "ok"), "wall_s": res.wall_s})


__all__ = ["PYTHON_SCHEMA", "PythonTool"]
