"""Which of this backend's kernels are batch-invariant (docs/performance.md, "Exact rollouts").

A kernel is batch-invariant when a row's result does not depend on how many other rows the call holds
(a one-token decode step vs a full training forward). For each contraction the decoder runs (the
projections, attention's q.k and p.v, the row reductions) this computes the first rows of a large call,
then the same rows in calls of fewer rows, and prints the fraction of outputs that differ in any bit;
also the same contractions run in fixed-shape row tiles (`lax.map`), and the tiles' cost.

Run: `python bench/row_invariance.py [--tiny]` (CPU here; on the lent GPU from the device kit).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROWS = (1, 2, 3, 8, 16, 64, 256, 1024)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _tiled(tile: int):
    def run(x: jax.Array, w: jax.Array) -> jax.Array:
        n = x.shape[0]
        xt = jnp.pad(x, ((0, -n % tile), (0, 0))).reshape(-1, tile, x.shape[1])
        return lax.map(lambda t: _dot(t, w), xt).reshape(-1, w.shape[1])[:n]
    return run


def _differs(fn, big: jax.Array, *rest, axis: int = 0) -> dict:
    """{rows: fraction of the first `rows` rows (along `axis`) that differ from the large call's}."""
    ref = np.asarray(fn(big, *rest))
    out = {}
    for n in ROWS:
        if n <= big.shape[axis]:
            part = np.asarray(fn(lax.slice_in_dim(big, 0, n, axis=axis), *rest))
            out[str(n)] = float(np.mean(part != lax.slice_in_dim(ref, 0, n, axis=axis)))
    return out


def _seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU rehearsal)")
    args = ap.parse_args()
    big = 1024 if args.tiny else 8192
    shapes = [(256, 512), (512, 256)] if args.tiny else [(1024, 4096), (4096, 1024), (896, 4864)]
    key = iter(jax.random.split(jax.random.key(0), 16))
    result: dict = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "matmul": {}}
    plain = jax.jit(_dot)
    for k, f in shapes:
        x = jax.random.normal(next(key), (big, k)).astype(jnp.bfloat16)
        w = (jax.random.normal(next(key), (k, f)) * k ** -0.5).astype(jnp.bfloat16)
        row = {"plain": _differs(plain, x, w)}
        for tile in (8, 64, 128):
            tiled = jax.jit(_tiled(tile))
            row[f"tiled{tile}"] = _differs(tiled, x, w)
            row[f"tiled{tile}_vs_plain"] = float(np.mean(np.asarray(tiled(x, w)) != np.asarray(plain(x, w))))
        result["matmul"][f"{k}x{f}"] = row
    # attention-shaped batched contractions: [B, kv, rows, D] x [B, kv, KB, D] and p [.., rows, KB] x v
    b, kv, d, kb = 4, 2, 128, 64
    q = jax.random.normal(next(key), (b, kv, big // 4, d)).astype(jnp.bfloat16)
    keys = jax.random.normal(next(key), (b, kv, kb, d)).astype(jnp.bfloat16)
    p = jax.nn.softmax(jax.random.normal(next(key), (b, kv, big // 4, kb)), axis=-1).astype(jnp.bfloat16)
    qk = jax.jit(lambda q, k: jnp.einsum("bkqd,bksd->bkqs", q, k, preferred_element_type=jnp.float32))
    pv = jax.jit(lambda p, v: jnp.einsum("bkqs,bksd->bkqd", p, v, preferred_element_type=jnp.float32))
    result["attention"] = {"qk": _differs(qk, q, keys, axis=2), "pv": _differs(pv, p, keys, axis=2)}
    # row reductions (RMSNorm's mean of squares, softmax sums) over a minor axis of fixed length
    result["reduce"] = {}
    for length in (64, 576, 4096):
        z = jax.random.normal(next(key), (big, length))
        result["reduce"][str(length)] = _differs(jax.jit(lambda z: jnp.sum(z * z, axis=-1)), z)
    # the tiles' cost against one plain call, at the training forward's row count
    k, f = shapes[0]
    x = jax.random.normal(next(key), (big * 2, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(next(key), (k, f)) * k ** -0.5).astype(jnp.bfloat16)
    t_plain = _seconds(plain, x, w)
    result["cost"] = {"rows": big * 2, "shape": f"{k}x{f}", "plain_ms": 1e3 * t_plain}
    for tile in (64, 128, 256):
        result["cost"][f"tiled{tile}_x"] = _seconds(jax.jit(_tiled(tile)), x, w) / t_plain
    print(json.dumps(result))


if __name__ == "__main__":
    main()
