"""LoRA training: the jitted actor update moves only the adapters (its gradient equals the one
through merged weights), optimizer state is adapter-shaped, the reference is the untouched base
(no copy), checkpoints hold the adapters and the base path, resume == uninterrupted, and the
merged export / converted checkpoint equal the trained policy."""
import dataclasses
import functools
import json

import jax
import numpy as np
import optax
import pytest
import tiny_runs
from test_actor_critic_update import CFG, SETTINGS, _batch
from test_trainer_e2e import read_metrics, tiny_config, with_reward_file

import jaxrl_llm.hf as hf
from jaxrl_llm.checkpoint import read_checkpoint_meta
from jaxrl_llm.config import ConfigError, validate_config
from jaxrl_llm.models import init_params
from jaxrl_llm.models.lora import LoraConfig, init_lora, merge_lora, with_lora
from jaxrl_llm.roles.actor import actor_loss, update_actor
from jaxrl_llm.roles.update import denominators
from jaxrl_llm.trainer import Trainer

LORA = LoraConfig(rank=4, alpha=8.0)
ARR = "actor_rollout_ref"
pytestmark = pytest.mark.usefixtures("smollm2_gguf")  # tiny runs use the SmolLM2 tokenizer


def test_lora_update_moves_only_adapters_by_their_gradient():
    base = init_params(CFG, jax.random.PRNGKey(0))
    ad = init_lora(CFG, LORA, jax.random.PRNGKey(1))
    ad = jax.tree.map(lambda x: x + 0.05, ad)  # B != 0: every adapter leaf gets a gradient
    b = _batch()
    s = dataclasses.replace(SETTINGS, ppo_epochs=1, shuffle=False)
    tx = optax.sgd(0.1)
    update = jax.jit(functools.partial(update_actor, model_cfg=CFG, s=s, tx=tx, num_mini_batches=1,
                                       num_micro_batches=2, lora_scale=LORA.scale))
    params = {"lora": ad}
    new, opt_state, metrics = update(params, tx.init(params), b, jax.random.PRNGKey(1), None, None, base)
    # reference: one SGD step on the full-batch loss through explicitly merged weights
    grads = jax.jit(jax.grad(lambda a: actor_loss(merge_lora(with_lora(base, a, LORA.scale)), b,
                                                  denominators(b.response_mask), model_cfg=CFG, s=s)[0]))(ad)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, ad, grads)
    assert jax.tree.structure(new) == jax.tree.structure(params)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-4), new["lora"], want)
    np.testing.assert_allclose(metrics["actor/grad_norm"], optax.tree.norm(grads), rtol=1e-4)
    assert float(metrics["actor/grad_norm"]) > 0


def test_lora_dropout_draws_its_masks_from_the_update_key():
    """lora_dropout in the update: the same key gives the same update, another key (or no dropout) another;
    the gradient stays on the adapters."""
    base = init_params(CFG, jax.random.PRNGKey(0))
    ad = jax.tree.map(lambda x: x + 0.05, init_lora(CFG, LORA, jax.random.PRNGKey(1)))
    b = _batch()
    s = dataclasses.replace(SETTINGS, ppo_epochs=1, shuffle=False)
    tx = optax.sgd(0.1)

    updates = {dropout: jax.jit(functools.partial(update_actor, model_cfg=CFG, s=s, tx=tx, num_mini_batches=1,
                                                  num_micro_batches=2, lora_scale=LORA.scale, lora_dropout=dropout))
               for dropout in (0.0, 0.3)}

    def run(dropout, key):
        update = updates[dropout]
        params = {"lora": ad}
        new, _, metrics = update(params, tx.init(params), b, jax.random.PRNGKey(key), None, None, base)
        return jax.device_get(new["lora"]), float(metrics["actor/grad_norm"])

    plain, again, other, none = run(0.3, 1), run(0.3, 1), run(0.3, 2), run(0.0, 1)
    jax.tree.map(np.testing.assert_array_equal, plain[0], again[0])
    assert plain[1] == again[1] and plain[1] != other[1] and plain[1] != none[1] and plain[1] > 0


@pytest.mark.parametrize("key,value,match", [
    (f"{ARR}.model.lora_rank", -1, r"actor_rollout_ref.model.lora_rank=-1: must be an int >= 0"),
    (f"{ARR}.model.target_modules", ["q_proj", "attn"],
     r"actor_rollout_ref.model.target_modules=.*unknown module name.*'attn'"),
    (f"{ARR}.model.lora_alpha", 0, r"actor_rollout_ref.model.lora_alpha=0(\.0)?: must be > 0"),
    (f"{ARR}.model.lora_dropout", 1.0, r"actor_rollout_ref.model.lora_dropout=1.0: must be in \[0, 1\)"),
])
def test_bad_lora_keys_name_the_key(tmp_path, key, value, match):
    cfg = tiny_config(tmp_path, **{f"{ARR}.model.lora_rank": 4, key: value})
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, dp_size=1)


def _run(run_dir, tmp_path, steps, **extra):
    # TRL's default lora_dropout: PEFT's dropout in the update's forward, its masks drawn from the step's key
    # (so the resumed run below trains on the same masks)
    overrides = {f"{ARR}.model.lora_rank": 8, f"{ARR}.model.lora_alpha": 16, f"{ARR}.model.lora_dropout": 0.05,
                 f"{ARR}.actor.optim.lr": 1e-2,
                 f"{ARR}.actor.use_kl_loss": True, f"{ARR}.actor.kl_loss_coef": 0.1,
                 "trainer.total_training_steps": steps, **extra}
    return Trainer(with_reward_file(tiny_config(run_dir, **overrides), tmp_path))


def test_lora_run_reference_checkpoint_resume_and_export(tmp_path):
    full = tmp_path / "full"
    trainer = _run(full, tmp_path, 3, **{"trainer.save_freq": 1, "trainer.export_hf": True})
    base0 = jax.device_get(trainer.actor.frozen)
    trainer.fit()
    actor = trainer.actor
    # the reference is the frozen base itself (no copy), which training left untouched
    assert trainer.reference.params is actor.frozen and trainer.reference.shares_base
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(actor.frozen), base0)
    # trained params and optimizer state: adapters only
    assert set(actor.params) == {"lora"}
    shapes = {x.shape for x in jax.tree.leaves(actor.params)}
    assert {x.shape for x in jax.tree.leaves(actor.opt_state) if x.ndim} == shapes
    assert actor.num_trainable_params < 0.01 * actor.num_params
    rows = [r for r in read_metrics(full) if "actor/kl_loss" in r]
    # step 1 updates from B = 0, the base: KL to the reference is exactly 0; then the policy moves
    assert rows[0]["actor/kl_loss"] == 0.0 and rows[-1]["actor/kl_loss"] > 0
    assert max(float(abs(x).max()) for x in jax.tree.leaves(jax.device_get(actor.params))) > 0

    meta = read_checkpoint_meta(full / "checkpoints" / "3")
    assert meta["lora"] == {"rank": 8, "alpha": 16.0, "target_modules": list(LORA.targets), "dropout": 0.05,
                            "base_path": "tiny:llama"}
    merged = jax.device_get(merge_lora(actor.model_params))
    exported = hf.load_hf_folder(full / "hf")[1]  # finish(): the merged policy as an HF folder ...
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), exported, merged)
    peft_dir = full / "hf_peft"  # ... and the adapters as a PEFT folder
    peft_config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (peft_config["r"], peft_config["lora_dropout"]) == (8, 0.05)
    # a LoRA checkpoint converts to the merged HF folder (base re-read from its path) and a PEFT folder
    convert = tiny_runs.load_convert_to_hf()
    assert convert.main(["--input", str(full), "--output", str(tmp_path / "hf"), "--peft", str(tmp_path / "peft")]) == 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), hf.load_hf_folder(tmp_path / "hf")[1],
                 merged)
    assert (tmp_path / "peft" / "adapter_model.safetensors").read_bytes() == \
        (peft_dir / "adapter_model.safetensors").read_bytes()

    tiny_runs.assert_resume_equals_uninterrupted(lambda d, n, **kw: _run(d, tmp_path, n, **kw), full,
                                                 tmp_path / "resumed")
