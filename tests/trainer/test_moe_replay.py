"""Routing replay (actor.router_replay = rollout): on a mixture-of-experts policy whose router logits are
near-tied, the trainer's recomputation routes some tokens to other experts than the sampler did and
its log-probs drift from the sampler's; replaying the sampler's recorded routing brings the mismatch
back to the dense model's fp32 floor, and a training step logs moe/routing_agreement."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import near_tied
from tiny_runs import read_metrics, tiny_config

from jaxrl_llm.config import ConfigError
from jaxrl_llm.models import ModelConfig, forward_hidden_moe, init_params
from jaxrl_llm.models.moe import NOT_RECORDED
from jaxrl_llm.roles.forward import response_log_probs
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from jaxrl_llm.sampler.engine import EngineSpec, PagedEngine
from jaxrl_llm.trainer.trainer import Trainer

CFG = ModelConfig.tiny("qwen3_moe")
# a dense MLP layer between two sparse ones: its recorded ids are unused and its replay rows ignored
MIXED_CFG = ModelConfig.tiny("qwen3_moe", num_hidden_layers=3, mlp_only_layers=(1,))
# Gemma 4's MoE block beside every layer's dense MLP (its router: scaled input, per-expert weight scales)
GEMMA4_CFG = ModelConfig.tiny("gemma4_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True)
# DeepSeek-V3's grouped sigmoid routing (a dense first layer, the latent attention absorbed in the sampler)
DEEPSEEK_CFG = ModelConfig.tiny("deepseek_v3")
# Qwen3.5-MoE: experts after gated delta-net and gated attention layers (the sampler carries the delta-net state)
QWEN35_MOE_CFG = ModelConfig.tiny("qwen3_5_moe_text")
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=["sparse", "mixed", "gemma4", "deepseek", "qwen35_moe"])
def rollout(request):
    cfg = {"sparse": CFG, "mixed": MIXED_CFG, "gemma4": GEMMA4_CFG, "deepseek": DEEPSEEK_CFG,
           "qwen35_moe": QWEN35_MOE_CFG}[request.param]
    params = near_tied(init_params(cfg, jax.random.key(0)))
    ids, mask = left_pad(_prompts(), 0)
    settings, knobs = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0).compile_args(
        cfg.eos_token_ids, 0, vocab_size=cfg.vocab_size)
    out = sample(params, cfg, ids, mask, jax.random.key(1), knobs,
                 settings=dataclasses.replace(settings, record_routing=True))
    full = jnp.concatenate([out.prompt_ids, out.tokens], 1)
    attention = jnp.concatenate([out.prompt_mask, out.response_mask], 1)
    return cfg, params, out, full, attention


def test_sampler_records_every_fed_token(rollout):
    cfg, _, out, full, attention = rollout
    routing = np.asarray(out.routing)
    assert routing.shape == (*full.shape, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert routing.dtype == np.int8  # 8 experts: compact ids
    fed = np.asarray(attention).astype(bool).copy()
    fed[np.arange(fed.shape[0]), ids_end := out.prompt_ids.shape[1] + np.asarray(out.lengths) - 1] = False
    assert (routing[fed] >= 0).all() and (routing[fed] < cfg.num_experts).all()
    assert (routing[~np.asarray(attention).astype(bool)] == NOT_RECORDED).all()  # padding: nothing fed
    # the last sampled token is never fed to the model: nothing recorded for it
    assert (routing[np.arange(fed.shape[0]), ids_end] == NOT_RECORDED).all()


def test_replay_brings_the_log_prob_mismatch_back_to_the_floor(rollout):
    cfg, params, out, full, attention = rollout
    recorded = np.asarray(out.routing)
    _, moe = forward_hidden_moe(params, cfg, full, attention, record_routing=True)
    assert moe is not None and moe.routing is not None
    recomputed = np.moveaxis(np.asarray(moe.routing), 0, 2)
    sparse = list(cfg.moe_layer_ids)
    recorded, recomputed = recorded[:, :, sparse], recomputed[:, :, sparse]  # dense layers route nothing
    scored = recorded[..., 0] >= 0
    flips = ~(np.sort(recorded, -1) == np.sort(recomputed, -1)).all(-1) & scored
    assert flips.sum() >= 5, flips.sum()  # the trainer's own routing differs for some tokens
    mask = np.asarray(out.response_mask) > 0
    free = np.asarray(response_log_probs(params, cfg, full, attention, NEW_TOKENS))
    recorded = np.asarray(out.routing)
    replayed = np.asarray(response_log_probs(params, cfg, full, attention, NEW_TOKENS, replay=jnp.asarray(recorded)))
    sampler = np.asarray(out.log_probs)
    assert np.abs(free - sampler)[mask].max() > 1e-3  # routed by itself: the importance ratio drifts
    # replayed: the dense model's fp32 floor, a few ulps of log-probs of -4..-8 (ulp 4.8e-7; 3 ulps on a Sapphire
    # Rapids host, 2026-12-07)
    assert np.abs(replayed - sampler)[mask].max() <= 4e-6
    _, stats = forward_hidden_moe(params, cfg, full, attention, replay=jnp.moveaxis(jnp.asarray(recorded), 2, 0))
    assert stats is not None
    assert float(jnp.sum(stats.stats.agree)) < float(jnp.sum(stats.stats.tokens))

    def loss(router):
        moe_params = {**params["layers"]["moe"], "router": {"kernel": router}}
        p = {**params, "layers": {**params["layers"], "moe": moe_params}}
        return jnp.sum(response_log_probs(p, cfg, full, attention, NEW_TOKENS, replay=jnp.asarray(recorded)))

    assert float(jnp.abs(jax.grad(loss)(params["layers"]["moe"]["router"]["kernel"])).max()) > 0


def _prompts() -> list[list[int]]:
    return [list(np.random.default_rng(i).integers(3, 200, size=6 + i)) for i in range(4)]


def test_paged_engine_records_what_the_static_sampler_records():
    """Greedy on an ordinary router: both engines generate the same tokens and record the same experts
    (prompt and response tokens, the same left-padded layout); on the near-tied router the paged
    engine's recording, replayed, brings the trainer to the sampler's log-probs."""
    settings, knobs = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False).compile_args(
        CFG.eos_token_ids, 0, vocab_size=CFG.vocab_size)
    settings = dataclasses.replace(settings, record_routing=True)
    engine = PagedEngine(CFG, EngineSpec(max_num_seqs=3, page_size=4, num_pages=64, pages_per_slot=16),
                         steps_per_call=4)  # 3 slots for 4 prompts: a slot is reused mid-run
    ordinary = init_params(CFG, jax.random.key(0))
    ids, mask = left_pad(_prompts(), 0)
    static = sample(ordinary, CFG, ids, mask, jax.random.key(1), knobs, settings=settings)
    paged, _ = engine.run(ordinary, _prompts(), jax.random.key(1), knobs, settings)
    np.testing.assert_array_equal(paged.tokens, np.asarray(static.tokens))
    assert paged.routing is not None
    np.testing.assert_array_equal(paged.routing, np.asarray(static.routing))

    tied = near_tied(ordinary)
    out, _ = engine.run(tied, _prompts(), jax.random.key(1), knobs, settings)
    assert out.routing is not None
    full = jnp.concatenate([jnp.asarray(out.prompt_ids), jnp.asarray(out.tokens)], 1)
    attention = jnp.concatenate([jnp.asarray(out.prompt_mask), jnp.asarray(out.response_mask)], 1)
    replayed = response_log_probs(tied, CFG, full, attention, NEW_TOKENS, replay=jnp.asarray(out.routing))
    free = response_log_probs(tied, CFG, full, attention, NEW_TOKENS)
    valid = out.response_mask > 0
    assert np.abs(np.asarray(free) - out.log_probs)[valid].max() > 1e-3
    assert np.abs(np.asarray(replayed) - out.log_probs)[valid].max() <= 1e-6


def test_training_step_with_replay_logs_routing_agreement(tmp_path):
    # on an expert-parallel mesh: 2 of the 8 experts per device (tests/sharding/test_expert_parallel.py)
    cfg = tiny_config(tmp_path, **{"actor_rollout_ref.model.path": "tiny:qwen3_moe",
                                   "actor_rollout_ref.actor.router_replay": "rollout",
                                   "actor_rollout_ref.rollout.engine": "paged",
                                   "trainer.total_training_steps": 1, "mesh.fsdp": 2, "mesh.expert": 4})
    Trainer(cfg).fit()
    row = read_metrics(tmp_path)[0]
    assert 0.0 < row["moe/routing_agreement"] <= 1.0
    assert row["moe/aux_loss"] > 0


def test_replay_on_a_dense_policy_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, **{"actor_rollout_ref.actor.router_replay": "rollout"})
    with pytest.raises(ConfigError, match="router_replay='rollout'.*no mixture-of-experts"):
        Trainer(cfg)
