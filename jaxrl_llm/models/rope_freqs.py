"""RoPE's inverse frequencies and cos / sin factor for a ModelConfig, as transformers computes them (plain,
linear, llama3, YaRN; `dynamic`'s base frequencies)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxrl_llm.models.config import ModelConfig


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor transformers multiplies RoPE's cos and sin by (YaRN's attention temperature; else 1):
    `attention_factor` when given, else 0.1 ln(factor) + 1 (DeepSeek's mscale / mscale_all_dim ratio
    when both are set)."""
    s = cfg.rope_scaling_dict
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"]))
    return mscale(factor)


def _yarn_inv_freq(inv: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """YaRN (arXiv 2309.00071) as transformers computes it: each frequency blends the interpolated
    (inv / factor) and the original one by a linear ramp over the dims between the rotation counts
    beta_slow and beta_fast of the original context."""
    s, dim = cfg.rope_scaling_dict, cfg.rotary_dim
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (the original frequency), 0: interpolate
    return (inv / np.float32(factor) * (1 - keep) + inv * keep).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] (float32), with linear / llama3 / yarn scaling as transformers does
    (`dynamic` depends on the positions of each forward: models/decoder.py `rope_cos_sin`; these are its
    frequencies within max_position_embeddings). Over `cfg.rotary_dim` (Qwen3.5's partial rotary)."""
    dim = cfg.rotary_dim
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)))
    inv = inv.astype(np.float32)
    s = cfg.rope_scaling_dict
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv = inv / np.float32(s["factor"])
    elif kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, cfg)
    return inv
