"""The continuous-batching rollout engine: paged KV, one prefill per prompt, host-driven slots.

    spec = EngineSpec(max_num_seqs=64, page_size=16, num_pages=..., pages_per_slot=...)
    engine = PagedEngine(model_cfg, spec, compute_dtype="float32")
    out, stats = engine.run(params, prompt_id_lists, rng, knobs, settings)   # SampleOutput (numpy)
    stats = engine.serve(params, request_source, rng, knobs, settings)    # requests that arrive over time

programs.py: the jitted prefill / insert / generate (JetStream's Engine shape); decode_state.py: the
spec, the pool and the slots they read and write; forward.py: the one-token decode through the paged
pool; scheduler.py: the host driver; requests.py: what it runs (requests, their sources) and reports;
pages.py: page bookkeeping and pool sizing; jaxrl_llm/sampler/paged_attention.py: the attention itself.
"""
from jaxrl_llm.sampler.engine.decode_state import KV_CACHE_DTYPES, DecodeState, EngineSpec, Prefix, init_state
from jaxrl_llm.sampler.engine.pages import PagePool, device_kv_budget, pages_for, plan_num_pages
from jaxrl_llm.sampler.engine.programs import generate, insert, prefill
from jaxrl_llm.sampler.engine.requests import EngineRequest, EngineStats, RequestSource
from jaxrl_llm.sampler.engine.scheduler import PagedEngine

__all__ = ["DecodeState", "EngineRequest", "EngineSpec", "EngineStats", "RequestSource", "KV_CACHE_DTYPES", "PagePool",
           "PagedEngine", "Prefix", "device_kv_budget", "generate", "init_state", "insert", "pages_for",
           "plan_num_pages", "prefill"]
