"""A LoRA run of a tiny Gemma 2 / Gemma 3 (both engines' sampler, the soft-capped head in the update),
GPT-OSS (attention sinks, biases and the clamped experts in the paged engine and the update), Gemma 4 (its
typed layers, shared KV and per-layer inputs, adapters on each layer kind's stack) or DeepSeek-V3 (the latent
pool and absorbed decode in the engine, adapters on the latent attention's projections) learns, and its
merged export reloads in transformers with equal logits and in our loader with equal params."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer_e2e import read_metrics, tiny_config, with_reward_file

import jaxrl_llm.hf as hf
from jaxrl_llm.models import compute_logits
from jaxrl_llm.models.lora import merge_lora
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")  # the tiny run's tokenizer


@pytest.mark.parametrize("family,engine", [("gemma2", "paged"), ("gemma3_text", "static"), ("gpt_oss", "paged"),
                                           ("gemma4_text", "paged"), ("deepseek_v3", "paged")])
def test_gemma_lora_run_learns_and_its_merged_export_reloads_in_transformers(family, engine, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    arr = "actor_rollout_ref"
    overrides = {f"{arr}.model.path": f"tiny:{family}", f"{arr}.model.lora_rank": 8, f"{arr}.model.lora_alpha": 16,
                 f"{arr}.actor.optim.lr": 1e-2, f"{arr}.actor.use_kl_loss": True, f"{arr}.actor.kl_loss_coef": 0.1,
                 f"{arr}.model.tiny.num_hidden_layers": 4 if family == "gemma4_text" else 3,
                 "trainer.total_training_steps": 3,
                 f"{arr}.rollout.engine": engine, "trainer.export_hf": True}
    trainer = Trainer(with_reward_file(tiny_config(tmp_path / "run", **overrides), tmp_path))
    cfg = trainer.actor.model_cfg
    assert cfg.model_type == family
    if family == "deepseek_v3":  # latent attention, a dense first layer, grouped sigmoid routing
        assert cfg.is_mla and cfg.mlp_only_layers == (0,) and cfg.router_sigmoid
    else:
        assert cfg.local_layer_ids == ((0, 2) if family == "gemma4_text" else (0,))  # Gemma 4: layers 2, 3 share KV
        assert cfg.attention_sinks if family == "gpt_oss" else cfg.sandwich_norms
    trainer.fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "actor/kl_loss" in r]
    assert rows[0]["actor/kl_loss"] == 0.0 and rows[-1]["actor/kl_loss"] > 0  # the adapters moved the policy
    assert all(np.isfinite(r["actor/pg_loss"]) for r in rows)
    merged = jax.device_get(merge_lora(trainer.actor.model_params))
    folder = tmp_path / "run" / "hf"
    assert json.loads((folder / "config.json").read_text())["model_type"] == family
    torch_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 11))  # longer than the window of 4
    with torch.no_grad():
        expected = torch_model(input_ids=torch.tensor(ids)).logits.numpy()
    ours = np.asarray(compute_logits(merged, cfg, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32)))
    assert np.abs(ours - expected).max() <= 1e-4
    cfg2, params2 = hf.load_hf_folder(folder)  # and our loader reads the export back
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params2, merged)
