"""Qwen3.5 (gated delta-net layers between gated attention layers, models/hybrid.py) beyond the logits parity of
tests/hf/test_hf_parity.py (case `qwen3_5`): each trait tested by removing it, packed sequences equal to each
sequence alone (the conv window and the delta-rule state restart), gradients, export reloaded by transformers and
by our loader, the config round trip, and decoding with a cache (the delta-net layers' per-row state beside the
attention layers' KV) equal to the full forward."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import (
    QWEN35,
    assert_export_reloads,
    build_hf_model,
    left_padded_batch,
    torch_logits,
    with_trained_adapters,
)

from jaxrl_llm.hf import load_hf_folder
from jaxrl_llm.models import ModelConfig, compute_logits, init_params

compute_logits = jax.jit(compute_logits, static_argnums=1)


@pytest.fixture(scope="module")
def qwen35_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35")
    family, overrides = QWEN35["qwen3_5"]
    model = build_hf_model(family, folder, **overrides)
    cfg, params = load_hf_folder(folder)
    return model, cfg, params, folder


@pytest.mark.parametrize("trait", ["output_gate", "partial_rope", "conv", "delta_decay"])
def test_each_trait_is_needed_for_parity(qwen35_hf, trait):
    model, cfg, params, _ = qwen35_hf
    ids, mask = left_padded_batch(np.random.default_rng(0), cfg.vocab_size, lengths=(12, 9, 6))
    valid = mask.astype(bool)
    want = torch_logits(model, ids, mask)[valid]
    got = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))[valid]
    assert np.abs(got - want).max() <= 1e-4
    linear = params["layers"]["linear"]
    if trait == "output_gate":
        cfg = dataclasses.replace(cfg, attention_output_gate=False)
        attn = params["layers"]["attn"]
        q = attn["q_proj"]["kernel"][..., :cfg.head_dim]
        params = {**params, "layers": {**params["layers"], "attn": {**attn, "q_proj": {"kernel": q}}}}
    elif trait == "partial_rope":
        cfg = dataclasses.replace(cfg, partial_rotary_factor=1.0)
    elif trait == "conv":  # only the last tap (the token itself)
        kernel = linear["conv1d"]["kernel"]
        linear = {**linear, "conv1d": {"kernel": kernel.at[:-1].set(0.0)}}
        params = {**params, "layers": {**params["layers"], "linear": linear}}
    else:
        linear = {**linear, "A_log": jnp.full_like(linear["A_log"], -30.0)}  # no decay
        params = {**params, "layers": {**params["layers"], "linear": linear}}
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))[valid]
    assert np.abs(ours - want).max() > 1e-3


@pytest.mark.parametrize("trait", ["renormalised_top_k", "shared_expert_gate"])
def test_each_moe_trait_is_needed_for_parity(trait, tmp_path):
    """Qwen3.5-MoE's MLP: its router renormalises the chosen experts' softmax weights (its config has no
    norm_topk_prob), and sigmoid(x w) gates the shared expert; without either the logits leave transformers'."""
    family, overrides = QWEN35["qwen3_5_moe"]
    model = build_hf_model(family, tmp_path, **overrides)
    cfg, params = load_hf_folder(tmp_path)
    assert cfg.norm_topk_prob and cfg.shared_expert_gated and cfg.shared_expert_intermediate_size == 48
    ids, mask = left_padded_batch(np.random.default_rng(0), cfg.vocab_size)
    valid = mask.astype(bool)
    want = torch_logits(model, ids, mask)[valid]
    got = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))[valid]
    assert np.abs(got - want).max() <= 1e-4
    if trait == "renormalised_top_k":
        cfg = dataclasses.replace(cfg, norm_topk_prob=False)
    else:
        moe = {k: v for k, v in params["layers"]["moe"].items() if k != "shared_expert_gate"}
        params = {**params, "layers": {**params["layers"], "moe": moe}}
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))[valid]
    assert np.abs(ours - want).max() > 1e-3


def test_peft_adapters_on_both_mixers_load_in_transformers(qwen35_hf, tmp_path):
    """'all-linear' LoRA on Qwen3.5: the gated attention's q / k / v / o_proj (stacked over the attention layers),
    the delta net's in_proj_qkv / z / b / a and out_proj (over the delta-net layers) and every layer's MLP. The PEFT
    folder loads onto the HF base with our logits (with the adapters, in the trainer's forward and through the
    paged engine's cached decode), and the merged export loads as a plain folder with them too."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from jaxrl_llm.hf import export_hf
    from jaxrl_llm.hf.peft import export_peft
    from jaxrl_llm.models.cache import init_cache
    from jaxrl_llm.models.lora import LoraConfig, merge_lora

    _, cfg, params, folder = qwen35_hf
    ids, mask = left_padded_batch(np.random.default_rng(0), cfg.vocab_size)
    valid = mask.astype(bool)
    lora = LoraConfig(rank=4, alpha=8.0, targets="all-linear")
    ad, full, ours = with_trained_adapters(cfg, params, lora, ids, mask)
    assert set(ad["layers"]) == {"attn", "linear", "mlp"} and len(ad["layers"]["linear"]) == 5
    assert ad["layers"]["linear"]["out_proj"]["A"].shape == (2, 4, 8, 4)  # 2 delta-net layers, (heads, dim) in
    cached, _ = compute_logits(full, cfg, jnp.asarray(ids), jnp.asarray(mask), cache=init_cache(cfg, 3, 8))
    np.testing.assert_allclose(np.asarray(cached)[valid], ours[valid], atol=1e-5)
    export_peft(cfg, ad, lora, tmp_path / "adapter", base_model_name_or_path=str(folder))
    names = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight" in names
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight" in names
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder).eval(), tmp_path / "adapter").eval()
    np.testing.assert_allclose(ours[valid], torch_logits(model, ids, mask)[valid], atol=1e-4, rtol=1e-4)
    export_hf(cfg, jax.device_get(merge_lora(full)), tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(ours[valid], torch_logits(merged, ids, mask)[valid], atol=1e-4, rtol=1e-4)


def test_packed_sequences_equal_each_alone_and_gradients_flow():
    """Three sequences packed in a row (segment ids; positions restart per sequence): each one's logits equal the
    sequence run alone, through both gated-delta-net layers and both attention layers; the loss's gradient
    reaches every weight of both kinds."""
    from jaxrl_llm.models import forward_hidden, logits_from_hidden

    cfg = ModelConfig.tiny("qwen3_5_text")
    params = init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 2 else x, params)  # away from the tiny init's near-zero
    rng = np.random.default_rng(1)
    lengths = (7, 11, 5)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, sum(lengths)))[None]
    segments = jnp.asarray(np.repeat(np.arange(1, 4), lengths))[None]
    hidden, _ = forward_hidden(params, cfg, ids, jnp.ones_like(ids), segment_ids=segments)
    packed = logits_from_hidden(params, cfg, hidden)[0]
    start = 0
    for n in lengths:
        alone = compute_logits(params, cfg, ids[:, start:start + n], jnp.ones((1, n), jnp.int32))[0]
        np.testing.assert_allclose(np.asarray(packed[start:start + n]), np.asarray(alone), atol=2e-5, rtol=1e-5)
        start += n

    def loss(p):
        return jnp.mean(jax.nn.log_softmax(compute_logits(p, cfg, ids, jnp.ones_like(ids)))[..., 5])

    grads = jax.grad(loss)(params)["layers"]
    for kind in ("attn", "linear"):
        for name, g in jax.tree_util.tree_leaves_with_path(grads[kind]):
            assert float(jnp.abs(g).max()) > 0, (kind, name)


@pytest.mark.parametrize("case", sorted(QWEN35))
def test_export_reloads_in_transformers_and_ours(case, tmp_path):
    family, overrides = QWEN35[case]
    build_hf_model(family, tmp_path / "src", **overrides)
    cfg, params = load_hf_folder(tmp_path / "src")
    assert cfg.attention_bias == (case == "qwen3_5_bias") and cfg.is_moe == (case == "qwen3_5_moe")
    assert_export_reloads(cfg, params, tmp_path / "out", cfg.architecture, seed=2)


def test_config_round_trip():
    from transformers import Qwen3_5TextConfig

    cfg = ModelConfig.tiny("qwen3_5_text")
    d = cfg.to_hf_config()
    assert ModelConfig.from_hf_config(d) == cfg
    again = Qwen3_5TextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert ModelConfig.from_hf_config({**again.to_dict(), "architectures": d["architectures"]}) == cfg
    with pytest.raises(ValueError, match="linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"):
        ModelConfig.from_hf_config({**d, "linear_num_value_heads": 3})


def test_cached_decoding_equals_the_full_forward():
    """A dense cache holds the attention layers' KV (2 of 4 layers) and each row's conv window and delta state:
    left-padded prompts prefilled in two calls (5 tokens, then the rest with 66 more: the chunked rule from a
    state, over a chunk boundary), then one token a step, with 4 steps of mask 0 between (a finished row's steps:
    the state, the window and the attention must not see them), give the full forward's logits."""
    from jaxrl_llm.models.cache import init_cache

    cfg = ModelConfig.tiny("qwen3_5_text")
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 2 else x, init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    b, p, r = 3, 9, 80
    ids = np.zeros((b, p + r), np.int32)
    mask = np.zeros((b, p + r), np.int32)
    for row, n in enumerate((9, 4, 6)):  # left-padded prompts
        ids[row, p - n:] = rng.integers(3, cfg.vocab_size, n + r)
        mask[row, p - n:] = 1
    want = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    cache = init_cache(cfg, b, p + r + 4)
    assert cache["k"].shape[0] == 2 and cache["conv"].shape == (2, b, 3, 64)  # attention layers; K - 1 inputs
    got = []
    for lo, hi in ((0, 5), (5, p + 66)):
        logits, cache = compute_logits(params, cfg, jnp.asarray(ids[:, lo:hi]), jnp.asarray(mask[:, lo:hi]),
                                       cache=cache)
        got.append(np.asarray(logits))
    for t in range(p + 66, p + r):
        if t == p + 70:  # 4 ignored steps (a token fed with mask 0), then on
            for _ in range(4):
                _, cache = compute_logits(params, cfg, jnp.asarray(ids[:, t:t + 1]), jnp.zeros((b, 1), jnp.int32),
                                          cache=cache)
        logits, cache = compute_logits(params, cfg, jnp.asarray(ids[:, t:t + 1]), jnp.asarray(mask[:, t:t + 1]),
                                       cache=cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    real = mask > 0
    np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=1e-5)


def test_sharded_forward_equals_one_device():
    """On 8 devices (data 2 x fsdp 2 x tensor 2: the attention's heads split, the delta net's projections split
    by their hidden dim) the logits are one device's."""
    from jaxrl_llm import sharding
    from jaxrl_llm.models import param_logical_axes

    cfg = ModelConfig.tiny("qwen3_5_text")
    params = init_params(cfg, jax.random.key(0))
    ids, mask = left_padded_batch(np.random.default_rng(3), cfg.vocab_size, lengths=(10, 7, 4, 9))
    want = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    placed = sharding.shard_params(params, param_logical_axes(cfg), mesh)
    batch = sharding.shard_batch((jnp.asarray(ids), jnp.asarray(mask)), mesh)
    with sharding.mesh_context(mesh):
        got = np.asarray(compute_logits(placed, cfg, *batch))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_decode_step_updates_the_pool_and_state_in_place():
    """The paged engine's decode program of a hybrid model has no conditional and copies neither the KV pool nor
    the delta-net state: choosing each layer's kind with `lax.cond` copied the whole pool and state at every layer
    of every step (25M numbers a step here), as did a loop body writing one buffer several times."""
    import re

    from jaxrl_llm.sampler import SamplingParams
    from jaxrl_llm.sampler.engine import EngineSpec, decode_state, programs

    cfg = ModelConfig.tiny("qwen3_5_text", num_hidden_layers=8, linear_layers=(0, 1, 2, 4, 5, 6))
    params = init_params(cfg, jax.random.key(0))
    spec = EngineSpec(max_num_seqs=4, page_size=16, num_pages=256, pages_per_slot=8)
    settings, knobs = SamplingParams(max_new_tokens=8, do_sample=False).compile_args((2,), 0, vocab_size=256)
    state = decode_state.init_state(cfg, spec, 8, "float32")
    hlo = programs.generate.lower(params, cfg, state, jax.random.key(0), knobs, np.int32(4), np.bool_(False),
                                  settings=settings).compile().as_text()
    assert " conditional(" not in hlo
    big = min(state.pool["k"].size, state.recurrent["delta"].size)
    copied = [int(np.prod([int(d) for d in m.group(1).split(",")])) for line in hlo.splitlines()
              if " copy(" in line or "wrapped_copy" in line or "wrapped_scatter" in line
              for m in [re.search(r"= f32\[([0-9,]+)\]", line)] if m]
    assert max(copied, default=0) < big, sorted(copied)[-4:]
