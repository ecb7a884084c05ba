"""Run in a fresh process (XLA_FLAGS are read once per process): bf16 sampler log-probs (the static
sampler and the paged engine) vs the trainer's scoring on a tiny model, and one tiny bf16 trainer
step with `rollout_is=token`.
Prints one JSON line. Used by test_bf16_numerics.py."""
from __future__ import annotations

import json
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def main(run_dir: str) -> None:
    import tiny_runs
    from bf16_mismatch import mismatch, tiny_model

    from jaxrl_llm.trainer import Trainer

    cfg, params, prompts, pad = tiny_model()
    out = {"sampler_vs_trainer": mismatch(cfg, params, prompts, pad, dtype="bfloat16", new_tokens=16),
           "paged_vs_trainer": mismatch(cfg, params, prompts, pad, dtype="bfloat16", new_tokens=16, engine="paged")}
    config = tiny_runs.tiny_config(run_dir, **{
        "trainer.total_training_steps": 1, "actor_rollout_ref.model.dtype": "bfloat16",
        "algorithm.rollout_correction.rollout_is": "token", "trainer.logger": ["jsonl"]})
    trainer = Trainer(config)
    metrics = trainer.train_step(next(trainer.train_loader))
    trainer.close()
    out["step"] = {k: float(v) for k, v in metrics.items() if k.startswith("rollout_corr/")}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main(sys.argv[1])
