"""Calculator, hermes tool-call parsing, tool / interaction YAML loading, guess-the-number, truncation."""
from __future__ import annotations

import pytest
from agent_fixtures import FAKE_SCHEMA

from jaxrl_llm.agents import (
    AgentConfigError,
    CalculatorError,
    CalculatorTool,
    GuessNumberEnv,
    ToolCall,
    ToolCallError,
    evaluate,
    load_interactions,
    load_tools,
    parse_tool_calls,
    truncate_text,
)
from jaxrl_llm.agents.calculator import format_number


@pytest.mark.parametrize("expr,want", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("2 ** 10", 1024), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 % 3", 2),
    ("-(3 - 5)", 2), ("sqrt(16) + abs(-2)", 6.0), ("max(1, 4, 2) - min(3, 0)", 4), ("round(2.567, 2)", 2.57),
    ("1.5e3 + 1", 1501.0), ("123456789 * 987654321", 121932631112635269),
])
def test_calculator_values(expr, want):
    assert evaluate(expr) == want


@pytest.mark.parametrize("expr", [
    "__import__('os').system('echo hi')", "open('/etc/passwd').read()", "x + 1", "(1).__class__",
    "[1, 2][0]", "'a' * 3", "lambda: 1", "1 if 1 else 2", "2 ** 10 ** 10", "9 ** 999 * 9 ** 999 * 9 ** 999 * 9 ** 999 "
    "* 9 ** 999", "1 / 0", "sqrt(-1)", "round(1, ndigits=2)", "1 +", "1" * 600, "True + 1",
    "(-8) ** (1 / 3)", "1e400", "10 ** 999 * 10 ** 999 * 10 ** 999 * 10 ** 999 * 10 ** 999",
])
def test_calculator_rejects_unsafe_or_invalid(expr):
    with pytest.raises(CalculatorError):
        evaluate(expr)


def test_calculator_tool_reports_errors_as_text():
    tool = CalculatorTool()
    iid = tool.create()
    assert tool.execute(iid, {"expression": "6 * 7"}) == ("42", 0.0, {"error": 0})
    text, reward, metrics = tool.execute(iid, {"expression": "os.getcwd()"})
    assert text.startswith("Error: unsupported syntax") and metrics == {"error": 1}
    assert format_number(2.0) == "2" and format_number(1 / 3) == "0.333333333333"


SCHEMAS = {"fake": FAKE_SCHEMA["function"],
           "pick": {"name": "pick", "parameters": {"type": "object", "additionalProperties": False, "properties": {
               "mode": {"type": "string", "enum": ["a", "b"]}, "n": {"type": "number"}}, "required": ["mode"]}}}


def test_parse_valid_calls_in_order():
    text = ('thinking <tool_call>\n{"name": "fake", "arguments": {"x": 3}}\n</tool_call> then '
            '<tool_call>{"name": "pick", "arguments": "{\\"mode\\": \\"b\\", \\"n\\": 2.5}"}</tool_call>')
    assert parse_tool_calls(text, SCHEMAS) == [ToolCall("fake", {"x": 3}), ToolCall("pick", {"mode": "b", "n": 2.5})]
    assert parse_tool_calls("no calls here", SCHEMAS) == []
    no_args = {"now": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>', no_args) == [ToolCall("now", {})]


@pytest.mark.parametrize("body,name,fragment", [
    ('{"name": "fake", "arguments": {"x": 1}', None, "not valid JSON"),
    ('[1, 2]', None, "must be a JSON object"),
    ('{"arguments": {"x": 1}}', None, "must be a JSON object"),
    ('{"name": "rm", "arguments": {}}', "rm", "unknown tool 'rm'"),
    ('{"name": "fake", "arguments": [1]}', "fake", "must be a JSON object, got list"),
    ('{"name": "fake", "arguments": "not json"}', "fake", "a string that is not a JSON object"),
    ('{"name": "fake", "arguments": {}}', "fake", "missing required argument 'x'"),
    ('{"name": "fake", "arguments": {"x": "3"}}', "fake", "must be of type integer, got str"),
    ('{"name": "fake", "arguments": {"x": true}}', "fake", "must be of type integer, got bool"),
    ('{"name": "pick", "arguments": {"mode": "c"}}', "pick", "must be one of ['a', 'b']"),
    ('{"name": "pick", "arguments": {"mode": "a", "extra": 1}}', "pick", "unknown argument 'extra'"),
])
def test_malformed_calls_become_tool_errors(body, name, fragment):
    (err,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", SCHEMAS)
    assert isinstance(err, ToolCallError) and err.name == name and fragment in err.message
    assert err.message.startswith("Error:")


def test_tool_call_formats_by_name():
    from jaxrl_llm.agents.tool_parser import get_tool_parser

    assert get_tool_parser("hermes") is parse_tool_calls
    with pytest.raises(ValueError, match=r"tool-call format 'gpt-oss' is not supported; known: \['hermes'\]"):
        get_tool_parser("gpt-oss")


def test_unclosed_call_is_an_error_after_the_valid_ones():
    out = parse_tool_calls('<tool_call>{"name": "fake", "arguments": {"x": 1}}</tool_call><tool_call>{"na',
                           SCHEMAS)
    assert out[0] == ToolCall("fake", {"x": 1}) and "without a closing" in out[1].message


def _write(tmp_path, text, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD_TOOLS = """
tools:
  - class_name: jaxrl_llm.agents.calculator.CalculatorTool
    config: {error_reward: -0.5}
  - class_name: agent_fixtures.FakeTool
    config: {}
    tool_schema:
      type: function
      function:
        name: echo
        description: echoes
        parameters: {type: object, properties: {x: {type: integer}}, required: [x]}
  - class_name: jaxrl_llm.agents.python_tool.PythonTool
    config: {cpu_s: 2, wall_s: 3}
"""


def test_load_tools_builds_configured_instances(tmp_path):
    tools = load_tools(_write(tmp_path, GOOD_TOOLS))
    assert list(tools) == ["calculator", "echo", "python"]
    assert tools["calculator"].config == {"error_reward": -0.5}
    assert tools["echo"].tool_schema["function"]["parameters"]["required"] == ["x"]
    assert tools["python"].limits.cpu_s == 2 and tools["python"].limits.wall_s == 3


@pytest.mark.parametrize("text,fragment", [
    ("tools: [unclosed", "invalid YAML at line 1"),
    ("tool: []", "expected a top-level 'tools:' list"),
    ("tools:\n  - class_name: nowhere.Tool\n", "tools[0].class_name: cannot import module 'nowhere'"),
    ("tools:\n  - class_name: jaxrl_llm.agents.calculator.NoSuchTool\n", "tools[0].class_name: module "
                                                                       "'jaxrl_llm.agents.calculator' has no class"),
    ("tools:\n  - class_name: CalculatorTool\n", "tools[0].class_name: expected a dotted"),
    ("tools:\n  - class_name: collections.OrderedDict\n", "tools[0].class_name: OrderedDict is not a BaseTool"),
    ("tools:\n  - class_name: agent_fixtures.FakeTool\n    tool_schema: {type: function, function: {}}\n",
     "tools[0].tool_schema.function.name: expected a non-empty string"),
    ("tools:\n  - class_name: agent_fixtures.FakeTool\n    tool_schema: {type: func}\n",
     "tools[0].tool_schema.type: expected 'function'"),
    ("tools:\n  - class_name: agent_fixtures.FakeTool\n    tool_schema: {type: function, function: {name: f, "
     "parameters: {type: object, properties: {a: {type: str}}}}}\n",
     "tools[0].tool_schema.function.parameters.properties.a.type"),
    ("tools:\n  - class_name: jaxrl_llm.agents.calculator.CalculatorTool\n  - class_name: "
     "jaxrl_llm.agents.calculator.CalculatorTool\n", "tools[1].tool_schema.function.name: duplicate tool name"),
    ("tools:\n  - class_name: jaxrl_llm.agents.python_tool.PythonTool\n    config: {cpu: 1}\n",
     "tools[0].config: PythonTool rejected it (ValueError: PythonTool config: unknown keys ['cpu']"),
    ("tools:\n  - class_name: jaxrl_llm.agents.calculator.CalculatorTool\n    conf: {}\n",
     "entry 0: unknown fields ['conf']"),
])
def test_bad_tool_yaml_is_one_clear_error(tmp_path, text, fragment):
    path = _write(tmp_path, text)
    with pytest.raises(AgentConfigError) as info:
        load_tools(path)
    assert str(info.value).startswith(str(path)) and fragment in str(info.value), str(info.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(AgentConfigError, match="nope.yaml: cannot read"):
        load_tools(tmp_path / "nope.yaml")


def test_interaction_yaml_and_guess_the_number(tmp_path):
    path = _write(tmp_path, "interaction:\n  - name: guess\n    class_name: jaxrl_llm.agents.environment."
                            "GuessNumberEnv\n    config: {low: 1, high: 10, max_guesses: 3}\n", "inter.yaml")
    factories = load_interactions(path)
    env, other = factories["guess"](), factories["guess"]()
    assert env is not other and env.max_guesses == 3
    env.reset({"extra_info": {"interaction_kwargs": {"target": 7}}})
    assert env.step("I guess 5") == ("higher", 0.0, False)
    assert env.step("maybe") == ("Reply with a single integer between 1 and 10.", 0.0, False)
    assert env.step("9") == (None, 0.0, True)  # third guess: out of guesses
    env.reset({"extra_info": {"interaction_kwargs": {"target": 7}}})
    assert env.step("9") == ("lower", 0.0, False) and env.step("it is 7") == (None, 1.0, True)
    envs = [GuessNumberEnv() for _ in range(3)]
    for e, seed in zip(envs, (3, 3, 5)):
        e.reset({"extra_info": {"interaction_kwargs": {"seed": seed}}})
    assert envs[0].target == envs[1].target != envs[2].target and all(1 <= e.target <= 100 for e in envs)
    bad = _write(tmp_path, "interaction:\n  - name: g\n    class_name: jaxrl_llm.agents.environment."
                           "GuessNumberEnv\n    config: {low: 5, high: 1}\n", "bad.yaml")
    with pytest.raises(AgentConfigError, match=r"bad.yaml: interaction\[0\].config: GuessNumberEnv rejected"):
        load_interactions(bad)


@pytest.mark.parametrize("side,want", [("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"),
                                       ("middle", "ab...(truncated)...ij")])
def test_truncate_sides(side, want):
    assert truncate_text("abcdefghij", 4, side) == want and truncate_text("abc", 4, side) == "abc"
