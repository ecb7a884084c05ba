"""Mixture of experts against the dense model with the same active parameters, on this machine.

    python bench/moe.py [--layers 8] [--experts 16] [--top-k 2] [--hidden 256] [--expert-width 256]

A Qwen3-MoE-shaped model (random weights; `--layers` layers, `--experts` experts of width
`--expert-width`, top-k routing) and a Qwen3 dense model whose MLP width is top-k x expert width (the
same parameters per token). Prints, each with the MoE / dense ratio:

- training tokens/s: forward + backward of the response log-probs (the actor's pass), batch x length;
- decode tokens/s: greedy generation through the static sampler;
- the MoE MLP alone: the dropless grouped matmul (models/moe_experts.py, `blocked` and `ragged_dot`) and the
  per-assignment weight gather (what a decode step runs) against the all-experts dense reference
  (every token through every expert), forward + backward.

With several devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8), also the training
pass on meshes that split the experts (models/expert_parallel.py) against the same devices as plain
fsdp: time per step and the bytes of collectives per device (read from the compiled program, where the
layer scan's body, one layer, appears once).
"""
from __future__ import annotations

import argparse
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxrl_llm import sharding
from jaxrl_llm.models import ModelConfig, greedy_generate, init_params, param_logical_axes
from jaxrl_llm.models.moe import route
from jaxrl_llm.models.moe_experts import dense_expert_ffn, expert_ffn
from jaxrl_llm.roles.forward import response_log_probs


def best_time(fn: Callable[[], Any], reps: int) -> float:
    jax.block_until_ready(fn())  # compile + warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def configs(args: argparse.Namespace) -> tuple[ModelConfig, ModelConfig]:
    common = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=args.hidden // 4, vocab_size=2048, max_position_embeddings=1024)
    moe = ModelConfig.tiny("qwen3_moe", num_experts=args.experts, num_experts_per_tok=args.top_k,
                           moe_intermediate_size=args.expert_width, moe_block_rows=args.block_rows, **common)
    dense = ModelConfig.tiny("qwen3", intermediate_size=args.top_k * args.expert_width, **common)
    return moe, dense


def training_tokens_per_s(cfg: ModelConfig, params: dict, batch: int, length: int, reps: int) -> float:
    ids = jax.random.randint(jax.random.key(1), (batch, length), 3, cfg.vocab_size)
    mask = jnp.ones_like(ids)
    response = length // 2
    grad = jax.jit(jax.grad(lambda p: jnp.sum(response_log_probs(p, cfg, ids, mask, response))))
    return batch * length / best_time(lambda: grad(params), reps)


def decode_tokens_per_s(cfg: ModelConfig, params: dict, batch: int, new_tokens: int, reps: int) -> float:
    ids = jax.random.randint(jax.random.key(2), (batch, 32), 3, cfg.vocab_size)
    mask = jnp.ones_like(ids)
    run = jax.jit(lambda p: greedy_generate(p, cfg, ids, mask, new_tokens))
    return batch * new_tokens / best_time(lambda: run(params), reps)


def mlp_seconds(cfg: ModelConfig, params: dict, tokens: int, reps: int) -> dict[str, float]:
    """Forward + backward seconds of layer 0's MoE MLP on `tokens` random tokens, per implementation."""
    experts = jax.tree.map(lambda x: x[0], params["layers"]["moe"]["experts"])
    router = params["layers"]["moe"]["router"]["kernel"][0]
    x = jax.random.normal(jax.random.key(3), (tokens, cfg.hidden_size))

    def timed(ffn: Callable) -> float:
        loss = lambda e, x: jnp.sum(ffn(e, x, route(cfg, router, x)) ** 2)  # noqa: E731
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return best_time(lambda: step(experts, x), reps)

    out = {kernel: timed(lambda e, x, r, k=kernel: expert_ffn(e, x, r, cfg, dtype=jnp.float32, kernel=k))
           for kernel in ("blocked", "ragged_dot", "gather")}
    out["dense all-experts"] = timed(lambda e, x, r: dense_expert_ffn(e, x, r, dtype=jnp.float32, cfg=cfg))
    return out


_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\][^=]*? "
                         r"(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)\(")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "s8": 1, "s16": 2, "f16": 2}


def collective_bytes(hlo: str) -> int:
    """Bytes the collectives of a compiled program's text produce per device (all-gather, reduce-scatter,
    all-reduce, all-to-all, collective-permute), each loop body once: the layer scan's body is one layer."""
    total = 0
    for dtype, dims, _ in _COLLECTIVE.findall(hlo):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _BYTES.get(dtype, 4)
    return total


def expert_parallel_rows(cfg: ModelConfig, params: dict, batch: int, length: int, reps: int) -> list[tuple]:
    """(mesh, seconds per training pass, MiB of collectives per device in the program text: one layer plus
    what runs outside the layer scan) on every device: plain fsdp, then the experts split over `expert`."""
    n = jax.device_count()
    ids = jax.random.randint(jax.random.key(1), (batch, length), 3, cfg.vocab_size)
    rows = []
    for name, shape in ((f"fsdp{n}", {"fsdp": n}), (f"fsdp2_expert{n // 2}", {"fsdp": 2, "expert": n // 2}),
                        (f"expert{n}", {"fsdp": 1, "expert": n})):
        mesh = sharding.make_mesh(shape)
        placed = sharding.shard_params(params, param_logical_axes(cfg), mesh)
        tokens = sharding.shard_batch(ids, mesh)
        mask = jnp.ones_like(tokens)
        loss = lambda p: jnp.sum(response_log_probs(p, cfg, tokens, mask, length // 2))  # noqa: E731
        with sharding.mesh_context(mesh):
            compiled = jax.jit(jax.grad(loss)).lower(placed).compile()
        rows.append((name, best_time(lambda: compiled(placed), reps), collective_bytes(compiled.as_text()) / 2**20))
    return rows


def single_device_rows(args: argparse.Namespace, moe_cfg: ModelConfig, dense_cfg: ModelConfig, moe: dict,
                       dense: dict) -> None:
    """Training and decode tokens/s of the MoE and dense models, and the MoE MLP's kernels."""
    rows = [("training tokens/s", training_tokens_per_s(moe_cfg, moe, args.batch, args.length, args.reps),
             training_tokens_per_s(dense_cfg, dense, args.batch, args.length, args.reps)),
            ("decode tokens/s", decode_tokens_per_s(moe_cfg, moe, args.batch, args.new_tokens, args.reps),
             decode_tokens_per_s(dense_cfg, dense, args.batch, args.new_tokens, args.reps))]
    print(f"{'':24s}{'MoE':>12s}{'dense':>12s}{'MoE/dense':>11s}")
    for name, a, b in rows:
        print(f"{name:24s}{a:12.0f}{b:12.0f}{a / b:11.2f}")
    seconds = mlp_seconds(moe_cfg, moe, args.mlp_tokens, args.reps)
    reference = seconds["dense all-experts"]
    print(f"MoE MLP fwd+bwd, {args.mlp_tokens} tokens:")
    for name, s in seconds.items():
        print(f"  {name:22s}{s * 1e3:9.1f} ms   {reference / s:6.2f}x the all-experts reference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--block-rows", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--mlp-tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--expert-parallel-only", action="store_true", help="only the meshes' training pass")
    args = parser.parse_args(argv)
    moe_cfg, dense_cfg = configs(args)
    moe, dense = init_params(moe_cfg, jax.random.key(0)), init_params(dense_cfg, jax.random.key(0))
    count = lambda p: sum(x.size for x in jax.tree.leaves(p))  # noqa: E731
    print(f"backend {jax.default_backend()}; MoE {count(moe) / 1e6:.1f}M params ({args.experts} experts, "
          f"top-{args.top_k}), dense {count(dense) / 1e6:.1f}M (same active params per token)")
    if not args.expert_parallel_only:
        single_device_rows(args, moe_cfg, dense_cfg, moe, dense)
    if jax.device_count() >= 4 and args.experts % jax.device_count() == 0:
        print(f"MoE training pass (fwd+bwd, {args.batch} x {args.length}) on {jax.device_count()} devices:")
        rows = expert_parallel_rows(moe_cfg, moe, args.batch, args.length, args.reps)
        for name, s, mib in rows:
            print(f"  {name:22s}{s * 1e3:9.1f} ms   {rows[0][1] / s:6.2f}x fsdp   "
                  f"collectives {mib:7.1f} MiB/device (one layer + the rest)")
    else:
        print("expert parallelism: needs >= 4 devices dividing --experts "
              "(CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
