"""Shared helpers for the agents tests: a char-level tokenizer with a Qwen-style tool chat template,
a scripted continue_fn, an engine stand-in for the streaming driver and a fake tool."""
from __future__ import annotations

import collections
from typing import Any

import numpy as np
from tiny_models import make_char_tokenizer

from jaxrl_llm.agents import BaseTool, Generated, ToolResult
from jaxrl_llm.sampler import FINISH_REASONS

# Qwen2.5-style hermes template: tools listed in a system turn, consecutive tool messages merged
# into one user turn of <tool_response> blocks.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call tools.\n<tools>\n{% for t in tools %}{{ t['function']['name'] }}"
    "\n{% endfor %}</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FAKE_SCHEMA = {"type": "function", "function": {
    "name": "fake", "description": "echoes x",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}


def hermes_char_tokenizer():
    return make_char_tokenizer(HERMES_TEMPLATE)


class FakeTool(BaseTool):
    """Replies `result-<x>` with step reward x / 10; calc_reward = number of calls of the instance."""

    default_schema = FAKE_SCHEMA

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        self.calls: dict[str, int] = {}
        self.released: list[str] = []

    def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResult:
        self.calls[instance_id] = self.calls.get(instance_id, 0) + 1
        return ToolResult(f"result-{parameters['x']}", parameters["x"] / 10, {"x": parameters["x"]})

    def calc_reward(self, instance_id: str) -> float:
        return float(self.calls.get(instance_id, 0))

    def release(self, instance_id: str) -> None:
        self.released.append(instance_id)
        super().release(instance_id)


class ScriptedContinue:
    """continue_fn replaying preset turns per trajectory (keyed by the prompt's first ids).

    script: prompt-id-tuple -> list of (ids, log_probs, finish_reason); records each call's batch size.
    """

    def __init__(self, script: dict[tuple, list[tuple[list[int], list[float], str]]], prompt_len: dict[tuple, int]):
        self.script, self.prompt_len = script, prompt_len
        self.turn: dict[tuple, int] = {k: 0 for k in script}
        self.batch_sizes: list[int] = []
        self.prefix_lengths: list[list[int]] = []

    def key(self, prefix: list[int]) -> tuple:
        return next(k for k, n in self.prompt_len.items() if tuple(prefix[:n]) == k)

    def __call__(self, prefixes, max_new_tokens, stop_token_ids):
        self.batch_sizes.append(len(prefixes))
        self.prefix_lengths.append([len(p) for p in prefixes])
        out = []
        for prefix, budget in zip(prefixes, max_new_tokens):
            k = self.key(prefix)
            ids, lps, finish = self.script[k][self.turn[k]]
            self.turn[k] += 1
            if len(ids) > budget:
                ids, lps, finish = ids[:budget], lps[:budget], "length"
            out.append(Generated(list(ids), list(lps), finish))
        return out


def serve_via(continue_fn, stop_token_ids=(), on_request=None):
    """An engine stand-in for `run_multi_turn_streaming`: requests are continued one at a time by
    `continue_fn` in arrival order, polling the source after each (as the engine does between
    decode calls). `on_request(request)` is called before each generation."""

    def serve(source):
        queue = collections.deque(source.poll())
        while queue or source.more_coming():
            if not queue:
                source.wait()
                queue.extend(source.poll())
                continue
            req = queue.popleft()
            if on_request is not None:
                on_request(req)
            (out,) = continue_fn([list(req.ids)], [req.max_new_tokens], stop_token_ids)
            source.finished(req, np.asarray(out.token_ids, np.int64), np.asarray(out.log_probs, np.float64),
                            FINISH_REASONS.index(out.finish_reason))
            queue.extend(source.poll())

    return serve
