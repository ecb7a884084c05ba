"""The memory plan (jaxrl_llm/planning/memory.py) against the measured peak, per program.

    python bench/memory_plan.py [--model tiny|smollm2] [--prompts 8] [--n 4] [--prompt-len 64] \
        [--response-len 64] [--out plan_vs_measured.json]

Each program of the step is compiled exactly as the plan compiles it, then run once on real
arrays of the same shapes and shardings, each in a fresh subprocess:
- on GPU/TPU the measured peak is `device.memory_stats()["peak_bytes_in_use"]`;
- on CPU (one device; the process is the device) it is the argument bytes plus the largest rise of
  the resident set (/proc/self/statm, polled every ~0.2 ms) over its level once the arguments
  were in memory, i.e. what the program itself allocated and touched. XLA:CPU allocates its
  temporaries as one block of `temp_size_in_bytes`; pages of it no buffer ever writes do not
  enter the resident set, so on CPU the measurement is a lower bound of the real allocation and
  a plan above it is expected (GPU/TPU allocators count whole buffers).
Prints per program: planned peak (arguments + outputs - donated + temporaries + code), measured
peak, and the relative error; `--out` writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# glibc: every buffer over 64 KiB gets its own mapping, returned on free, so the resident set
# follows XLA's live buffers instead of the allocator's cached heap
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _config(args: argparse.Namespace):
    from jaxrl_llm.config import default_config, smollm2_gguf_path

    cfg = default_config()
    model = cfg.actor_rollout_ref.model
    if args.model == "smollm2":
        model.path = str(smollm2_gguf_path())
    else:  # a mid-size random Llama: big enough that the buffers dwarf the allocator's noise
        model.path = "tiny:llama"
        model.tiny.update(dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                               intermediate_size=1408, max_position_embeddings=1024, vocab_size=8192))
        cfg.data.tokenizer = smollm2_gguf_path()
    cfg.data.synthetic.task = "add"
    cfg.data.max_prompt_length, cfg.data.max_response_length = args.prompt_len, args.response_len
    cfg.data.train_batch_size = args.prompts
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = args.prompts
    cfg.actor_rollout_ref.rollout.n = args.n
    cfg.algorithm.adv_estimator = "gae"  # the critic's programs too
    cfg.actor_rollout_ref.actor.use_kl_loss = True  # and the reference pass
    cfg.actor_rollout_ref.actor.remat_policy = args.remat
    cfg.trainer.default_local_dir = "/tmp/jaxrl_llm_bench_memory_plan"
    cfg.trainer.memory_plan = True
    return cfg


def _planner(args: argparse.Namespace):
    from jaxrl_llm.config import resolve, resolve_data, validate_config
    from jaxrl_llm.hf import load_tokenizer
    from jaxrl_llm.planning.memory import Planner
    from jaxrl_llm.sharding import batch_axis_size, make_mesh

    cfg = _config(args)
    mesh = make_mesh(cfg.mesh)
    checked = validate_config(cfg, dp_size=batch_axis_size(mesh))
    spec = resolve(checked, dp_size=batch_axis_size(mesh))
    return Planner(spec, mesh, load_tokenizer(resolve_data(checked).tokenizer)), spec


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _real_args(lowered, compiled):
    """Concrete arrays for a lowered program's dynamic arguments, on its input shardings."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)

    def make(info, sharding):
        shape, dtype = info.shape, info.dtype
        if jnp.issubdtype(dtype, jnp.floating):
            host = (rng.standard_normal(shape) * 0.02).astype(dtype)
        else:
            host = np.ones(shape, dtype)  # ids 1, masks 1, PRNG key words 1
        return jax.device_put(host, sharding)

    (args, kwargs) = lowered.args_info
    shard_args, shard_kwargs = compiled.input_shardings
    return (jax.tree.map(make, args, shard_args, is_leaf=lambda x: hasattr(x, "shape")),
            jax.tree.map(make, kwargs, shard_kwargs, is_leaf=lambda x: hasattr(x, "shape")))


def measure_one(args: argparse.Namespace, name: str) -> dict:
    import jax

    planner, spec = _planner(args)
    program = next(p for p in planner.programs if p.name == name)
    lowered = program.lower(spec.plan)
    compiled = lowered.compile()
    row = planner.analyse(program, spec.plan)
    own = row.peak_bytes  # the program's own buffers (resident state of other programs is not built here)
    device = jax.local_devices()[0]
    # warm the runtime (thread pools, first-execution state) so its one-off allocations are not counted
    warm = jax.jit(lambda x: x @ x + 1)(jax.numpy.ones((256, 256)))
    jax.block_until_ready(warm)
    before = _rss()
    call_args, call_kwargs = _real_args(lowered, compiled)
    jax.block_until_ready((call_args, call_kwargs))
    args_rss = _rss() - before
    if device.platform != "cpu":
        # a fresh process: its peak is this program with its arguments (nothing else was allocated)
        out = compiled(*call_args, **call_kwargs)
        jax.block_until_ready(out)
        measured = device.memory_stats()["peak_bytes_in_use"]
        how = "peak_bytes_in_use"
    else:
        peak, stop = [_rss()], threading.Event()
        start_rss = peak[0]

        def poll():
            while not stop.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.0002)

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        out = compiled(*call_args, **call_kwargs)
        jax.block_until_ready(out)
        stop.set()
        t.join()
        measured = row.argument_bytes + (peak[0] - start_rss)
        how = "arguments + RSS rise"
    return {"program": name, "planned_bytes": own, "measured_bytes": int(measured), "how": how,
            "argument_bytes": row.argument_bytes, "argument_rss_bytes": int(args_rss),
            "output_bytes": row.output_bytes, "alias_bytes": row.alias_bytes, "temp_bytes": row.temp_bytes,
            "error": (own - measured) / measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="comma-separated program names (default: all)")
    parser.add_argument("--program", default=None, help=argparse.SUPPRESS)  # child mode: one program
    args = parser.parse_args()
    if args.program:
        print("RESULT " + json.dumps(measure_one(args, args.program)), flush=True)
        return
    planner, _ = _planner(args)
    results = []
    only = set(args.only.split(",")) if args.only else None
    for program in planner.programs:
        if only is not None and program.name not in only:
            continue
        child = [f"--model={args.model}", f"--prompts={args.prompts}", f"--n={args.n}", f"--remat={args.remat}",
                 f"--prompt-len={args.prompt_len}", f"--response-len={args.response_len}"]
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *child, "--program", program.name],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT, **MALLOC_ENV})
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{program.name}: {proc.stderr[-3000:]}")
        r = json.loads(line[len("RESULT "):])
        results.append(r)
        print(f"{r['program']:<14} planned {r['planned_bytes'] / 2**20:9.1f} MiB  measured "
              f"{r['measured_bytes'] / 2**20:9.1f} MiB ({r['how']})  error {100 * r['error']:+6.1f}%", flush=True)
    worst = max(abs(r["error"]) for r in results)
    print(f"largest |error|: {100 * worst:.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
