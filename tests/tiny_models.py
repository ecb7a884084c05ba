"""Test helpers shared across folders: a tiny char-level ChatML tokenizer and tiny random
transformers models saved to a folder (for parity tests against our loaders and sampler).
`pyproject.toml` puts `tests/` on the pytest path, so any test can `import tiny_models`."""
from __future__ import annotations

import string

import numpy as np

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# vocab 256, pad 0, bos 1, eos 2: the HF twin of `ModelConfig.tiny(...)`
TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_char_tokenizer(chat_template: str = CHATML):
    """One token per printable ASCII character; specials <pad>=0, <|im_start|>=1, <|im_end|>=2 (eos)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(dict.fromkeys(string.printable)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = chat_template
    return tok


# the mixture-of-experts families' tiny twins (ModelConfig.tiny(family)): 8 experts, top-2, width 32
TINY_MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
}
MOE_FAMILIES = tuple(TINY_MOE)
# mixture-of-experts models with dense MLP layers between the sparse ones: (family, config overrides)
MIXED_MOE = {
    "qwen3_moe_mixed": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[0])),      # sparse: 1, 2
    "qwen2_moe_mixed": ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),  # sparse: 1, 3
}


# per-layer sliding windows (Qwen2 / Qwen3 `layer_types`): 3 layers, a window of 3 tokens
WINDOW_LAYERS = {
    "qwen2_window_layers": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=3,
                                          max_window_layers=1)),  # sliding: 1, 2
    "qwen3_layer_types": ("qwen3", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=3,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


# Gemma 2 / Gemma 3 (text): 3 layers, sliding (window 3), full, sliding; query_pre_attn_scalar 32 (not
# head_dim 16); Gemma 2's soft-caps small enough to bite at these scales; Gemma 3's own local RoPE base
GEMMA = {
    "gemma2": ("gemma2", dict(num_hidden_layers=3, sliding_window=3, query_pre_attn_scalar=32,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=3, sliding_window=3, query_pre_attn_scalar=32,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 1e4}})),
}


# GPT-OSS: 3 layers, sliding (window 3), full, sliding; a SwiGLU clamp the tiny weights reach (transformers'
# default YaRN RoPE, attention sinks, biases everywhere)
GPT_OSS = {"gpt_oss": ("gpt_oss", dict(num_hidden_layers=3, sliding_window=3, swiglu_limit=1.0,
                                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "truncate": False, "rope_theta": 1.5e5,
                                                        "original_max_position_embeddings": 64}))}


# Gemma 4 (text): 6 layers, sliding (window 3) / full alternating, full layers with heads twice as wide;
# "gemma4": the E2B-style traits (k = v with one global kv head, the last 2 layers reading layers 2 and 3's
# K / V, double-wide MLP there, per-layer inputs, a final soft-cap); "gemma4_plain": none of those (the 31B
# shape: own K / V everywhere, v_proj on every layer)
_GEMMA4_BASE = dict(num_hidden_layers=6, sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 3,
                    global_head_dim=32)
GEMMA4 = {
    "gemma4": ("gemma4_text", dict(_GEMMA4_BASE, attention_k_eq_v=True, num_global_key_value_heads=1,
                                   num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                                   vocab_size_per_layer_input=256, final_logit_softcapping=30.0)),
    "gemma4_plain": ("gemma4_text", dict(_GEMMA4_BASE, hidden_size_per_layer_input=0)),
    # the 26B-A4B shape: routed experts (4, top-2, width 16) beside every layer's MLP, k = v
    "gemma4_moe": ("gemma4_text", dict(_GEMMA4_BASE, attention_k_eq_v=True, num_global_key_value_heads=1,
                                       hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                                       top_k_experts=2, moe_intermediate_size=16)),
}


# DeepSeek-V3: 3 layers (layer 0 dense, 1 and 2 routed: 8 experts in 4 groups, the best 2 open, top-2, a shared
# expert); multi-head latent attention with a q bottleneck, interleaved rope dims and YaRN with both mscales
# ("deepseek_v3"; rope dims 16: a latent pool of 32 + 16 = 48, which the Triton kernel reads in two pieces), or
# one q_proj, rotate-half rope dims, values wider than the keys and no groups, every layer routed
# ("deepseek_v3_plain")
_DEEPSEEK_BASE = dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=8, kv_lora_rank=32, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      n_shared_experts=1, routed_scaling_factor=2.5, num_mtp_layers=0)
DEEPSEEK = {
    "deepseek_v3": ("deepseek_v3", dict(_DEEPSEEK_BASE, head_dim=16, qk_rope_head_dim=16, q_lora_rank=24,
                                        v_head_dim=16, n_group=4, topk_group=2, first_k_dense_replace=1,
                                        rope_interleave=True,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                         "original_max_position_embeddings": 64, "mscale": 0.8,
                                                         "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                                         "beta_slow": 1.0})),
    "deepseek_v3_plain": ("deepseek_v3", dict(_DEEPSEEK_BASE, q_lora_rank=None, v_head_dim=24, n_group=1,
                                              topk_group=1, first_k_dense_replace=0, rope_interleave=False)),
    # DeepSeek-V2: softmax routing limited to the 2 of 4 groups with the best single expert, weights not renormalised
    # but scaled; complex-pair RoPE with YaRN; a dense first layer (num_mtp_layers is V3's: left out)
    "deepseek_v2": ("deepseek_v2", dict({k: v for k, v in _DEEPSEEK_BASE.items() if k != "num_mtp_layers"},
                                        q_lora_rank=None, v_head_dim=16, topk_method="group_limited_greedy",
                                        n_group=4, topk_group=2, first_k_dense_replace=1,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                         "original_max_position_embeddings": 64,
                                                         "mscale": 0.8, "mscale_all_dim": 1.0})),
}


# Qwen3.5 (text): 4 layers, gated delta net / gated attention alternating (2 key and 4 value heads of 8 dims, a conv
# of 4 taps; attention heads of 16 with RoPE on their first 4 dims and an output gate)
_QWEN35_BASE = dict(num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=["linear_attention", "full_attention"] * 2)
QWEN35 = {"qwen3_5": ("qwen3_5_text", _QWEN35_BASE),
          # biases on the gated attention's q (query and gate) / k / v / o
          "qwen3_5_bias": ("qwen3_5_text", dict(_QWEN35_BASE, attention_bias=True)),
          # Qwen3.5-MoE: every layer's MLP 8 experts (2 a token, renormalised) and a sigmoid-gated shared expert
          "qwen3_5_moe": ("qwen3_5_moe_text", dict(_QWEN35_BASE, num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, shared_expert_intermediate_size=48))}


def family_case(case: str) -> tuple[str, dict]:
    """(family, overrides) of a family name or a MIXED_MOE / WINDOW_LAYERS / GEMMA / GEMMA4 / GPT_OSS / DEEPSEEK
    case name."""
    return {**MIXED_MOE, **WINDOW_LAYERS, **GEMMA, **GEMMA4, **GPT_OSS, **DEEPSEEK, **QWEN35}.get(case, (case, {}))


def hf_config(family: str, **overrides):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "mixtral": transformers.MixtralConfig, "gemma2": transformers.Gemma2Config,
           "gemma3_text": transformers.Gemma3TextConfig, "gemma4_text": transformers.Gemma4TextConfig,
           "gpt_oss": transformers.GptOssConfig, "deepseek_v3": transformers.DeepseekV3Config,
           "deepseek_v2": transformers.DeepseekV2Config,
           "qwen3_5_text": transformers.Qwen3_5TextConfig,
           "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig}[family]
    return cls(**{**TINY_HF, **TINY_MOE.get(family, {}), **overrides})


def build_hf_model(family: str, folder, *, head: str = "lm", seed: int = 0, **overrides):
    """A randomly initialised (every weight, norms included) tiny HF model saved to `folder`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    auto = (transformers.AutoModelForSequenceClassification if head == "score"
            else transformers.AutoModelForCausalLM)
    # eager attention: the reference computation (sdpa has no soft-capping)
    model = auto.from_config(hf_config(family, **overrides), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():  # Gemma 4's per-layer scalar is a (saved) buffer
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router bias: moves the experts chosen
                b.normal_(0.0, 0.3)
    model.eval()
    model.save_pretrained(folder)
    return model


def torch_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


def assert_export_reloads(cfg, params, folder, architecture: str, seed: int = 0) -> None:
    """`export_hf` of (cfg, params) into `folder` reloads in transformers as `architecture` with our logits
    (1e-4, fp32, a left-padded batch) and in our loader with our config and bit-equal params."""
    import jax
    import jax.numpy as jnp
    from transformers import AutoModelForCausalLM

    from jaxrl_llm.hf import export_hf, load_hf_folder
    from jaxrl_llm.models import compute_logits

    export_hf(cfg, params, folder)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == architecture
    ids, mask = left_padded_batch(np.random.default_rng(seed), cfg.vocab_size)
    valid = mask.astype(bool)
    ours = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(ours[valid] - torch_logits(hf, ids, mask)[valid]).max() <= 1e-4
    cfg2, params2 = load_hf_folder(folder)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def left_padded_batch(rng: np.random.Generator, vocab: int, lengths=(8, 5, 3), pad_id: int = 0):
    """Left-padded ids/mask; pad id also appears as a real token (padding is the mask, not the id)."""
    t = max(lengths)
    ids = np.full((len(lengths), t), pad_id, np.int64)
    mask = np.zeros((len(lengths), t), np.int64)
    for row, n in enumerate(lengths):
        ids[row, t - n:] = rng.integers(0, vocab, n)
        ids[row, t - n] = pad_id  # a real token equal to the pad id
        mask[row, t - n:] = 1
    return ids, mask


def random_rollout(rng: np.random.Generator, rows: int, prompt_width: int, response_width: int, *,
                   min_prompt: int = 2, max_prompt: int | None = None, max_response: int | None = None,
                   low_id: int = 3, vocab: int = 64):
    """A random rollout batch in the trainer's layout (numpy): prompts left-padded to `prompt_width`,
    responses right-padded to `response_width`. Returns (ids [rows, P + R] int32, attention_mask
    [rows, P + R] int32, response_mask [rows, R] int32, prompt lengths, response lengths). Draws
    prompt lengths, response lengths, then ids from `rng`, so callers that draw more afterwards keep
    their numbers."""
    prompt_len = rng.integers(min_prompt, (max_prompt or prompt_width) + 1, size=rows)
    resp_len = rng.integers(1, (max_response or response_width) + 1, size=rows)
    prompt_mask = (np.arange(prompt_width)[None] >= prompt_width - prompt_len[:, None]).astype(np.int32)
    resp_mask = (np.arange(response_width)[None] < resp_len[:, None]).astype(np.int32)
    ids = rng.integers(low_id, vocab, size=(rows, prompt_width + response_width)).astype(np.int32)
    return ids, np.concatenate([prompt_mask, resp_mask], 1), resp_mask, prompt_len, resp_len


def with_trained_adapters(cfg, params, lora, ids: np.ndarray, mask: np.ndarray):
    """(adapters as if trained: fresh LoRA adapters with every A and B moved by noise of 0.05, the params with
    them, our logits of ids / mask with them), asserting the adapters move those logits by more than 1e-2."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models import compute_logits
    from jaxrl_llm.models.lora import init_lora, with_lora

    ad = init_lora(cfg, lora, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), 64))
    ad = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), ad)
    full = with_lora(params, ad, lora.scale)
    ours = np.asarray(compute_logits(full, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    base = np.asarray(compute_logits(params, cfg, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(ours - base)[mask.astype(bool)].max() > 1e-2  # the adapters change the logits
    return ad, full, ours
