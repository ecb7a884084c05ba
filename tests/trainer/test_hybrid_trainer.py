"""GRPO on a tiny Qwen3.5 and Qwen3.5-MoE (gated delta-net layers between gated attention layers,
models/hybrid.py): both rollout engines carry each row's / slot's delta-net state beside the attention layers' KV,
the sampled log-probs are the trainer's (rollout_corr), packed rows give each response its own copy of the prompt
(a delta net cannot read two responses from one prompt), the update moves both kinds of layers (the dense run
every weight, the MoE run its 'all-linear' LoRA adapters on both mixers and the shared expert), the MoE run replays
the sampler's routing, and the (merged) export reloads in transformers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer_e2e import read_metrics, tiny_config, with_reward_file

from jaxrl_llm.models import compute_logits
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")  # the tiny run's tokenizer


@pytest.mark.parametrize("family,engine", [("qwen3_5_text", "paged"), ("qwen3_5_moe_text", "static")])
def test_qwen35_grpo_run_samples_with_its_state_and_exports(family, engine, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    arr = "actor_rollout_ref"
    overrides = {f"{arr}.model.path": f"tiny:{family}", f"{arr}.model.tiny.num_hidden_layers": 4,
                 f"{arr}.rollout.engine": engine, f"{arr}.rollout.n": 4, f"{arr}.model.use_remove_padding": True,
                 f"{arr}.actor.optim.lr": 1e-2, "trainer.total_training_steps": 2,
                 "algorithm.rollout_correction.rollout_is": "token",  # the trainer recomputes and compares
                 "trainer.export_hf": True}
    if family == "qwen3_5_moe_text":
        overrides.update({f"{arr}.actor.router_replay": "rollout", f"{arr}.model.lora_rank": 8,
                          f"{arr}.model.lora_alpha": 16})
    trainer = Trainer(with_reward_file(tiny_config(tmp_path / "run", **overrides), tmp_path))
    cfg = trainer.actor.model_cfg
    assert cfg.hybrid and cfg.linear_layers == (0, 2) and cfg.is_moe == (family == "qwen3_5_moe_text")
    assert not trainer.spec.model.share_packed_prompts and not trainer.actor.model.share_packed_prompts
    lora = trainer.actor.lora is not None
    assert lora == cfg.is_moe
    trained = lambda: jax.device_get(trainer.actor.params["lora"] if lora else trainer.actor.params)  # noqa: E731
    before = trained()["layers"]
    trainer.fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "actor/pg_loss" in r]
    assert len(rows) == 2 and all(np.isfinite(r["actor/pg_loss"]) for r in rows)
    for row in rows:  # the rollout's log-probs are the trainer's recomputation, to fp32 rounding
        assert row["rollout_corr/max_abs_log_ratio"] < 2e-4, row
    after = trained()["layers"]
    for kind in ("linear", "attn") + (("shared_expert",) if lora else ("mlp",)):
        moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), before[kind], after[kind])
        assert max(jax.tree.leaves(moved)) > 0, kind
    if cfg.is_moe:  # the sampler recorded its routing and the update replayed it
        assert all(0.0 < r["moe/routing_agreement"] <= 1.0 for r in rows)
    folder = tmp_path / "run" / "hf"
    torch_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 11))
    with torch.no_grad():
        expected = torch_model(input_ids=torch.tensor(ids)).logits.numpy()
    ours = np.asarray(compute_logits(jax.device_get(trainer.actor.model_params), cfg, jnp.asarray(ids),
                                     jnp.ones(ids.shape, jnp.int32)))
    assert np.abs(ours - expected).max() <= 1e-4


def test_speculative_decoding_is_refused_before_loading(tmp_path):
    """Drafts a verification rejects would have to take back a slot's delta-net state: a Qwen3.5 run with
    speculative decoding stops before any weight loads, naming the key (the engine refuses it too,
    tests/sampler/test_engine_parity.py)."""
    from jaxrl_llm.config import ConfigError

    cfg = tiny_config(tmp_path / "run", **{"actor_rollout_ref.model.path": "tiny:qwen3_5_text",
                                          "actor_rollout_ref.rollout.engine": "paged",
                                          "actor_rollout_ref.rollout.speculative.method": "ngram"})
    with pytest.raises(ConfigError, match="rollout.speculative.method='ngram'.*cannot roll back"):
        Trainer(cfg)
