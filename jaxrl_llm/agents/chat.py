"""Chat-template rendering as token deltas: new messages become tokens without re-tokenizing the past.

`ChatRenderer(tokenizer, tools)` wraps a transformers tokenizer (its `chat_template`, rendered with
the OpenAI `tools` schemas when given). `delta_text(messages, new, tail)` is the text that takes a
conversation whose last message is an assistant turn, as the model produced it, to the same
conversation plus `new` messages and the generation prompt:

1. the template's closure of the assistant turn that the model did not produce itself: the text
   the template renders after the assistant content (found with a sentinel content), minus `tail`,
   what the model already emitted after its content (its EOS text, or "" when it stopped at a stop
   token such as the end of a tool call). For ChatML: "<|im_end|>\n" minus "<|im_end|>" = "\n".
2. render(messages + new, add_generation_prompt=True) minus render(messages): the new messages
   and the generation prompt. When a template does not render the longer conversation as an
   extension of the shorter one (e.g. it rewrites earlier assistant turns once a new user turn
   follows, as Qwen3's drops earlier <think> blocks), the same difference is taken on a minimal
   base conversation [user ".", assistant "."] instead (veRL's approach): the model's tokens stay
   as produced, and the sanity check reports where a re-rendering would differ. When even the base
   conversation does not extend, `TemplateError`.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.images import decode_image
from jaxrl_llm.data.vision_prompts import ImageTokens, expand_image_tokens, with_image_tokens
from jaxrl_llm.hf.tokenizer import Tokenizer, render_chat

_SENTINEL = "\u2063JAXRL-ASSISTANT-CONTENT\u2063"


def hermes_tools_prompt(tools: Sequence[dict]) -> str:
    """The tool instructions Qwen2.5's template puts in its system turn (hermes format), for chat
    templates that do not render `tools` themselves (SmolLM2's, plain ChatML)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class TemplateError(ValueError):
    """The chat template cannot render new messages as a suffix of the conversation."""


class ChatRenderer:
    def __init__(self, tokenizer: Tokenizer, tools: Sequence[dict] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None, image_tokens: ImageTokens | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat_template: multi-turn rollouts render turns through it")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.template_kwargs = dict(template_kwargs or {})  # e.g. enable_thinking, for every render
        self.eos_text: str = tokenizer.eos_token or ""
        self.image_tokens = image_tokens  # a vision-language policy's: how a prompt's images become its tokens

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        extra = {"tools": self.tools} if self.tools else {}
        return render_chat(self.tokenizer, list(messages), add_generation_prompt=add_generation_prompt, **extra,
                           **self.template_kwargs)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the `tools` schemas to the model (False without tools)."""
        if not self.tools:
            return False
        probe = [{"role": "user", "content": "."}]
        plain = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        return self.render(probe, add_generation_prompt=True) != plain

    def with_tools_prompt(self, messages: Sequence[dict]) -> list[dict]:
        """`messages` with the hermes tool instructions (`hermes_tools_prompt`) added to the system
        turn (a new one first when there is none) when the template does not render the tools itself."""
        messages = [dict(m) for m in messages]
        if not self.tools or self.renders_tools:
            return messages
        prompt = hermes_tools_prompt(self.tools)
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{prompt}"
            return messages
        return [{"role": "system", "content": prompt}, *messages]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: Sequence[dict], images: Sequence[Any] = ()) -> list[int]:
        """The ids of a conversation's opening (generation prompt added); with `images` (a vision-language
        policy's: its `<image>` placeholders in order), each image as the policy's image tokens, as the
        single-turn records have them (data/vision_prompts.py)."""
        return self.encode_with_images(messages, images, add_generation_prompt=True)

    def encode_with_images(self, messages: Sequence[dict], images: Sequence[Any], *,
                           add_generation_prompt: bool) -> list[int]:
        """The rendered conversation's ids, its images (if any) as the policy's image tokens."""
        if not images:
            return self.encode(self.render(messages, add_generation_prompt=add_generation_prompt))
        tokens = self.image_tokens
        if tokens is None:
            raise ValueError(f"a multi-turn prompt with {len(images)} image(s), but the policy reads text only")
        decoded = [decode_image(image, f"multi-turn prompt: image {i}") for i, image in enumerate(images)]
        marked = with_image_tokens(list(messages), tokens.placeholder)
        assert not isinstance(marked, str)
        ids = self.encode(tokens.after_render(self.render(marked, add_generation_prompt=add_generation_prompt)))
        return expand_image_tokens(np.asarray(ids), [tokens.tokens_for(*image.size) for image in decoded],
                                   tokens.image_token_id, "multi-turn prompt").tolist()

    def split_model_text(self, text: str, finish_reason: str) -> tuple[str, str]:
        """(content for the template, tail the template renders itself): the EOS text when the turn
        ended on EOS, else ""."""
        if finish_reason == "eos" and self.eos_text and text.endswith(self.eos_text):
            return text[: -len(self.eos_text)], self.eos_text
        return text, ""

    def _around_content(self, messages: list[dict]) -> tuple[str, str]:
        """(the text before, the text after) the last (assistant) message's content, as the template renders it."""
        marked = messages[:-1] + [{**messages[-1], "content": _SENTINEL}]
        text = self.render(marked, add_generation_prompt=False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise TemplateError("the chat template does not render the assistant message content")
        return text[:at], text[at + len(_SENTINEL):]

    def opening(self, messages: list[dict]) -> str:
        """The text the template renders before the last (assistant) message's content."""
        return self._around_content(messages)[0]

    def closure(self, messages: list[dict]) -> str:
        """The text the template renders after the last (assistant) message's content."""
        return self._around_content(messages)[1]

    def _suffix(self, messages: list[dict], new: list[dict]) -> str | None:
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + new, add_generation_prompt=True)
        return after[len(before):] if after.startswith(before) else None

    def delta_text(self, messages: Sequence[dict], new: Sequence[dict], tail: str) -> str:
        """Text appended after the model's last turn to add `new` (see the module docstring)."""
        messages, new = list(messages), list(new)
        if not messages or messages[-1].get("role") != "assistant":
            raise TemplateError("delta_text: the conversation must end with an assistant message")
        closure = self.closure(messages)
        glue = closure[len(tail):] if closure.startswith(tail) else closure
        suffix = self._suffix(messages, new)
        if suffix is None:
            suffix = self._suffix([{"role": "user", "content": "."}, {"role": "assistant", "content": "."}], new)
        if suffix is None:
            raise TemplateError(f"the chat template does not render {[m.get('role') for m in new]} messages "
                                "as an extension of the conversation")
        return glue + suffix


__all__ = ["ChatRenderer", "TemplateError", "hermes_tools_prompt"]
