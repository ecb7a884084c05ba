"""`EngineOptions` (the typed `actor_rollout_ref.rollout` engine keys) -> a sized `PagedEngine`,
and `sample_paged`, the engine behind the static sampler's `SampleOutput`.

Sizing: slots = min(max_num_seqs, power-of-two bucket of the number of requests), so a small
batch does not decode empty slots and a run sees a few slot counts at most; the page table
covers max_model_len = bucket(longest prompt) + max_new_tokens rounded up to a multiple of 256
(a handful of values, so a handful of programs); the pool holds every slot at full length, capped
by `gpu_memory_utilization` of the device's memory where the backend reports it ('auto': what is
left after what is in use and the sampling step's temporaries). Where that cap leaves fewer
full-length sequences than slots (a prompt's pages shared by its samples), the slots shrink to the
power of two below: a slot the pool cannot fill would decode nothing at every step. Engines are
cached per shape, so their compiled programs and KV buffers are reused from call to call.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.hybrid import recurrent_bytes
from jaxrl_llm.models.moe_experts import experts_kernel
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sampler.core import SampleOutput
from jaxrl_llm.sampler.engine import slot_shards
from jaxrl_llm.sampler.engine.decode_state import KV_CACHE_DTYPES, EngineSpec
from jaxrl_llm.sampler.engine.pages import device_kv_budget, pages_for, plan_num_pages
from jaxrl_llm.sampler.engine.requests import EngineStats, RequestImages
from jaxrl_llm.sampler.engine.scheduler import PagedEngine
from jaxrl_llm.sampler.host import bucket_batch, bucket_length
from jaxrl_llm.sampler.paged_attention import IMPLS as ATTENTION_IMPLS
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.speculative import SpeculativeSpec
from jaxrl_llm.shapes import previous_power_of_two

ENGINES = ("auto", "paged", "static")
PAGE_SIZE = 16  # tokens per KV page (vLLM's default block size)
# engine='auto' takes the paged engine from this many new tokens per response on (and for every
# multi-turn rollout); below it the static batch: its long tail is a few steps at most, and it
# compiles two programs instead of the engine's dozen (measured: docs/performance-history.md)
AUTO_PAGED_MIN_NEW_TOKENS = 64
# unroll_layers='auto' decodes over per-layer weights on CPU (and for a MoE model on TPU) from this many new
# tokens per response on: XLA:CPU copies each layer's weights out of the scan's stack every decode step (~30% of
# a SmolLM2 drain step), XLA:TPU a MoE layer's experts (the ragged dot's operands: 30B-A3B on v5p-32, 0.15 of
# a layer's 0.36 GB a step), while the unrolled programs compile longer per slot set (~8 s on CPU; ~55 s for
# 30B-A3B on TPU); at 512 tokens a rollout's ~500 steps save more than the 7 slot sets' extra compile within a
# run's first few steps, and shorter runs (tests, the quickstart's 8 tokens) keep the fast compile
# (docs/performance-history.md)
AUTO_UNROLL_MIN_NEW_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Rollout engine settings (veRL / vLLM names; docs/config.md)."""

    engine: str = "auto"  # 'auto': paged at RL lengths, static for short responses (`resolved`)
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float | str = "auto"
    kv_cache_dtype: str = "auto"
    steps_per_call: int = 16
    attention_impl: str = "auto"  # 'auto' (Pallas on GPU / TPU, the C++ kernel on CPU), 'pallas', 'cpu', 'xla'
    enable_chunked_prefill: bool = True  # longer prompts prefill `prefill_chunk` tokens at a time
    batch_prefill: bool = False  # rollout.batch_prefill: new prompts of one bucket prefill in one call
    precompile_drain: bool = True  # rollout.precompile_drain: every drain set's decode program before round 1
    cascade_attention: bool | str = "auto"  # rollout.cascade_attention: a prompt's n samples read its pages once
    unroll_layers: bool | str = "auto"  # rollout.unroll_layers: decode over per-layer weights (`unroll_for`)
    speculative: SpeculativeSpec | None = None  # rollout.speculative: draft and verify tokens (None: off)

    @property
    def prefill_chunk(self) -> int | None:
        """Tokens per chunked-prefill step: the largest power of two within max_num_batched_tokens (the
        prompt buckets are powers of two, so it divides every longer one); None when disabled."""
        if not self.enable_chunked_prefill:
            return None
        return 1 << (self.max_num_batched_tokens.bit_length() - 1)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"rollout.engine={self.engine!r}: expected one of {ENGINES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"rollout.paged_attention={self.attention_impl!r}: expected one of {ATTENTION_IMPLS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"rollout.kv_cache_dtype={self.kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
        if not isinstance(self.unroll_layers, bool) and self.unroll_layers != "auto":
            raise ValueError(f"rollout.unroll_layers={self.unroll_layers!r}: expected 'auto', True or False")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.steps_per_call < 1:
            raise ValueError("rollout.max_num_seqs / max_num_batched_tokens must be >= 1")
        util = self.gpu_memory_utilization
        if util != "auto" and (isinstance(util, str) or not 0.0 < util <= 1.0):
            raise ValueError(f"rollout.gpu_memory_utilization={util!r}: must be in (0, 1] or 'auto'")

    def resolved(self, max_new_tokens: int, *, multi_turn: bool = False) -> EngineOptions:
        """These options with engine 'auto' replaced by the engine it picks for responses of up to
        `max_new_tokens` tokens: 'paged' from AUTO_PAGED_MIN_NEW_TOKENS on, for multi-turn or speculative
        decoding, else 'static'."""
        if self.engine != "auto":
            return self
        paged = multi_turn or max_new_tokens >= AUTO_PAGED_MIN_NEW_TOKENS or self.speculative is not None
        return dataclasses.replace(self, engine="paged" if paged else "static")

    def unroll_for(self, max_new_tokens: int, cfg: ModelConfig) -> bool:
        """Whether decode runs over per-layer weights for responses of up to `max_new_tokens` tokens of model
        `cfg`: unroll_layers as set, and for 'auto' from AUTO_UNROLL_MIN_NEW_TOKENS on where the programs compile
        for a CPU (XLA:CPU copies a scanned layer's weights), or for a TPU and `cfg` has routed experts (XLA:TPU's
        ragged dot takes a scanned layer's experts as a copy; its dense dots, and a GPU's, read a layer in place).
        Resolved where the engine is built (or planned), so a plan for a TPU slice follows the TPU."""
        if isinstance(self.unroll_layers, bool):
            return self.unroll_layers
        platform = target_platform()
        copies = platform == "cpu" or (platform == "tpu" and cfg.is_moe and experts_kernel(cfg) == "ragged_dot")
        return copies and max_new_tokens >= AUTO_UNROLL_MIN_NEW_TOKENS


_MODEL_LEN_STEP = 256  # max_model_len rounds up to a multiple of this (a few page-table shapes per run)


def _kv_shards(cfg: ModelConfig, mesh: Mesh | None) -> int:
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    return tensor if cfg.cache_kv_heads % tensor == 0 else 1


# gpu_memory_utilization 'auto' leaves room for this many [slots, vocab] fp32 buffers: the sampling step's
# logits, softmax weights and draws (the 0.5B sampler's temporaries on v5e-8 were ~5 of them)
LOGITS_BUFFERS = 6


def engine_spec(cfg: ModelConfig, opts: EngineOptions, *, num_requests: int, max_prompt_len: int,
                max_new_tokens: int, compute_dtype: str, mesh: Mesh | None = None,
                samples_per_prompt: int = 1) -> EngineSpec:
    """The engine for `num_requests` sequences (`samples_per_prompt` of each prompt, sharing its full
    prompt pages) of up to `max_prompt_len` + `max_new_tokens` tokens (see the module doc)."""
    slots = min(opts.max_num_seqs, bucket_batch(num_requests))
    shards = slot_shard_count(mesh, opts.max_num_seqs)
    slots = -(-slots // shards) * shards  # a whole number of slots per shard
    prompt_len = bucket_length(max_prompt_len)
    max_model_len = -(-(prompt_len + max_new_tokens) // _MODEL_LEN_STEP) * _MODEL_LEN_STEP
    pps = pages_for(max_model_len, PAGE_SIZE)
    probe = EngineSpec(max_num_seqs=slots, page_size=PAGE_SIZE, num_pages=2, pages_per_slot=pps,
                       kv_cache_dtype=opts.kv_cache_dtype, attn_impl=opts.attention_impl,
                       cascade=opts.cascade_attention, speculative=opts.speculative)  # sized below
    temporaries = LOGITS_BUFFERS * (slots // shards) * cfg.vocab_size * 4  # per device: its shard's slots
    budget = device_kv_budget(opts.gpu_memory_utilization, temporaries)
    if budget is not None:  # a hybrid model's per-slot delta-net state comes out of the cache's share, as vLLM's
        budget = max(0, budget - slots // shards * recurrent_bytes(cfg))  # state cache does (its shard's slots)
    num_pages = plan_num_pages(cfg, max_num_seqs=slots, pages_per_slot=pps,
                               page_bytes=probe.page_bytes(cfg, compute_dtype), kv_shards=_kv_shards(cfg, mesh),
                               budget_bytes=budget, slot_shards=shards)
    # full-length sequences the pool holds: a prompt's full pages once for its samples (in each shard that runs
    # some), each sample's own rest
    shared, n = prompt_len // PAGE_SIZE, max(1, samples_per_prompt)
    held = shards * (n * (num_pages // shards - 1) // (shared + n * (pps - shared)))
    if held < slots:
        slots = max(shards, previous_power_of_two(max(1, held)) // shards * shards)
    return dataclasses.replace(probe, max_num_seqs=slots, num_pages=num_pages, slot_shards=shards)


def slot_shard_count(mesh: Mesh | None, max_num_seqs: int) -> int:
    """The slot shards of an engine on `mesh` (engine/slot_shards.py): the mesh's batch split where
    rollout.max_num_seqs splits evenly over it (an engine for fewer requests than shards gets one slot per
    shard: an empty slot decodes nothing), else 1 (every device holds every slot)."""
    count = slot_shards.batch_split(mesh)[1]
    return count if max_num_seqs % count == 0 else 1


def describe(cfg: ModelConfig, spec: EngineSpec, compute_dtype: str, mesh: Mesh | None = None) -> str:
    """One summary line: slots, page size, pool pages and KV bytes per device."""
    per_device = spec.shard_pages * spec.page_bytes(cfg, compute_dtype) // _kv_shards(cfg, mesh)
    kv = "int8" if spec.kv_cache_dtype == "int8" else compute_dtype
    slots = spec.max_num_seqs // spec.slot_shards  # a device's
    state = slots * recurrent_bytes(cfg)
    recurrent = f", delta-net state {state / 2**20:.1f} MiB per device ({slots} slots, fp32)" if state else ""
    shards = f" over {spec.slot_shards} slot shards" if spec.slot_shards > 1 else ""
    return (f"rollout engine: paged, {spec.max_num_seqs} slots{shards}, page size {spec.page_size}, "
            f"{spec.num_pages} pages ({kv}), max_model_len {spec.pages_per_slot * spec.page_size}, "
            f"KV {per_device / 2**20:.1f} MiB per device{recurrent}")


_ENGINES: dict[tuple, PagedEngine] = {}


def get_engine(cfg: ModelConfig, spec: EngineSpec, opts: EngineOptions, compute_dtype: str,
               mesh: Mesh | None = None) -> PagedEngine:
    """A cached engine per (model, shape, mesh): its KV buffers and compiled programs are reused.
    `opts.unroll_layers` resolved (`EngineOptions.unroll_for`)."""
    if not isinstance(opts.unroll_layers, bool):
        raise ValueError("get_engine: resolve rollout.unroll_layers='auto' first (EngineOptions.unroll_for)")
    key = (cfg, spec, compute_dtype, opts.steps_per_call, opts.max_num_batched_tokens, opts.prefill_chunk,
           opts.batch_prefill, opts.unroll_layers, opts.precompile_drain, mesh)
    if key not in _ENGINES:
        if len(_ENGINES) >= 4:  # a few shapes per run; drop the oldest pool
            _ENGINES.pop(next(iter(_ENGINES)))
        _ENGINES[key] = PagedEngine(cfg, spec, compute_dtype=compute_dtype, steps_per_call=opts.steps_per_call,
                                    max_num_batched_tokens=opts.max_num_batched_tokens, mesh=mesh,
                                    prefill_chunk=opts.prefill_chunk, batch_prefill=opts.batch_prefill,
                                    unroll_layers=opts.unroll_layers, precompile_drain=opts.precompile_drain)
    return _ENGINES[key]


def release_engines() -> None:
    """Drop every cached engine: its KV pool and its compiled programs go when nothing else holds them."""
    _ENGINES.clear()


def sample_paged(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]], rng: jax.Array,
                 knobs: SampleKnobs, *, settings: SampleSettings, opts: EngineOptions, mesh: Mesh | None = None,
                 prompt_routing: Sequence[np.ndarray | None] | None = None, draft_params: dict | None = None,
                 max_prompt_len: int | None = None, images: Sequence[RequestImages | None] | None = None
                 ) -> tuple[SampleOutput, EngineStats]:
    """`settings.n` samples of each prompt (id lists, unpadded) through the paged engine; numpy
    `SampleOutput` (prompts left-padded to their bucket, rows prompt-major) and the run's stats.
    prompt_routing: per prompt, the experts its prefill replays (`EngineRequest.routing`);
    draft_params: the draft model's (opts.speculative.method 'draft'); max_prompt_len: the run's bound
    on prompt length (data.max_prompt_length), which sizes the engine instead of this batch's longest
    prompt, so every batch of a run reuses one engine and its compiled programs; images: per prompt, a
    vision-language prompt's (`RequestImages`)."""
    longest = prompt_room(max(map(len, prompts)), max_prompt_len)
    engine = sized_engine(cfg, opts, num_requests=len(prompts) * settings.n, max_prompt_len=longest,
                          settings=settings, mesh=mesh, samples_per_prompt=settings.n)
    return engine.run(params, prompts, rng, knobs, settings, prompt_routing=prompt_routing, draft_params=draft_params,
                      images=images)


def prompt_room(longest: int, run_bound: int | None) -> int:
    """The prompt length to size an engine for: the run's bound on prompts (data.max_prompt_length),
    so every call of a run reuses one engine and its compiled programs, or `longest` (this call's
    longest prompt, or resumed prefix) where it is longer or there is no bound."""
    return max(longest, run_bound or 0)


def sized_engine(cfg: ModelConfig, opts: EngineOptions, *, num_requests: int, max_prompt_len: int,
                 settings: SampleSettings, mesh: Mesh | None = None, samples_per_prompt: int = 1) -> PagedEngine:
    """The cached engine for `num_requests` sequences of at most `max_prompt_len` prompt tokens plus
    `settings.max_new_tokens`, `samples_per_prompt` of each prompt (see the module doc for the sizing)."""
    opts = dataclasses.replace(opts, unroll_layers=opts.unroll_for(settings.max_new_tokens, cfg))
    spec = engine_spec(cfg, opts, num_requests=num_requests, max_prompt_len=max_prompt_len,
                       max_new_tokens=settings.max_new_tokens, compute_dtype=settings.compute_dtype, mesh=mesh,
                       samples_per_prompt=samples_per_prompt)
    return get_engine(cfg, spec, opts, settings.compute_dtype, mesh)
