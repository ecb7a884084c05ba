"""Mixture-of-experts layers (models/moe.py): the dropless grouped matmul against the all-experts
reference (values, gradients, FLOPs), routing that really spreads tokens, HF's load-balancing loss,
routing replay. Logits / greedy / export parity with transformers run in tests/hf and tests/sampler."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import build_hf_model, family_case, left_padded_batch

from jaxrl_llm.hf import load_hf_folder
from jaxrl_llm.models import ModelConfig, forward_hidden_moe, init_params
from jaxrl_llm.models.moe import expert_load_max, load_balancing_loss, route, router_z_loss
from jaxrl_llm.models.moe_experts import (
    dense_expert_ffn,
    expert_ffn,
    expert_layout,
    held_expert_ffn,
    num_blocks,
    own_capacity,
    token_chunks,
)


def _random_experts(rng, experts: int, hidden: int, width: int, bias: bool = False) -> dict:
    keys = jax.random.split(rng, 6)
    out = {"gate_proj": {"kernel": jax.random.normal(keys[0], (experts, hidden, width)) * 0.2},
           "up_proj": {"kernel": jax.random.normal(keys[1], (experts, hidden, width)) * 0.2},
           "down_proj": {"kernel": jax.random.normal(keys[2], (experts, width, hidden)) * 0.2}}
    if bias:  # GPT-OSS
        for key, (name, size) in zip(keys[3:], (("gate_proj", width), ("up_proj", width), ("down_proj", hidden))):
            out[name]["bias"] = jax.random.normal(key, (experts, size)) * 0.5
    return out


def _case(tokens: int = 37, experts: int = 8, top_k: int = 2, block_rows: int = 8, hidden: int = 16, width: int = 24,
          family: str = "qwen3_moe"):
    extra = {"intermediate_size": width, "swiglu_limit": 0.5} if family == "gpt_oss" else {}
    cfg = ModelConfig.tiny(family, num_experts=experts, num_experts_per_tok=top_k, moe_block_rows=block_rows,
                           hidden_size=hidden, moe_intermediate_size=width, **extra)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (tokens, hidden))
    router = jax.random.normal(k2, (hidden, experts))
    return cfg, x, router, _random_experts(k3, experts, hidden, width, bias=cfg.expert_bias)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("kernel", ["blocked", "ragged_dot", "gather"])
def test_grouped_matmul_equals_all_experts_reference_values_and_gradients(kernel, family):
    """gpt_oss: the experts' biases, the clamped SwiGLU (a clamp the values reach) and the top-k softmax router."""
    cfg, x, router, experts = _case(family=family)

    def loss(fn, x, router, experts):
        routing = route(cfg, router, x)
        out = fn(experts, x, routing)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    ours = lambda e, x, r: expert_ffn(e, x, r, cfg, dtype=jnp.float32, kernel=kernel)  # noqa: E731
    ref = lambda e, x, r: dense_expert_ffn(e, x, r, dtype=jnp.float32, cfg=cfg)  # noqa: E731
    routing = route(cfg, router, x)
    assert len(np.unique(np.asarray(routing.ids))) == cfg.num_experts  # every expert gets tokens
    np.testing.assert_allclose(ours(experts, x, routing), ref(experts, x, routing), atol=1e-5, rtol=1e-5)
    got = jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2))(x, router, experts)
    want = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(x, router, experts)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(got[1]).max()) > 0  # the router learns through the mixing weights


@pytest.mark.parametrize("kernel", ["blocked", "ragged_dot"])
def test_chunked_experts_give_the_one_pass_numbers_and_gradients(kernel):
    """More assignments than moe_chunk_rows run in rematerialised token chunks: the same values and
    gradients as one pass (36 tokens x top-2 in chunks of 24 assignments: 3 chunks of 12 tokens)."""
    import dataclasses

    cfg, x, router, experts = _case(tokens=36)
    chunked = dataclasses.replace(cfg, moe_chunk_rows=24)
    assert token_chunks(36, 2, 24) == 3 and token_chunks(36, 2, 65536) == 1 and token_chunks(37, 2, 24) == 37

    def loss(c, x, router, experts):
        out = expert_ffn(experts, x, route(c, router, x), c, dtype=jnp.float32, kernel=kernel)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

    (_, want), want_grads = jax.value_and_grad(lambda *a: loss(cfg, *a), argnums=(0, 1, 2), has_aux=True)(
        x, router, experts)
    (_, got), got_grads = jax.value_and_grad(lambda *a: loss(chunked, *a), argnums=(0, 1, 2), has_aux=True)(
        x, router, experts)
    loops = [jax.jit(lambda *a, c=c: loss(c, *a)[1]).lower(x, router, experts).as_text().count("stablehlo.while")
             for c in (cfg, chunked)]
    assert loops[1] > loops[0], loops  # the chunks are a loop around the one-pass layout
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["blocked", "ragged_dot"])
def test_an_expert_parallel_device_lays_out_only_its_own_assignments(kernel, monkeypatch):
    """Under expert parallelism a device holds E_held of the experts and sees the others' ids as E_held
    (models/expert_parallel.py); it lays out its own assignments only, `own_capacity` of them a trip
    (models/moe_experts.py `_own_expert_ffn`). Its output and gradients are those of its experts' share of the
    all-experts reference, with the routing spread (the first of two trips runs), every assignment its own
    (both run: nothing dropped) and none its own."""
    from jaxrl_llm.models import moe_experts

    trips = []
    own_ffn = moe_experts._own_expert_ffn
    monkeypatch.setattr(moe_experts, "_own_expert_ffn", lambda *a, **k: trips.append(k["capacity"]) or own_ffn(*a, **k))
    cfg, x, router, experts = _case(tokens=48, block_rows=4)
    held = 2  # of 8 experts, top-2: 96 assignments, 48 a trip
    routing = route(cfg, router, x)
    everything_mine = jnp.stack([jnp.arange(48) % 2, 1 - jnp.arange(48) % 2], axis=1)
    none_mine = jnp.full_like(routing.ids, 5)
    assert 0 < int((routing.ids < held).sum()) <= 48  # spread: one trip holds them
    for ids in (routing.ids, everything_mine, none_mine):
        own = ids < held

        def ours(experts, x, weights, ids=ids, own=own):
            device_ids = jnp.where(own, ids, held)  # another device's expert: E_held
            return held_expert_ffn(jax.tree.map(lambda w: w[:held], experts), x, device_ids, weights, cfg,
                                   dtype=jnp.float32, kernel=kernel)

        def reference(experts, x, weights, ids=ids, own=own):
            share = routing._replace(ids=ids, weights=jnp.where(own, weights, 0.0))
            return dense_expert_ffn(experts, x, share, dtype=jnp.float32, cfg=cfg)

        np.testing.assert_allclose(ours(experts, x, routing.weights), reference(experts, x, routing.weights),
                                   atol=1e-5, rtol=1e-5)
        probe = lambda fn: lambda *a: jnp.sum(fn(*a) * jnp.cos(jnp.arange(48 * 16).reshape(48, 16)))  # noqa: E731
        got = jax.grad(probe(ours), argnums=(0, 1, 2))(experts, x, routing.weights)
        want = jax.grad(probe(reference), argnums=(0, 1, 2))(experts, x, routing.weights)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    assert trips and set(trips) == {own_capacity(96, held, cfg.num_experts, cfg.moe_block_rows)} == {48}


def test_layout_is_dropless_sorted_and_bounded():
    cfg, x, router, _ = _case(tokens=50, block_rows=4)
    ids = route(cfg, router, x).ids
    layout = expert_layout(ids, cfg.num_experts, cfg.moe_block_rows)
    dest, src = np.asarray(layout.dest), np.asarray(layout.src_token)
    assert len(np.unique(dest)) == dest.size  # every assignment has its own row: nothing dropped
    np.testing.assert_array_equal(src[dest], np.repeat(np.arange(50), 2).reshape(50, 2))
    block_of_row = dest // cfg.moe_block_rows
    np.testing.assert_array_equal(np.asarray(layout.block_expert)[block_of_row], np.asarray(ids))
    assert layout.block_expert.shape[0] == num_blocks(50, 2, cfg.num_experts, 4) == 50 * 2 // 4 + 8


def _ffn_flops(tokens: int, experts: int, k: int, hidden: int, width: int, block: int) -> tuple[float, float]:
    """(dropless blocked, all-experts dense) FLOPs from XLA's cost analysis of one MoE FFN."""
    cfg, x, router, weights = _case(tokens, experts, k, block, hidden, width)
    routing = route(cfg, router, x)

    def flops(fn) -> float:
        analysis = jax.jit(fn).lower(weights, x, routing).compile().cost_analysis()
        return float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])

    # fully unrolled: XLA's cost analysis counts a loop body once
    return (flops(lambda e, x, r: expert_ffn(e, x, r, cfg, dtype=jnp.float32, kernel="blocked", unroll=True)),
            flops(lambda e, x, r: dense_expert_ffn(e, x, r, dtype=jnp.float32, cfg=cfg)))


def test_grouped_matmul_flops_grow_with_tokens_times_k_not_experts():
    tokens, k, hidden, width, block = 512, 2, 32, 64, 32
    blocked, dense = _ffn_flops(tokens, 16, k, hidden, width, block)
    useful = 3 * 2 * tokens * k * hidden * width  # three matmuls per (token, expert) assignment
    padded_rows = num_blocks(tokens, k, 16, block) * block
    assert dense >= 3 * 2 * tokens * 16 * hidden * width
    # the matmuls over the padded rows, plus elementwise work (SiLU, gathers) on those rows
    assert useful <= blocked <= 2 * 3 * 2 * padded_rows * hidden * width
    assert blocked < dense / 3  # 2 of 16 experts per token: ~1/6 of the dense FLOPs plus padding
    # twice the experts: the dense reference doubles, the dropless FFN grows only with the padding bound
    # (one partial block per expert: 48 -> 64 blocks here)
    blocked_32, dense_32 = _ffn_flops(tokens, 32, k, hidden, width, block)
    padding_growth = num_blocks(tokens, k, 32, block) / num_blocks(tokens, k, 16, block)
    assert dense_32 / dense > 1.9
    assert blocked_32 / blocked < 1.2 * padding_growth < 1.9


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_mixed", "gpt_oss"])
def test_aux_loss_equals_transformers_and_routing_spreads(case, tmp_path):
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    family, overrides = family_case(case)
    model = build_hf_model(family, tmp_path, output_router_logits=True, **overrides)
    cfg, params = load_hf_folder(tmp_path)
    ids, mask = left_padded_batch(np.random.default_rng(0), cfg.vocab_size, lengths=(12, 9, 5))
    _, moe = forward_hidden_moe(params, cfg, jnp.asarray(ids), jnp.asarray(mask))
    assert moe is not None
    sparse = list(cfg.moe_layer_ids)  # a dense layer's stats count no tokens (HF pools the sparse layers only)
    np.testing.assert_array_equal(np.asarray(moe.stats.tokens) > 0, np.isin(np.arange(cfg.num_hidden_layers), sparse))
    per_layer_experts = (np.asarray(moe.stats.counts)[sparse] > 0).sum(axis=-1)
    assert (per_layer_experts >= 6).all(), per_layer_experts  # tokens really go to different experts
    np.testing.assert_allclose(np.asarray(moe.stats.counts)[sparse].sum(-1), mask.sum() * 2)  # k per valid token
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    expected = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok,
                                        torch.tensor(mask))
    np.testing.assert_allclose(float(load_balancing_loss(moe.stats)), float(expected), rtol=1e-5)
    # z-loss: the mean over layers and valid tokens of logsumexp(router logits)^2
    lse = np.stack([torch.logsumexp(r, -1).numpy() for r in out.router_logits])  # [L, B*T]
    assert len(out.router_logits) == len(sparse)
    want_z = (lse ** 2 * mask.reshape(-1)).sum() / (mask.sum() * len(sparse))
    np.testing.assert_allclose(float(router_z_loss(moe.stats)), want_z, rtol=1e-5)
    load = float(expert_load_max(moe.stats))
    assert 1.0 <= load <= cfg.num_experts


def test_replay_uses_the_given_experts_and_keeps_router_gradients():
    cfg = ModelConfig.tiny("qwen3_moe")
    params = init_params(cfg, jax.random.key(1))
    ids = jax.random.randint(jax.random.key(2), (2, 7), 3, cfg.vocab_size)
    mask = jnp.ones_like(ids)
    hidden, moe = forward_hidden_moe(params, cfg, ids, mask, record_routing=True)
    assert moe is not None and moe.routing is not None
    assert moe.routing.shape == (cfg.num_hidden_layers, 2, 7, cfg.num_experts_per_tok)
    again, replayed = forward_hidden_moe(params, cfg, ids, mask, replay=moe.routing)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(hidden))  # own routing replayed: same numbers
    assert float(jnp.sum(replayed.stats.agree)) == float(jnp.sum(replayed.stats.tokens))
    other = (moe.routing + 1) % cfg.num_experts  # every token to other experts
    changed, stats = forward_hidden_moe(params, cfg, ids, mask, replay=other)
    assert float(jnp.abs(changed - hidden).max()) > 1e-3
    assert float(jnp.sum(stats.stats.agree)) < float(jnp.sum(stats.stats.tokens))

    def loss(router):
        layers = {**params["layers"], "moe": {**params["layers"]["moe"], "router": {"kernel": router}}}
        h, _ = forward_hidden_moe({**params, "layers": layers}, cfg, ids, mask, replay=other)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    assert float(jnp.abs(jax.grad(loss)(params["layers"]["moe"]["router"]["kernel"])).max()) > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_config_json_round_trip_and_refused_layouts(family):
    cfg = ModelConfig.tiny(family)
    hf = cfg.to_hf_config()
    assert ModelConfig.from_hf_config(hf) == cfg
    assert cfg.moe_layer_ids == (0, 1) and not cfg.mixed_layers
    if family != "mixtral":
        # HF's rule: layer i is sparse iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
        hf4 = {**hf, "num_hidden_layers": 6}
        mixed = ModelConfig.from_hf_config({**hf4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
        assert (mixed.moe_layer_ids, mixed.dense_layer_ids, mixed.mixed_layers) == ((1, 5), (0, 2, 3, 4), True)
        assert ModelConfig.from_hf_config(mixed.to_hf_config()) == mixed
        assert ModelConfig.from_hf_config({**hf4, "mlp_only_layers": [0, 4]}).dense_layer_ids == (0, 4)
        with pytest.raises(ValueError, match="leave no layer with experts"):
            ModelConfig.from_hf_config({**hf4, "decoder_sparse_step": 7})
        with pytest.raises(ValueError, match="mlp_only_layers=.*layer 6 is not in 0..5"):
            ModelConfig.from_hf_config({**hf4, "mlp_only_layers": [6]})
        with pytest.raises(ValueError, match="config.json: num_experts=0"):
            ModelConfig.from_hf_config({**hf4, "num_experts": 0})
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 is unsupported"):
        ModelConfig.from_hf_config({**hf, "router_jitter_noise": 0.1})
