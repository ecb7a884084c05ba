"""Long rows under context parallelism: training tokens/s and per-device temporaries, context 1 / 4 / 8,
ring attention vs all-to-all over heads (Ulysses) vs gathered keys / values.

    python bench/long_context.py [--lengths 4096,8192,16384,32768] [--contexts 1,4,8] [--reps 2]
                                 [--attention ring,all_to_all,gather]
    python bench/long_context.py --model qwen2-0.5b --lengths 4096 --contexts 1   # on a GPU
    python bench/long_context.py --contexts 1 --blockwise-from 1000000   # context 1 without blockwise

One row of T tokens (a T/2-token response) through the training forward and backward: the value and
gradient of the response's summed log-probs (roles/forward.py `response_log_probs`, the actor
update's model path), jitted on a mesh of `context` devices (mesh.context). Prints, per (length,
context): tokens/s (best of --reps after a compile) and the compiled program's per-device temporaries
(`memory_analysis`). On this CPU host the devices are virtual (XLA_FLAGS 8 host devices, set below):
they share the 2 cores, so tokens/s shows the program's overhead, not a speed-up; the memory column
is the point. The three ways to attend with split tokens (mesh.context_attention,
models/context_parallel.py) run on the same row; context 1 has no split, so it runs once. Rows of
--blockwise-from tokens or more attend blockwise (models/blockwise.py; the library's threshold by
default); a large value gives context 1 the chunked attention, for comparison.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import sharding
from jaxrl_llm.models import ModelConfig, blockwise, init_params, param_logical_axes
from jaxrl_llm.models.families import CONTEXT_ATTENTION
from jaxrl_llm.roles.forward import response_log_probs

MODELS = {
    # a small Llama that runs 32k-token rows on this CPU host
    # (8 query heads: all-to-all over heads needs them divisible by the context size)
    "small": dict(family="llama", num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=16, vocab_size=2048),
    # SmolLM2-135M's shape with 4 of its 30 layers
    "smollm2-4l": dict(family="llama", num_hidden_layers=4, hidden_size=576, intermediate_size=1536,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=2048),
    # Qwen2-0.5B's shape (random weights), for a GPU
    "qwen2-0.5b": dict(family="qwen2", num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                       num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936),
}


def run(model: str, length: int, context: int, attention: str, reps: int, dtype: str) -> tuple[float, int]:
    dims = dict(MODELS[model])
    cfg = ModelConfig.tiny(dims.pop("family"), max_position_embeddings=max(length, 4096), context_attention=attention,
                           **dims)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "context": context, "expert": 1, "tensor": 1})
    params = sharding.shard_params(init_params(cfg, jax.random.key(0)), param_logical_axes(cfg), mesh)
    whole = NamedSharding(mesh, PartitionSpec())
    ids = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (1, length)), jnp.int32),
                         whole)
    mask = jax.device_put(jnp.ones((1, length), jnp.int32), whole)

    def loss(params, ids, mask):
        return jnp.sum(response_log_probs(params, cfg, ids, mask, length // 2, compute_dtype=dtype, remat="full"))

    with sharding.mesh_context(mesh):
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params, ids, mask).compile()
    temps = int(compiled.memory_analysis().temp_size_in_bytes)
    jax.block_until_ready(compiled(params, ids, mask))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, ids, mask))
        best = min(best, time.perf_counter() - start)
    return length / best, temps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--contexts", default="1,4,8")
    parser.add_argument("--attention", default=",".join(CONTEXT_ATTENTION),
                        help="the ways to attend with split tokens (mesh.context_attention)")
    parser.add_argument("--blockwise-from", type=int, default=blockwise.BLOCKWISE_MIN_TOKENS,
                        help="rows of this many tokens or more attend blockwise (models/blockwise.py)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    blockwise.BLOCKWISE_MIN_TOKENS = args.blockwise_from
    lengths = [int(x) for x in args.lengths.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    print(f"model {args.model}, {args.dtype}, devices: {jax.device_count()} {jax.devices()[0].platform}, "
          f"blockwise from {args.blockwise_from} tokens")
    kinds = args.attention.split(",")
    print(f"{'tokens/row':>10} {'context':>8} {'attention':>10} {'tokens/s':>10} {'temps MiB/device':>17} "
          f"{'vs first':>9}")
    for length in lengths:
        base = None
        for context in contexts:
            for kind in kinds if context > 1 else kinds[:1]:
                try:
                    rate, temps = run(args.model, length, context, kind, args.reps, args.dtype)
                except ValueError as err:  # all-to-all with heads that do not divide
                    print(f"{length:>10} {context:>8} {kind:>10}  skipped: {err}", flush=True)
                    continue
                base = base or temps
                print(f"{length:>10} {context:>8} {kind if context > 1 else '-':>10} {rate:>10.0f} "
                      f"{temps / 2**20:>17.1f} {temps / base:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
