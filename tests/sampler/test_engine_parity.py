"""The paged engine against transformers `generate` (every family; SmolLM2 slow) and across meshes."""
import dataclasses

import jax
import numpy as np
import pytest
from sampler_fixtures import EOS_ID, MESHES, PAD_ID, PROMPTS, PROMPTS8, hf_greedy
from tiny_models import (
    DEEPSEEK,
    GEMMA,
    GEMMA4,
    MIXED_MOE,
    MOE_FAMILIES,
    QWEN35,
    WINDOW_LAYERS,
    build_hf_model,
    family_case,
)

from jaxrl_llm import sharding
from jaxrl_llm.hf import load_hf_folder
from jaxrl_llm.models import param_logical_axes
from jaxrl_llm.sampler import SamplingParams, left_pad
from jaxrl_llm.sampler.engine import EngineSpec, PagedEngine
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged

NEW = 12


@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES, *MIXED_MOE,
                                  *WINDOW_LAYERS, *GEMMA, *GEMMA4, *DEEPSEEK, *QWEN35])
def test_engine_greedy_matches_transformers(case, tmp_path):
    family, overrides = family_case(case)
    torch_model = build_hf_model(family, tmp_path, **overrides)
    cfg, params = load_hf_folder(tmp_path)
    hf_ids, hf_mask = left_pad(PROMPTS, PAD_ID, length=max(map(len, PROMPTS)))
    expected = hf_greedy(torch_model, hf_ids, hf_mask, NEW, EOS_ID, PAD_ID)
    settings, knobs = SamplingParams(max_new_tokens=NEW, do_sample=False).compile_args(
        cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    # 3 slots for 4 prompts: the last prompt is inserted into a slot freed mid-run; decode over per-layer
    # weights (rollout.unroll_layers: every family's unrolled decode against transformers, while the
    # other engine tests run the default layer scan)
    engine = PagedEngine(cfg, EngineSpec(max_num_seqs=3, page_size=4, num_pages=32, pages_per_slot=8),
                         steps_per_call=4, unroll_layers=True, precompile_drain=False)
    out, _ = engine.run(params, PROMPTS, jax.random.key(0), knobs, settings)
    np.testing.assert_array_equal(out.tokens, expected)
    for row, seq in enumerate(expected):
        hits = np.flatnonzero(seq == EOS_ID)
        assert out.lengths[row] == (hits[0] + 1 if len(hits) else NEW)


@pytest.mark.slow
@pytest.mark.optimized_xla  # real SmolLM2 forwards: running, not compiling
def test_smollm2_engine_greedy_matches_transformers(smollm2_greedy):
    case = smollm2_greedy
    settings, knobs = SamplingParams(max_new_tokens=case.new_tokens, do_sample=False).compile_args(
        [case.eos_id], case.pad_id, vocab_size=case.cfg.vocab_size)
    out, stats = sample_paged(case.params, case.cfg, case.prompts, jax.random.key(0), knobs, settings=settings,
                              opts=EngineOptions(max_num_seqs=2, precompile_drain=False))
    np.testing.assert_array_equal(out.tokens, case.expected)
    assert stats.prefill_calls == 2
    # (rollout.batch_prefill gives the per-prompt prefill's tokens: test_engine_core.py, on the tiny model; with
    # SmolLM2 too until 2026-12-06, a second compile of its 30 layers)


SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=40, n=2, seed=5)


@pytest.fixture(scope="module")
def engine_single_device(llama_tiny):
    cfg, params = llama_tiny
    settings, knobs = SAMPLED.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    out, _ = sample_paged(jax.device_put(params, jax.devices()[0]), cfg, PROMPTS8, jax.random.key(5), knobs,
                          settings=settings, opts=EngineOptions(max_num_seqs=8, precompile_drain=False))
    return out


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_engine_sharded_matches_one_device(llama_tiny, engine_single_device, mesh_name):
    cfg, params = llama_tiny
    mesh = sharding.make_mesh(MESHES[mesh_name])
    placed = sharding.shard_params(params, param_logical_axes(cfg), mesh)
    settings, knobs = SAMPLED.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    out, _ = sample_paged(placed, cfg, PROMPTS8, jax.random.key(5), knobs, settings=settings,
                          opts=EngineOptions(max_num_seqs=8, precompile_drain=False), mesh=mesh)
    ref = engine_single_device
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_allclose(out.log_probs, ref.log_probs, atol=1e-5)


@pytest.mark.parametrize("case", ["gpt_oss", "deepseek_v3", "qwen3_5"])
def test_engine_paths_follow_transformers_and_the_trainers_scoring(case, tmp_path):
    """GPT-OSS's attention sinks and DeepSeek-V3's latent pool (one kv head of latent + rope key, read as keys
    and values; the trainer scores with per-head keys and values) in every path of the paged engine: 2 samples
    a prompt reading their shared pages once (cascade), prompts prefilled 4 tokens at a time (chunked prefill),
    n-gram drafts verified 2 at a time (speculative), through the interpreted Triton kernels (GPT-OSS, and
    DeepSeek's latent of 32 + 16 dims, read in two power-of-2 pieces; the XLA paths: the plain engine parity
    above): greedy tokens are transformers', and
    sampled tokens' log-probs are the trainer's scoring of them. Qwen3.5: each slot's delta-net state set from its
    prompt's (chunked) prefill and carried by decode beside the full-attention layers' pages, no drafts (refused:
    the state cannot roll back a rejected draft yet), prompts of one bucket prefilled in one call."""
    impl = "auto" if case == "qwen3_5" else "pallas"
    from test_sampler_logprobs import rescore

    from jaxrl_llm.sampler.speculative import SpeculativeSpec

    family, overrides = family_case(case)
    torch_model = build_hf_model(family, tmp_path, **overrides)
    cfg, params = load_hf_folder(tmp_path)
    hf_ids, hf_mask = left_pad(PROMPTS, PAD_ID, length=max(map(len, PROMPTS)))
    expected = np.repeat(hf_greedy(torch_model, hf_ids, hf_mask, NEW, EOS_ID, PAD_ID), 2, axis=0)
    hybrid = case == "qwen3_5"
    spec = EngineSpec(max_num_seqs=4, page_size=4, num_pages=48, pages_per_slot=8, attn_impl=impl, cascade=True,
                      speculative=None if hybrid else SpeculativeSpec(num_tokens=2))
    engine = PagedEngine(cfg, spec, steps_per_call=4, prefill_chunk=None if hybrid else 4, batch_prefill=hybrid,
                         precompile_drain=False)
    if hybrid:
        with pytest.raises(ValueError, match="cannot roll back"):
            PagedEngine(cfg, dataclasses.replace(spec, speculative=SpeculativeSpec(num_tokens=2)))
        chunked = PagedEngine(cfg, spec, steps_per_call=4, prefill_chunk=4, precompile_drain=False)
    for sp in (SamplingParams(max_new_tokens=NEW, do_sample=False, n=2), SamplingParams(max_new_tokens=NEW, n=2)):
        settings, knobs = sp.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
        out, stats = engine.run(params, PROMPTS, jax.random.key(0), knobs, settings)
        if not sp.do_sample:
            np.testing.assert_array_equal(out.tokens, expected)
            assert stats.spec_proposed > 0 or hybrid
            if hybrid:
                assert stats.prefill_calls < len(PROMPTS)  # a batched prefill served several prompts
                again, _ = chunked.run(params, PROMPTS, jax.random.key(0), knobs, settings)
                np.testing.assert_array_equal(again.tokens, expected)
        else:
            m = out.response_mask.astype(bool)
            # Qwen3.5: logits of up to 12 through 4 layers; decode's recurrence and the trainer's chunks sum in
            # other orders (its logits differ by <= 2e-5 from the full forward's; 6e-5 seen on these log-probs)
            np.testing.assert_allclose(out.log_probs[m], np.asarray(rescore(params, cfg, out, 1.0))[m],
                                       atol=1.5e-4 if hybrid else 1e-5)
