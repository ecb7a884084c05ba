"""Load a Llama-architecture GGUF file (llama.cpp format) without torch.

Tensors are dequantised one at a time with `gguf.quants.dequantize` (F32 / F16 / BF16 / Q8_0 /
Q4_0 / Q4_1). llama.cpp's converter permutes the rows of q and k (interleaved RoPE layout); we undo
that so the weights match the HF (rotate-half) layout our decoder uses. The ModelConfig comes from
the GGUF metadata; embeddings are tied when the file has no `output.weight`.
"""
from __future__ import annotations

import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import DType
from jaxrl_llm.hf.assemble import Shardings, assemble_params
from jaxrl_llm.models.config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


class UnsupportedQuantizationError(ValueError):
    """A GGUF tensor uses a quantisation type we cannot dequantise."""


def gguf_name(hf_name: str) -> str:
    m = _LAYER_RE.fullmatch(hf_name)
    if m:
        return f"blk.{m.group(1)}.{_LAYER_NAMES.get(m.group(2), m.group(2))}"
    return _TOP_NAMES.get(hf_name, hf_name)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)` on q/k rows ([n_head*head_dim, hidden])."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class GGUFSource:
    """HF-named, HF-layout tensors read (and dequantised) lazily from a GGUF file."""

    def __init__(self, path: str | pathlib.Path):
        import gguf

        self._dequantize = gguf.quants.dequantize
        self.reader = gguf.GGUFReader(str(path))
        self._tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in SUPPORTED_GGUF_TYPES:
                raise UnsupportedQuantizationError(
                    f"GGUF tensor {t.name!r} has quantisation type {kind}, which is unsupported; "
                    f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}")

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self._tensors.get(gguf_name(name))
        return None if t is None else tuple(int(d) for d in reversed(t.shape))

    def read(self, name: str) -> np.ndarray:
        t = self._tensors[gguf_name(name)]
        arr = self._dequantize(t.data, t.tensor_type)
        return np.asarray(arr, np.float32).reshape(self.shape(name))

    def has(self, gguf_tensor: str) -> bool:
        return gguf_tensor in self._tensors


def gguf_config(source: GGUFSource) -> ModelConfig:
    arch = source.field("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    if source.has("rope_freqs.weight"):
        raise ValueError("GGUF has rope_freqs.weight (llama3 rope scaling), which is unsupported "
                         "for GGUF import; load the HF folder instead")

    def need(key: str):
        value = source.field(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    embed_shape = source.shape("model.embed_tokens.weight")
    if embed_shape is None:
        raise ValueError("GGUF is missing tensor 'token_embd.weight'")
    vocab = int(source.field(f"{arch}.vocab_size", embed_shape[0]))
    head_dim = int(source.field(f"{arch}.attention.key_length", hidden // heads))
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(source.field(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(source.field(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(source.field(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": not source.has("output.weight"),
        "bos_token_id": source.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": source.field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": source.field("tokenizer.ggml.padding_token_id"),
    }
    scaling = source.field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF rope scaling type {scaling!r} is unsupported (only 'linear')")
        d["rope_scaling"] = {"rope_type": "linear",
                             "factor": float(need("rope.scaling.factor"))}
    return ModelConfig.from_hf_config(d)


def load_gguf(path: str | pathlib.Path, *, dtype: DType = jnp.float32, shardings: Shardings = None,
              head: str = "lm", rng=None) -> tuple[ModelConfig, dict]:
    """(cfg, params) from a GGUF file (dequantised to `dtype`)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    source = GGUFSource(path)
    cfg = gguf_config(source)

    def undo_permutation(name: str, w: np.ndarray) -> np.ndarray:
        if name.endswith("self_attn.q_proj.weight"):
            return unpermute_qk(w, cfg.num_attention_heads)
        if name.endswith("self_attn.k_proj.weight"):
            return unpermute_qk(w, cfg.num_key_value_heads)
        return w

    params = assemble_params(cfg, source, head=head, dtype=dtype, shardings=shardings, rng=rng,
                             transform=undo_permutation)
    return cfg, params
