"""Qwen3.5's hybrid decoder (gated delta-net layers between gated attention layers) against an all-attention
decoder of the same size (Qwen3: the same hidden, heads, MLP and layer count), through the paged engine, on this
machine.

    python bench/hybrid.py [--layers 8] [--hidden 512] [--heads 8] [--prompt 512] [--new 64] [--slots 8]

The hybrid model's layers are Qwen3.5's pattern (three delta-net layers, then one attention layer); its delta net
has half as many key heads as value heads, both of the attention's head dim. Prints for each: parameters, the KV
bytes a token takes over all layers (the pool's: the hybrid's attention layers only), the fixed recurrent state a
sequence holds (the delta-net layers' conv window and state, fp32), new tokens/s of greedy generation of `--new`
tokens after `--prompt`-token prompts in `--slots` slots (prefill included), and the hybrid / attention ratios.
On a CPU decode is bound by the weights as much as by the KV; the pool's bytes per token (a quarter of the
attention model's) are what lets a device hold longer contexts or more slots.
"""
from __future__ import annotations

import argparse

import jax
from mla import decode_tokens_per_s  # bench/mla.py, beside this script: the same measurement

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.models.hybrid import recurrent_bytes


def configs(args: argparse.Namespace) -> tuple[ModelConfig, ModelConfig]:
    hd = args.hidden // args.heads
    common = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                  num_key_value_heads=2, head_dim=hd, intermediate_size=3 * args.hidden, vocab_size=4096,
                  max_position_embeddings=4 * (args.prompt + args.new), eos_token_id=None)
    hybrid = ModelConfig.tiny("qwen3_5_text", **common,
                              linear_layers=tuple(i for i in range(args.layers) if (i + 1) % 4),
                              linear_key_heads=args.heads // 2, linear_value_heads=args.heads,
                              linear_key_head_dim=hd, linear_value_head_dim=hd)
    return hybrid, ModelConfig.tiny("qwen3", **common)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--unroll", default="auto", type=lambda v: v if v == "auto" else v == "true",
                        help="rollout.unroll_layers (auto: on for a CPU's long decodes; the hybrid stays scanned)")
    args = parser.parse_args(argv)
    rows = {}
    for name, cfg in zip(("hybrid (qwen3_5_text)", "attention (qwen3)"), configs(args)):
        rows[name] = decode_tokens_per_s(cfg, args)
        speed, kv = rows[name]
        size = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda cfg=cfg: init_params(cfg, jax.random.key(0)))))
        print(f"{name:22s} {size / 1e6:6.1f}M params  KV {kv:6d} B/token (fp32, all layers)  state "
              f"{recurrent_bytes(cfg) / 2**10:6.1f} KiB/sequence  generate {speed:8.1f} new tokens/s "
              "(prefill included)")
    (s_h, kv_h), (s_a, kv_a) = rows.values()
    print(f"hybrid / attention: KV bytes {kv_h / kv_a:.2f}x, new tokens/s {s_h / s_a:.2f}x "
          f"({args.slots} slots, {args.prompt}-token prompts, {args.new} new tokens, {jax.devices()[0].platform})")


if __name__ == "__main__":
    main()
