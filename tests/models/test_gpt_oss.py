"""GPT-OSS pieces beyond the logits / greedy / export parity with transformers (tests/hf, tests/sampler
GPT_OSS cases): attention sinks in every attention (the chunked and blockwise trainer attention against a
naive softmax with an extra zero-valued key, values and gradients including the sinks'; paged decode
attention on the XLA path, the interpreted Pallas kernel and both cascade paths against the dense formula),
MXFP4 expert checkpoints dequantised on load, and the config.json round trip."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import GPT_OSS, build_hf_model, left_padded_batch, torch_logits

from jaxrl_llm.hf import load_hf_folder, mxfp4
from jaxrl_llm.models import ModelConfig, compute_logits
from jaxrl_llm.models.attention import attend
from jaxrl_llm.models.blockwise import causal_blockwise_attend
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.paged_attention import paged_decode_attention


def _naive_sink_attention(q, k, v, allowed, sinks, nkv):
    """softmax over [scores, sink] per row, the sink's column dropped: out [B * T, heads, D]."""
    b, t, nh, hd = q.shape
    qg = q.reshape(b, t, nkv, nh // nkv, hd)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k) * hd ** -0.5
    s = jnp.where(allowed[:, None, None], s, -1e30)
    sink = jnp.broadcast_to(sinks.reshape(nkv, nh // nkv)[None, :, :, None, None], (*s.shape[:-1], 1))
    p = jax.nn.softmax(jnp.concatenate([s, sink], -1), -1)[..., :-1]
    return jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(b * t, nh, hd)


@pytest.mark.parametrize("path", ["chunked", "blockwise"])
def test_sink_attention_values_and_gradients_equal_a_softmax_with_a_zero_valued_key(path):
    b, t, nh, nkv, hd = 2, 256, 4, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    q = jax.random.normal(keys[0], (b, t, nh, hd)) * 1.5
    k = jax.random.normal(keys[1], (b, nkv, t, hd))
    v = jax.random.normal(keys[2], (b, nkv, t, hd))
    sinks = jax.random.normal(keys[3], (nh,)) + 1.0  # of the scores' order: they take a real share
    causal = jnp.tril(jnp.ones((t, t), bool))
    allowed = jnp.stack([causal, causal.at[:, :40].set(False).at[:40].set(causal[:40])])  # row 1 left-padded
    d_out = jax.random.normal(keys[4], (b * t, nh, hd))

    def ours(q, k, v, s):
        if path == "chunked":  # two causal query chunks of 128
            out = attend(q, k, v, allowed, nkv, causal=True, sinks=s)
        else:  # blocks of 128 keys merged by log-sum-exp, the sink as the first block
            out = causal_blockwise_attend(q, k, v, allowed, s, nkv, None).reshape(b * t, nh, hd)
        return jnp.sum(out * d_out)

    def naive(q, k, v, s):
        return jnp.sum(_naive_sink_attention(q, k, v, allowed, s, nkv) * d_out)

    got, got_grads = jax.value_and_grad(ours, (0, 1, 2, 3))(q, k, v, sinks)
    want, want_grads = jax.value_and_grad(naive, (0, 1, 2, 3))(q, k, v, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)
    assert float(jnp.abs(got_grads[3]).min()) > 1e-3  # every head's sink learns
    # without the sinks the numbers move: the sink is not a no-op at these scales
    assert abs(float(naive(q, k, v, sinks)) - float(naive(q, k, v, sinks - 1e4))) > 1.0


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("cascade", [False, True])
def test_paged_attention_with_sinks_equals_the_dense_formula(impl, cascade):
    """Slots 0 and 2 share their first two pages (a cascade group); 13 / 7 / 16 keys of pages of 4."""
    rng = np.random.default_rng(0)
    slots, nh, nkv, hd, ps, pps = 3, 4, 2, 16, 4, 4
    lengths = np.array([13, 7, 16], np.int32)
    k_pages = rng.normal(size=(nkv, slots * pps + 1, ps, hd)).astype(np.float32)
    v_pages = rng.normal(size=(nkv, slots * pps + 1, ps, hd)).astype(np.float32)
    table = 1 + rng.permutation(slots * pps).reshape(slots, pps).astype(np.int32)
    table[2, :2] = table[0, :2]
    q = rng.normal(size=(slots, nh, hd)).astype(np.float32) * 1.5
    sinks = (rng.normal(size=(nh,)) + 1.0).astype(np.float32)
    groups = Cascade(jnp.asarray([[0, 2]], jnp.int32), jnp.asarray([2], jnp.int32)) if cascade else None
    got = np.asarray(paged_decode_attention(q, k_pages, v_pages, lengths, table, impl=impl, cascade=groups,
                                            sinks=jnp.asarray(sinks)))
    k = k_pages[:, table].reshape(nkv, slots, pps * ps, hd)
    v = v_pages[:, table].reshape(nkv, slots, pps * ps, hd)
    for s in range(slots):
        seen = np.arange(pps * ps) < lengths[s]
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = (k[kv, s] @ q[s, head]) * hd ** -0.5
            peak = max(scores[seen].max(), sinks[head])
            p = np.exp(scores - peak) * seen
            want = (p / (p.sum() + np.exp(sinks[head] - peak))) @ v[kv, s]
            np.testing.assert_allclose(got[s, head], want, atol=1e-5, rtol=1e-5)


def test_mxfp4_experts_load_dequantised(tmp_path):
    """A checkpoint whose experts are MXFP4 blocks and scales (as the GPT-OSS releases ship them) gives the
    logits of the same model with those weights dequantised."""
    import torch
    from safetensors.numpy import load_file, save_file

    family, overrides = GPT_OSS["gpt_oss"]
    model = build_hf_model(family, tmp_path / "dense", **overrides)
    with torch.no_grad():  # weights MXFP4 represents exactly: the model the quantised file describes
        for layer in model.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(layer.mlp.experts, name)
                exact = mxfp4.dequantize(*mxfp4.quantize(w.numpy()))
                assert np.abs(exact - w.numpy()).max() > 0  # really rounded
                w.copy_(torch.from_numpy(exact))
    model.save_pretrained(tmp_path / "dense")
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    tensors = load_file(str(tmp_path / "dense" / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4.quantize(tensors.pop(name))
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))

    cfg, params = load_hf_folder(folder)
    ids, mask = left_padded_batch(np.random.default_rng(0), cfg.vocab_size)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - torch_logits(model, ids, mask)[valid]).max() <= 1e-4

    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='fp8' is unsupported"):
        load_hf_folder(folder)


def test_config_json_round_trip():
    cfg = ModelConfig.tiny("gpt_oss")
    d = cfg.to_hf_config()
    assert d["layer_types"] == ["sliding_attention", "full_attention"] and d["num_local_experts"] == 8
    assert ModelConfig.from_hf_config(d) == cfg
    from transformers import GptOssConfig

    hf = GptOssConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert ModelConfig.from_hf_config({**hf.to_dict(), "architectures": d["architectures"]}) == cfg


def _write_gpt_oss_gguf(model, path, *, fused_gate_up: bool) -> None:
    """A GGUF of `model` laid out as llama.cpp's converter writes GPT-OSS: gate / up experts split from
    transformers' interleaved `gate_up_proj` (or fused, gate first) and transposed to [E, F, H], down to
    [E, H, F], the expert matrices in GGML's MXFP4, everything else F32."""
    import gguf

    cfg = model.config
    mx = gguf.GGMLQuantizationType.MXFP4
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
    for name, t in model.state_dict().items():
        a = t.detach().numpy().astype(np.float32)
        if name == "lm_head.weight":
            w.add_tensor("output.weight", a)
            continue
        name = name.removeprefix("model.")
        if name in names:
            w.add_tensor(names[name], a)
            continue
        i, rest = name.removeprefix("layers.").split(".", 1)
        blk = f"blk.{i}."
        if rest == "self_attn.sinks":
            w.add_tensor(blk + "attn_sinks.weight", a)
        elif rest.startswith("mlp.experts."):
            what = rest.removeprefix("mlp.experts.")
            if what == "down_proj":  # [E, F, H] -> [E, H, F]
                q = gguf.quants.quantize(np.ascontiguousarray(np.swapaxes(a, -1, -2)), mx)
                w.add_tensor(blk + "ffn_down_exps.weight", q, raw_dtype=mx)
            elif what == "down_proj_bias":
                w.add_tensor(blk + "ffn_down_exps.bias", a)
            else:
                bias = what.endswith("_bias")
                gate, up = a[..., 0::2], a[..., 1::2]
                if not bias:
                    gate, up = np.swapaxes(gate, -1, -2), np.swapaxes(up, -1, -2)  # [E, F, H]
                leaf = "bias" if bias else "weight"
                parts = {"ffn_gate_up_exps": np.concatenate([gate, up], axis=1)} if fused_gate_up else {
                    "ffn_gate_exps": gate, "ffn_up_exps": up}
                for gname, v in parts.items():
                    v = np.ascontiguousarray(v)
                    if bias:
                        w.add_tensor(blk + f"{gname}.{leaf}", v)
                    else:
                        w.add_tensor(blk + f"{gname}.{leaf}", gguf.quants.quantize(v, mx), raw_dtype=mx)
        else:
            module, leaf = rest.rsplit(".", 1)
            w.add_tensor(blk + f"{layer[module]}.{leaf}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("fused_gate_up", [False, True])
def test_gguf_with_mxfp4_experts_loads_with_transformers_logits(tmp_path, fused_gate_up):
    """llama.cpp's gpt-oss GGUF layout (split or fused gate / up experts, MXFP4 expert matrices): the logits
    of the transformers model whose experts hold the same (MXFP4-rounded) weights."""
    import gguf
    import torch

    from jaxrl_llm.hf import load_gguf

    family, overrides = GPT_OSS["gpt_oss"]
    # llama.cpp keeps no swiglu_limit (its gpt-oss clamps at transformers' default 7)
    model = build_hf_model(family, tmp_path / "hf", **{**overrides, "swiglu_limit": 7.0})
    mx = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():  # weights GGML's MXFP4 holds exactly (quantised along each row's inputs)
        for layer in model.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, name)
                rows = np.ascontiguousarray(np.swapaxes(p.numpy(), -1, -2))  # [E, out, in]
                exact = gguf.quants.dequantize(gguf.quants.quantize(rows, mx), mx).reshape(rows.shape)
                p.copy_(torch.from_numpy(np.ascontiguousarray(np.swapaxes(exact, -1, -2))))
    path = tmp_path / "gpt-oss.gguf"
    _write_gpt_oss_gguf(model, path, fused_gate_up=fused_gate_up)
    cfg, params = load_gguf(path)
    assert cfg.model_type == "gpt_oss" and cfg.local_layer_ids == (0, 2) and cfg.attention_sinks
    ids, mask = left_padded_batch(np.random.default_rng(0), cfg.vocab_size)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - torch_logits(model, ids, mask)[valid]).max() <= 1e-4


def test_mxfp4_export_reloads_in_transformers_and_ours(tmp_path):
    """`export_hf(experts="mxfp4")`: the experts as blocks and scales with `quantization_config`, as the releases
    ship; transformers' MXFP4 loader (dequantising on CPU) and ours give the same logits, the expert weights are
    the originals rounded to MXFP4, and a family without that format is refused."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from jaxrl_llm.hf import export_hf

    family, overrides = GPT_OSS["gpt_oss"]
    build_hf_model(family, tmp_path / "src", **overrides)
    cfg, params = load_hf_folder(tmp_path / "src")
    export_hf(cfg, params, tmp_path / "mx", experts="mxfp4")
    assert json.loads((tmp_path / "mx" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(str(tmp_path / "mx" / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    cfg2, params2 = load_hf_folder(tmp_path / "mx")
    assert cfg2 == cfg
    up = np.asarray(params["layers"]["moe"]["experts"]["up_proj"]["kernel"])
    up2 = np.asarray(params2["layers"]["moe"]["experts"]["up_proj"]["kernel"])
    assert 0 < np.abs(up2 - up).max() < 0.2 * np.abs(up).max()  # rounded, not replaced
    np.testing.assert_array_equal(params2["layers"]["attn"]["sinks"], params["layers"]["attn"]["sinks"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "mx", dtype=torch.float32).eval()
    ids, mask = left_padded_batch(np.random.default_rng(0), cfg.vocab_size)
    ours = np.asarray(compute_logits(params2, cfg2, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - torch_logits(hf, ids, mask)[valid]).max() <= 1e-4
    with pytest.raises(ValueError, match="GPT-OSS's checkpoint format"):
        export_hf(ModelConfig.tiny("qwen3_moe"), {}, tmp_path / "no", experts="mxfp4")
