"""Multi-head latent attention (DeepSeek-V3's shape) against a dense grouped-query model of the same active size,
through the paged engine, on this machine.

    python bench/mla.py [--layers 4] [--hidden 512] [--heads 8] [--prompt 512] [--new 64] [--slots 8] [--kv-heads 0]

Both models have `--layers` layers of hidden `--hidden` with MoE MLPs of the same active width (top-2 of 8 experts
plus a shared expert; the dense twin: a Qwen3-MoE-shaped model with no shared expert whose experts are wide enough
to match). The MLA model's heads are DeepSeek-V3's proportions (nope = a head, rope = half a head, values a head,
a latent of 4 heads' dims); the twin has a kv head per query head (`--kv-heads`: fewer), as the multi-head
attention MLA replaces. Prints for each: the KV bytes a token takes over all layers (the pool's), new tokens/s of
greedy generation of `--new` tokens after `--prompt`-token prompts in `--slots` slots (the paged engine, XLA
attention; the prefill included), and the MLA / GQA ratios. On a CPU the decode is bound by the weights as much
as by the KV, so the ratio says more about the extra absorbed matmuls than about memory; the pool's bytes are
what matter on a device.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.engine import EngineSpec
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged


def configs(args: argparse.Namespace) -> tuple[ModelConfig, ModelConfig]:
    hd = args.hidden // args.heads
    common = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                  vocab_size=4096, max_position_embeddings=4 * (args.prompt + args.new), num_experts=8,
                  num_experts_per_tok=2, eos_token_id=None)
    mla = ModelConfig.tiny("deepseek_v3", head_dim=hd // 2, qk_nope_head_dim=hd, v_head_dim=hd,
                           kv_lora_rank=4 * hd, q_lora_rank=args.hidden // 2, moe_intermediate_size=args.hidden,
                           shared_expert_intermediate_size=args.hidden, mlp_only_layers=(), n_group=4, topk_group=2,
                           **common)
    gqa = ModelConfig.tiny("qwen3_moe", num_key_value_heads=args.kv_heads or args.heads, head_dim=hd,
                           moe_intermediate_size=3 * args.hidden // 2,
                           **common)
    return mla, gqa


def decode_tokens_per_s(cfg: ModelConfig, args: argparse.Namespace) -> tuple[float, int]:
    """(new tokens/s of greedy generation through the paged engine, prefill included; KV bytes a token over all
    layers) for `args`' prompts, new tokens, slots and reps (bench/hybrid.py measures with it too)."""
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, args.prompt)) for _ in range(args.slots)]
    settings, knobs = SamplingParams(max_new_tokens=args.new, do_sample=False, ignore_eos=True).compile_args(
        (), 0, vocab_size=cfg.vocab_size)
    opts = EngineOptions(engine="paged", max_num_seqs=args.slots, attention_impl="xla", cascade_attention=False,
                         unroll_layers=getattr(args, "unroll", "auto"))
    sample_paged(params, cfg, prompts, jax.random.key(0), knobs, settings=settings, opts=opts)  # compile
    best = float("inf")
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out, _ = sample_paged(params, cfg, prompts, jax.random.key(0), knobs, settings=settings, opts=opts)
        best = min(best, time.perf_counter() - t0)
    tokens = int(np.asarray(out.response_mask).sum())
    page = EngineSpec(max_num_seqs=1, page_size=16, num_pages=2, pages_per_slot=1).page_bytes(cfg, "float32") // 16
    return tokens / best, page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=0, help="the twin's kv heads (0: one per head, MHA)")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    mla, gqa = configs(args)
    rows = {}
    for name, cfg in (("mla (deepseek_v3)", mla), ("gqa (qwen3_moe)", gqa)):
        rows[name] = decode_tokens_per_s(cfg, args)
        speed, kv = rows[name]
        print(f"{name:20s} KV {kv:7d} B/token (fp32, all layers)   generate {speed:8.1f} new tokens/s "
              "(prefill included)")
    (s_mla, kv_mla), (s_gqa, kv_gqa) = rows.values()
    print(f"mla / gqa: KV bytes {kv_mla / kv_gqa:.2f}x, new tokens/s {s_mla / s_gqa:.2f}x "
          f"({args.slots} slots, {args.prompt}-token prompts, {args.new} new tokens, {jax.devices()[0].platform})")


if __name__ == "__main__":
    main()
