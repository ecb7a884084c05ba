"""The decoder over per-layer weight arrays (`unstack_layers`, the paged engine's decode layout with
rollout.unroll_layers) computes what the layer scan over the stacked params computes."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.models.decoder import unstack_layers
from jaxrl_llm.models.model import forward_hidden_moe
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.engine import EngineSpec
from jaxrl_llm.sampler.engine.setup import EngineOptions, get_engine, release_engines, sample_paged
from jaxrl_llm.sampler.speculative import SpeculativeSpec

forward = jax.jit(forward_hidden_moe, static_argnums=1, static_argnames=("record_routing",))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3_text"])
def test_unstacked_layers_give_the_scans_hidden_states_and_routing(family):
    cfg = ModelConfig.tiny(family)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    mask = jnp.asarray([[1] * 7, [0, 0] + [1] * 5], jnp.int32)
    flat = unstack_layers(params, cfg)
    assert isinstance(flat["layers"], tuple) and len(flat["layers"]) == cfg.num_hidden_layers
    np.testing.assert_array_equal(np.asarray(flat["layers"][1]["attn"]["q_proj"]["kernel"]),
                                  np.asarray(params["layers"]["attn"]["q_proj"]["kernel"][1]))
    record = cfg.is_moe
    want, want_moe = forward(params, cfg, ids, mask, record_routing=record)
    got, got_moe = forward(flat, cfg, ids, mask, record_routing=record)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if record:
        assert want_moe is not None and got_moe is not None
        np.testing.assert_array_equal(np.asarray(got_moe.routing), np.asarray(want_moe.routing))
        for a, b in zip(jax.tree.leaves(got_moe.stats), jax.tree.leaves(want_moe.stats), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert unstack_layers(flat, cfg) is flat  # already unstacked: unchanged


@pytest.mark.parametrize("speculative", [None, "draft"])
def test_the_engines_unrolled_decode_samples_what_its_scan_samples(speculative):
    """rollout.unroll_layers: the same tokens and log-probs at temperature 1 (n=2: cascade attention),
    with the target as its own unrolled draft too."""
    cfg = ModelConfig.tiny("llama")
    params = init_params(cfg, jax.random.key(0))
    settings, knobs = SamplingParams(max_new_tokens=10, temperature=1.0, n=2, seed=3).compile_args(
        cfg.eos_token_ids, 0, vocab_size=cfg.vocab_size)
    prompts = [[5, 6, 7, 8, 9], [3, 1], [11, 12, 13, 14, 15, 16, 17]]
    spec = None if speculative is None else SpeculativeSpec("draft", num_tokens=3, draft_cfg=cfg)
    outs = []
    for unroll in (False, True):
        opts = EngineOptions(engine="paged", max_num_seqs=4, speculative=spec, unroll_layers=unroll,
                             cascade_attention=True)
        out, _ = sample_paged(params, cfg, prompts, jax.random.key(1), knobs, settings=settings, opts=opts,
                              draft_params=None if spec is None else params)
        outs.append(out)
    scan, unrolled = outs
    np.testing.assert_array_equal(unrolled.tokens, scan.tokens)
    np.testing.assert_array_equal(unrolled.lengths, scan.lengths)
    m = scan.response_mask.astype(bool)
    assert m.sum() > 20
    np.testing.assert_allclose(unrolled.log_probs[m], scan.log_probs[m], rtol=1e-5, atol=1e-5)


def test_the_config_key_reaches_the_engine():
    from jaxrl_llm.config import apply_overrides, default_config
    from jaxrl_llm.config.resolve import resolve_rollout_engine

    rollout = "actor_rollout_ref.rollout"
    paged = [f"{rollout}.engine=paged", f"{rollout}.response_length=128"]
    on = apply_overrides(default_config(), [f"{rollout}.unroll_layers=True", *paged])
    off = apply_overrides(default_config(), [f"{rollout}.unroll_layers=False", *paged])
    opts_on = resolve_rollout_engine(on.actor_rollout_ref.rollout)
    opts_off = resolve_rollout_engine(off.actor_rollout_ref.rollout)
    assert opts_on.unroll_layers and not opts_off.unroll_layers
    cfg = ModelConfig.tiny("llama")
    spec = EngineSpec(max_num_seqs=2, page_size=4, num_pages=8, pages_per_slot=4)
    engine_on, engine_off = get_engine(cfg, spec, opts_on, "float32"), get_engine(cfg, spec, opts_off, "float32")
    assert engine_on.unroll_layers and not engine_off.unroll_layers  # two cached engines, one per layout
    release_engines()


def test_auto_unrolls_long_rollouts_on_cpu_and_moe_rollouts_on_tpu():
    """unroll_layers='auto' (the default): per-layer weights where decode compiles for a CPU, or for a TPU with
    a MoE model, and responses reach 512 tokens; the scan for shorter ones, on GPU and for dense models on TPU;
    True / False as set; anything else is an error naming the key. The config keeps 'auto' until an engine is
    built (or planned) for its platform; an unresolved 'auto' never reaches an engine."""
    from jaxrl_llm.config import apply_overrides, default_config
    from jaxrl_llm.config.resolve import resolve_rollout_engine
    from jaxrl_llm.platform.target import CompileTarget, compiling_for

    dense = ModelConfig.tiny("llama")

    def unroll(platform: str, tokens: int, value: str | None = None, cfg: ModelConfig = dense) -> bool:
        keys = [f"actor_rollout_ref.rollout.response_length={tokens}"]
        keys += [] if value is None else [f"actor_rollout_ref.rollout.unroll_layers={value}"]
        opts = resolve_rollout_engine(apply_overrides(default_config(), keys).actor_rollout_ref.rollout)
        assert opts.unroll_layers == ("auto" if value is None else value == "True")
        with compiling_for(CompileTarget(platform, None)):
            return opts.unroll_for(tokens, cfg)

    assert unroll("cpu", 512) is True and unroll("cpu", 2048) is True
    assert unroll("cpu", 511) is False and unroll("cpu", 128) is False
    assert unroll("gpu", 512) is False and unroll("tpu", 4096) is False
    assert unroll("cpu", 1024, "False") is False and unroll("tpu", 128, "True") is True
    # a TPU copies a scanned MoE layer's experts for its ragged dot (not the mode's blocked kernel, nor on GPU)
    moe = ModelConfig.tiny("qwen3_moe")
    assert unroll("tpu", 512, cfg=moe) is True and unroll("tpu", 511, cfg=moe) is False
    assert unroll("gpu", 4096, cfg=moe) is False
    assert unroll("tpu", 4096, cfg=dataclasses.replace(moe, batch_invariant=True)) is False
    assert unroll("tpu", 4096, cfg=dataclasses.replace(moe, moe_kernel="blocked")) is False
    with pytest.raises(ValueError, match="rollout.unroll_layers='always'"):
        EngineOptions(unroll_layers="always")
    cfg = ModelConfig.tiny("llama")
    spec = EngineSpec(max_num_seqs=2, page_size=4, num_pages=8, pages_per_slot=4)
    with pytest.raises(ValueError, match="unroll_layers='auto'"):
        get_engine(cfg, spec, EngineOptions(), "float32")


def test_a_mixed_layer_moe_model_stays_stacked():
    mixed = ModelConfig.tiny("qwen2_moe", mlp_only_layers=(0,))
    assert mixed.mixed_layers
    mixed_params = init_params(mixed, jax.random.key(0))
    assert unstack_layers(mixed_params, mixed) is mixed_params  # its MLPs are stacked apart: no copy
