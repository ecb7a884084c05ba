"""The actor update of a mixture-of-experts policy: the router losses enter the loss exactly as
ALGORITHMS' terms (coefficient x HF's load-balancing loss, coefficient x z-loss), and one update gives
the same loss, metrics and params on 1 device and on 8 devices with the expert weights sharded."""
import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from moe_cases import CFG, SETTINGS, moe_batch

from jaxrl_llm import sharding
from jaxrl_llm.models import forward_hidden_moe, init_params, param_logical_axes
from jaxrl_llm.models.moe import load_balancing_loss, router_z_loss
from jaxrl_llm.roles.actor import actor_loss, update_actor
from jaxrl_llm.roles.update import denominators


def test_router_losses_enter_the_actor_loss_with_their_coefficients():
    params, b = init_params(CFG, jax.random.key(0)), moe_batch()
    d = denominators(b.response_mask)
    loss, metrics = actor_loss(params, b, d, model_cfg=CFG, s=SETTINGS)
    plain, _ = actor_loss(params, b, d, model_cfg=CFG,
                          s=dataclasses.replace(SETTINGS, router_aux_loss_coef=0.0, router_z_loss_coef=0.0))
    _, moe = forward_hidden_moe(params, CFG, b.input_ids, b.attention_mask)
    assert moe is not None
    aux, z = float(load_balancing_loss(moe.stats)), float(router_z_loss(moe.stats))
    np.testing.assert_allclose(float(loss) - float(plain), 0.01 * aux + 0.001 * z, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["moe/aux_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["moe/z_loss"]), z, rtol=1e-5)
    assert 1.0 <= float(metrics["moe/expert_load_max"]) <= CFG.num_experts
    # unset: the model's own coefficient only where its config.json asks for router logits (HF's rule)
    unset = dataclasses.replace(SETTINGS, router_aux_loss_coef=None, router_z_loss_coef=0.0)
    quiet, _ = actor_loss(params, b, d, model_cfg=CFG, s=unset)
    np.testing.assert_allclose(float(quiet), float(plain), rtol=1e-6)
    loud_cfg = dataclasses.replace(CFG, output_router_logits=True)
    loud, _ = actor_loss(params, b, d, model_cfg=loud_cfg, s=unset)
    np.testing.assert_allclose(float(loud) - float(plain), CFG.router_aux_loss_coef * aux, rtol=1e-4)


def _run(mesh_shape: dict | None):
    params = init_params(CFG, jax.random.key(0))
    b = moe_batch()
    rows = None
    if mesh_shape is not None:
        mesh = sharding.make_mesh(mesh_shape)
        params = sharding.shard_params(params, param_logical_axes(CFG), mesh)
        rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
        b = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(
            mesh, PartitionSpec(("data", "fsdp"), *([None] * (v.ndim - 1))))), b)
    tx = optax.sgd(0.5)
    update = jax.jit(functools.partial(update_actor, model_cfg=CFG, s=SETTINGS, tx=tx, num_mini_batches=1,
                                       num_micro_batches=1, rows_sharding=rows))
    new, _, metrics = update(params, tx.init(params), b, jax.random.key(1))
    return jax.device_get(new), jax.device_get(metrics)


@pytest.mark.parametrize("mesh_shape", [{"data": 2, "fsdp": 4, "tensor": 1}, {"data": 1, "fsdp": 2, "tensor": 4}],
                         ids=["data2_fsdp4", "fsdp2_tensor4"])
def test_moe_update_same_on_8_devices(mesh_shape):
    p1, m1 = _run(None)
    p8, m8 = _run(mesh_shape)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5), p1, p8)
    for key in ("actor/pg_loss", "moe/aux_loss", "moe/z_loss", "moe/expert_load_max", "actor/grad_norm"):
        np.testing.assert_allclose(m1[key], m8[key], rtol=1e-5, err_msg=key)


def test_tiny_moe_keys_shape_the_model():
    from types import SimpleNamespace

    from jaxrl_llm.config.spec import ModelSpec
    from jaxrl_llm.roles.trained import model_config_of

    dims = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=64, max_position_embeddings=128, seed=0)
    tokenizer = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    shaped = ModelSpec(path="tiny:mixtral", param_dtype="float32", override_config=(), tiny=tuple({
        **dims, "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 16}.items()))
    cfg = model_config_of(shaped, tokenizer)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 1, 16)
    unset = ModelSpec(path="tiny:mixtral", param_dtype="float32", override_config=(), tiny=tuple({
        **dims, "num_experts": None, "num_experts_per_tok": None, "moe_intermediate_size": None}.items()))
    default = model_config_of(unset, tokenizer)  # the family's tiny defaults
    assert (default.num_experts, default.num_experts_per_tok, default.moe_intermediate_size) == (8, 2, 32)
