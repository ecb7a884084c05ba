"""The tool protocol (veRL's `BaseTool`): one object per configured tool, one instance per trajectory.

    class MyTool(BaseTool):
        def execute(self, instance_id, parameters): return ToolResult("text", 0.0, {})

    tool = MyTool(config={...}, tool_schema={"type": "function", "function": {...}})
    iid = tool.create(None, **create_kwargs)        # per trajectory (kwargs: the row's tools_kwargs)
    text, reward, metrics = tool.execute(iid, {"expression": "1+2"})
    tool.calc_reward(iid); tool.release(iid)

Methods are synchronous. The multi-turn driver runs every call on a thread pool with a timeout, so
a blocking tool (a subprocess, an HTTP request) releases the GIL and overlaps the others without an
event loop inside the trainer process; sync code is also what a user writes first. A tool ported
from veRL with `async def` methods still works: `call_tool_method` runs a returned awaitable to
completion on the worker thread (`asyncio.run`).
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import uuid
from typing import Any, NamedTuple

JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")


class ToolResult(NamedTuple):
    """What `execute` returns: the text fed back to the model, a step reward, metrics (numbers)."""

    text: str
    reward: float = 0.0
    metrics: dict = {}


def schema_problem(schema: Any) -> str | None:
    """None when `schema` is an OpenAI function schema we can use, else what is wrong (a field path)."""
    if not isinstance(schema, dict):
        return "tool_schema: expected a mapping"
    if schema.get("type") != "function":
        return f"tool_schema.type: expected 'function', got {schema.get('type')!r}"
    fn = schema.get("function")
    if not isinstance(fn, dict):
        return "tool_schema.function: expected a mapping with name / description / parameters"
    if not isinstance(fn.get("name"), str) or not fn["name"].strip():
        return "tool_schema.function.name: expected a non-empty string"
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        return "tool_schema.function.parameters: expected a JSON schema of type 'object'"
    props = params.get("properties", {})
    if not isinstance(props, dict):
        return "tool_schema.function.parameters.properties: expected a mapping"
    for key, spec in props.items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        kinds = kind if isinstance(kind, list) else [kind]
        if not isinstance(spec, dict) or not all(k in JSON_TYPES for k in kinds):
            return (f"tool_schema.function.parameters.properties.{key}.type: expected one of {JSON_TYPES}, "
                    f"got {kind!r}")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        return f"tool_schema.function.parameters.required: {required!r} must list declared properties"
    return None


def checked_schema(schema: Any) -> dict:
    """`schema` when it is an OpenAI function schema we can use; ValueError saying what is wrong."""
    problem = schema_problem(schema)
    if problem is not None or not isinstance(schema, dict):
        raise ValueError(problem)
    return schema


class BaseTool:
    """Base class of every tool. Subclasses implement `execute`; the rest has working defaults.

    `config`: the `config` mapping of the tool's YAML entry. `tool_schema`: its OpenAI function
    schema (a subclass may set `default_schema` and then be configured without one).
    """

    default_schema: dict | None = None

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None) -> None:
        self.config = dict(config or {})
        schema = copy.deepcopy(tool_schema if tool_schema is not None else self.default_schema)
        try:
            self.tool_schema: dict = checked_schema(schema)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        self._instances: dict[str, dict] = {}

    @property
    def name(self) -> str:
        return self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict:
        return self.tool_schema

    def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Starts the per-trajectory state (kwargs: the row's `tools_kwargs[name].create_kwargs`)."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"kwargs": kwargs, "reward": 0.0}
        return instance_id

    def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResult:
        raise NotImplementedError(f"{type(self).__name__}.execute")

    def calc_reward(self, instance_id: str) -> float:
        """The tool's reward for the whole trajectory (default 0.0)."""
        return 0.0

    def release(self, instance_id: str) -> None:
        self._instances.pop(instance_id, None)


def call_tool_method(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls a tool method; an awaitable result (an `async def` method) is run to completion here."""
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        async def _wait() -> Any:
            return await out
        out = asyncio.run(_wait())
    return out


def as_tool_result(out: Any, tool: str) -> ToolResult:
    """Normalises `execute`'s return: (text, reward, metrics), (text, reward) or text; veRL's
    ToolResponse-like objects with a `.text` attribute are accepted as the text."""
    if isinstance(out, tuple):
        parts = list(out) + [0.0, {}][len(out) - 1:] if 1 <= len(out) <= 3 else None
        if parts is None:
            raise TypeError(f"tool {tool!r}: execute returned a tuple of {len(out)}, expected (text, reward, metrics)")
        text, reward, metrics = parts[:3]
    else:
        text, reward, metrics = out, 0.0, {}
    if not isinstance(text, str):
        text = getattr(text, "text", None)
        if not isinstance(text, str):
            raise TypeError(f"tool {tool!r}: execute returned {type(out).__name__}; expected text first")
    return ToolResult(text, float(reward or 0.0), dict(metrics or {}))


__all__ = ["BaseTool", "JSON_TYPES", "ToolResult", "as_tool_result", "call_tool_method", "checked_schema",
           "schema_problem"]
