"""MXFP4 expert weights (GPT-OSS releases): dequantised on load to the compute dtype.

A released GPT-OSS checkpoint stores each layer's experts as `<name>_blocks` (uint8 [E, out, G, 16]: two
4-bit E2M1 values a byte, the low nibble first) and `<name>_scales` (uint8 [E, out, G]: a power-of-two
exponent per block of 32 values, biased by 127); `config.json` says `quantization_config.quant_method:
mxfp4`. Dequantised, block g of row o holds the inputs [32 g, 32 g + 32) of output o, so the tensor
read back is [E, in, out], the layout of transformers' dequantised `GptOssExperts` (hf/names.py's
`gate_up_proj` / `down_proj`). We dequantise rather than train in FP4: RL updates need the master
weights in fp32 (and export writes them dense: docs/gpt_oss.md).
"""
from __future__ import annotations

import numpy as np

# E2M1 values of the 16 nibbles (sign bit 3)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[E, out, G, B] packed blocks -> the dequantised [E, G * B * 2, out]."""
    *lead, out, groups, size = blocks_shape
    return (*lead, groups * size * 2, out)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """fp32 [E, in, out] of MXFP4 `blocks` uint8 [E, out, G, B] and `scales` uint8 [E, out, G]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} disagree (scales are the blocks' "
                         "shape without its last axis)")
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    *lead, out, groups, width = values.shape
    return np.swapaxes(values.reshape(*lead, out, groups * width), -1, -2)


def quantize(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of fp32 [E, in, out] weights whose every block of 32 inputs is exactly a power of two
    times E2M1 values (round to nearest E2M1 otherwise). Tests build MXFP4 checkpoints with it."""
    w = np.swapaxes(np.asarray(weights, np.float32), -1, -2)  # [E, out, in]
    *lead, out, width = w.shape
    if width % 32:
        raise ValueError(f"MXFP4 needs the input width ({width}) in blocks of 32")
    w = w.reshape(*lead, out, width // 32, 32)
    peak = np.max(np.abs(w), axis=-1)
    exponent = np.where(peak > 0, np.ceil(np.log2(np.where(peak > 0, peak, 1.0) / 6.0)), 0).astype(np.int32)
    scaled = w / np.ldexp(1.0, exponent)[..., None]
    nibbles = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    # C order: numpy keeps its input's (transposed) layout through these ops, and safetensors writes an array's
    # memory as it lies
    return (np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8))
