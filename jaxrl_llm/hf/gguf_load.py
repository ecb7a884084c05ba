"""Load a Llama or GPT-OSS GGUF file (llama.cpp format) without torch.

Tensors are dequantised one at a time with `gguf.quants.dequantize` (F32 / F16 / BF16 / Q8_0 /
Q4_0 / Q4_1, and MXFP4, GPT-OSS's expert format). llama.cpp's converter permutes the rows of Llama's q
and k (interleaved RoPE layout); we undo that so the weights match the HF (rotate-half) layout our
decoder uses (GPT-OSS's are stored unpermuted). GPT-OSS's experts are stored as llama.cpp's converter
writes them: `ffn_gate_exps` / `ffn_up_exps` [E, F, H] (or fused `ffn_gate_up_exps` [E, 2F, H], gate
first) and `ffn_down_exps` [E, H, F], each with a bias; they answer to transformers' interleaved
`gate_up_proj` [E, H, 2F] and `down_proj` [E, F, H] here (hf/names.py reads those). The ModelConfig comes
from the GGUF metadata; embeddings are tied when the file has no `output.weight`.
"""
from __future__ import annotations

import functools
import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import DType
from jaxrl_llm.hf.assemble import Shardings, assemble_params
from jaxrl_llm.hf.names import interleave_parts
from jaxrl_llm.models.config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "gpt-oss")
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "MXFP4")

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
# GPT-OSS (llama.cpp's `gpt-oss` architecture): its norm after attention, biases, sinks and router
_GPT_OSS_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    **{f"self_attn.{p}_proj.bias": f"attn_{g}.bias" for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))},
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# transformers' GPT-OSS expert tensors a GGUF holds as other tensors (`GGUFSource.read` composes them)
_COMPOSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj")


class UnsupportedQuantizationError(ValueError):
    """A GGUF tensor uses a quantisation type we cannot dequantise."""


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    m = _LAYER_RE.fullmatch(hf_name)
    if m:
        names = _GPT_OSS_LAYER_NAMES if arch == "gpt-oss" else _LAYER_NAMES
        return f"blk.{m.group(1)}.{names.get(m.group(2), m.group(2))}"
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
        self.arch = str(self.field("general.architecture", "llama"))

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _stored_shape(self, gguf_tensor: str) -> tuple[int, ...] | None:
        t = self._tensors.get(gguf_tensor)
        return None if t is None else tuple(int(d) for d in reversed(t.shape))

    def _stored(self, gguf_tensor: str) -> np.ndarray:
        t = self._tensors[gguf_tensor]
        arr = self._dequantize(t.data, t.tensor_type)
        shape = self._stored_shape(gguf_tensor)
        assert shape is not None
        return np.asarray(arr, np.float32).reshape(shape)

    def _experts(self, name: str) -> tuple[str, str] | None:
        """(layer prefix `blk.{i}.`, what) of GPT-OSS's composed expert tensors, else None."""
        m = _LAYER_RE.fullmatch(name)
        if self.arch != "gpt-oss" or m is None:
            return None
        what = m.group(2)
        return (f"blk.{m.group(1)}.", what) if what in _COMPOSED_EXPERTS else None

    def shape(self, name: str) -> tuple[int, ...] | None:
        composed = self._experts(name)
        if composed is None:
            return self._stored_shape(gguf_name(name, self.arch))
        blk, what = composed
        if what == "mlp.experts.down_proj":  # [E, H, F] stored -> [E, F, H]
            stored = self._stored_shape(blk + "ffn_down_exps.weight")
            return None if stored is None else (stored[0], stored[2], stored[1])
        parts = self._gate_up_parts(blk, bias=what.endswith("_bias"))
        if parts is None:
            return None
        e, width = parts[1][0], parts[1][1]
        return (e, 2 * width) if what.endswith("_bias") else (e, parts[1][2], 2 * width)

    def _gate_up_parts(self, blk: str, *, bias: bool) -> tuple[str, tuple[int, ...]] | None:
        """('split' | 'fused', the gate part's stored shape [E, F(, H)]) of a layer's gate / up experts."""
        leaf = "bias" if bias else "weight"
        gate = self._stored_shape(blk + f"ffn_gate_exps.{leaf}")
        if gate is not None:
            return "split", gate
        fused = self._stored_shape(blk + f"ffn_gate_up_exps.{leaf}")
        if fused is None:
            return None
        return "fused", (fused[0], fused[1] // 2, *fused[2:])

    def read(self, name: str) -> np.ndarray:
        composed = self._experts(name)
        if composed is None:
            return self._stored(gguf_name(name, self.arch))
        blk, what = composed
        if what == "mlp.experts.down_proj":
            return np.swapaxes(self._stored(blk + "ffn_down_exps.weight"), -1, -2)
        bias = what.endswith("_bias")
        leaf = "bias" if bias else "weight"
        parts = self._gate_up_parts(blk, bias=bias)
        assert parts is not None, name  # assemble_params checked every shape before reading
        if parts[0] == "split":
            gate, up = self._stored(blk + f"ffn_gate_exps.{leaf}"), self._stored(blk + f"ffn_up_exps.{leaf}")
        else:
            gate, up = np.split(self._stored(blk + f"ffn_gate_up_exps.{leaf}"), 2, axis=1)
        if not bias:  # [E, F, H] -> transformers' [E, H, F]
            gate, up = np.swapaxes(gate, -1, -2), np.swapaxes(up, -1, -2)
        return interleave_parts([gate, up])

    def has(self, gguf_tensor: str) -> bool:
        return gguf_tensor in self._tensors


def open_gguf(path: str | pathlib.Path) -> GGUFSource:
    """The file's `GGUFSource`, parsed once per process while the file is unchanged (same size and
    modification time): `gguf.GGUFReader` parses every metadata field up front, ~4 s for SmolLM2's
    49k-token vocabulary and merges, and a run reads one file for the model's config, its weights, and
    again for a reference, judge or teacher of the same folder (4 parses a launch of configs/judge.py)."""
    resolved = pathlib.Path(path).resolve()
    stat = resolved.stat()
    return _parsed_gguf(str(resolved), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)  # memory-mapped: the tensors are not held, only the parsed header
def _parsed_gguf(path: str, size: int, mtime_ns: int) -> GGUFSource:
    del size, mtime_ns  # the cache key: a rewritten file is parsed again
    return GGUFSource(path)


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
    gpt_oss = arch == "gpt-oss"
    d = {
        "architectures": ["GptOssForCausalLM" if gpt_oss else "LlamaForCausalLM"],
        "model_type": "gpt_oss" if gpt_oss else "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("expert_feed_forward_length" if gpt_oss else "feed_forward_length")),
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
    if gpt_oss:  # llama.cpp's gpt-oss: sliding on even layers (transformers' default layer_types), YaRN
        d.update(num_local_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                 sliding_window=int(need("attention.sliding_window")), attention_bias=True)
        if scaling not in (None, "none"):
            if scaling != "yarn":
                raise ValueError(f"GGUF rope scaling type {scaling!r} is unsupported for gpt-oss (only 'yarn')")
            d["rope_scaling"] = {"rope_type": "yarn", "factor": float(need("rope.scaling.factor")),
                                 "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    elif scaling not in (None, "none"):
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
    source = open_gguf(path)
    cfg = gguf_config(source)

    def undo_permutation(name: str, w: np.ndarray) -> np.ndarray:
        if cfg.model_type != "llama":  # llama.cpp permutes Llama's q / k rows only
            return w
        if name.endswith("self_attn.q_proj.weight"):
            return unpermute_qk(w, cfg.num_attention_heads)
        if name.endswith("self_attn.k_proj.weight"):
            return unpermute_qk(w, cfg.num_key_value_heads)
        return w

    params = assemble_params(cfg, source, head=head, dtype=dtype, shardings=shardings, rng=rng,
                             transform=undo_permutation)
    return cfg, params
