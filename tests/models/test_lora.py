"""LoRA adapters (models/lora.py): B = 0 is the base, in-layer adapters equal merged weights
(logits, gradients, sampler), only targeted modules get adapters, sharded == single device, and
bad target names fail naming the key."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig, init_params, param_logical_axes
from jaxrl_llm.models import compute_logits as _compute_logits
from jaxrl_llm.models.lora import (
    ALL_LINEAR,
    LoraConfig,
    init_lora,
    lora_delta,
    lora_logical_axes,
    merge_lora,
    parse_target_modules,
    with_lora,
)
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from jaxrl_llm.sharding import shard_params

LORA = LoraConfig(rank=4, alpha=8.0)  # scale 2
compute_logits = jax.jit(_compute_logits, static_argnums=1)


def _cfg(family="llama"):
    return ModelConfig.tiny(family, vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_hidden_layers=2)


def _trained(cfg, lora=LORA, seed=1):
    """Adapters as after some training: A random, B random (not zero)."""
    ad = init_lora(cfg, lora, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
    return jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), ad)


def _batch(vocab, b=3, t=9, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[0, :3] = 0  # left padding
    return jnp.asarray(ids), jnp.asarray(mask)


def test_fresh_adapters_are_the_base_and_shapes_follow_the_kernels():
    cfg = _cfg()
    params = init_params(cfg, jax.random.key(0))
    ad = init_lora(cfg, LORA, jax.random.key(1))
    ids, mask = _batch(cfg.vocab_size)
    np.testing.assert_array_equal(compute_logits(with_lora(params, ad, LORA.scale), cfg, ids, mask),
                                  compute_logits(params, cfg, ids, mask))
    layers = ad["layers"]
    assert layers["attn"]["q_proj"]["A"].shape == (2, 32, 4) and layers["attn"]["q_proj"]["B"].shape == (2, 4, 4, 8)
    assert layers["attn"]["k_proj"]["B"].shape == (2, 4, 2, 8)
    assert layers["attn"]["o_proj"]["A"].shape == (2, 4, 8, 4) and layers["attn"]["o_proj"]["B"].shape == (2, 4, 32)
    assert layers["mlp"]["down_proj"]["A"].shape == (2, 48, 4) and layers["mlp"]["down_proj"]["B"].shape == (2, 4, 32)
    assert all(float(jnp.abs(m["B"]).max()) == 0 for g in layers.values() for m in g.values())
    a = np.asarray(layers["mlp"]["gate_proj"]["A"])  # PEFT's kaiming-uniform(a=sqrt(5)): U(+-1/sqrt(fan_in))
    assert a.max() <= 32 ** -0.5 and a.min() >= -(32 ** -0.5) and a.std() > 0.5 * 32 ** -0.5 / np.sqrt(3)
    axes = lora_logical_axes(cfg, LORA)["layers"]
    assert axes["attn"]["q_proj"] == {"A": ("layers", "embed", None), "B": ("layers", None, "heads", "head_dim")}
    assert axes["attn"]["o_proj"] == {"A": ("layers", "heads", "head_dim", None), "B": ("layers", None, "embed")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_adapters_in_layers_equal_merged_weights(family):
    cfg = _cfg(family)
    params = init_params(cfg, jax.random.key(0))
    full = with_lora(params, _trained(cfg), LORA.scale)
    ids, mask = _batch(cfg.vocab_size)
    got = compute_logits(full, cfg, ids, mask)
    want = compute_logits(merge_lora(full), cfg, ids, mask)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert float(jnp.abs(got - compute_logits(params, cfg, ids, mask)).max()) > 0.05  # the adapters matter


def test_lora_dropout_is_peft_on_the_adapters_input():
    """PEFT's lora_dropout: scale * ((x * m / keep) @ A) @ B, m ~ Bernoulli(keep) per element, a mask of its own
    per projection and layer; dropout 0 (or no key: the sampler, the no-grad passes) is the plain adapter."""
    x = jax.random.normal(jax.random.key(0), (3, 5, 32))
    a, b = jax.random.normal(jax.random.key(1), (32, 4)), jax.random.normal(jax.random.key(2), (4, 8))
    key = jax.random.key(3)
    got = lora_delta(x, {"A": a, "B": b, "dropout_key": key, "dropout_keep": jnp.float32(0.75)}, 2.0, jnp.float32)
    kept = jax.random.bernoulli(key, 0.75, x.shape)
    np.testing.assert_allclose(got, 2.0 * (jnp.where(kept, x / 0.75, 0.0) @ a) @ b, rtol=1e-5, atol=1e-5)
    assert 0.6 < float(kept.mean()) < 0.9

    cfg = _cfg()
    params, ad = init_params(cfg, jax.random.key(0)), _trained(cfg)
    ids, mask = _batch(cfg.vocab_size)
    plain = compute_logits(with_lora(params, ad, LORA.scale), cfg, ids, mask)
    np.testing.assert_array_equal(compute_logits(with_lora(params, ad, LORA.scale, 0.0, jax.random.key(5)), cfg,
                                                 ids, mask), plain)
    np.testing.assert_array_equal(compute_logits(with_lora(params, ad, LORA.scale, 0.5), cfg, ids, mask), plain)
    one = compute_logits(with_lora(params, ad, LORA.scale, 0.5, jax.random.key(5)), cfg, ids, mask)
    np.testing.assert_array_equal(one, compute_logits(with_lora(params, ad, LORA.scale, 0.5, jax.random.key(5)),
                                                      cfg, ids, mask))
    assert float(jnp.abs(one - plain).max()) > 1e-3
    assert float(jnp.abs(one - compute_logits(with_lora(params, ad, LORA.scale, 0.5, jax.random.key(6)), cfg, ids,
                                              mask)).max()) > 1e-3
    keys = with_lora(params, ad, LORA.scale, 0.5, jax.random.key(5))["lora"].weights["layers"]["attn"]
    assert not np.array_equal(jax.random.key_data(keys["q_proj"]["dropout_key"]),
                              jax.random.key_data(keys["k_proj"]["dropout_key"]))
    with pytest.raises(ValueError, match="dropout"):
        LoraConfig(rank=4, alpha=8.0, dropout=1.0)


def test_target_modules_subset_and_names():
    assert parse_target_modules("all-linear") == ALL_LINEAR
    assert parse_target_modules(["v_proj", "q_proj"]) == ("q_proj", "v_proj")
    assert parse_target_modules("q_proj,down_proj") == ("q_proj", "down_proj")
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.target_modules=.*'qkv'"):
        parse_target_modules(["q_proj", "qkv"], "actor_rollout_ref.model.target_modules")
    cfg = _cfg()
    lora = LoraConfig(2, 2.0, ("q_proj", "v_proj"))
    ad = _trained(cfg, lora)
    assert set(ad["layers"]) == {"attn"} and set(ad["layers"]["attn"]) == {"q_proj", "v_proj"}
    params = init_params(cfg, jax.random.key(0))
    merged = merge_lora(with_lora(params, ad, lora.scale))
    merged_attn, base_attn = merged["layers"]["attn"], params["layers"]["attn"]
    np.testing.assert_array_equal(merged_attn["k_proj"]["kernel"], base_attn["k_proj"]["kernel"])
    assert not np.array_equal(merged_attn["v_proj"]["kernel"], base_attn["v_proj"]["kernel"])
    ids, mask = _batch(cfg.vocab_size)
    np.testing.assert_allclose(compute_logits(with_lora(params, ad, lora.scale), cfg, ids, mask),
                               compute_logits(merged, cfg, ids, mask), atol=1e-5, rtol=0)


def _loss(full, cfg, ids, mask):
    logits = compute_logits(full, cfg, ids, mask)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 5] * mask)


def test_gradients_only_on_adapters_and_equal_merged_weight_gradients():
    cfg = _cfg()
    params = init_params(cfg, jax.random.key(0))
    ad = _trained(cfg)
    ids, mask = _batch(cfg.vocab_size)
    in_layer = jax.jit(jax.grad(lambda a: _loss(with_lora(params, a, LORA.scale), cfg, ids, mask)))(ad)
    # the reference: the same loss through explicitly merged kernels W + scale * A @ B
    merged = jax.jit(jax.grad(lambda a: _loss(merge_lora(with_lora(params, a, LORA.scale)), cfg, ids, mask)))(ad)
    assert jax.tree.structure(in_layer) == jax.tree.structure(ad)  # a gradient for every adapter, nothing else
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, atol=1e-6, rtol=1e-4), in_layer, merged)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(in_layer))


def test_bfloat16_base_gives_float32_adapter_gradients():
    cfg = _cfg()
    params = init_params(cfg, jax.random.key(0))
    ad = _trained(cfg)
    ids, mask = _batch(cfg.vocab_size)
    grad = jax.jit(jax.grad(lambda p, a: _loss(with_lora(p, a, LORA.scale), cfg, ids, mask), argnums=1))
    g32 = grad(params, ad)
    g16 = grad(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), ad)  # the frozen base kept in bf16
    assert {x.dtype for x in jax.tree.leaves(g16)} == {jnp.dtype("float32")}
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16)):  # bf16 rounding of the base only (~1%)
        assert float(jnp.abs(a - b).max() / jnp.abs(a).max()) < 0.05


def test_sampler_with_adapters_equals_merged_weights():
    cfg = ModelConfig.tiny("llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, num_hidden_layers=2, eos_token_id=2, pad_token_id=0)
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, init_params(cfg, jax.random.key(0)))
    full = with_lora(params, jax.tree.map(lambda x: x * 3.0, _trained(cfg)), LORA.scale)
    ids, mask = left_pad([[5, 17, 9, 40], [12, 33], [7, 8, 9, 10, 11, 12]], 0)
    sp = SamplingParams(max_new_tokens=8, do_sample=False)
    settings, knobs = sp.compile_args(cfg.eos_token_ids, 0, vocab_size=cfg.vocab_size)
    a = sample(full, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    b = sample(merge_lora(full), cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    base = sample(params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
    assert not np.array_equal(a.tokens, base.tokens)  # the adapters change what is generated


def test_paged_engine_with_adapters_equals_merged_weights_and_scores_as_the_adapted_model():
    """The paged engine's decode step applies the adapters in-layer too (not only its prefill)."""
    from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged

    cfg = ModelConfig.tiny("llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, num_hidden_layers=2, eos_token_id=2, pad_token_id=0)
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, init_params(cfg, jax.random.key(0)))
    full = with_lora(params, jax.tree.map(lambda x: x * 3.0, _trained(cfg)), LORA.scale)
    prompts = [[5, 17, 9, 40], [12, 33], [7, 8, 9, 10, 11, 12]]
    sp = SamplingParams(max_new_tokens=8, n=2, temperature=1.0, seed=3)
    settings, knobs = sp.compile_args(cfg.eos_token_ids, 0, vocab_size=cfg.vocab_size)
    opts = EngineOptions(engine="paged", max_num_seqs=4)

    def paged(p):
        out, _ = sample_paged(p, cfg, prompts, jax.random.key(3), knobs, settings=settings, opts=opts)
        return out

    a, merged, base = paged(full), paged(merge_lora(full)), paged(params)
    np.testing.assert_array_equal(a.tokens, merged.tokens)
    # these weights give large logits (|log p| up to ~10): fp32 rounding of merged vs in-layer ~1e-5 relative
    # (2.2e-5 on AVX2-only CPUs, whose matmul kernels round the merged and the in-layer sums differently)
    np.testing.assert_allclose(a.log_probs, merged.log_probs, atol=1e-5, rtol=5e-5)
    assert not np.array_equal(a.tokens, base.tokens)  # the adapters change what is generated
    # its log-probs are the adapted model's: score the sampled tokens with a full forward
    ids, mask = a.prompt_ids, a.prompt_mask
    seq = np.concatenate([ids, a.tokens], axis=1)
    logits = compute_logits(full, cfg, jnp.asarray(seq), jnp.asarray(np.concatenate([mask, a.response_mask], 1)))
    lp = jax.nn.log_softmax(np.asarray(logits, np.float32)[:, ids.shape[1] - 1:-1], axis=-1)
    scored = np.take_along_axis(np.asarray(lp), a.tokens[..., None], axis=-1)[..., 0] * a.response_mask
    np.testing.assert_allclose(a.log_probs, scored, atol=1e-5, rtol=1e-5)


def test_sharded_adapters_on_8_devices_equal_one_device():
    cfg = _cfg()
    params = init_params(cfg, jax.random.key(0))
    ad = _trained(cfg)
    ids, mask = _batch(cfg.vocab_size, b=8)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 4, 2), ("data", "fsdp", "tensor"))
    sharded_params = shard_params(params, param_logical_axes(cfg), mesh)
    sharded_ad = shard_params(ad, lora_logical_axes(cfg, LORA), mesh)
    assert sharded_ad["layers"]["mlp"]["up_proj"]["B"].sharding.spec != jax.sharding.PartitionSpec()

    def loss_and_grad(p, a):
        return jax.value_and_grad(lambda a: _loss(with_lora(p, a, LORA.scale), cfg, ids, mask))(a)

    l1, g1 = jax.jit(loss_and_grad)(params, ad)
    l8, g8 = jax.jit(loss_and_grad)(sharded_params, sharded_ad)
    np.testing.assert_allclose(l8, l1, rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-4), jax.device_get(g8), g1)
