"""SftTrainer end to end on the tiny model: the loss falls, validation runs, a resumed run equals an
uninterrupted one, packed and padded updates agree, LoRA trains adapters only; the SFT checkpoint is a
policy an RL run (or convert_to_hf) reads."""
from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from tiny_runs import tiny_config

from jaxrl_llm.sft import SftTrainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def sft_config(run_dir, **overrides):
    return tiny_config(run_dir, "sft_tiny.py", **{"trainer.total_training_steps": 4, **overrides})


def _params(trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(trainer.policy.params)]


def test_loss_falls_validation_runs_and_resume_equals_uninterrupted(tmp_path):
    full = SftTrainer(sft_config(tmp_path / "full"))
    full.fit()
    losses = [h["train/loss"] for h in full.history]
    assert losses[-1] < losses[0]
    assert "val/loss" in full.history[1] and "val/loss" in full.history[3]
    assert [h["train/lr"] for h in full.history] == pytest.approx([1e-3, 0.000854, 0.0005, 0.000146], rel=1e-2)

    first = SftTrainer(sft_config(tmp_path / "resumed", **{"trainer.total_training_steps": 4}))
    first.step()
    first.step()  # trainer.save_freq=2 saves this step
    first.close()
    resumed = SftTrainer(sft_config(tmp_path / "resumed"))
    resumed.fit()
    assert resumed.history[0]["training/global_step"] == 3
    assert [h["train/loss"] for h in resumed.history] == pytest.approx(losses[2:], rel=1e-6)
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_packed_token_budget_and_padded_updates_agree(tmp_path):
    padded = SftTrainer(sft_config(tmp_path / "a", **{"actor_rollout_ref.model.use_remove_padding": False,
                                                      "trainer.total_training_steps": 2}))
    packed = SftTrainer(sft_config(tmp_path / "b", **{"sft.use_dynamic_bsz": True, "sft.max_token_len_per_device": 96,
                                                      "trainer.total_training_steps": 2}))
    padded.fit()
    packed.fit()
    for h, g in zip(padded.history, packed.history):
        assert h["train/loss"] == pytest.approx(g["train/loss"], rel=1e-5)
        assert h["train/grad_norm"] == pytest.approx(g["train/grad_norm"], rel=1e-4)


def test_lora_trains_the_adapters_and_the_checkpoint_is_a_policy(tmp_path):
    from jaxrl_llm.checkpoint import load_policy_checkpoint, register_checkpoint_loader

    cfg = sft_config(tmp_path / "lora", **{"actor_rollout_ref.model.lora_rank": 4,
                                           "actor_rollout_ref.model.lora_alpha": 8, "trainer.total_training_steps": 2})
    trainer = SftTrainer(cfg)
    trainer.fit()
    assert set(trainer.policy.params) == {"lora"}
    register_checkpoint_loader()
    model_cfg, params = load_policy_checkpoint(str(tmp_path / "lora" / "checkpoints"))
    merged = jax.tree.map(np.asarray, trainer.policy.model_params)
    from jaxrl_llm.models.lora import merge_lora

    for a, b in zip(jax.tree.leaves(merge_lora(merged)), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert model_cfg.architecture == trainer.policy.model_cfg.architecture
    # an RL run starts from it: the tokenizer is the one the SFT run used (the checkpoint's meta)
    from jaxrl_llm.config import validate_config

    rl = tiny_config(tmp_path / "rl", **{"actor_rollout_ref.model.path": str(tmp_path / "lora" / "checkpoints"),
                                         "data.tokenizer": None})
    assert validate_config(rl, dp_size=1).data.tokenizer == str(cfg.data.tokenizer)


def test_rl_sft_warmup_trains_the_policy_as_sft_does_before_the_first_rl_step(tmp_path):
    """Trinity's sft_warmup_steps: the RL run's policy after its warm-up equals an SFT run's after the same
    steps on the same rows at the same (constant) learning rate; then RL steps follow."""
    from jaxrl_llm.data.synthetic import write_synthetic_files
    from jaxrl_llm.trainer import Trainer

    rows = tmp_path / "sft.parquet"
    write_synthetic_files(str(rows), str(tmp_path / "unused.parquet"), "add", 16, 4, seed=5)
    warm = {"sft.warmup_steps": 2, "sft.warmup_files": str(rows), "sft.response_key": "reward_model",
            "sft.response_dict_keys": ["ground_truth"], "sft.max_length": 64, "sft.micro_batch_size_per_device": 1,
            "data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
            "actor_rollout_ref.actor.optim.lr_warmup_steps": 0, "trainer.total_training_steps": 1}
    rl = Trainer(tiny_config(tmp_path / "rl", **warm))
    rl.start()
    assert rl.history[0]["sft_warmup/steps"] == 2
    assert rl.history[0]["sft_warmup/loss_last"] < rl.history[0]["sft_warmup/loss_first"]
    sft = SftTrainer(sft_config(tmp_path / "sft", **{"data.train_files": str(rows), "data.synthetic.task": None,
                                                     "data.val_files": None, "trainer.total_training_steps": 2,
                                                     "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
                                                     "actor_rollout_ref.actor.optim.lr_warmup_steps": 0,
                                                     "trainer.save_freq": -1}))
    sft.fit()
    for a, b in zip(jax.tree.leaves(rl.actor.params), _params(sft)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
    rl.close()  # (the RL steps that follow read actor.params: tests/trainer cover them)


def test_qwen35_sft_loss_falls_packed_as_padded(tmp_path):
    """A tiny Qwen3.5 (gated delta-net and gated attention layers, models/hybrid.py) trains with SFT: the loss
    falls, and packed rows (the delta net restarting its state and conv window per sequence) give the padded
    rows' loss and gradient norm. (An RL run is refused before loading: the samplers cannot decode it yet.)"""
    arch = {"actor_rollout_ref.model.path": "tiny:qwen3_5_text", "actor_rollout_ref.model.tiny.num_hidden_layers": 4}
    padded = SftTrainer(sft_config(tmp_path / "a", **arch, **{"actor_rollout_ref.model.use_remove_padding": False}))
    padded.fit()
    losses = [h["train/loss"] for h in padded.history]
    assert losses[-1] < losses[0]
    packed = SftTrainer(sft_config(tmp_path / "b", **arch, **{"sft.use_dynamic_bsz": True,
                                                               "sft.max_token_len_per_device": 96}))
    packed.fit()
    for h, g in zip(padded.history, packed.history):
        assert h["train/loss"] == pytest.approx(g["train/loss"], rel=1e-5)
        assert h["train/grad_norm"] == pytest.approx(g["train/grad_norm"], rel=1e-4)
