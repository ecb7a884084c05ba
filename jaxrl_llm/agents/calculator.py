"""Safe arithmetic: `evaluate("2 * (3 + 4) ** 2")` parses with `ast` and walks only whitelisted nodes.

Allowed: int / float literals, + - * / // % **, unary + -, parentheses, and the functions
abs, round, min, max, sqrt, floor, ceil. Nothing else is evaluated (names, attributes,
subscripts, strings, lambdas, comprehensions all raise `CalculatorError`), `eval` is never called,
and sizes are bounded (expression length, exponent magnitude, integer digits) so that no input
can hang the host process.
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Any

from jaxrl_llm.agents.tool_base import BaseTool, ToolResult

MAX_EXPRESSION_CHARS = 512
MAX_EXPONENT = 1000
MAX_INT_DIGITS = 4000
_INT_LIMIT = 10 ** MAX_INT_DIGITS  # built once (a 4000-digit power costs more than an evaluation)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "floor": math.floor,
              "ceil": math.ceil}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value cannot be computed."""


def _check_size(value: float | int) -> float | int:
    if isinstance(value, complex):  # (-8) ** (1 / 3)
        raise CalculatorError("result is not a real number")
    if isinstance(value, int) and abs(value) >= _INT_LIMIT:
        raise CalculatorError(f"result has more than {MAX_INT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    return value


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result is too large") from None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        args = [_eval(a) for a in node.args]
        try:
            return _check_size(_FUNCTIONS[node.func.id](*args))
        except (TypeError, ValueError, OverflowError) as err:
            raise CalculatorError(f"{node.func.id}: {err}") from None
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression (see the module docstring); CalculatorError otherwise."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an expression: {err.msg}") from None
    return _eval(tree)


def format_number(value: float | int) -> str:
    """Integers as integers (also integral floats below 1e15), other floats with 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g") if isinstance(value, float) else str(value)


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression (+ - * / // % **, parentheses, abs, round, min, "
                       "max, sqrt, floor, ceil) and returns its value.",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string", "description": "e.g. 12 * (7 + 5)"}},
                       "required": ["expression"]},
    },
}


class CalculatorTool(BaseTool):
    """The calculator as a tool. Config: `error_reward` (step reward of a failing call, default 0.0)."""

    default_schema = CALCULATOR_SCHEMA

    def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResult:
        try:
            text = format_number(evaluate(parameters.get("expression", "")))
        except CalculatorError as err:
            return ToolResult(f"Error: {err}", float(self.config.get("error_reward", 0.0)), {"error": 1})
        return ToolResult(text, 0.0, {"error": 0})


__all__ = ["CALCULATOR_SCHEMA", "CalculatorError", "CalculatorTool", "evaluate", "format_number"]
