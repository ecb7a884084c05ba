"""Reward model: a sequence-classification model scoring (prompt, response) pairs.

    rm = RewardModel.load(spec.reward_model, policy_tokenizer)   # reward_model.enable=True
    scores = rm.score(prompt_ids, prompt_mask, response_ids, response_mask,
                      raw_prompts=batch["raw_prompt"])       # float32[B]

The score is label 0 of the `score` head (`jaxrl_llm.models.score_from_hidden`) at the last token
whose attention mask is 1, like transformers' `*ForSequenceClassification` (which finds it by pad
id instead; padding here is defined by the mask, never by token identity).

Same tokenizer as the policy (same vocabulary, special tokens and chat template): the policy's
left-padded prompt and right-padded response are concatenated and scored as they are; this path is
the pure jittable `score_sequences(params, cfg, input_ids, attention_mask)` too.
Different tokenizer (veRL's `input_tokenizer` switch): the response is decoded with the policy
tokenizer (special tokens dropped), appended to the raw chat (`data.return_raw_chat=True`; a
string prompt becomes one user message) as an assistant turn, rendered with the reward model's
chat template, tokenised, right-truncated to `reward_model.max_length` and right-padded to it.
Forward passes run in micro-batches of `micro_batch_size` rows (the last one padded), one compile
per input length.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import DType
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig, forward_hidden, score_from_hidden
from jaxrl_llm.rewards.spec import RewardModelSpec


def score_sequences(params: dict, cfg: ModelConfig, input_ids: jax.Array, attention_mask: jax.Array,
                    *, compute_dtype: DType = jnp.float32) -> jax.Array:
    """float32[B]: label-0 score at each row's last valid token (pure; jit it or call inside jit)."""
    hidden, _ = forward_hidden(params, cfg, input_ids, attention_mask, compute_dtype=compute_dtype)
    return score_from_hidden(params, hidden, attention_mask)[:, 0]


def same_tokenizer(a: Any, b: Any) -> bool:
    """True when `a` and `b` produce the same ids and chat text (no re-tokenisation needed)."""
    if a is b:
        return True
    return (
        a.get_vocab() == b.get_vocab()
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
        and a.all_special_tokens == b.all_special_tokens
    )


class RewardModel:
    """Scores responses with a score-head model (see module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        tokenizer: Tokenizer,
        *,
        input_tokenizer: Tokenizer | None = None,
        max_length: int | None = None,
        micro_batch_size: int | None = None,
        compute_dtype: DType = jnp.float32,
    ):
        if "score" not in params:
            raise ValueError("reward model params have no 'score' head (load it with head='score')")
        self.cfg = cfg
        self.params = params
        self.tokenizer = tokenizer
        self.input_tokenizer = input_tokenizer if input_tokenizer is not None else tokenizer
        self.retokenize = not same_tokenizer(self.input_tokenizer, tokenizer)
        if self.retokenize and not max_length:
            raise ValueError("reward_model.max_length is required when the reward model's tokenizer differs "
                             "from the policy's")
        self.max_length = max_length
        self.micro_batch_size = micro_batch_size
        self._score = jax.jit(functools.partial(score_sequences, cfg=cfg, compute_dtype=compute_dtype))

    @classmethod
    def load(cls, spec: RewardModelSpec, policy_tokenizer: Tokenizer, *, dtype: DType = jnp.float32) -> RewardModel:
        """From `spec.path` (an HF *ForSequenceClassification folder); the policy's tokenizer is
        `policy_tokenizer`, else the one at `spec.input_tokenizer`."""
        from transformers import AutoTokenizer

        from jaxrl_llm.hf import load_hf_folder

        model_cfg, params = load_hf_folder(spec.path, dtype=dtype, head="score")
        tokenizer = AutoTokenizer.from_pretrained(spec.path)
        input_tokenizer = policy_tokenizer
        if input_tokenizer is None and spec.input_tokenizer:
            input_tokenizer = AutoTokenizer.from_pretrained(spec.input_tokenizer)
        micro = spec.micro_batch_size_per_device
        return cls(model_cfg, params, tokenizer, input_tokenizer=input_tokenizer, max_length=spec.max_length,
                   micro_batch_size=micro * jax.local_device_count() if micro else None)

    def score_tokens(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """float32[B] for already-tokenised sequences (any padding side; the mask defines it)."""
        input_ids = np.asarray(input_ids, dtype=np.int32)
        attention_mask = np.asarray(attention_mask, dtype=np.int32)
        b = input_ids.shape[0]
        micro = min(self.micro_batch_size or b, b)
        out = []
        for start in range(0, b, micro):
            ids, mask = input_ids[start:start + micro], attention_mask[start:start + micro]
            n = ids.shape[0]
            if n < micro:  # pad the last micro-batch with empty-but-one-token rows: one compiled shape
                ids = np.concatenate([ids, np.zeros((micro - n, ids.shape[1]), np.int32)])
                mask = np.concatenate([mask, np.ones((micro - n, mask.shape[1]), np.int32)])
            out.append(np.asarray(self._score(self.params, input_ids=ids, attention_mask=mask))[:n])
        return np.concatenate(out).astype(np.float32)

    def encode_chats(self, chats: Sequence[Any], responses: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded [B, max_length] ids and mask of chat + assistant response in the RM's template."""
        length = self.max_length
        if not length:
            raise ValueError("re-templating for the reward model needs reward_model.max_length")
        texts = []
        for chat, response in zip(chats, responses):
            if isinstance(chat, str):
                messages = [{"role": "user", "content": chat}]
            elif chat is not None:
                messages = [dict(m) for m in chat]
            else:
                raise ValueError("re-templating for the reward model needs the raw chat: set data.return_raw_chat=True")
            messages.append({"role": "assistant", "content": response})
            texts.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        ids = np.zeros((len(texts), length), np.int32)
        mask = np.zeros((len(texts), length), np.int32)
        for i, row in enumerate(encoded):
            row = row[:length]
            ids[i, :len(row)] = row
            mask[i, :len(row)] = 1
        return ids, mask

    def score(
        self,
        prompt_ids: np.ndarray,
        prompt_mask: np.ndarray,
        response_ids: np.ndarray,
        response_mask: np.ndarray,
        *,
        raw_prompts: Sequence[Any] | None = None,
    ) -> np.ndarray:
        """float32[B] rewards for policy prompts [B, P] (left-padded) and responses [B, R] (right-padded)."""
        if not self.retokenize:
            ids = np.concatenate([np.asarray(prompt_ids), np.asarray(response_ids)], axis=1)
            mask = np.concatenate([np.asarray(prompt_mask), np.asarray(response_mask)], axis=1)
            return self.score_tokens(ids, mask)
        if raw_prompts is None:
            raise ValueError("re-templating for the reward model needs raw_prompts: set data.return_raw_chat=True")
        response_ids = np.asarray(response_ids)
        response_mask = np.asarray(response_mask).astype(bool)
        responses = self.input_tokenizer.batch_decode(
            [row[m] for row, m in zip(response_ids, response_mask)], skip_special_tokens=True)
        return self.score_tokens(*self.encode_chats(raw_prompts, responses))
