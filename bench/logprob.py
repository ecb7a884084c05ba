"""Fused (chunked-vocab, custom VJP) vs naive token log-probs: peak memory and value+grad time.

Peak memory is the compiled executable's temp + output bytes (`memory_analysis()`); time is the
median wall time of `jax.value_and_grad` over hidden and unembedding after one warm-up call.
Run: `.venv/bin/python bench/logprob.py [--tokens 4096] [--chunk 2048] [--repeats 3]`.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.losses.logprob import token_logprobs

SHAPES = ((576, 49152), (896, 151936))  # SmolLM2-135M, Qwen2.5-0.5B


def naive_loss(h, w, t):
    logp = jax.nn.log_softmax(jnp.einsum("nh,hv->nv", h, w), axis=-1)
    return jnp.sum(jnp.take_along_axis(logp, t[:, None], axis=-1))


def fused_loss(h, w, t, chunk):
    return jnp.sum(token_logprobs(h, w, t, chunk_size=chunk, impl="xla"))


def measure(fn, args, repeats):
    compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()
    mem = compiled.memory_analysis()
    peak = mem.temp_size_in_bytes + mem.output_size_in_bytes
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return peak, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=None, help="vocab chunk (default: the library default)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"backend={jax.default_backend()} tokens={args.tokens}")
    print(f"{'H':>5} {'V':>7} | {'naive MiB':>9} {'fused MiB':>9} {'mem ratio':>9} | "
          f"{'naive s':>7} {'fused s':>7} {'time ratio':>10}")
    for hidden, vocab in SHAPES:
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
        h = jax.random.normal(k1, (args.tokens, hidden), jnp.float32)
        w = jax.random.normal(k2, (hidden, vocab), jnp.float32) * hidden**-0.5
        t = jax.random.randint(k3, (args.tokens,), 0, vocab)
        n_peak, n_time = measure(naive_loss, (h, w, t), args.repeats)
        f_peak, f_time = measure(lambda a, b, c: fused_loss(a, b, c, args.chunk), (h, w, t), args.repeats)
        print(f"{hidden:>5} {vocab:>7} | {n_peak / 2**20:>9.0f} {f_peak / 2**20:>9.0f} {f_peak / n_peak:>9.3f} | "
              f"{n_time:>7.2f} {f_time:>7.2f} {f_time / n_time:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
