"""The teacher of on-policy distillation (`algorithm.distillation`): a second, frozen language model
that scores the student's own samples.

    check_teacher(spec, student_cfg, tokenizer)  # before any weight loads: one clear error if the
                                                 # vocabularies differ (sizes, a sample of token ids)
    teacher = load_teacher(spec, tokenizer, mesh=..., seed=...)   # placed like the reference
    seen = teacher.rollout_for(rollout, mesh)  # context distillation's rows: the teacher's own
        # prompt, the student's response tokens, aligned (else `rollout` itself)
    signal, metrics = teacher.signal(seen, student_log_probs, batching=..., micro=..., ...)
        # teacher_no_grad over them; distill_signal

The teacher's pass is the reference pass with another model (roles/experience.py
`teacher_no_grad`): packed, in the reference pass's micro-batches, with its params in
`teacher.dtype` and, with `teacher.param_offload`, in pinned host memory between passes. The
teacher only reads response tokens the student generated (multi-turn: the model's tokens; tool
output is masked as in every loss). Formulas: losses/distill.py, docs/algorithms.md.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.batching import StepBatching
from jaxrl_llm.batching.batch_plan import MicroBatching
from jaxrl_llm.batching.ops import run_no_grad_pass
from jaxrl_llm.config import ConfigError
from jaxrl_llm.config.spec import DistillSpec, RefSpec
from jaxrl_llm.data.prompts import encode_prompts
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.losses.distill import reverse_kl_advantages
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.roles.experience import DistillSignal, teacher_no_grad
from jaxrl_llm.roles.reference import is_offloaded, make_reference, reference_on_device
from jaxrl_llm.roles.trained import check_vocabulary, load_model, model_config_of, tokenizer_of
from jaxrl_llm.rollout.batch import Rollout
from jaxrl_llm.sampler import bucket_length, left_pad
from jaxrl_llm.sharding import to_device

Array = jax.Array
KEY = "algorithm.distillation.teacher"


@dataclasses.dataclass(frozen=True)
class TeacherRole:
    """A loaded teacher: its settings, model config, params (stored as the reference's are) and
    tokenizer (the student's vocabulary, possibly another chat template)."""

    spec: DistillSpec
    model_cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer

    def device_params(self) -> dict:
        """The params a teacher pass reads (a transient device copy when they are offloaded)."""
        return reference_on_device(self.params)

    def describe(self) -> str:
        where = "pinned host" if is_offloaded(self.params) else "device"
        prompt = ", its own prompt (context distillation)" if self.spec.own_prompt else ""
        return (f"{self.spec.signal} from {self.spec.teacher.path} ({self.model_cfg.architecture}, "
                f"{self.spec.teacher.param_dtype}, {where} memory){prompt}; coef {self.spec.coef}, "
                f"reward_coef {self.spec.reward_coef}")

    def signal(self, seen: Rollout, student_log_probs: Array, *, batching: StepBatching, micro: MicroBatching,
               temperature: float, logprob_impl: str, mesh: Mesh) -> tuple[DistillSignal, dict[str, Array]]:
        """The teacher's pass over `seen`, the rollout as it reads it (`rollout_for`: its response
        columns and mask are the student's), in `micro`'s micro-batches (the reference pass's), packed
        as the student's passes are, and the signal it gives against the student's sampled-token
        log-probs (`distill_signal`)."""
        how = batching.no_grad(micro, self.spec.teacher, batching.rows_of(seen))
        out = run_no_grad_pass(
            teacher_no_grad, self.device_params(), seen.input_ids, seen.attention_mask, seen.response_mask, how,
            model_cfg=self.model_cfg, temperature=temperature, compute_dtype=self.spec.teacher.param_dtype,
            logprob_impl=logprob_impl, mesh=mesh, topk=self.spec.topk if self.spec.signal == "topk_forward_kl" else 0)
        return distill_signal(out, student_log_probs, seen.response_mask, self.spec)

    def rollout_for(self, rollout: Rollout, mesh: Mesh) -> Rollout:
        """`rollout` as the teacher reads it: the same response tokens after the teacher's prompt
        (its system prompt / template / few-shot turns) when it has one of its own, else `rollout`."""
        if not self.spec.own_prompt:
            return rollout
        chats = rollout.meta.get("raw_prompt")
        if chats is None:
            raise ValueError(f"{KEY}: a teacher prompt of its own needs the row's chat (data.return_raw_chat)")
        prompts = teacher_prompt_ids(list(chats), rollout.group_ids, self.spec, self.tokenizer)
        return with_prompts(rollout, prompts, self.model_cfg.pad_token_id or 0, mesh)


def teacher_messages(chat: Any, spec: DistillSpec) -> list[dict[str, Any]]:
    """The teacher's chat for a row's `chat` (a string is one user message): its system prompt in
    place of the row's, its few-shot turns, then the row's turns with the last user message run
    through `prompt_template`."""
    messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else [dict(m) for m in chat]
    system = []
    if messages and messages[0].get("role") == "system":
        system = [messages.pop(0)]
    if spec.system_prompt is not None:
        system = [{"role": "system", "content": spec.system_prompt}]
    if spec.prompt_template is not None:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise ValueError(f"{KEY}.prompt_template: the row's chat has no user message ({chat!r})")
        last = messages[users[-1]]
        # str.replace, not str.format: the row's text may hold braces of its own
        messages[users[-1]] = {**last, "content": spec.prompt_template.replace("{prompt}", str(last["content"]))}
    fewshot = [{"role": role, "content": content} for role, content in spec.fewshot]
    return [*system, *fewshot, *messages]


def teacher_prompt_ids(chats: Sequence[Any], group_ids: np.ndarray, spec: DistillSpec,
                       tokenizer: Tokenizer) -> list[Any]:
    """Per row, the teacher's prompt token ids (rendered once per prompt group: its n samples share it)."""
    _, first, inverse = np.unique(np.asarray(group_ids), return_index=True, return_inverse=True)
    rendered = encode_prompts([teacher_messages(chats[i], spec) for i in first], tokenizer, apply_chat_template=True)
    return [rendered[g] for g in inverse.reshape(-1)]


def with_prompts(rollout: Rollout, prompts: Sequence[Any], pad_id: int, mesh: Mesh) -> Rollout:
    """`rollout` with its prompts replaced by `prompts` (left-padded to their bucket): the response
    columns, mask and lengths stay as they are, so position P' + j of the new rows is response token
    j of the old ones (`response_scores` reads the last R columns)."""
    response_len = int(rollout.response_mask.shape[1])
    old_prompt = int(rollout.input_ids.shape[1]) - response_len
    ids, mask = left_pad(prompts, pad_id, length=bucket_length(max(len(p) for p in prompts)))
    device = to_device({"ids": ids, "mask": mask}, mesh)
    return dataclasses.replace(
        rollout,
        input_ids=jnp.concatenate([device["ids"], rollout.input_ids[:, old_prompt:]], axis=1),
        attention_mask=jnp.concatenate([device["mask"], rollout.attention_mask[:, old_prompt:]], axis=1),
        prompt_lengths=np.asarray([len(p) for p in prompts], np.int32), routing=None)


def check_teacher(spec: DistillSpec, student_cfg: ModelConfig, student_tokenizer: Tokenizer) -> Tokenizer:
    """The teacher's tokenizer, once its vocabulary is checked against the student's (no weight is
    read: configs and tokenizers only)."""
    try:
        tokenizer = tokenizer_of(spec.teacher, student_tokenizer, key=f"{KEY}.path")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    teacher_cfg = model_config_of(spec.teacher, tokenizer)
    check_vocabulary(student_cfg, student_tokenizer, teacher_cfg, tokenizer, spec.teacher.path, key=f"{KEY}.path",
                     names=("student", "teacher"), purpose="distillation")
    if spec.own_prompt and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"{KEY}: a teacher prompt of its own is rendered with the teacher's chat template, and "
                          f"{spec.teacher.path} has none")
    return tokenizer


def load_teacher(spec: DistillSpec, tokenizer: Tokenizer, *, mesh: Mesh, seed: int) -> TeacherRole:
    """The teacher's params on `mesh` (the policy's shardings for its shapes), in `teacher.dtype`,
    offloaded to pinned host memory with `teacher.param_offload`; `tokenizer` from `check_teacher`."""
    model_cfg, params = load_model(spec.teacher, head="lm", mesh=mesh, tokenizer=tokenizer, seed=seed)
    if spec.param_offload:
        params = make_reference(params, RefSpec(spec.teacher.param_dtype, param_offload=True))
    return TeacherRole(spec, model_cfg, params, tokenizer)


@functools.partial(jax.jit, static_argnames=("signal", "discount"))
def _signal(teacher_log_probs: Array, student_log_probs: Array, mask: Array, *, signal: str, discount: float
            ) -> tuple[Array | None, dict[str, Array]]:
    tokens = jnp.maximum(mask.sum(), 1.0)
    metrics = {"distill/reverse_kl": jnp.sum((student_log_probs - teacher_log_probs) * mask) / tokens,
               "distill/teacher_logprob": jnp.sum(teacher_log_probs * mask) / tokens}
    if signal != "reverse_kl":
        return None, metrics
    return reverse_kl_advantages(student_log_probs, teacher_log_probs, mask, discount), metrics


def distill_signal(teacher_out: dict[str, Array], student_log_probs: Array, response_mask: Array,
                   spec: DistillSpec) -> tuple[DistillSignal, dict[str, Array]]:
    """The step's `DistillSignal` from the teacher pass's outputs and the student's log-probs of its
    sampled tokens, and the device metrics `distill/reverse_kl` (the mean per-token estimate
    log pi - log teacher) and `distill/teacher_logprob`."""
    advantages, metrics = _signal(teacher_out["log_probs"], student_log_probs, response_mask, signal=spec.signal,
                                  discount=spec.discount)
    signal = DistillSignal(advantages, spec.coef, spec.reward_coef, teacher_out.get("topk_ids"),
                           teacher_out.get("topk_log_probs"))
    return signal, metrics
