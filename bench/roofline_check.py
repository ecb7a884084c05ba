"""The memory plan's roofline estimates (planning/roofline.py) against steps we measured.

Two checks, each printing estimated vs measured seconds per program and their ratio:

- `--check h200` (default): the GRPO step measured on an H200 (docs/performance-history.md, 2026-11-27: a
  Qwen2-0.5B-shaped model with random weights, bf16 compute, 16 prompts x 8 samples, 256-token
  prompts, 512 new tokens with ignore_eos, the paged engine at 128 slots, one micro-batch of 128
  sequences): generation 1.56 s, actor update 1.64 s. Its programs are compiled here for this CPU
  (no CUDA compiler on this host: XLA:CPU's fusions stand in for XLA:GPU's) and estimated at the
  H200's published figures.
- `--check cpu`: a small random model's GRPO step run here on one CPU device (timed after a warm-up
  step), and its programs planned here at this host's measured matmul peak and copy bandwidth.

    JAX_PLATFORMS=cpu XLA_FLAGS= python bench/roofline_check.py --check h200
    JAX_PLATFORMS=cpu XLA_FLAGS= python bench/roofline_check.py --check cpu
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# docs/performance-history.md, "A GRPO step of a Qwen2-0.5B-shaped model" (H200, 2026-11-27)
H200_MEASURED = {"sample": 1.56, "update_actor": 1.64}
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)


def _config(run_dir: str, dims: dict, *, prompts: int, n: int, prompt_len: int, new_tokens: int, dtype: str,
            slots: int | None, steps: int):
    from jaxrl_llm.config import default_config, smollm2_gguf_path

    cfg = default_config()
    model = cfg.actor_rollout_ref.model
    model.path = "tiny:qwen2"
    for key, value in dims.items():
        model.tiny[key] = value
    model.dtype = dtype
    cfg.data.tokenizer = smollm2_gguf_path()
    cfg.data.synthetic.task = "add"
    cfg.data.synthetic.n_train = prompts * (steps + 1)
    cfg.data.synthetic.n_val = 4
    cfg.data.max_prompt_length = prompt_len
    cfg.data.max_response_length = new_tokens
    cfg.data.train_batch_size = prompts
    cfg.algorithm.adv_estimator = "grpo"
    rollout = cfg.actor_rollout_ref.rollout
    rollout.n, rollout.engine, rollout.ignore_eos = n, "paged", True
    if slots is not None:
        rollout.max_num_seqs = slots
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = prompts
    actor.ppo_micro_batch_size_per_device = prompts * n
    cfg.trainer.default_local_dir = run_dir
    cfg.trainer.total_training_steps = steps
    cfg.trainer.total_epochs = 1
    cfg.trainer.val_before_train = False
    cfg.trainer.test_freq = -1
    cfg.trainer.save_freq = -1
    cfg.trainer.logger = ["jsonl"]
    cfg.trainer.export_hf = False
    cfg.trainer.memory_plan = False
    return cfg


def _estimates(cfg, **plan_kwargs) -> dict[str, float]:
    from jaxrl_llm.config import resolve, resolve_data, validate_config
    from jaxrl_llm.hf import load_tokenizer
    from jaxrl_llm.planning.memory import plan_memory
    from jaxrl_llm.sharding import make_mesh

    cfg = validate_config(cfg, num_devices=1)
    mesh = make_mesh(cfg.mesh)
    plan = plan_memory(resolve(cfg, dp_size=1), mesh, load_tokenizer(resolve_data(cfg).tokenizer), check=False,
                       costs=True, **plan_kwargs)
    print(plan.table())
    return {p.name: r.seconds for p in plan.programs if (r := plan.roofline(p)) is not None}


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s of an elementwise pass over a large fp32 array (read + written) on this host's device."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((megabytes << 18,), jnp.float32)
    step = jax.jit(lambda a: a * 1.0001)
    step(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def _report(estimated: dict[str, float], measured: dict[str, float]) -> None:
    print("\n| program | estimated s | measured s | measured / estimated |\n|---|---|---|---|")
    for name, seconds in measured.items():
        est = estimated.get(name)
        ratio = f"{seconds / est:.2f}" if est else "-"
        print(f"| {name} | {est if est is None else round(est, 3)} | {seconds:.3f} | {ratio} |")


def check_h200() -> None:
    from jaxrl_llm.platform.chips import chip_for

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(tmp, QWEN2_05B, prompts=16, n=8, prompt_len=256, new_tokens=512, dtype="bfloat16", slots=128,
                      steps=1)
        chip = chip_for("nvidia h200")
        assert chip is not None
        estimated = _estimates(cfg, chip=chip)
    _report(estimated, H200_MEASURED)


def check_cpu(steps: int = 3) -> None:
    from jaxrl_llm.trainer import Trainer

    dims = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(tmp, dims, prompts=8, n=4, prompt_len=64, new_tokens=128, dtype="float32", slots=32,
                      steps=steps)
        Trainer(cfg).fit()
        rows = [json.loads(line) for line in open(pathlib.Path(tmp) / "metrics.jsonl")]
        timed = rows[1:]  # after the step that compiles
        measured = {"sample": sum(r["timing_s/gen"] for r in timed) / len(timed),
                    "update_actor": sum(r["timing_s/update_actor"] for r in timed) / len(timed)}
        bandwidth = copy_bandwidth()
        print(f"this host: copy bandwidth {bandwidth / 1e9:.1f} GB/s")
        estimated = _estimates(_config(tmp, dims, prompts=8, n=4, prompt_len=64, new_tokens=128, dtype="float32",
                                       slots=32, steps=steps), hbm_bandwidth=bandwidth)
    _report(estimated, measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", choices=("h200", "cpu"), default="h200")
    args = parser.parse_args()
    {"h200": check_h200, "cpu": check_cpu}[args.check]()


if __name__ == "__main__":
    main()
