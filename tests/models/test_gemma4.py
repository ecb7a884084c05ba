"""Gemma 4 beyond the logits / export / PEFT parity with transformers (tests/hf GEMMA4 cases): the static
engine's greedy tokens are transformers' and its sampled log-probs the trainer's scoring; the KV cache holds
the layers that compute keys / values only; log-probs and gradients on sharded and context-parallel meshes
equal one device's; config.json in each form transformers reads; what is refused, and why."""
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from tiny_models import GEMMA4, build_hf_model, hf_config

from jaxrl_llm import sharding
from jaxrl_llm.hf import load_hf_folder
from jaxrl_llm.models import ModelConfig, init_cache, init_params, param_logical_axes
from jaxrl_llm.sampler import SamplingParams, left_pad, sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sampler"))
from sampler_fixtures import EOS_ID, PAD_ID, PROMPTS, hf_greedy

NEW = 10


@pytest.mark.parametrize("case", sorted(GEMMA4))
def test_static_engine_greedy_is_transformers_and_sampled_log_probs_are_the_trainers(case, tmp_path):
    from jaxrl_llm.roles.forward import response_log_probs

    family, overrides = GEMMA4[case]
    torch_model = build_hf_model(family, tmp_path, **overrides)
    cfg, params = load_hf_folder(tmp_path)
    ids, mask = left_pad(PROMPTS, PAD_ID)
    hf_ids, hf_mask = left_pad(PROMPTS, PAD_ID, length=max(map(len, PROMPTS)))
    expected = hf_greedy(torch_model, hf_ids, hf_mask, NEW, EOS_ID, PAD_ID)
    settings, knobs = SamplingParams(max_new_tokens=NEW, do_sample=False).compile_args(
        cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    out = sample(params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    settings, knobs = SamplingParams(max_new_tokens=NEW, n=2).compile_args(cfg.eos_token_ids, PAD_ID,
                                                                           vocab_size=cfg.vocab_size)
    out = sample(params, cfg, ids, mask, jax.random.key(1), knobs, settings=settings)
    m = np.asarray(out.response_mask).astype(bool)
    seqs = jnp.concatenate([out.prompt_ids, out.tokens], axis=1)
    seq_mask = jnp.concatenate([out.prompt_mask, out.response_mask], axis=1)
    scored = response_log_probs(params, cfg, seqs, seq_mask, NEW)  # the trainer's (soft-capped) scoring
    np.testing.assert_allclose(np.asarray(out.log_probs)[m], np.asarray(scored)[m], rtol=1e-5, atol=1e-5)


def test_the_cache_holds_only_the_layers_that_compute_keys_and_values():
    cfg = ModelConfig.tiny("gemma4_text", num_hidden_layers=6)  # s f s f | s f shared (reading layers 2, 3)
    assert cfg.local_layer_ids == (0, 2, 4) and cfg.first_shared_layer == 4
    assert cfg.kv_layer_ids(True) == (0, 2) and cfg.kv_layer_ids(False) == (1, 3)
    np.testing.assert_array_equal(cfg.kv_rows, [0, 0, 1, 1, 1, 1])  # layers 4, 5 read rows 1: layers 2, 3
    cache = jax.eval_shape(lambda: init_cache(cfg, 3, 20))
    assert cache["k"].shape == (2, 3, cfg.num_key_value_heads, 20, cfg.head_dim)
    assert cache["k_full"].shape == (2, 3, 1, 20, 2 * cfg.head_dim) == cache["v_full"].shape
    # the sharing layers have no K / V weights; the full layers have no v_proj (k = v)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))["layers"]
    assert params["kv"]["k_proj"]["kernel"].shape[0] == 2 and "v_proj" not in params["kv_full"]
    assert params["mlp_wide"]["up_proj"]["kernel"].shape == (2, cfg.hidden_size, 2 * cfg.intermediate_size)


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


@pytest.mark.parametrize("mesh_sizes,moe", [({"data": 2, "fsdp": 2, "context": 1, "tensor": 2}, False),
                                            ({"data": 2, "fsdp": 1, "context": 4, "tensor": 1}, False),
                                            ({"data": 1, "fsdp": 2, "context": 1, "tensor": 1, "expert": 4}, True)])
def test_log_probs_and_gradients_on_a_mesh_equal_one_device(mesh_sizes, moe):
    """The new tensors' sharding rules (per-kind stacks, per-layer inputs, the MoE block's router scales),
    context parallelism, whose shared layers attend with the producers' keys / values split over the tokens
    like their own, and the MoE block's experts split over 'expert'."""
    from jaxrl_llm.roles.forward import response_log_probs

    cfg = ModelConfig.tiny("gemma4_text", vocab_size=128, **(MOE if moe else {}))
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 128, size=(4, 64)), jnp.int32)
    mask = jnp.ones(ids.shape, jnp.int32).at[1, :9].set(0)
    params = init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params)

    def loss(params, ids, mask):
        return jnp.sum(response_log_probs(params, cfg, ids, mask, 32))

    want, want_grads = jax.jit(jax.value_and_grad(loss))(params, ids, mask)
    mesh = sharding.make_mesh({"expert": 1, **mesh_sizes})
    placed = sharding.shard_params(params, param_logical_axes(cfg), mesh)
    whole = NamedSharding(mesh, PartitionSpec())
    with sharding.mesh_context(mesh):
        got, grads = jax.jit(jax.value_and_grad(loss))(placed, jax.device_put(ids, whole), jax.device_put(mask, whole))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for g, w in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(jax.device_get(want_grads))):
        # fp32 sums in other orders (gradients up to ~60 through 4 layers); a misplaced shard is off by O(1)
        assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max()


def test_config_json_in_each_form_transformers_reads():
    """transformers 5 writes `per_layer_config`; the released folders carry `global_head_dim` and
    `num_global_key_value_heads` (kv heads only with attention_k_eq_v); ours reads back to the same config."""
    import transformers

    family, overrides = GEMMA4["gemma4"]
    written = {**hf_config(family, **overrides).to_dict(), "architectures": ["Gemma4ForCausalLM"]}
    assert "per_layer_config" in written
    cfg = ModelConfig.from_hf_config(written)
    assert (cfg.full_head_dim, cfg.full_kv_heads, cfg.kv_shared_layers, cfg.rope_partial_factor) == (32, 1, 2, 0.25)
    released = {k: v for k, v in written.items() if k != "per_layer_config"}
    released.update(global_head_dim=32, num_global_key_value_heads=1)
    assert ModelConfig.from_hf_config(released) == cfg
    without_k_eq_v = dict(released, attention_k_eq_v=False)  # the global kv heads apply with k = v only
    assert ModelConfig.from_hf_config(without_k_eq_v).full_kv_heads == cfg.num_key_value_heads
    ours = cfg.to_hf_config()
    theirs = transformers.Gemma4TextConfig(**{k: v for k, v in ours.items() if k not in ("architectures",
                                                                                         "model_type")})
    assert ModelConfig.from_hf_config({**theirs.to_dict(), "architectures": ours["architectures"]}) == cfg
    assert json.loads(json.dumps(ours)) == ours  # plain JSON


@pytest.mark.parametrize("change,message", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=None, moe_intermediate_size=16),
     "enable_moe_block=True needs top_k_experts"),
    (dict(num_kv_shared_layers=5), "num_kv_shared_layers=5 leaves no earlier full-attention layer"),
    (dict(per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 64}, "5": {"head_dim": 32}}),
     "different shapes"),
])
def test_what_is_refused_names_the_key(change, message):
    family, overrides = GEMMA4["gemma4"]
    d = {**hf_config(family, **overrides).to_dict(), "architectures": ["Gemma4ForCausalLM"], **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(d)


@pytest.mark.parametrize("case", ["gemma4", "gemma4_moe"])
def test_paged_engine_paths_follow_transformers_and_the_trainers_scoring(case, tmp_path):
    """A pool per attention type through every path of the paged engine: chunked prefill (4 tokens at a
    time), 2 samples a prompt reading their shared pages once (cascade), n-gram drafts verified 2 at a time
    (speculative), the interpreted Pallas kernel (sampling, without experts) and int8 pages: greedy tokens are
    transformers', sampled tokens' log-probs the trainer's scoring of them."""
    from jaxrl_llm.roles.forward import response_log_probs
    from jaxrl_llm.sampler.engine import EngineSpec, PagedEngine
    from jaxrl_llm.sampler.speculative import SpeculativeSpec

    family, overrides = GEMMA4[case]
    torch_model = build_hf_model(family, tmp_path, **overrides)
    cfg, params = load_hf_folder(tmp_path)
    hf_ids, hf_mask = left_pad(PROMPTS, PAD_ID, length=max(map(len, PROMPTS)))
    expected = np.repeat(hf_greedy(torch_model, hf_ids, hf_mask, NEW, EOS_ID, PAD_ID), 2, axis=0)
    # the interpreted Pallas kernel (slow on CPU) samples only, in the case without experts (the attention is the
    # same in both): its log-probs equal to the trainer's within 1e-5 are the kernel's check
    variants = [(dict(cascade=True, speculative=SpeculativeSpec(num_tokens=2)), (False, True))]  # (.., do_sample)
    if case == "gemma4":
        variants.append((dict(attn_impl="pallas"), (True,)))
    for extra, do_sample_values in variants:
        spec = EngineSpec(max_num_seqs=4, page_size=4, num_pages=48, pages_per_slot=8, **extra)
        engine = PagedEngine(cfg, spec, steps_per_call=4, prefill_chunk=4, precompile_drain=False)
        for sp in (SamplingParams(max_new_tokens=NEW, do_sample=do_sample, n=2) for do_sample in do_sample_values):
            settings, knobs = sp.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
            out, _ = engine.run(params, PROMPTS, jax.random.key(0), knobs, settings)
            if not sp.do_sample:
                np.testing.assert_array_equal(out.tokens, expected)
                continue
            m = out.response_mask.astype(bool)
            seqs = jnp.concatenate([jnp.asarray(out.prompt_ids), jnp.asarray(out.tokens)], axis=1)
            seq_mask = jnp.concatenate([jnp.asarray(out.prompt_mask), jnp.asarray(out.response_mask)], axis=1)
            scored = np.asarray(response_log_probs(params, cfg, seqs, seq_mask, NEW))
            np.testing.assert_allclose(out.log_probs[m], scored[m], rtol=1e-5, atol=1e-5)
    int8 = PagedEngine(cfg, EngineSpec(max_num_seqs=4, page_size=4, num_pages=48, pages_per_slot=8,
                                       kv_cache_dtype="int8"), steps_per_call=4)
    settings, knobs = SamplingParams(max_new_tokens=NEW, do_sample=False).compile_args(
        cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    out, _ = int8.run(params, PROMPTS, jax.random.key(0), knobs, settings)
    assert (out.tokens == expected[::2]).mean() > 0.8  # int8 pages round the keys / values


def test_the_pool_holds_only_the_producing_layers_and_the_plan_counts_its_bytes():
    from jaxrl_llm.sampler.engine.decode_state import EngineSpec, empty_pool, pool_dims

    cfg = ModelConfig.tiny("gemma4_text", num_hidden_layers=6)
    spec = EngineSpec(max_num_seqs=2, page_size=8, num_pages=10, pages_per_slot=4)
    pool = jax.eval_shape(lambda: empty_pool(cfg, spec, "float32"))
    assert pool["sliding"]["k"].shape == (2, cfg.num_key_value_heads, 10, 8, cfg.head_dim)
    assert pool["full"]["v"].shape == (2, 1, 10, 8, 2 * cfg.head_dim)
    assert pool_dims(cfg) == {"sliding": (2, 2, 16), "full": (2, 1, 32)}
    pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))
    assert spec.page_bytes(cfg, "float32") * spec.num_pages == pool_bytes == 10 * 8 * 4 * 2 * (2 * 2 * 16 + 2 * 32)
