"""The paged engine's one-prompt prefill in the batch-invariant mode (`actor_rollout_ref.model.batch_invariant`)
compiled for a TPU slice, with the weights split by columns (`decode_layout.matmul_columns`, what the engine
runs) and gathered (the prefill before 2026-12-07): HBM bytes, link bytes and FLOPs per chip. The memory plan
plans the decode loop, not the prefill, so this is where the prefill's cost is read.

    JAX_PLATFORMS=cpu python bench/tpu_prefill.py                          # 0.5b on v5e-8, a 1,024-token prompt
    JAX_PLATFORMS=cpu python bench/tpu_prefill.py --shape 1.5b --topology v5e-8 --bucket 512

The counts take each loop body once (the layer scan's trip: planning/hbm_bytes.py), as the plan's own program
counts do before it scales them by the layer count. The run is configs/tpu_grpo.py's shape (random weights, bf16
compute).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.5b", help="configs/tpu_grpo.py's shape")
    parser.add_argument("--topology", default="v5e-8", help="the TPU slice, as --plan's --topology")
    parser.add_argument("--bucket", type=int, default=1024, help="the prompt's padded length")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from bench.tpu_plan import tpu_grpo
    from jaxrl_llm.config import resolve, validate_config
    from jaxrl_llm.planning.context import make_context
    from jaxrl_llm.planning.hbm_bytes import hbm_bytes_of
    from jaxrl_llm.planning.memory import planning_context, planning_setup
    from jaxrl_llm.planning.roofline import link_bytes_of
    from jaxrl_llm.planning.sample_program import decode_weights
    from jaxrl_llm.sampler.engine import programs, slot_shards
    from jaxrl_llm.sampler.engine.setup import engine_spec
    from jaxrl_llm.sharding import batch_axis_size

    cfg = tpu_grpo(args.shape)
    cfg.actor_rollout_ref.model.batch_invariant = True
    cfg.actor_rollout_ref.model.use_remove_padding = False  # the mode's packed rows are not planned here
    cfg.trainer.plan_topology = args.topology
    target, mesh, tokenizer = planning_setup(cfg)
    cfg = validate_config(cfg, num_devices=mesh.size)
    spec = resolve(cfg, dp_size=batch_axis_size(mesh))
    rollout = cfg.actor_rollout_ref.rollout
    with planning_context(mesh, target):
        ctx = make_context(spec, mesh, tokenizer)
        model = ctx.actor.cfg
        engine = engine_spec(model, spec.rollout_engine, num_requests=cfg.data.train_batch_size * rollout.n,
                             max_prompt_len=cfg.data.max_prompt_length, samples_per_prompt=rollout.n,
                             max_new_tokens=cfg.data.max_response_length, compute_dtype=spec.actor.compute_dtype,
                             mesh=mesh)
        slot_axes = slot_shards.slot_axes(mesh, engine.slot_shards)
        weights = decode_weights(ctx.policy_params(), model, spec.actor.compute_dtype, False, mesh, slot_axes).params
        ids, length = jax.ShapeDtypeStruct((args.bucket,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
        print(f"{args.shape} on {args.topology}, a {args.bucket}-token prompt; slot axes {slot_axes}")
        for name, axes in (("by columns", slot_axes), ("gathered", ())):
            start = time.time()
            compiled = programs.prefill.lower(weights, model, ids, length, compute_dtype=spec.actor.compute_dtype,
                                              mesh=mesh, slot_axes=axes).compile()
            text = compiled.as_text()
            flops = float((compiled.cost_analysis() or {}).get("flops", 0.0))
            print(f"  {name:10s}: HBM {hbm_bytes_of(text) / 1e9:.3f} GB, link {link_bytes_of(text) / 1e9:.3f} GB, "
                  f"{flops / 1e12:.4f} TFLOP a chip (compiled in {time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
