"""Generative reward model (LLM-as-judge): `reward_model.enable=True, reward_model.style=generative`.

    judge = load_judge(path, spec.reward_model.judge, policy_model=..., ...)  # roles/trained.py
    verdicts = judge.judge(chats, responses, ground_truths, rng)    # JudgeVerdicts
    scores, info, metrics = judge.combine(rule_scores, verdicts)    # with the rule scorer's, if any
    scores, info, metrics = judge.grade(chats, responses, meta, rule_scores, rng)  # the two, on the rows
                                                                    # of reward_model.judge.data_sources

For each response the judge's user message is `reward_model.judge.template` with {prompt} (the row's
last user message), {response}, {ground_truth} and {rubric} (the row's extra_info[rubric_key], as
`render_rubric` lists it) filled in, after the judge's system prompt; it is rendered with the judge's
own chat template (with `chat_template_kwargs`) (its vocabulary may differ from the policy's: the
response is passed as text), cut to its last `max_prompt_length` tokens, and generated with the
paged engine (greedy at temperature 0) on the judge's mesh. A parser (rewards/judge_parsers.py)
turns each verdict into a score; a verdict it cannot read scores `default_score` and is counted in
`reward/judge_parse_failures`, never stopping the step.

`combine`: judge (the judge's score), sum (rule_weight * rule + judge_weight * judge), or fallback
(the rule score, and the judge's where the rule scorer has no verdict: it returned None or knows
no scorer for the data source). The rule scorer runs in every mode (a data source without one is
no verdict, not an error), so `reward/judge_rule_agreement` is reported wherever both speak.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.data.prompts import encode_prompts
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.rewards.judge_parsers import ScoreRange, load_parser, read_verdict
from jaxrl_llm.rewards.spec import JudgeSpec
from jaxrl_llm.sampler import SamplingParams, decode_texts, eos_ids_of
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged
from jaxrl_llm.sharding import batch_axis_size, on_own_mesh


@dataclasses.dataclass(frozen=True)
class JudgeVerdicts:
    """The judge's reading of a batch: verdict texts, parsed scores (NaN where unreadable)."""

    texts: list[str]
    parsed: np.ndarray  # float32 [N], NaN where the parser could not read the verdict
    prompt_tokens: int = 0  # what the judge's generation read (its prompts) and wrote: for perf/mfu
    response_tokens: int = 0

    @property
    def failures(self) -> np.ndarray:
        return np.isnan(self.parsed)


def last_user_message(chat: Any) -> str:
    """The text a template's {prompt} stands for: a string prompt itself, else the chat's last user message."""
    if isinstance(chat, str):
        return chat
    users = [m for m in chat if m.get("role") == "user"]
    return str(users[-1]["content"]) if users else ""


def render_rubric(rubric: Any) -> str:
    """A row's rubric (a list of {description, weight}, or its JSON) as Trinity's rubric judge lists it:
    'Rubric i (weight: w): description' per line, from 0; none: 'Rubrics are not provided.'."""
    if isinstance(rubric, str):
        try:
            rubric = json.loads(rubric)
        except ValueError:
            return rubric  # free text: as it is
    if hasattr(rubric, "tolist"):  # a parquet list column
        rubric = rubric.tolist()
    if not rubric:
        return "Rubrics are not provided."
    return "\n".join(f"Rubric {i} (weight: {item['weight']}): {item['description']}" if isinstance(item, dict)
                     else f"Rubric {i}: {item}" for i, item in enumerate(rubric))


def render_user_message(template: str, *, prompt: str, response: str, ground_truth: Any, rubric: Any = None) -> str:
    """`template` with its fields filled by replacement (the texts may hold braces of their own)."""
    values = {"prompt": prompt, "response": response, "ground_truth": "" if ground_truth is None else str(ground_truth),
              "rubric": render_rubric(rubric)}
    out = template
    for name, value in values.items():
        out = out.replace("{" + name + "}", value)
    return out


class Judge:
    """A language model that grades responses (module docstring)."""

    def __init__(self, spec: JudgeSpec, model_cfg: ModelConfig, params: dict, tokenizer: Tokenizer, *, mesh: Mesh,
                 engine: EngineOptions, compute_dtype: str = "float32", path: str = ""):
        self.spec, self.model_cfg, self.params, self.tokenizer = spec, model_cfg, params, tokenizer
        self.mesh, self.compute_dtype, self.path = mesh, compute_dtype, path
        # the rollout's draft model drafts for the policy, not the judge: the judge decodes plainly then
        drafting = engine.speculative is not None and engine.speculative.uses_draft_model
        self.engine = dataclasses.replace(engine, engine="paged", speculative=None if drafting else engine.speculative)
        self.parser = load_parser(spec.parser, ScoreRange(spec.min_score, spec.max_score))
        self.pad_id = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else 0
        self.eos_ids = eos_ids_of(model_cfg, tokenizer)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"reward_model.model.path={path!r}: the judge's tokenizer has no chat template")

    def describe(self) -> str:
        return (f"judge {self.path} ({self.model_cfg.architecture}), parser {self.spec.parser}, "
                f"combine {self.spec.combine}, up to {self.spec.max_new_tokens} verdict tokens")

    def prompts(self, chats: Sequence[Any], responses: Sequence[str], ground_truths: Sequence[Any],
                rubrics: Sequence[Any] | None = None) -> list[Any]:
        """The judge's prompt token ids for each (chat, response, ground truth, rubric), at most
        `max_prompt_length` tokens (the last ones)."""
        system = [] if self.spec.system_prompt is None else [{"role": "system", "content": self.spec.system_prompt}]
        rubrics = [None] * len(chats) if rubrics is None else rubrics
        chats_out = [[*system, {"role": "user", "content": render_user_message(
            self.spec.template, prompt=last_user_message(c), response=r, ground_truth=g, rubric=b)}]
            for c, r, g, b in zip(chats, responses, ground_truths, rubrics)]
        encoded = encode_prompts(chats_out, self.tokenizer, apply_chat_template=True,
                                 template_kwargs=dict(self.spec.chat_template_kwargs))
        return [ids[-self.spec.max_prompt_length:] for ids in encoded]

    @on_own_mesh
    def generate(self, prompts: list[Any], rng: jax.Array) -> tuple[list[str], np.ndarray]:
        """The judge's verdict text for each prompt (paged engine, one sample each), and its length in tokens."""
        sampling = SamplingParams(max_new_tokens=self.spec.max_new_tokens, temperature=self.spec.temperature,
                                  do_sample=self.spec.temperature > 0, n=1, top_p=self.spec.top_p,
                                  top_k=self.spec.top_k)
        settings, knobs = sampling.compile_args(list(self.eos_ids), self.pad_id, vocab_size=self.model_cfg.vocab_size,
                                                compute_dtype=self.compute_dtype)
        count = len(prompts)
        padded = list(prompts) + [prompts[0]] * (-count % batch_axis_size(self.mesh))  # the mesh's batch ways
        out, _ = sample_paged(self.params, self.model_cfg, padded, rng, knobs, settings=settings, opts=self.engine,
                              mesh=self.mesh)
        tokens, lengths = np.asarray(out.tokens)[:count], np.asarray(out.lengths)[:count]
        return decode_texts(self.tokenizer, tokens, lengths), lengths

    def judge(self, chats: Sequence[Any], responses: Sequence[str], ground_truths: Sequence[Any],
              rng: jax.Array, rubrics: Sequence[Any] | None = None) -> JudgeVerdicts:
        """Verdicts and parsed scores of the responses (a user parser receives prompt, response and
        ground_truth beside the verdict)."""
        prompts = self.prompts(chats, responses, ground_truths, rubrics)
        texts, lengths = self.generate(prompts, rng)
        rows = [{"prompt": last_user_message(c), "response": r, "ground_truth": g}
                for c, r, g in zip(chats, responses, ground_truths)]
        parsed = [read_verdict(self.parser, text, row) for text, row in zip(texts, rows)]
        return JudgeVerdicts(texts, np.asarray([np.nan if v is None else v for v in parsed], np.float32),
                             prompt_tokens=sum(len(p) for p in prompts), response_tokens=int(np.sum(lengths)))

    def grade(self, chats: Sequence[Any], responses: Sequence[str], meta: dict[str, np.ndarray],
              rule_scores: np.ndarray, rng: jax.Array) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """`combine` over the rows this judge grades (`data_sources`: by each row's data_source in `meta`);
        the other rows keep their rule score, and have no verdict in the per-row info."""
        graded = self.spec.grades(meta["data_source"])
        rows = np.flatnonzero(graded).tolist()
        scores = np.asarray(rule_scores, np.float32).copy()
        info = {"judge_verdict": np.full(len(scores), "", dtype=object),
                "judge_score": np.full(len(scores), np.nan, np.float32)}
        if not rows:
            return scores, info, {"reward/num_judge_rows": 0.0}
        key = self.spec.rubric_key
        rubrics = None if key is None else [(meta["extra_info"][i] or {}).get(key) for i in rows]
        verdicts = self.judge([chats[i] for i in rows], [responses[i] for i in rows],
                              [meta["ground_truth"][i] for i in rows], rng, rubrics)
        scores[rows], part, metrics = self.combine(scores[rows], verdicts)
        for name, values in part.items():
            info[name][rows] = values
        return scores, info, metrics

    def combine(self, rule_scores: np.ndarray | None, verdicts: JudgeVerdicts
                ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """(final scores float32 [N], per-row info for the rollout dump, metrics). `rule_scores`: the
        rule scorer's, NaN where it has no verdict (None: no rule scorer). Where both give a verdict,
        `reward/judge_rule_agreement` is how often they agree on pass (> 0.5) / fail, in every mode."""
        s = self.spec
        failures = verdicts.failures
        judge_scores = np.where(failures, np.float32(s.default_score), verdicts.parsed).astype(np.float32)
        metrics = {"reward/judge_parse_failures": float(failures.sum()),
                   "reward/judge_score/mean": float(judge_scores.mean()) if len(judge_scores) else 0.0,
                   "reward/num_judge_prompt_tokens": float(verdicts.prompt_tokens),  # summed over merged batches
                   "reward/num_judge_response_tokens": float(verdicts.response_tokens),
                   "reward/num_judge_rows": float(len(verdicts.texts))}
        info = {"judge_verdict": np.asarray(verdicts.texts, dtype=object), "judge_score": judge_scores}
        if rule_scores is None:
            return judge_scores, info, metrics
        rule = np.asarray(rule_scores, np.float32)
        missing = np.isnan(rule)
        both = ~missing & ~failures
        if both.any():  # where both give a verdict: does the judge pass what the rule passes (> 0.5)?
            metrics["reward/judge_rule_agreement"] = float(((judge_scores[both] > 0.5) == (rule[both] > 0.5)).mean())
        if s.combine == "judge":
            scores = judge_scores
        elif s.combine == "sum":
            scores = s.rule_weight * np.where(missing, 0.0, rule) + s.judge_weight * judge_scores
        else:  # fallback: the judge only where the rule scorer gave no verdict
            scores = np.where(missing, judge_scores, rule)
            metrics["reward/judge_fallback_frac"] = float(missing.mean()) if len(missing) else 0.0
        return np.asarray(scores, np.float32), info, metrics
