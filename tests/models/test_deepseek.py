"""DeepSeek-V3 pieces beyond the logits / greedy / export parity with transformers (tests/hf, tests/sampler
DEEPSEEK cases): the router against transformers' on many tokens, each trait tested by removing it, the
absorbed (cache) and expanded (training) forms of the latent attention against each other (LoRA included),
the latent cache's bytes, PEFT adapters on the latent attention's projections, the frozen correction bias,
and the config.json round trip and refusals."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_models import (
    DEEPSEEK,
    assert_export_reloads,
    build_hf_model,
    family_case,
    left_padded_batch,
    torch_logits,
    with_trained_adapters,
)

from jaxrl_llm.hf import load_hf_folder
from jaxrl_llm.models import ModelConfig, compute_logits, init_params
from jaxrl_llm.models.cache import init_cache
from jaxrl_llm.models.lora import LoraConfig, init_lora, with_lora
from jaxrl_llm.models.moe import route
from jaxrl_llm.sampler.engine import EngineSpec

compute_logits = jax.jit(compute_logits, static_argnums=1)
CFG = ModelConfig.tiny("deepseek_v3")


@pytest.fixture(scope="module")
def deepseek_hf(tmp_path_factory):
    """(the torch model, our config and params) of the DEEPSEEK["deepseek_v3"] case."""
    folder = tmp_path_factory.mktemp("deepseek")
    family, overrides = DEEPSEEK["deepseek_v3"]
    model = build_hf_model(family, folder, **overrides)
    cfg, params = load_hf_folder(folder)
    return model, cfg, params, folder


def test_router_chooses_and_weighs_as_transformers():
    """512 tokens through a router with a correction bias and 4 groups of which 2 open: the same experts and
    weights as transformers' `DeepseekV3TopkRouter`; without the bias or the group limit the choices differ."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    family, overrides = DEEPSEEK["deepseek_v3"]
    from tiny_models import hf_config

    hf_cfg = hf_config(family, **overrides)
    router = DeepseekV3TopkRouter(hf_cfg)
    rng = np.random.default_rng(0)
    kernel = rng.normal(0, 0.3, (hf_cfg.hidden_size, 8)).astype(np.float32)
    bias = rng.normal(0, 0.3, (8,)).astype(np.float32)
    tokens = rng.normal(size=(512, hf_cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(kernel.T))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, want_w, want_ids = router(torch.from_numpy(tokens))
    cfg = dataclasses.replace(CFG, hidden_size=hf_cfg.hidden_size)
    got = route(cfg, jnp.asarray(kernel), jnp.asarray(tokens), score_bias=jnp.asarray(bias))
    order, want_order = np.argsort(np.asarray(got.ids), -1), np.argsort(want_ids.numpy(), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got.ids), order, -1),
                                  np.take_along_axis(want_ids.numpy(), want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got.weights), order, -1),
                               np.take_along_axis(want_w.numpy(), want_order, -1), rtol=1e-5, atol=1e-6)
    assert np.allclose(np.asarray(got.weights).sum(-1), cfg.routed_scaling_factor)  # renormalised, then scaled

    def chosen(c, b):
        return np.sort(np.asarray(route(c, jnp.asarray(kernel), jnp.asarray(tokens), score_bias=b).ids), -1)

    base = chosen(cfg, jnp.asarray(bias))
    assert (chosen(cfg, None) != base).any(axis=-1).mean() > 0.1  # the bias moves choices
    assert (chosen(dataclasses.replace(cfg, topk_group=4), jnp.asarray(bias)) != base).any(axis=-1).mean() > 0.1


@pytest.mark.parametrize("trait", ["rope_interleave", "mscale", "score_bias", "groups", "routed_scaling"])
def test_each_trait_is_needed_for_parity(deepseek_hf, trait):
    np_rng = np.random.default_rng(0)
    """Dropping one trait from our model moves its logits off transformers' (each test of the parity suite
    would fail without it)."""
    model, cfg, params, _ = deepseek_hf
    ids, mask = left_padded_batch(np_rng, cfg.vocab_size, lengths=(12, 9, 6))
    valid = mask.astype(bool)
    want = torch_logits(model, ids, mask)[valid]
    assert np.abs(np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))[valid] - want).max() \
        <= 1e-4
    if trait == "rope_interleave":
        cfg = dataclasses.replace(cfg, rope_interleave=False)
    elif trait == "mscale":
        cfg = dataclasses.replace(cfg, rope_scaling=tuple((k, v) for k, v in cfg.rope_scaling
                                                          if k not in ("mscale", "mscale_all_dim")))
    elif trait == "score_bias":
        moe = params["layers"]["moe"]
        params = {**params, "layers": {**params["layers"], "moe": {**moe,
                                                                   "score_bias": jnp.zeros_like(moe["score_bias"])}}}
    elif trait == "groups":
        cfg = dataclasses.replace(cfg, topk_group=cfg.n_group)
    else:
        cfg = dataclasses.replace(cfg, routed_scaling_factor=1.0)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))[valid]
    assert np.abs(ours - want).max() > 1e-3


@pytest.mark.parametrize("lora", [False, True])
def test_absorbed_latent_attention_equals_the_expanded_one(lora):
    np_rng = np.random.default_rng(0)
    """A prefill through a cache (the absorbed form: one kv head of latent + rope key) gives the logits of the
    training forward (keys and values per head), with LoRA adapters on every projection (kv_b_proj's merged
    into the absorbed matrices) too; fp32."""
    params = init_params(CFG, jax.random.key(0))
    if lora:
        cfg_lora = LoraConfig(rank=4, alpha=8.0)
        ad = init_lora(CFG, cfg_lora, jax.random.key(1))
        keys = iter(jax.random.split(jax.random.key(2), 64))
        ad = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), ad)
        assert set(ad["layers"]["attn"]) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
        params = with_lora(params, ad, cfg_lora.scale)
    ids, mask = left_padded_batch(np_rng, CFG.vocab_size, lengths=(12, 9, 6))
    expanded = np.asarray(compute_logits(params, CFG, jnp.asarray(ids), jnp.asarray(mask)))
    cache = init_cache(CFG, 3, 16)
    absorbed, cache = compute_logits(params, CFG, jnp.asarray(ids), jnp.asarray(mask), cache=cache)
    valid = mask.astype(bool)
    assert np.abs(np.asarray(absorbed)[valid] - expanded[valid]).max() <= 2e-5
    assert set(cache) == {"k", "mask", "index"}  # no values: they are the keys' first kv_lora_rank numbers


def test_the_latent_cache_holds_kv_lora_plus_rope_numbers_a_token_a_layer():
    cfg = CFG
    per_token = cfg.kv_lora_rank + cfg.head_dim
    assert init_cache(cfg, 2, 16)["k"].shape == (cfg.num_hidden_layers, 2, 1, 16, per_token)
    spec = EngineSpec(max_num_seqs=2, page_size=4, num_pages=8, pages_per_slot=4)
    assert spec.page_bytes(cfg, "bfloat16") == cfg.num_hidden_layers * per_token * 2 * 4
    expanded = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.head_dim)  # K and V per head
    assert per_token < expanded / 2
    # DeepSeek-V3's own shapes: 576 numbers a token a layer against 2 x 128 heads x 192
    big = ModelConfig.tiny("deepseek_v3", num_attention_heads=128, head_dim=64, qk_nope_head_dim=128,
                           kv_lora_rank=512, v_head_dim=128, hidden_size=256)
    assert big.cache_head_dim == 576 and big.cache_kv_heads == 1
    assert spec.page_bytes(big, "bfloat16") == big.num_hidden_layers * 576 * 2 * 4


def test_peft_adapters_on_the_latent_attention_load_in_transformers(deepseek_hf, tmp_path):
    """Adapters on the latent attention's projections (the q bottleneck, kv_a_proj_with_mqa, kv_b_proj, o_proj)
    exported as a PEFT folder load onto the HF base with our logits; 'all-linear' (the dense layer's MLP and the
    shared experts, `mlp.shared_experts`, too) merged and exported as a plain folder loads with our logits.
    (transformers 5 + PEFT turn MLP-named targets of a MoE model into adapters on its fused routed experts, so
    MLP adapters are checked through the merged export.)"""
    pytest.importorskip("peft")
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from jaxrl_llm.hf import export_hf
    from jaxrl_llm.hf.peft import export_peft
    from jaxrl_llm.models.lora import merge_lora

    np_rng = np.random.default_rng(0)
    _, cfg, params, folder = deepseek_hf
    ids, mask = left_padded_batch(np_rng, cfg.vocab_size)
    valid = mask.astype(bool)
    for targets in (("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"), "all-linear"):
        lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
        ad, full, ours = with_trained_adapters(cfg, params, lora, ids, mask)
        if targets == "all-linear":
            assert set(ad["layers"]) == {"attn", "mlp", "shared_expert"}
            export_hf(cfg, jax.device_get(merge_lora(full)), tmp_path / "merged")
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
            np.testing.assert_allclose(ours[valid], torch_logits(merged, ids, mask)[valid], atol=1e-4, rtol=1e-4)
            continue
        export_peft(cfg, ad, lora, tmp_path / "adapter", base_model_name_or_path=str(folder))
        names = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
        assert len(names) == 2 * cfg.num_hidden_layers * len(targets)
        assert "base_model.model.model.layers.1.self_attn.kv_a_proj_with_mqa.lora_A.weight" in names
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder).eval(),
                                          tmp_path / "adapter").eval()
        np.testing.assert_allclose(ours[valid], torch_logits(model, ids, mask)[valid], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="k_proj not in DeepseekV3ForCausalLM"):
        init_lora(cfg, LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj")), jax.random.key(0))


def test_the_correction_bias_is_not_trained():
    """No gradient reaches it (it only chooses) and weight decay leaves it alone (roles/optim.py)."""
    from jaxrl_llm.config.spec import OptimSpec
    from jaxrl_llm.roles.optim import decayed_leaves

    params = init_params(CFG, jax.random.key(0))
    params["layers"]["moe"]["score_bias"] = jnp.full_like(params["layers"]["moe"]["score_bias"], 0.5)
    mask = decayed_leaves(params)
    assert mask["layers"]["moe"]["score_bias"] is False and mask["layers"]["moe"]["router"]["kernel"] is True
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 10)))

    def loss(p):
        return jnp.mean(compute_logits(p, CFG, ids, jnp.ones_like(ids)) ** 2)

    grads = jax.grad(loss)(params)
    assert float(jnp.abs(grads["layers"]["moe"]["score_bias"]).max()) == 0.0
    assert float(jnp.abs(grads["layers"]["moe"]["router"]["kernel"]).max()) > 0.0
    tx = optax.adamw(1e-2, weight_decay=0.5, mask=decayed_leaves)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["layers"]["moe"]["score_bias"], params["layers"]["moe"]["score_bias"])
    assert OptimSpec  # the trainer's optimizer (make_optimizer) passes the same mask


def test_config_json_round_trip_and_refusals():
    from transformers import DeepseekV3Config

    for case in DEEPSEEK:
        family, overrides = family_case(case)
        from tiny_models import hf_config

        hf = hf_config(family, **overrides)
        arch = "DeepseekV2ForCausalLM" if family == "deepseek_v2" else "DeepseekV3ForCausalLM"
        cfg = ModelConfig.from_hf_config({**hf.to_dict(), "architectures": [arch]})
        assert cfg.is_mla and cfg.cache_kv_heads == 1
        v2 = family == "deepseek_v2"
        assert (cfg.router_sigmoid, cfg.router_group_max) == ((False, True) if v2 else (True, False))
        assert cfg.mlp_only_layers == tuple(range(overrides["first_k_dense_replace"]))
        assert cfg.q_lora_rank == (overrides["q_lora_rank"] or 0)
        d = cfg.to_hf_config()
        assert ModelConfig.from_hf_config(d) == cfg
        if family == "deepseek_v2":
            continue
        again = DeepseekV3Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
        assert ModelConfig.from_hf_config({**again.to_dict(), "architectures": d["architectures"]}) == cfg
    d = CFG.to_hf_config()
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        ModelConfig.from_hf_config({**d, "n_group": 3})
    with pytest.raises(ValueError, match="first_k_dense_replace=2 must be in 0..1"):
        ModelConfig.from_hf_config({**d, "first_k_dense_replace": 2})
    with pytest.raises(ValueError, match="needs a positive kv_lora_rank"):
        ModelConfig.from_hf_config({**d, "kv_lora_rank": None})


def test_deepseek_v2_export_reloads_in_transformers_and_ours(tmp_path):
    """DeepSeek-V2 (softmax routing limited to the best groups, unnormalised scaled weights, complex-pair RoPE):
    our export reloads in transformers with our logits and in our loader with our params. (Greedy parity runs
    through the paged engine in tests/sampler. tests/hf/test_hf_export.py's greedy check runs transformers with
    min_new_tokens, EOS suppressed, against `greedy_generate`, which does not suppress it: on this tiny V2 one row's
    first argmax is EOS, so that check cannot serve it.)"""
    family, overrides = DEEPSEEK["deepseek_v2"]
    build_hf_model(family, tmp_path / "src", **overrides)
    cfg, params = load_hf_folder(tmp_path / "src")
    assert cfg.router_group_max and not cfg.router_sigmoid and not cfg.norm_topk_prob
    assert_export_reloads(cfg, params, tmp_path / "out", "DeepseekV2ForCausalLM")
