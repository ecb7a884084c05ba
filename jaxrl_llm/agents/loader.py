"""Tool and interaction config files in veRL's YAML shapes.

Tools (`multi_turn.tool_config_path`):

    tools:
      - class_name: jaxrl_llm.agents.calculator.CalculatorTool
        config: {error_reward: 0.0}
        tool_schema:                 # OpenAI function schema; optional when the class has a default
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, properties: {...}}}

Interactions / environments (`multi_turn.interaction_config_path`):

    interaction:
      - name: guess
        class_name: jaxrl_llm.agents.environment.GuessNumberEnv
        config: {low: 1, high: 100, max_guesses: 7}

Any problem (unreadable file, bad YAML, a missing or wrong field, a class path that does not
import, a class of the wrong kind, a constructor that rejects the config, a duplicate name) is one
`AgentConfigError` naming the file, the entry index and the field.
"""
from __future__ import annotations

import importlib
import pathlib
from collections.abc import Callable
from typing import Any

import yaml

from jaxrl_llm.agents.environment import Environment
from jaxrl_llm.agents.tool_base import BaseTool, checked_schema


class AgentConfigError(ValueError):
    """A tool / interaction config file is wrong (the message names file, index and field)."""


def _read_yaml(path: str | pathlib.Path, top: str) -> tuple[str, list]:
    where = str(path)
    try:
        data = yaml.safe_load(pathlib.Path(path).read_text())
    except OSError as err:
        raise AgentConfigError(f"{where}: cannot read ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise AgentConfigError(f"{where}: invalid YAML{at}: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(data, dict) or not isinstance(data.get(top), list):
        raise AgentConfigError(f"{where}: expected a top-level '{top}:' list")
    return where, data[top]


def import_class(path: Any, where: str) -> type:
    """The class at dotted `path` ('pkg.mod.Class'); AgentConfigError (prefixed by `where`) otherwise."""
    if not isinstance(path, str) or "." not in path:
        raise AgentConfigError(f"{where}: expected a dotted 'package.module.Class' path, got {path!r}")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import failure of a user module is a config error
        raise AgentConfigError(f"{where}: cannot import module {module_name!r} "
                               f"({type(err).__name__}: {err})") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise AgentConfigError(f"{where}: module {module_name!r} has no class {attr!r}")
    return cls


def _entry(where: str, index: int, entry: Any, fields: tuple[str, ...]) -> dict:
    if not isinstance(entry, dict):
        raise AgentConfigError(f"{where}: entry {index}: expected a mapping with {list(fields)}")
    unknown = sorted(set(entry) - set(fields))
    if unknown:
        raise AgentConfigError(f"{where}: entry {index}: unknown fields {unknown}; known: {list(fields)}")
    if entry.get("config") is not None and not isinstance(entry["config"], dict):
        raise AgentConfigError(f"{where}: entry {index}: field 'config': expected a mapping")
    return entry


def load_tools(path: str | pathlib.Path) -> dict[str, BaseTool]:
    """Tool name -> constructed tool, from a veRL tool config YAML (see the module docstring)."""
    where, entries = _read_yaml(path, "tools")
    tools: dict[str, BaseTool] = {}
    for i, raw in enumerate(entries):
        entry = _entry(where, i, raw, ("class_name", "config", "tool_schema"))
        cls = import_class(entry.get("class_name"), f"{where}: tools[{i}].class_name")
        if not issubclass(cls, BaseTool) and not all(callable(getattr(cls, m, None)) for m in
                                                     ("create", "execute", "calc_reward", "release")):
            raise AgentConfigError(f"{where}: tools[{i}].class_name: {cls.__name__} is not a BaseTool "
                                   "(needs create / execute / calc_reward / release)")
        try:
            schema = checked_schema(entry.get("tool_schema", getattr(cls, "default_schema", None)))
        except ValueError as err:
            raise AgentConfigError(f"{where}: tools[{i}].{err}") from None
        try:
            tool = cls(config=entry.get("config") or {}, tool_schema=schema)
        except Exception as err:  # the tool's constructor judges its own config
            raise AgentConfigError(f"{where}: tools[{i}].config: {cls.__name__} rejected it "
                                   f"({type(err).__name__}: {err})") from None
        name = schema["function"]["name"]
        if name in tools:
            raise AgentConfigError(f"{where}: tools[{i}].tool_schema.function.name: duplicate tool name {name!r}")
        tools[name] = tool
    return tools


def load_interactions(path: str | pathlib.Path) -> dict[str, Callable[[], Environment]]:
    """Interaction name -> a factory of fresh environments (one per trajectory), from veRL's
    interaction config YAML. Each class is constructed once here to check its config."""
    where, entries = _read_yaml(path, "interaction")
    factories: dict[str, Callable[[], Environment]] = {}
    for i, raw in enumerate(entries):
        entry = _entry(where, i, raw, ("name", "class_name", "config"))
        cls = import_class(entry.get("class_name"), f"{where}: interaction[{i}].class_name")
        name = entry.get("name") or getattr(cls, "default_name", None)
        if not isinstance(name, str) or not name:
            raise AgentConfigError(f"{where}: interaction[{i}].name: expected a non-empty string")
        if name in factories:
            raise AgentConfigError(f"{where}: interaction[{i}].name: duplicate interaction name {name!r}")
        if not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
            raise AgentConfigError(f"{where}: interaction[{i}].class_name: {cls.__name__} is not an "
                                   "Environment (needs reset / step)")
        config = dict(entry.get("config") or {})
        try:
            cls(config=config)
        except Exception as err:  # the class judges its own config
            raise AgentConfigError(f"{where}: interaction[{i}].config: {cls.__name__} rejected it "
                                   f"({type(err).__name__}: {err})") from None
        factories[name] = lambda cls=cls, config=config: cls(config=dict(config))
    return factories


__all__ = ["AgentConfigError", "import_class", "load_interactions", "load_tools"]
