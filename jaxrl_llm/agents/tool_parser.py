"""Hermes tool calls (Qwen / Hermes chat templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_tool_calls(text, schemas)` returns every call in an assistant message, in order, each
either valid (`ToolCall`) or an error (`ToolCallError` with the message fed back to the model as
the tool's reply). It never raises: malformed JSON, a missing name, an unknown tool, arguments
that are not an object or do not match the tool's JSON schema (missing required, wrong type,
not in enum, unknown key), and an unclosed `<tool_call>` all become errors.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_PY_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
             "array": (list,), "object": (dict,), "null": (type(None),)}


class ToolCall(NamedTuple):
    name: str
    arguments: dict


class ToolCallError(NamedTuple):
    name: str | None  # the tool's name when it could be read
    message: str  # what the model gets back


def _type_ok(value: Any, kind: Any) -> bool:
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        if k is None:
            return True
        if k in ("integer", "number") and isinstance(value, bool):
            continue  # JSON true is not a number
        if isinstance(value, _PY_TYPES.get(k, ())):
            return True
        if k == "integer" and isinstance(value, float) and value.is_integer():
            return True
    return False


def argument_problem(arguments: dict, parameters: Mapping[str, Any]) -> str | None:
    """None when `arguments` satisfy the (object) JSON schema `parameters`, else the first problem."""
    props = parameters.get("properties", {}) or {}
    for key in parameters.get("required", []) or []:
        if key not in arguments:
            return f"missing required argument {key!r}"
    for key, value in arguments.items():
        if key not in props:
            if parameters.get("additionalProperties", True) is False:
                return f"unknown argument {key!r} (expected {sorted(props)})"
            continue
        spec = props[key]
        if not _type_ok(value, spec.get("type")):
            return f"argument {key!r} must be of type {spec.get('type')}, got {type(value).__name__}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return None


def _parse_one(body: str, schemas: Mapping[str, Mapping[str, Any]]) -> ToolCall | ToolCallError:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as err:
        return ToolCallError(None, f"Error: the tool call is not valid JSON ({err.msg} at char {err.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError(None, 'Error: a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = call["name"]
    if name not in schemas:
        return ToolCallError(name, f"Error: unknown tool {name!r}; available: {sorted(schemas)}")
    args = call.get("arguments")
    if args is None:  # {"name": "f"} or "arguments": null: a call without arguments
        args = {}
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCallError(name, f"Error: arguments of {name!r} are a string that is not a JSON object")
    if not isinstance(args, dict):
        return ToolCallError(name, f"Error: arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    problem = argument_problem(args, schemas[name].get("parameters", {}))
    if problem is not None:
        return ToolCallError(name, f"Error: {name}: {problem}")
    return ToolCall(name, args)


def parse_tool_calls(text: str, schemas: Mapping[str, Mapping[str, Any]]) -> list[ToolCall | ToolCallError]:
    """All hermes tool calls in `text` (see the module docstring). `schemas`: tool name -> the
    `function` part of its OpenAI schema (name / description / parameters)."""
    out: list[ToolCall | ToolCallError] = [_parse_one(m.group(1), schemas) for m in _CALL.finditer(text)]
    rest = _CALL.sub("", text)
    if TOOL_CALL_START in rest:
        out.append(ToolCallError(None, f"Error: {TOOL_CALL_START} without a closing {TOOL_CALL_END}"))
    return out


def has_tool_call(text: str) -> bool:
    return TOOL_CALL_START in text


# Tool-call formats by veRL's `multi_turn.format` name -> parser(text, schemas).
TOOL_CALL_FORMATS = {"hermes": parse_tool_calls}


def get_tool_parser(fmt: str):
    """The parser of tool-call format `fmt` (a ValueError naming the known formats otherwise)."""
    if fmt not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool-call format {fmt!r} is not supported; known: {sorted(TOOL_CALL_FORMATS)}")
    return TOOL_CALL_FORMATS[fmt]


__all__ = ["TOOL_CALL_END", "TOOL_CALL_FORMATS", "TOOL_CALL_START", "ToolCall", "ToolCallError", "argument_problem",
           "get_tool_parser", "has_tool_call", "parse_tool_calls"]
