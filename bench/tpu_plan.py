"""Memory plans of Qwen2-shaped GRPO runs compiled for TPU slices, on this host (libtpu: the
tpu-plan extra). Prints one markdown table: per model and slice, each program's bytes per chip
against the chip's HBM, its FLOPs, whether it fits, and the micro-batch sizes 'auto' picked.

    JAX_PLATFORMS=cpu python bench/tpu_plan.py                       # 0.5B / 1.5B / 7B on v5e-8, v5p-8, v6e-8
    JAX_PLATFORMS=cpu python bench/tpu_plan.py --models 0.5B --topologies v5e-8

The models are config.json files with Qwen2's published dimensions (no weights: the plan compiles
on abstract arrays); bf16 compute, fp32 master weights, GRPO with 8 samples of 1k-token prompts and
4k-token responses, the paged rollout engine, every micro-batch size 'auto'.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Qwen2 (transformers config.json fields)
QWEN2 = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
}


def write_model(folder: pathlib.Path, dims: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
              "use_sliding_window": False, **dims}
    (folder / "config.json").write_text(json.dumps(config))
    # the folder check wants a weights index; the plan never reads a weight
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    return str(folder)


def grpo_config(model_path: str, topology: str):
    from jaxrl_llm.config import default_config, smollm2_gguf_path

    cfg = default_config()
    arr = cfg.actor_rollout_ref
    arr.model.path = model_path
    arr.model.dtype = "bfloat16"
    arr.model.param_dtype = "float32"
    cfg.data.tokenizer = smollm2_gguf_path()  # token ids only (eos / pad); the vocabulary is the config's
    cfg.data.synthetic.task = "add"
    cfg.data.max_prompt_length = 1024
    cfg.data.max_response_length = 4096
    cfg.data.train_batch_size = 64
    cfg.algorithm.adv_estimator = "grpo"
    arr.rollout.n = 8
    arr.actor.ppo_mini_batch_size = 64
    arr.actor.use_kl_loss = True  # GRPO's KL loss: a reference pass
    arr.actor.ppo_micro_batch_size_per_device = "auto"
    arr.ref.log_prob_micro_batch_size_per_device = "auto"
    cfg.trainer.plan_topology = topology
    return cfg


def plan_row(name: str, topology: str, folder: pathlib.Path) -> list[str]:
    from jaxrl_llm.config import ConfigError, validate_config
    from jaxrl_llm.platform import parse_accelerator_type
    from jaxrl_llm.trainer.memory_plan import plan_for_config

    _, devices = parse_accelerator_type(topology)
    cfg = validate_config(grpo_config(write_model(folder / name, QWEN2[name]), topology), num_devices=devices)
    start = time.perf_counter()
    try:
        plan = plan_for_config(cfg, check=False)  # every program's row, fitting or not
    except ConfigError as err:  # an 'auto' micro-batch that does not fit even at 1
        return [f"| {name} | {topology} | does not fit: {str(err)[:200]} |"]
    gib = lambda b: f"{b / (1 << 30):.1f}"  # noqa: E731
    rows = []
    for p in plan.programs:
        fit = "ok" if p.total_bytes <= plan.device_memory else "NO"
        rows.append(f"| {name} | {topology} | {p.name} | {p.micro if p.micro is not None else '-'} | "
                    f"{gib(p.total_bytes)} / {gib(plan.device_memory)} | {gib(p.params_bytes)} | {gib(p.kv_bytes)} | "
                    f"{p.flops / 1e12:.1f} | {p.flops / plan.peak_flops:.2f} | {fit} |")
    print(f"# {name} on {topology}: planned in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.5B,1.5B,7B")
    parser.add_argument("--topologies", default="v5e-8,v5p-8,v6e-8")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("jaxrl_llm").setLevel(logging.INFO)  # one line per compiled program (stderr)
    print("| model | slice | program | micro (auto) | GiB per chip / HBM | params GiB | KV GiB | TFLOP per chip "
          "| est. s at peak | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            for topology in args.topologies.split(","):
                for row in plan_row(name, topology, pathlib.Path(tmp)):
                    print(row, flush=True)


if __name__ == "__main__":
    main()
