"""Multi-turn tool rollouts on the host: tools, environments, token-in/token-out trajectories, the driver.

  tool_base.py        BaseTool protocol (create / execute / calc_reward / release, OpenAI tool_schema)
  loader.py           veRL's tool config YAML and interaction config YAML -> tools / env factories
  calculator.py       safe arithmetic (ast walk, no eval) and CalculatorTool
  sandbox.py          run_python: CPU / memory / output / wall-clock limits, no network, temp dir
  python_tool.py      PythonTool: the sandbox as a tool
  tool_parser.py      hermes <tool_call> parsing; bad calls become tool error messages
  environment.py      Environment protocol (reset / step) and GuessNumberEnv
  chat.py             chat-template rendering of new messages as a token delta
  trajectory.py       Trajectory (segments, loss mask, rollout log-probs, sanity check), TurnLimits
  job_runner.py       JobRunner: tool calls / environment steps on a bounded thread pool with timeouts
  driver.py           run_multi_turn over a continue_fn (in rounds), the per-turn steps, multi_turn/* metrics
  streaming.py        run_multi_turn_streaming over the continuous-batching engine (no rounds)
  rows.py             dataset rows -> trajectories; finished trajectories -> padded trainer arrays
  sampler_continue.py continue_fn over the static sampler (jaxrl_llm.sampler.sample)

Nothing here reads the config tree; the trainer builds these objects from `multi_turn.*` keys.
"""
from jaxrl_llm.agents.calculator import CalculatorError, CalculatorTool, evaluate
from jaxrl_llm.agents.chat import ChatRenderer, TemplateError
from jaxrl_llm.agents.driver import Generated, MultiTurnResult, multi_turn_metrics, run_multi_turn
from jaxrl_llm.agents.environment import Environment, GuessNumberEnv
from jaxrl_llm.agents.loader import AgentConfigError, load_interactions, load_tools
from jaxrl_llm.agents.python_tool import PythonTool
from jaxrl_llm.agents.rows import TrajectoryBatch, pad_trajectories, trajectories_from_rows
from jaxrl_llm.agents.streaming import TrajectorySource, run_multi_turn_streaming
from jaxrl_llm.agents.tool_base import BaseTool, ToolResult
from jaxrl_llm.agents.tool_parser import ToolCall, ToolCallError, parse_tool_calls
from jaxrl_llm.agents.trajectory import Segment, Trajectory, TurnLimits, truncate_text
from jaxrl_llm.sandbox import SandboxLimits, SandboxResult, run_python, unshare_available

__all__ = [
    "AgentConfigError", "BaseTool", "CalculatorError", "CalculatorTool", "ChatRenderer", "Environment", "Generated",
    "GuessNumberEnv", "MultiTurnResult", "PythonTool", "SandboxLimits", "SandboxResult", "Segment", "TemplateError",
    "ToolCall", "ToolCallError", "ToolResult", "Trajectory", "TrajectoryBatch", "TrajectorySource", "TurnLimits",
    "evaluate", "load_interactions", "load_tools", "multi_turn_metrics", "pad_trajectories", "parse_tool_calls",
    "run_multi_turn", "run_multi_turn_streaming", "run_python", "trajectories_from_rows", "truncate_text",
    "unshare_available",
]
