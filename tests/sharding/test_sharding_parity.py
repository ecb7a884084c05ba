"""Sharded == unsharded numerics; optimizer-state shardings mirror the params."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharding_fixtures import logical_axes, loss_and_logits, make_batch, make_params, mlp_loss

from jaxrl_llm import sharding

MESHES = {"data2_tensor4": {"data": 2, "fsdp": 1, "tensor": 4}, "fsdp8": {"data": 1, "fsdp": -1, "tensor": 1}}


@pytest.fixture(scope="module")
def reference():
    """Loss, gradients, and a one-device AdamW step (given grads) with no mesh at all."""
    device = jax.devices()[0]
    params = jax.device_put(make_params(), device)
    batch = jax.device_put(make_batch(), device)
    loss, grads = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    tx = optax.chain(optax.clip_by_global_norm(1e3), optax.adamw(1e-2))

    @jax.jit
    def update(grads):
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    return loss, grads, lambda g: update(jax.device_put(g, device))


@pytest.mark.parametrize("name", sorted(MESHES))
def test_sharded_loss_grads_and_update_match_one_device(name, reference):
    ref_loss, ref_grads, ref_update = reference
    mesh = sharding.make_mesh(MESHES[name])
    param_shardings = sharding.logical_to_sharding(logical_axes(), make_params(), mesh)
    params = sharding.shard_params(make_params(), logical_axes(), mesh)
    batch = sharding.shard_batch(make_batch(), mesh)
    tx = optax.chain(optax.clip_by_global_norm(1e3), optax.adamw(1e-2))  # clip never binds
    opt_shardings = sharding.optimizer_state_sharding(jax.eval_shape(tx.init, params), param_shardings)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

    def step(params, opt_state, batch):
        (loss, logits), grads = jax.value_and_grad(loss_and_logits, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, logits, grads, optax.apply_updates(params, updates), opt_state

    with jax.set_mesh(mesh):  # logits: no out_sharding, so the activation constraints decide it
        step = jax.jit(step, out_shardings=(NamedSharding(mesh, P()), None, param_shardings,
                                            param_shardings, opt_shardings))
        loss, logits, grads, new_params, new_opt_state = step(params, opt_state, batch)
    # batch rows split over data x fsdp; the 98-wide vocab dim cannot split over tensor=4, so it replicates
    want = P(("data", "fsdp"), None, None if name == "data2_tensor4" else "tensor")
    assert logits.sharding.is_equivalent_to(NamedSharding(mesh, want), 3), logits.sharding
    assert logits.addressable_shards[0].data.shape[0] == 16 // sharding.batch_axis_size(mesh)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # fp32 reduction order
    # Adam's first step is ~lr * sign(grad), so a ~0 grad that differs in the last bit (another
    # reduction order) flips its step: compare the sharded update with the one-device update of
    # the very same gradients.
    want_params = ref_update(jax.device_get(grads))
    for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert new_params["layers"]["up"].sharding.spec == param_shardings["layers"]["up"].spec
    assert jax.tree.map(lambda a: a.sharding.spec, new_opt_state) == jax.tree.map(lambda s: s.spec, opt_shardings)


@pytest.mark.parametrize("make_tx", [
    lambda: optax.adamw(1e-3),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    lambda: optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2),
], ids=["adamw", "clip_adamw", "multisteps"])
def test_optimizer_state_sharding_mirrors_params(make_tx):
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    param_shardings = sharding.logical_to_sharding(logical_axes(), make_params(), mesh)
    state_shapes = jax.eval_shape(make_tx().init, make_params())
    shardings = sharding.optimizer_state_sharding(state_shapes, param_shardings)
    param_specs = jax.tree.map(lambda s: s.spec, param_shardings)
    mirrored, scalars = [], []

    def collect(node):
        if jax.tree.structure(node) == jax.tree.structure(param_shardings):
            mirrored.append(jax.tree.map(lambda s: s.spec, node))
        else:
            scalars.append(node.spec)
        return node

    jax.tree.map(collect, shardings, is_leaf=lambda n: isinstance(n, NamedSharding) or
                 jax.tree.structure(n) == jax.tree.structure(param_shardings))
    expected_trees = {"adamw": 2, "clip_adamw": 2, "multisteps": 3}  # mu, nu (+ acc_grads)
    kind = "multisteps" if isinstance(make_tx(), optax.MultiSteps) else "adamw"
    assert len(mirrored) == expected_trees[kind]
    assert all(specs == param_specs for specs in mirrored)
    assert scalars and all(spec == P() for spec in scalars)  # step counts etc. are replicated


def test_optimizer_state_with_other_shapes_replicates():
    """Same tree structure as the params but other shapes (factored stats): replicated."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    params = {"w": np.zeros((8, 16), np.float32), "b": np.zeros((16,), np.float32)}
    param_shardings = sharding.logical_to_sharding({"w": ("embed", "mlp"), "b": ("mlp",)}, params, mesh)
    state = {"row_stats": {"w": np.zeros((8,), np.float32), "b": np.zeros((16,), np.float32)}}
    out = sharding.optimizer_state_sharding(state, param_shardings)
    assert out["row_stats"]["w"].spec == P() and out["row_stats"]["b"].spec == P("tensor")


def test_activation_constraint_is_a_noop_without_a_mesh():
    x = jnp.ones((4, 8))
    y = jax.jit(lambda x: sharding.with_activation_constraint(x, ("batch", "act_embed")))(x)
    assert y.sharding == x.sharding
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    z = jax.jit(lambda x: sharding.with_activation_constraint(x, ("batch", "act_vocab"), mesh))(x)
    assert z.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), "tensor")), 2)
    assert z.addressable_shards[0].data.shape == (2, 2)
