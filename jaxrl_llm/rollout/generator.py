"""Rollout: prompts -> sampled responses (on the policy's own params) -> scores.

The only host work of a step lives here: decoding response text for the rule-based scorers.
Shapes are bucketed (prompt length by the sampler's buckets, response width to a power of two
>= 8) so a run compiles a handful of programs. Rows are prompt-major: row i*n + j is sample j of
prompt i, and `group_ids[row] = i`.

Multi-host: host-side data (prompts, texts, scores, metadata) is the whole global batch on every
process; device arrays are global jax.Arrays built from each process's own rows
(`sharding.to_device`) and gathered back with `sharding.to_host`. Rule-based rewards are computed
once, on process 0, and broadcast (`score_responses`), so processes can never disagree on a score
(a timed-out call, a random or stateful reward function), nor on DAPO's group filter built on them.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.bookkeeping.nonfinite import sanitize_scores
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.vision.qwen_vl import ImagePrompt
from jaxrl_llm.models.vision.tower_lora import tower_params
from jaxrl_llm.rewards import RewardManager
from jaxrl_llm.rollout.batch import Rollout, response_bucket, rollout_row_images, rows_meta, score_responses
from jaxrl_llm.rollout.multi_turn import generate_multi_turn
from jaxrl_llm.sampler import FINISH_EOS, SamplingParams, bucket_length, decode_texts, eos_ids_of, left_pad, sample
from jaxrl_llm.sampler.core import SampleOutput
from jaxrl_llm.sampler.engine.requests import RequestImages
from jaxrl_llm.sampler.engine.setup import EngineOptions, describe, engine_spec, sample_paged
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sharding import (
    batch_axis_size,
    on_own_mesh,
    to_device,
    to_device_if_rows_split,
    to_host,
)
from jaxrl_llm.sharding.split import transfer

Array = jax.Array
_JUDGE_STREAM = 0x7D6E  # the judge's random stream: fold_in(the rollout's key, this)
ROW_FIELDS = ("tokens", "response_mask", "log_probs", "lengths", "finish_reason", "prompt_ids", "prompt_mask",
               "routing")



@functools.partial(jax.jit, static_argnums=1)
def _first_rows(fields: dict[str, jax.Array], keep: int) -> dict[str, jax.Array]:
    """Every field's first `keep` rows, in one program: sliced one by one, each eager slice of a
    sharded array was its own dispatch (7 a batch, ~10% of a small sharded step on CPU)."""
    return {k: jax.lax.slice_in_dim(v, 0, keep, axis=0) for k, v in fields.items()}


def rows_on_mesh(out: SampleOutput, mesh: Mesh) -> SampleOutput:
    """A host `SampleOutput` (the paged engine's) with its row fields as global arrays on `mesh`."""
    return out._replace(**to_device({f: getattr(out, f) for f in ROW_FIELDS if getattr(out, f) is not None}, mesh))

class RolloutGenerator:
    """Prompts -> sampled, scored responses on given params: training rollouts, ReMax greedy
    baselines and validation all go through `generate`."""

    def __init__(self, *, model_cfg: ModelConfig, mesh: Mesh, tokenizer: Tokenizer,
                 reward_manager: RewardManager | None,
                 reward_model: Any = None, compute_dtype: str = "float32", engine: EngineOptions | None = None,
                 multi_turn: Any = None, max_prompt_length: int | None = None, record_routing: bool = False,
                 judge: Any = None, draft_params: dict | None = None, vision: Any = None):
        """multi_turn: a `trainer.multi_turn.MultiTurn` (every generation is then multi-turn);
        max_prompt_length: the bound its rendered prompts must fit (data.max_prompt_length);
        record_routing: a MoE policy's rollouts carry the sampler's routing (actor.router_replay);
        judge: a generative reward model (roles/judge.py) scoring beside the rule scorer;
        draft_params: the draft model of rollout.speculative.method='draft' (roles/draft.py);
        vision: a vision-language policy's frozen tower (roles/vision.py `VisionTower`): a batch's images go
        through it into the prefill, and the rollout carries them row by row (`Rollout.images`)."""
        self.model_cfg, self.mesh, self.tokenizer = model_cfg, mesh, tokenizer
        self.record_routing = record_routing and model_cfg.is_moe
        self.multi_turn, self.max_prompt_length = multi_turn, max_prompt_length
        self.reward_manager, self.reward_model, self.compute_dtype = reward_manager, reward_model, compute_dtype
        self.judge = judge
        self.draft_params = draft_params
        self.vision = vision
        self.engine = engine if engine is not None else EngineOptions()
        self.last_engine_stats = None  # EngineStats of the last paged generation (None: static)
        # what every rollout (single- or multi-turn) pads with and stops at: the model's EOS ids and
        # the tokenizer's, when it names another one
        self.pad_id = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else 0
        self.eos_ids: tuple[int, ...] = eos_ids_of(model_cfg, tokenizer)

    def on_mesh(self, mesh: Mesh) -> "RolloutGenerator":
        """The same generator sampling on `mesh` (a split mesh's rollout devices)."""
        return RolloutGenerator(model_cfg=self.model_cfg, mesh=mesh, tokenizer=self.tokenizer,
                                reward_manager=self.reward_manager, reward_model=self.reward_model,
                                compute_dtype=self.compute_dtype, engine=self.engine, multi_turn=self.multi_turn,
                                max_prompt_length=self.max_prompt_length, record_routing=self.record_routing,
                                judge=self.judge,
                                draft_params=None if self.draft_params is None else transfer(self.draft_params, mesh),
                                vision=None if self.vision is None else dataclasses.replace(
                                    self.vision, params=transfer(self.vision.params, mesh)))

    def compile_args(self, sampling: SamplingParams) -> tuple[SampleSettings, SampleKnobs]:
        """`sampling`'s static settings and traced knobs for this generator's model: its EOS ids and
        pad id, its compute dtype, its routing recording."""
        settings, knobs = sampling.compile_args(list(self.eos_ids), self.pad_id, vocab_size=self.model_cfg.vocab_size,
                                                compute_dtype=self.compute_dtype)
        return dataclasses.replace(settings, record_routing=self.record_routing), knobs

    def engine_for(self, max_new_tokens: int) -> EngineOptions:
        """The engine options with 'auto' resolved for responses of up to `max_new_tokens` tokens."""
        return self.engine.resolved(max_new_tokens, multi_turn=self.multi_turn is not None)

    def describe_engine(self, num_requests: int, max_prompt_len: int, max_new_tokens: int,
                        samples_per_prompt: int = 1) -> str:
        """The start-of-run summary line of the rollout engine for a batch of that shape."""
        opts = self.engine_for(max_new_tokens)
        if opts.engine == "static":
            return "rollout engine: static (one padded batch)"
        spec = engine_spec(self.model_cfg, opts, num_requests=num_requests, max_prompt_len=max_prompt_len,
                           max_new_tokens=max_new_tokens, compute_dtype=self.compute_dtype, mesh=self.mesh,
                           samples_per_prompt=samples_per_prompt)
        return describe(self.model_cfg, spec, self.compute_dtype, self.mesh)

    @on_own_mesh  # traced on its own mesh, also from the pipeline's thread (the context is per thread)
    def generate(self, batch: dict[str, np.ndarray], params: dict, sampling: SamplingParams, rng: Array) -> Rollout:
        """`sampling.n` responses per prompt of `batch` (the whole global batch), scored."""
        if self.multi_turn is not None:
            return generate_multi_turn(self, batch, params, sampling, rng)
        model_cfg, mesh, pad_id = self.model_cfg, self.mesh, self.pad_id
        raw_prompts = list(batch["raw_prompt_ids"])
        num_prompts = len(raw_prompts)
        # a short (validation) batch is padded to the mesh's batch ways
        raw_prompts += [raw_prompts[0]] * (-num_prompts % batch_axis_size(mesh))
        prompt_width = bucket_length(max(len(p) for p in raw_prompts))
        prompt_ids, prompt_mask = left_pad(raw_prompts, pad_id, length=prompt_width)
        device = to_device({"ids": prompt_ids, "mask": prompt_mask}, mesh)

        settings, knobs = self.compile_args(sampling)
        opts = self.engine_for(sampling.max_new_tokens)
        self.last_engine_stats = None
        images = self._image_prompt(batch, prompt_ids, prompt_mask, len(raw_prompts) - num_prompts, params)
        if opts.engine == "paged":
            requests = None  # each prompt's images: the scheduler prefills them prompt by prompt
            if images is not None:
                requests = RequestImages.of_batch(images, prompt_mask)
            host_out, self.last_engine_stats = sample_paged(
                params, model_cfg, raw_prompts, rng, knobs, settings=settings, opts=opts, mesh=mesh,
                draft_params=self.draft_params, max_prompt_len=self.max_prompt_length, images=requests)
            out = rows_on_mesh(host_out, mesh)
        else:
            out = sample(params, model_cfg, device["ids"], device["mask"], rng, knobs, settings=settings, mesh=mesh,
                         images=None if images is None else images.for_sampler())

        n = sampling.n
        if len(raw_prompts) > num_prompts:  # drop the padding rows again
            keep = num_prompts * n
            out = out._replace(**_first_rows({f: getattr(out, f) for f in ROW_FIELDS if getattr(out, f) is not None},
                                             keep))
        if images is not None:  # the rows' own (padding rows dropped): the small arrays on the host for `row_images`,
            # the features where the tower left them (gathered row by row on the devices)
            positions, slots, deltas = (np.asarray(x) for x in to_host((images.positions, images.slots,
                                                                        images.deltas)))
            tower = None if images.tower_rows is None else jax.tree.map(lambda x: x[:num_prompts], images.tower_rows)
            images = images._replace(positions=positions[:, :num_prompts], slots=slots[:num_prompts],
                                     deltas=deltas[:num_prompts], tower_rows=tower)
        return self.scored(batch, out, n, sampling.max_new_tokens, rng, images=images)

    def _image_prompt(self, batch: dict[str, np.ndarray], prompt_ids: np.ndarray, prompt_mask: np.ndarray,
                      padding_rows: int, params: dict) -> ImagePrompt | None:
        """The batch's images through the policy's tower (None: no tower, or no image in the batch); the padding
        rows repeat row 0 (its images too). A trained tower is the policy's own `params["vision"]`."""
        if self.vision is None or "images" not in batch or not any(len(row) for row in batch["images"]):
            return None
        rows = list(batch["images"])
        return self.vision.prompt(prompt_ids, prompt_mask, rows + [rows[0]] * padding_rows,
                                  params=tower_params(params) if self.vision.trained else None)

    def scored(self, batch: dict[str, np.ndarray], out: Any, n: int, max_new_tokens: int, rng: Array, *,
               images: ImagePrompt | None = None) -> Rollout:
        """The scored `Rollout` of `out` (a SampleOutput: n rows per prompt of `batch`, prompt-major,
        its row fields on the mesh), with the last paged generation's engine counters; `images`: the prompts'
        (positions, slots and deltas on the host), carried row by row (`Rollout.images`)."""
        mesh, tokenizer, reward_model = self.mesh, self.tokenizer, self.reward_model
        raw_prompts = list(batch["raw_prompt_ids"])
        num_prompts = len(raw_prompts)
        lengths = np.asarray(to_host(out.lengths)).astype(np.int32)
        width = response_bucket(int(lengths.max()), max_new_tokens)
        tokens, finish = (np.asarray(a) for a in to_host((out.tokens[:, :width], out.finish_reason)))
        texts = decode_texts(tokenizer, tokens, lengths)
        rows = np.repeat(np.arange(num_prompts), n)
        meta = rows_meta(batch, rows)

        if reward_model is not None:
            raw = meta.get("raw_prompt")
            prompt_ids, prompt_mask = left_pad(raw_prompts, self.pad_id, length=int(out.prompt_ids.shape[1]))
            scores = reward_model.score(np.repeat(prompt_ids, n, 0), np.repeat(prompt_mask, n, 0), tokens,
                                        (np.arange(width)[None] < lengths[:, None]).astype(np.int32),
                                        raw_prompts=None if raw is None else list(raw))
            extra, reward_metrics = {"score": scores.copy()}, {}
        else:
            assert self.reward_manager is not None, "a rollout is scored by a reward model or a reward manager"
            result = score_responses(self.reward_manager, texts, meta, response_lengths=lengths,
                                     finished_with_eos=finish == FINISH_EOS)
            scores, extra, reward_metrics = result.scores, result.reward_extra_info, result.metrics
            if self.judge is not None:  # a generative reward model reads and grades the responses
                chats = meta.get("raw_prompt")
                if chats is None:
                    chats = [tokenizer.decode(raw_prompts[i], skip_special_tokens=True) for i in rows]
                start = time.perf_counter()
                scores, judge_info, judge_metrics = self.judge.grade(
                    list(chats), texts, meta, scores, jax.random.fold_in(rng, _JUDGE_STREAM))
                extra = {**extra, **judge_info, "score": scores.copy()}
                reward_metrics = {**reward_metrics, **judge_metrics, "timing_s/judge": time.perf_counter() - start}
        # a NaN / inf reward from any source is counted and scored 0 (bookkeeping/nonfinite.py)
        scores, num_nonfinite = sanitize_scores(scores)
        reward_metrics = {**reward_metrics, "reward/num_nonfinite": float(num_nonfinite)}
        if self.last_engine_stats is not None:
            reward_metrics.update(self.last_engine_stats.metrics())

        # outcome reward on the last valid response token
        token_scores = np.zeros((len(scores), width), np.float32)
        token_scores[np.arange(len(scores)), np.maximum(lengths - 1, 0)] = scores
        response_mask = out.response_mask[:, :width]
        host_side = to_device_if_rows_split({"token_scores": token_scores}, mesh)
        input_ids = jnp.concatenate([out.prompt_ids, out.tokens[:, :width]], axis=1)
        attention_mask = jnp.concatenate([out.prompt_mask, response_mask], axis=1)
        prompt_texts = [tokenizer.decode(p, skip_special_tokens=False) for p in raw_prompts] if tokenizer else []
        row_imgs = None
        if images is not None:
            prompt_mask = np.asarray(to_host(out.prompt_mask))[::n]
            row_imgs = rollout_row_images(images, prompt_mask, width, mesh, self.vision, n=n)
        return Rollout(
            input_ids=input_ids, attention_mask=attention_mask,
            response_mask=jnp.asarray(response_mask, jnp.float32),
            rollout_log_probs=jnp.asarray(out.log_probs[:, :width]), token_level_scores=host_side["token_scores"],
            group_ids=rows.astype(np.int32), scores=np.asarray(scores, np.float32), response_lengths=lengths,
            prompt_lengths=np.repeat(np.asarray([len(p) for p in raw_prompts], np.int32), n),
            texts=texts, prompt_texts=[prompt_texts[i] for i in rows] if prompt_texts else [],
            meta=meta, reward_extra_info=extra, reward_metrics=reward_metrics,
            routing=None if out.routing is None else jnp.asarray(out.routing[:, :input_ids.shape[1]]),
            images=row_imgs)
