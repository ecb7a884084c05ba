"""Paged decode attention: the Pallas kernel vs the XLA paths, correctness and speed, one layer.

For each (slots, mean length) point: builds a shuffled page pool, random per-slot lengths around the
mean (and one empty slot), checks the kernel against a dense fp32 gather reference (max abs error)
and times, per call (median of --repeats after a compile): the Pallas kernel, the engine's
length-aware XLA path (`paged_attention.paged_decode_attention_xla`, when this checkout has it) and
the dense gather (every page of the table, no length awareness). Reports decode tokens/s (slots /
call time) and K/V bytes read/s (the visible pages of every slot, K and V, all kv heads / call
time) against a jitted copy's bandwidth; `pages_per_slot` stays at --max-len / page_size for every
point, so a kernel whose time tracks the mean length (not the table width) is length-aware.

    python bench/paged_attention.py                       # GPU/TPU: compiled, SmolLM2-like shapes
    python bench/paged_attention.py --tiny                # CPU: interpret mode, tiny shapes (a smoke run)
    options: --slots 8 64 256 --lengths 128 512 2048 --max-len 4096 --page-size 16 --heads 9
             --kv-heads 3 --head-dim 64 --dtype bfloat16 --window W --pages-per-block N --repeats 5
             --variant triton|mosaic --num-splits N (triton; default: from slots * kv_heads)
             --group N --prompt-len P: slots in groups of N samples sharing a P-token prompt's full pages
             (rollout.n = N); adds the cascade rows (`pallas_cascade`, `xla_cascade`: the shared pages
             read once per group), whose KV GB/s count the bytes the plain kernel reads (effective rate)
             --impls xla dense: only these rows (on a CPU the kernels run interpreted: slow)
    python bench/paged_attention.py --slots 12 32 --lengths 256 512 --max-len 1024 --dtype float32 \
        --impls xla cpu dense                            # the CPU engine's attention, per layer
             (row cpu: the C++ kernel of jaxrl_llm/sampler/native, fp32 on a CPU backend)

The header's read_bw (a jitted sum) is the floor a KV read can reach; `bw use` divides by copy_bw.
"""
from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.sampler import native
from jaxrl_llm.sampler.cascade_attention import Cascade, cascade_decode_attention_pallas, cascade_decode_attention_xla
from jaxrl_llm.sampler.paged_attention_pallas import (
    default_pages_per_block,
    default_variant,
    paged_decode_attention_pallas,
)

try:  # the engine's length-aware XLA path (jaxrl_llm/sampler/paged_attention.py), if merged
    from jaxrl_llm.sampler.paged_attention import paged_decode_attention_xla
except ImportError:
    paged_decode_attention_xla = None


@functools.partial(jax.jit, static_argnames=("sliding_window",))
def dense_gather(q, k_pages, v_pages, lengths, page_indices, sliding_window=None):
    """Dense XLA reference: gather every page of the table, mask, fp32 softmax (not length-aware)."""
    slots, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    k = k_pages[:, page_indices].reshape(kv_heads, slots, -1, head_dim)
    v = v_pages[:, page_indices].reshape(kv_heads, slots, -1, head_dim)
    qg = q.reshape(slots, kv_heads, num_heads // kv_heads, head_dim)
    scores = jnp.einsum("skgd,kstd->skgt", qg, k, preferred_element_type=jnp.float32,
                        precision="highest") * head_dim ** -0.5
    pos = jnp.arange(k.shape[2])[None, :]
    visible = pos < lengths[:, None]
    if sliding_window is not None:
        visible &= pos >= lengths[:, None] - sliding_window
    visible = visible[:, None, None, :]
    probs = jnp.where(visible, jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1), 0.0)
    out = jnp.einsum("skgt,kstd->skgd", probs, v.astype(jnp.float32), precision="highest")
    return out.reshape(q.shape).astype(q.dtype)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Read + write bytes/s of a jitted elementwise op on an `nbytes` fp32 array."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    jax.block_until_ready(f(x))
    return 2 * nbytes / median_time(lambda: f(x), repeats)


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of a jitted sum over an `nbytes` fp32 array (reads only: the roofline of a KV read)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    jax.block_until_ready(f(x))
    return nbytes / median_time(lambda: f(x), repeats)


def make_inputs(rng, *, slots, mean_len, max_len, page_size, heads, kv_heads, head_dim, dtype, group=1,
                prompt_len=0) -> dict[str, Any]:
    pages_per_slot = max_len // page_size
    num_pages = slots * pages_per_slot
    lengths = np.clip(rng.integers(mean_len // 2, mean_len * 3 // 2 + 1, slots), 1, max_len)
    page_indices = rng.permutation(num_pages).reshape(slots, pages_per_slot)
    shared = prompt_len // page_size if group > 1 else 0
    rows = np.full((max(1, slots // 2), max(group, 1)), -1, np.int32)
    for g, first in enumerate(range(0, slots - group + 1, group) if group > 1 else []):
        members = np.arange(first, first + group)
        page_indices[members, :shared] = page_indices[first, :shared]  # the prompt's full pages, once
        lengths[members] = np.maximum(lengths[members], prompt_len + 1)
        rows[g] = members
    lengths[0] = 0  # an empty slot
    shape = (kv_heads, num_pages, page_size, head_dim)
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    return dict(q=jax.random.normal(kq, (slots, heads, head_dim), dtype),
                k_pages=jax.random.normal(kk, shape, dtype), v_pages=jax.random.normal(kv, shape, dtype),
                lengths=jnp.asarray(lengths, jnp.int32), page_indices=jnp.asarray(page_indices, jnp.int32),
                cascade=Cascade(jnp.asarray(rows), jnp.asarray(np.where(rows[:, 0] >= 0, shared, 0), jnp.int32)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="interpret mode, tiny shapes (CPU smoke run)")
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048], help="mean lengths")
    parser.add_argument("--max-len", type=int, default=4096, help="page-table width in tokens")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--pages-per-block", type=int, default=None)
    parser.add_argument("--variant", choices=["triton", "mosaic"], default=None)
    parser.add_argument("--num-splits", type=int, default=None, help="triton: splits per slot")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group", type=int, default=1, help="samples per prompt sharing its pages (cascade rows)")
    parser.add_argument("--prompt-len", type=int, default=256, help="the shared prompt's tokens (with --group)")
    parser.add_argument("--impls", nargs="+", default=None,
                        help="rows to run (pallas xla cpu pallas_cascade xla_cascade dense; default: all)")
    args = parser.parse_args()
    interpret = args.tiny or jax.default_backend() == "cpu"
    if args.tiny:
        args.slots, args.lengths, args.max_len, args.repeats = [4], [24, 48], 64, 1
    variant = args.variant or default_variant()
    dtype = jnp.dtype(args.dtype)
    ppb = args.pages_per_block or default_pages_per_block(args.page_size, args.max_len // args.page_size,
                                                          variant, args.head_dim)
    bw = copy_bandwidth(1 << (22 if interpret else 30), args.repeats)
    read_bw = read_bandwidth(1 << (22 if args.tiny else 30), args.repeats)
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} variant={variant} "
          f"interpret={interpret} dtype={dtype.name} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim} page_size={args.page_size} pages_per_block={ppb} "
          f"max_len={args.max_len} window={args.window} copy_bw={bw / 1e9:.1f} GB/s "
          f"read_bw={read_bw / 1e9:.1f} GB/s (a sum: the floor of a KV read is its bytes / read_bw)")
    impls = {"pallas": lambda c: paged_decode_attention_pallas(
        c["q"], c["k_pages"], c["v_pages"], c["lengths"], c["page_indices"],
        sliding_window=args.window, interpret=interpret, pages_per_block=ppb, variant=variant,
        num_splits=args.num_splits)}
    if paged_decode_attention_xla is not None:
        xla_fn = jax.jit(paged_decode_attention_xla, static_argnames=("sliding_window",))
        impls["xla"] = lambda c: xla_fn(c["q"], c["k_pages"], c["v_pages"], c["lengths"],
                                        c["page_indices"], sliding_window=args.window)
    if jax.default_backend() == "cpu" and dtype == jnp.float32 and native.available():
        cpu_fn = jax.jit(native.paged_decode_attention_cpu, static_argnames=("sliding_window",))
        impls["cpu"] = lambda c: cpu_fn(c["q"], c["k_pages"], c["v_pages"], c["lengths"], c["page_indices"],
                                        sliding_window=args.window)
    if args.group > 1:
        if args.window is None:  # the engine keeps the plain kernel in windowed layers
            impls["pallas_cascade"] = lambda c: cascade_decode_attention_pallas(
                c["q"], c["k_pages"], c["v_pages"], c["lengths"], c["page_indices"], c["cascade"],
                interpret=interpret, variant=variant)
        cascade_xla = jax.jit(cascade_decode_attention_xla, static_argnames=("sliding_window",))
        impls["xla_cascade"] = lambda c: cascade_xla(c["q"], c["k_pages"], c["v_pages"], c["lengths"],
                                                     c["page_indices"], c["cascade"], sliding_window=args.window)
    impls["dense"] = lambda c: dense_gather(c["q"], c["k_pages"], c["v_pages"], c["lengths"],
                                            c["page_indices"], sliding_window=args.window)
    if args.impls:  # e.g. the XLA rows only on a CPU, where the kernels would run interpreted
        missing = sorted(set(args.impls) - set(impls))
        if missing:
            parser.error(f"--impls {' '.join(missing)}: not available here (have {', '.join(impls)})")
        impls = {name: fn for name, fn in impls.items() if name in args.impls}
    # Error bound vs the fp32 reference: fp32 summation order (1e-5) plus, for bf16 outputs, the
    # final rounding (half a bf16 ulp <= 2**-8 |x|); the tests assert the same bound.
    rel = 2.0 ** -8 if dtype == jnp.bfloat16 else 0.0
    print(f"{'slots':>5} {'mean len':>8} {'impl':>6} | {'1st call s':>10} {'call us':>9} "
          f"{'tok/s':>10} {'KV GB/s':>8} {'bw use':>6} | max|err| vs dense fp32, within bound")
    rng = np.random.default_rng(0)
    for slots in args.slots:
        for mean_len in args.lengths:
            case = make_inputs(rng, slots=slots, mean_len=mean_len, max_len=args.max_len,
                               page_size=args.page_size, heads=args.heads, kv_heads=args.kv_heads,
                               head_dim=args.head_dim, dtype=dtype, group=args.group, prompt_len=args.prompt_len)
            lengths = np.asarray(case["lengths"])
            first = 0 if args.window is None else np.maximum(lengths - args.window, 0) // args.page_size
            pages_read = np.sum(-(-lengths // args.page_size) - first)
            kv_bytes = 2 * pages_read * args.kv_heads * args.page_size * args.head_dim * dtype.itemsize
            ref = dense_gather(case["q"].astype(jnp.float32), case["k_pages"].astype(jnp.float32),
                               case["v_pages"].astype(jnp.float32), case["lengths"],
                               case["page_indices"], sliding_window=args.window)
            for name, fn in impls.items():
                t0 = time.perf_counter()
                out = jax.block_until_ready(fn(case))
                compile_s = time.perf_counter() - t0
                diff = jnp.abs(out.astype(jnp.float32) - ref)
                err, ok = float(jnp.max(diff)), bool(jnp.all(diff <= rel * jnp.abs(ref) + 1e-5))
                t = median_time(lambda: fn(case), args.repeats)
                print(f"{slots:>5} {mean_len:>8} {name:>6} | {compile_s:>10.2f} {t * 1e6:>9.1f} "
                      f"{slots / t:>10.0f} {kv_bytes / t / 1e9:>8.2f} {kv_bytes / t / bw:>6.1%} | "
                      f"{err:.2e} {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
