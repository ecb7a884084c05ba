"""Context parallelism (`mesh.context`): the training forward / backward splits each row's tokens over the
'context' axis. On 8 CPU devices as (context 4, data 2) and (context 8), a packed actor update with several
segments per row and shared prompts gives the 1-device params and every metric, and the compiled update's
per-device temporaries fall about linearly with the context size."""
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import batching as pk
from jaxrl_llm import sharding
from jaxrl_llm.models import init_params, param_logical_axes
from jaxrl_llm.trainer.actor import update_actor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from test_packing import CFG, SETTINGS, R, _assert_same  # noqa: E402
from test_shared_prompts import _grouped, _shared  # noqa: E402

MESHES = {"context4_data2": {"data": 2, "fsdp": 1, "context": 4, "tensor": 1},
          "context8": {"data": 1, "fsdp": 1, "context": 8, "tensor": 1}}
PARAM_ATOL = 3e-5  # an Adam-free SGD step; reductions in other orders (tests/trainer/test_shared_prompts.py)


def _update(mesh, b, *, budget=40, lower_only=False):
    params = init_params(CFG, jax.random.PRNGKey(0))
    s = dataclasses.replace(SETTINGS, loss_agg_mode="seq-mean-token-sum")
    tx = optax.sgd(0.5)
    rng = jax.random.PRNGKey(1)
    rows_sharding, shards = None, 1
    if mesh is not None:
        params = sharding.shard_params(params, param_logical_axes(CFG), mesh)
        axes = sharding.batch_axes(mesh)
        rows_sharding = NamedSharding(mesh, PartitionSpec(axes))
        shards = sharding.batch_axis_size(mesh)
        b = jax.tree.map(lambda v: jax.device_put(v, sharding.batch_sharding(mesh, v.ndim)), b)
    rows = pk.StepRows.of_mask(np.asarray(b.attention_mask), R, _shared(b))
    packing, num_micro = pk.plan_update(rows, rng, epochs=s.ppo_epochs, shuffle=s.shuffle, num_mini=2, num_micro=None,
                                        shards=shards, token_budget=budget)
    fn = jax.jit(functools.partial(update_actor, model_cfg=CFG, s=s, tx=tx, num_mini_batches=2,
                                   num_micro_batches=num_micro, rows_sharding=rows_sharding))
    args = (params, tx.init(params), b, rng, None, packing)
    with sharding.mesh_context(mesh):
        compiled = fn.lower(*args).compile()
    if lower_only:
        return compiled
    new, _, metrics = compiled(*args)
    return jax.device_get(new), jax.device_get(metrics), packing


@pytest.fixture(scope="module")
def one_device():
    return _update(None, _grouped(1))


@pytest.mark.parametrize("name", sorted(MESHES))
def test_context_parallel_update_equals_one_device(one_device, name):
    mesh = sharding.make_mesh(MESHES[name])
    assert mesh.shape["context"] == MESHES[name]["context"]
    p1, m1, packing = one_device
    assert (np.asarray(packing.layout.branch_ids) >= 2).any()  # shared prompts in the rows
    assert (np.asarray(packing.layout.segment_ids).max(axis=-1) >= 2).any()  # several segments per row
    assert np.asarray(packing.layout.segment_ids).shape[-1] % 8 == 0  # the rows' tokens split 4 / 8 ways
    pn, mn, _ = _update(mesh, _grouped(1))
    _assert_same((p1, m1), (pn, mn), atol=PARAM_ATOL)


def test_per_device_activation_memory_falls_with_the_context_size():
    """The value and gradient of the log-probs of two 2048-token rows (a 1024-token response each): the
    compiled program's per-device temporaries for context 1, 2, 4, 8."""
    import jax.numpy as jnp

    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.trainer.forward import response_log_probs

    cfg = ModelConfig.tiny("llama", vocab_size=512, max_position_embeddings=4096)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 512, size=(2, 2048)), jnp.int32)
    mask = jnp.ones(ids.shape, jnp.int32)

    def loss(params, ids, mask):
        return jnp.sum(response_log_probs(params, cfg, ids, mask, 1024))

    temps = {}
    for context in (1, 2, 4, 8):
        mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "context": context, "tensor": 1})
        params = sharding.shard_params(init_params(cfg, jax.random.key(0)), param_logical_axes(cfg), mesh)
        whole = NamedSharding(mesh, PartitionSpec())
        with sharding.mesh_context(mesh):
            compiled = jax.jit(jax.value_and_grad(loss)).lower(params, jax.device_put(ids, whole),
                                                               jax.device_put(mask, whole)).compile()
        temps[context] = compiled.memory_analysis().temp_size_in_bytes
    # context 1 skips the causal chunks' hidden keys; from 2 on every device scores its rows against
    # all keys, and the split roughly halves the bytes per doubling (measured: 258, 252, 142, 87 MiB)
    assert temps[4] < 0.6 * temps[2] and temps[8] < 0.7 * temps[4] and temps[8] < 0.4 * temps[1], temps


@pytest.mark.usefixtures("smollm2_gguf")  # the tiny run's tokenizer
def test_a_run_on_a_context_mesh_logs_the_numbers_of_one_without(tmp_path):
    """Two GRPO steps (packed rows, KL loss; the samplers decode without context splitting) on
    (fsdp 2, context 4) log the same step-2 numbers as on (fsdp 2)."""
    from tiny_runs import read_metrics, step_numbers, tiny_config

    from jaxrl_llm.trainer import Trainer

    logged = {}
    for context in (1, 4):
        run_dir = tmp_path / f"context{context}"
        Trainer(tiny_config(run_dir, **{"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": context,
                                        "actor_rollout_ref.actor.use_kl_loss": True,
                                        "actor_rollout_ref.model.use_remove_padding": True})).fit()
        logged[context] = step_numbers(read_metrics(run_dir), 2)
    assert set(logged[1]) == set(logged[4])
    for key, value in logged[1].items():
        if isinstance(value, float):
            np.testing.assert_allclose(logged[4][key], value, rtol=1e-4, atol=1e-5, err_msg=key)
