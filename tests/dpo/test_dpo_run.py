"""DPO end to end on the tiny model (rewards/accuracies rises, val metrics, LoRA's reference is the base,
precomputed reference columns, resume), preference rows as TRL / veRL store them and their bad inputs,
TRL's DPOConfig and Trinity's DPO files, launch/dpo.py's one-line errors."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml
from tiny_models import make_char_tokenizer
from tiny_runs import tiny_config

from jaxrl_llm.config import ConfigError, default_config
from jaxrl_llm.config.importers.dpo import dpo_config
from jaxrl_llm.data import DataError
from jaxrl_llm.data.sources import RowRef
from jaxrl_llm.data.spec import DataSpec
from jaxrl_llm.dpo import DpoSpec, DpoTrainer
from jaxrl_llm.dpo.data import _pair

ROOT = pathlib.Path(__file__).resolve().parents[2]


def dpo_config_file(run_dir, **overrides):
    return tiny_config(run_dir, "dpo_tiny.py", **overrides)


def test_training_raises_the_reward_accuracy_and_reports_held_out_pairs(tmp_path):
    trainer = DpoTrainer(dpo_config_file(tmp_path / "run", **{"trainer.total_training_steps": 6}))
    trainer.fit()
    h = trainer.history
    assert h[0]["rewards/accuracies"] == 0.0 and h[0]["train/loss"] == pytest.approx(np.log(2), rel=1e-5)
    assert h[-1]["rewards/accuracies"] >= 0.75 and h[-1]["rewards/margins"] > 0
    assert h[-1]["train/loss"] < h[0]["train/loss"]
    assert {"val/rewards/accuracies", "val/loss", "val/logps/chosen"} <= set(h[1])
    assert trainer.reference is not None and not trainer.reference.shares_base


def test_lora_reference_is_the_base_and_resume_equals_uninterrupted(tmp_path):
    lora = {"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 8,
            "trainer.total_training_steps": 4, "trainer.test_freq": -1}
    full = DpoTrainer(dpo_config_file(tmp_path / "full", **lora))
    assert full.reference is not None and full.reference.shares_base
    full.fit()
    first = DpoTrainer(dpo_config_file(tmp_path / "resumed", **lora))
    first.step()
    first.step()  # trainer.save_freq=2
    first.close()
    resumed = DpoTrainer(dpo_config_file(tmp_path / "resumed", **lora))
    resumed.fit()
    assert [h["train/loss"] for h in resumed.history] == pytest.approx([h["train/loss"] for h in full.history[2:]],
                                                                       rel=1e-6)


def test_precomputed_reference_columns_replace_the_reference(tmp_path):
    import pandas as pd

    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1?"}], "chosen": str(i + 1), "rejected": str(i + 2),
             "ref_chosen_logps": -10.0, "ref_rejected_logps": -10.0} for i in range(16)]
    path = tmp_path / "pairs.parquet"
    pd.DataFrame(rows).to_parquet(path)
    overrides = {"data.synthetic.task": None, "data.train_files": str(path), "data.val_files": None,
                 "trainer.total_training_steps": 1}
    trainer = DpoTrainer(dpo_config_file(tmp_path / "run", **overrides))
    assert trainer.reference is None and trainer.precomputed
    metrics = trainer.step()
    # rewards are beta * (policy - (-10)) from the rows' numbers, not 0 as against an identical reference
    assert metrics["rewards/chosen"] == pytest.approx(0.1 * (metrics["logps/chosen"] + 10.0), rel=1e-5)
    trainer.close()


DATA_SPEC = DataSpec(train_files=None, val_files=None, tokenizer=None, prompt_key="prompt", messages_key="messages",
                     apply_chat_template=True, max_prompt_length=512, train_batch_size=2, val_batch_size=None,
                     return_raw_chat=False, truncation="error", filter_overlong_prompts=False,
                     filter_overlong_prompts_workers=1, shuffle=False, seed=0, train_max_samples=-1,
                     val_max_samples=-1, dataloader_num_workers=0, custom_cls_path=None, custom_cls_name=None)


def _decode(tok, ids) -> str:
    return tok.decode([int(i) for i in ids])


def test_preference_rows_as_trl_stores_them():
    tok = make_char_tokenizer()
    spec, where = DpoSpec(), RowRef("pairs.jsonl", 0)
    text = _pair({"prompt": "q", "chosen": "a", "rejected": "b"}, where, DATA_SPEC, spec, tok)
    conversational = _pair({"prompt": [{"role": "user", "content": "q"}],
                            "chosen": [{"role": "assistant", "content": "a"}],
                            "rejected": [{"role": "assistant", "content": "b"}]}, where, DATA_SPEC, spec, tok)
    implicit = _pair({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
                     where, DATA_SPEC, spec, tok)
    for pair in (text, conversational, implicit):
        assert _decode(tok, pair.chosen.prompt) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        assert np.array_equal(pair.chosen.prompt, pair.rejected.prompt)
        assert (_decode(tok, pair.chosen.response), _decode(tok, pair.rejected.response)) == (
            "a<|im_end|>", "b<|im_end|>")


@pytest.mark.parametrize("row,message", [
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "row 0: the chosen and the rejected response are the same"),
    ({"prompt": "q", "chosen": "a"}, "row 0: missing column 'rejected' \\(dpo.rejected_key\\)"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "row 0: column 'chosen' is neither a string nor a list"),
    ({"chosen": "a", "rejected": "b"}, "row 0: missing column 'prompt'"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]},
     "row 0: no 'prompt' column, and 'chosen' / 'rejected' differ before their last assistant turn"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}],
      "rejected": "b"}, "row 0: column 'chosen' is a message list whose last message is not the assistant"),
])
def test_bad_preference_rows_name_file_and_row(row, message):
    with pytest.raises(DataError, match=message):
        _pair(row, RowRef("pairs.jsonl", 0), DATA_SPEC, DpoSpec(), make_char_tokenizer())


def test_trl_dpo_config_and_trinity_dpo_import(tmp_path):
    trl = {"model_name_or_path": "Qwen/Qwen2-0.5B-Instruct", "beta": 0.2, "loss_type": "ipo",
           "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "learning_rate": 5e-7,
           "lr_scheduler_type": "cosine", "max_length": 512, "num_train_epochs": 1, "use_peft": True, "lora_r": 8,
           "output_dir": "out", "logging_steps": 25, "bf16": True, "precompute_ref_log_probs": True}
    path = tmp_path / "dpo_config.yaml"
    path.write_text(yaml.safe_dump(trl))
    cfg = dpo_config(default_config(), [], str(path))
    assert (cfg.dpo.beta, cfg.dpo.loss_type, cfg.dpo.max_length, cfg.dpo.micro_batch_size_per_device) == (
        0.2, "ipo", 512, 2)
    import jax

    assert cfg.data.train_batch_size == 2 * 4 * jax.device_count()
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert cfg.actor_rollout_ref.model.lora_rank == 8 and cfg.dpo.label_smoothing == 0.0
    path.write_text(yaml.safe_dump({**trl, "loss_type": "kto_pair"}))
    with pytest.raises(ConfigError, match="dpo_config.yaml: loss_type: 'kto_pair'"):
        dpo_config(default_config(), [], str(path))
    trinity = {"project": "p", "name": "dpo", "checkpoint_root_dir": "ckpt", "mode": "train",
               "algorithm": {"algorithm_type": "dpo", "kl_coef": 0.3},
               "model": {"model_path": "~/models/Qwen2.5-1.5B-Instruct", "max_model_len": 1792},
               "buffer": {"total_epochs": 2, "batch_size": 32, "trainer_input": {"experience_buffer": {
                   "name": "dpo_buffer", "storage_type": "file", "path": str(tmp_path / "human_like.jsonl"),
                   "format": {"prompt_type": "messages", "prompt_key": "prompt", "chosen_key": "chosen",
                              "rejected_key": "rejected"}}}},
               "trainer": {"save_interval": 30}}
    path = tmp_path / "trinity_dpo.yaml"
    path.write_text(yaml.safe_dump(trinity))
    cfg = dpo_config(default_config(), [], str(path))
    assert (cfg.dpo.beta, cfg.dpo.max_length, cfg.data.train_batch_size, cfg.trainer.total_epochs) == (
        0.3, 1792, 32, 2)
    assert list(cfg.data.train_files) == [str(tmp_path / "human_like.jsonl")]


def test_launch_dpo_reports_a_pair_without_difference_in_one_line(tmp_path):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n'
                    '{"prompt": "q", "chosen": "x", "rejected": "x"}\n')
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "launch/dpo.py", "--config=configs/dpo_tiny.py", "--dry_run", "--",
                           f"trainer.default_local_dir={tmp_path}", "data.synthetic.task=null",
                           f"data.train_files={rows}", "data.val_files=null"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("data error: ") and "pairs.jsonl line 2" in last and "are the same text" in last
