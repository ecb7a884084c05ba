"""Long sequences in the paged engine: chunked prefill equals the one-program prefill (KV, logits and
recorded experts), and a 32k-token response is generated within a KV pool smaller than the worst case
(requests wait for pages), its log-probs equal to the trainer's scoring."""
import time

import jax
import numpy as np
import pytest
from sampler_fixtures import PAD_ID, tiny_params
from test_sampler_logprobs import rescore

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.core import FINISH_LENGTH
from jaxrl_llm.sampler.engine import EngineSpec, PagedEngine, programs
from jaxrl_llm.sampler.engine.setup import EngineOptions


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma2"])
def test_chunked_prefill_equals_one_program(family):
    cfg = ModelConfig.tiny(family)
    params = tiny_params(cfg)
    rng = np.random.default_rng(0)
    ids = np.zeros((64,), np.int32)
    ids[:45] = rng.integers(3, cfg.vocab_size, 45)  # 45 real tokens in a bucket of 64
    record = cfg.is_moe
    whole = programs.prefill(params, cfg, ids, np.int32(45), compute_dtype="float32", record_routing=record)
    chunked = programs.prefill(params, cfg, ids, np.int32(45), compute_dtype="float32", record_routing=record,
                               chunk=16)
    np.testing.assert_allclose(chunked.logits, whole.logits, atol=1e-4, rtol=1e-5)
    for ours, theirs in ((chunked.k, whole.k), (chunked.v, whole.v)):
        np.testing.assert_allclose(np.asarray(ours)[:, :, :45], np.asarray(theirs)[:, :, :45], atol=1e-5, rtol=1e-5)
    if record:
        np.testing.assert_array_equal(np.asarray(chunked.routing)[:45], np.asarray(whole.routing)[:45])
    # the chunk program is the 16-token step: its attention scores are [16, 64], never [64, 64]
    text = jax.jit(programs.prefill.__wrapped__, static_argnames=("cfg", "compute_dtype", "record_routing", "mesh",
                                                                  "chunk")).lower(
        params, cfg, ids, np.int32(45), compute_dtype="float32", chunk=16).as_text()
    heads = f"1x{cfg.num_key_value_heads}x{cfg.num_attention_heads // cfg.num_key_value_heads}"
    assert f"{heads}x64x64xf32" not in text and f"{heads}x16x64xf32" in text


def test_engine_options_chunk_is_the_largest_power_of_two_of_the_token_budget():
    from jaxrl_llm.config import apply_overrides, default_config
    from jaxrl_llm.config.resolve import resolve_rollout_engine

    assert EngineOptions(max_num_batched_tokens=8192).prefill_chunk == 8192
    assert EngineOptions(max_num_batched_tokens=3000).prefill_chunk == 2048
    assert EngineOptions(enable_chunked_prefill=False).prefill_chunk is None
    # veRL's key reaches the engine
    rollout = "actor_rollout_ref.rollout"
    sizes = [f"{rollout}.max_num_batched_tokens=1000", f"{rollout}.response_length=512"]
    cfg = apply_overrides(default_config(), [f"{rollout}.enable_chunked_prefill=False", *sizes])
    assert resolve_rollout_engine(cfg.actor_rollout_ref.rollout).prefill_chunk is None
    cfg = apply_overrides(default_config(), sizes)
    assert resolve_rollout_engine(cfg.actor_rollout_ref.rollout).prefill_chunk == 512


@pytest.mark.optimized_xla  # 65k decode steps of a tiny model: running, not compiling, is its time
def test_a_32k_token_response_waits_for_pages_and_scores_like_the_trainer():
    new = 32768
    cfg = ModelConfig.tiny("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=40000)
    params = tiny_params(cfg, scale=1.0)
    prompts = [[5, 9, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56], [7, 8, 9]]
    page_size = 256
    per_request = -(-(len(prompts[0]) + new) // page_size)
    # room for one request's KV at a time: the second (a 4k-token budget of its own, so the test decodes
    # 37k steps rather than 65k) waits for the first one's pages
    spec = EngineSpec(max_num_seqs=2, page_size=page_size, num_pages=per_request + 2, pages_per_slot=per_request + 1)
    engine = PagedEngine(cfg, spec, steps_per_call=512, max_num_batched_tokens=16, prefill_chunk=16)
    settings, knobs = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True).compile_args(
        cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    start = time.perf_counter()
    out, stats = engine.run(params, prompts, jax.random.key(0), knobs, settings, max_new_tokens=[new, 4096])
    print(f"32k + 4k-token rollout of 2 requests: {time.perf_counter() - start:.1f} s, {stats.decode_steps} decode "
          "steps")
    assert stats.waits_for_pages > 0 and stats.peak_pages_used <= spec.num_pages - 1
    np.testing.assert_array_equal(out.lengths, [new, 4096])
    assert np.all(np.asarray(out.finish_reason) == FINISH_LENGTH)
    # the trainer's scoring of prompt + response (one forward over 32k tokens per row)
    scored = np.asarray(rescore(params, cfg, out, 1.0))
    real = np.asarray(out.response_mask, bool)
    np.testing.assert_allclose(np.asarray(out.log_probs)[real], scored[real], atol=2e-4)
    assert len(set(np.asarray(out.tokens)[0, -1000:].tolist())) > 10  # sampled text, not a stuck loop
