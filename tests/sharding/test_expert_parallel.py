"""Expert parallelism (models/expert_parallel.py): a mixture-of-experts model on 8 devices as
(data 2, expert 4), (fsdp 2, expert 4) and (expert 8) gives the 1-device loss, gradients (the params
after an update) and greedy tokens through both engines, with each device holding only its share of
the experts and the tokens exchanged over the `expert` axis."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from moe_cases import CFG, DEEPSEEK_CFG, GPT_OSS_CFG, MIXED_CFG, SETTINGS, moe_batch, with_random_biases
from tiny_runs import tiny_config

from jaxrl_llm import sharding
from jaxrl_llm.models import init_params, param_logical_axes
from jaxrl_llm.models.expert_parallel import expert_ways
from jaxrl_llm.roles.actor import update_actor
from jaxrl_llm.sampler import SamplingParams, sample
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged

MESHES = {"data2_expert4": {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1},
          "fsdp2_expert4": {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1},
          "expert8": {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1}}
# CFG: a tiny Qwen2-MoE (8 experts, top-2, a shared expert; hidden 32 splits over fsdp)
PROMPTS8 = [[5, 17, 9, 33, 23, 2, 41, 7, 60], [12, 25, 3], [47, 4, 4, 8, 19], [20], [9] * 14, [31, 2],
            [6, 12, 19, 25], [1, 2, 3, 4, 5, 6]]
NEW = 6


def _update(mesh: jax.sharding.Mesh | None, cfg=CFG):
    """One actor update (loss, router losses, SGD step) and the compiled program's text."""
    params, batch = init_params(cfg, jax.random.key(0)), moe_batch()
    if cfg.expert_bias or cfg.router_sigmoid:
        params = with_random_biases(params)
    rows = None
    if mesh is not None:
        params = sharding.shard_params(params, param_logical_axes(cfg), mesh)
        rows = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))
        batch = sharding.shard_batch(batch, mesh)
    tx = optax.sgd(0.5)
    update = jax.jit(functools.partial(update_actor, model_cfg=cfg, s=SETTINGS, tx=tx,
                                       num_mini_batches=1, num_micro_batches=1, rows_sharding=rows))
    args = (params, tx.init(params), batch, jax.random.key(1))
    with sharding.mesh_context(mesh):
        compiled = update.lower(*args).compile()
    new, _, metrics = compiled(*args)
    return jax.device_get(new), jax.device_get(metrics), compiled.as_text(), params


@pytest.fixture(scope="module")
def one_device_update():
    return _update(None)[:2]


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_update_same_on_expert_meshes(one_device_update, mesh_name):
    mesh = sharding.make_mesh(MESHES[mesh_name])
    assert expert_ways(CFG, mesh.abstract_mesh) == mesh.shape["expert"]
    p1, m1 = one_device_update
    p8, m8, hlo, placed = _update(mesh)
    # each device holds its share of the experts (and of their hidden dim over fsdp), not all of them
    gate = placed["layers"]["moe"]["experts"]["gate_proj"]["kernel"]  # [L, E, H, F]
    local = gate.addressable_shards[0].data.shape
    assert local[1] == CFG.num_experts // mesh.shape["expert"]
    assert local[2] == CFG.hidden_size // mesh.shape["fsdp"]
    # tokens go to their experts (all-gather over `expert`) and come back summed (reduce-scatter)
    assert "reduce-scatter" in hlo and "all-gather" in hlo
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5), p1, p8)
    for key in ("actor/pg_loss", "moe/aux_loss", "moe/z_loss", "moe/expert_load_max", "actor/grad_norm"):
        np.testing.assert_allclose(m1[key], m8[key], rtol=1e-5, err_msg=key)


def test_mixed_layer_update_same_on_an_expert_mesh():
    """A dense MLP layer between the sparse ones: its layer picks the dense stack (lax.cond), the sparse
    layers exchange tokens over `expert`, and the update equals the 1-device one."""
    assert MIXED_CFG.moe_layer_ids == (0, 2) and MIXED_CFG.dense_layer_ids == (1,)
    p1, m1, _, _ = _update(None, MIXED_CFG)
    p8, m8, hlo, placed = _update(sharding.make_mesh(MESHES["fsdp2_expert4"]), MIXED_CFG)
    assert placed["layers"]["moe"]["experts"]["gate_proj"]["kernel"].addressable_shards[0].data.shape[:2] == (2, 2)
    assert placed["layers"]["mlp"]["gate_proj"]["kernel"].shape[0] == 1
    assert "reduce-scatter" in hlo
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5), p1, p8)
    fresh = init_params(MIXED_CFG, jax.random.key(0))["layers"]["mlp"]["up_proj"]["kernel"]
    assert float(np.abs(p1["layers"]["mlp"]["up_proj"]["kernel"] - np.asarray(fresh)).max()) > 0  # the dense MLP trains
    for key in ("actor/pg_loss", "moe/aux_loss", "moe/z_loss", "moe/expert_load_max", "actor/grad_norm"):
        np.testing.assert_allclose(m1[key], m8[key], rtol=1e-5, err_msg=key)


def test_gpt_oss_update_same_on_expert_and_tensor_meshes():
    """GPT-OSS's expert biases under expert parallelism (each device its experts' biases) and with the experts'
    width split over `tensor` (the output bias joins after the partial sums are added), attention sinks split
    with the heads, and the clamped SwiGLU: the 1-device update."""
    p1, m1, _, _ = _update(None, GPT_OSS_CFG)
    assert float(np.abs(p1["layers"]["attn"]["sinks"]).min()) > 0
    for shape in (MESHES["fsdp2_expert4"], {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}):
        p8, m8, hlo, placed = _update(sharding.make_mesh(shape), GPT_OSS_CFG)
        bias = placed["layers"]["moe"]["experts"]["up_proj"]["bias"]  # [L, E, F]
        assert bias.addressable_shards[0].data.shape[1] == GPT_OSS_CFG.num_experts // shape["expert"]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5), p1, p8)
        for key in ("actor/pg_loss", "moe/aux_loss", "actor/grad_norm"):
            np.testing.assert_allclose(m1[key], m8[key], rtol=1e-5, err_msg=f"{key} on {shape}")


def test_deepseek_update_same_on_expert_and_tensor_meshes():
    """DeepSeek-V3 under expert parallelism and a tensor split of its heads: the latent attention's per-head
    expansion (kv_b_proj), q_b_proj and o_proj split with the heads (the bottlenecks' ranks whole), the grouped
    sigmoid routing and its correction bias (which the update leaves alone), a dense first layer and the
    shared expert: the 1-device update."""
    p1, m1, _, params = _update(None, DEEPSEEK_CFG)
    bias = np.asarray(params["layers"]["moe"]["score_bias"])
    assert np.abs(bias).min() > 0
    np.testing.assert_array_equal(p1["layers"]["moe"]["score_bias"], bias)  # no gradient reaches it
    for shape in (MESHES["fsdp2_expert4"], {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}):
        p8, m8, hlo, placed = _update(sharding.make_mesh(shape), DEEPSEEK_CFG)
        kv_b = placed["layers"]["attn"]["kv_b_proj"]["kernel"]  # [L, kv_lora, heads, nope + v]
        assert kv_b.addressable_shards[0].data.shape[2] == DEEPSEEK_CFG.num_attention_heads // shape["tensor"]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5), p1, p8)
        for key in ("actor/pg_loss", "moe/aux_loss", "actor/grad_norm"):
            np.testing.assert_allclose(m1[key], m8[key], rtol=1e-5, err_msg=f"{key} on {shape}")


GREEDY = SamplingParams(max_new_tokens=NEW, do_sample=False)


def _generate(params: dict, mesh: jax.sharding.Mesh | None):
    """(static sampler tokens, paged engine tokens) of greedy decoding of PROMPTS8."""
    settings, knobs = GREEDY.compile_args(CFG.eos_token_ids, 0, vocab_size=CFG.vocab_size)
    ids, mask = (np.zeros((8, 14), np.int32) for _ in range(2))
    for row, p in enumerate(PROMPTS8):  # left padded
        ids[row, 14 - len(p):], mask[row, 14 - len(p):] = p, 1
    if mesh is not None:
        params = sharding.shard_params(params, param_logical_axes(CFG), mesh)
        ids, mask = sharding.shard_batch((jnp.asarray(ids), jnp.asarray(mask)), mesh)
    static = sample(params, CFG, ids, mask, jax.random.key(0), knobs, settings=settings, mesh=mesh)
    paged, _ = sample_paged(params, CFG, PROMPTS8, jax.random.key(0), knobs, settings=settings,
                            opts=EngineOptions(max_num_seqs=8, precompile_drain=False), mesh=mesh)
    return np.asarray(static.tokens), np.asarray(paged.tokens)


def test_greedy_tokens_same_on_expert_meshes():
    params = init_params(CFG, jax.random.key(3))
    want_static, want_paged = _generate(params, None)
    np.testing.assert_array_equal(want_static, want_paged)
    assert len(np.unique(want_static)) > 4  # not one repeated token
    for name, shape in MESHES.items():
        static, paged = _generate(params, sharding.make_mesh(shape))
        np.testing.assert_array_equal(static, want_static, err_msg=f"static sampler on {name}")
        np.testing.assert_array_equal(paged, want_paged, err_msg=f"paged engine on {name}")


def test_expert_axis_that_does_not_divide_the_experts_is_refused(tmp_path):
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.trainer.trainer import Trainer

    cfg = tiny_config(tmp_path, **{"actor_rollout_ref.model.path": "tiny:qwen3_moe",
                                   "actor_rollout_ref.model.tiny.num_experts": 6, "trainer.memory_plan": False,
                                   "mesh.fsdp": 2, "mesh.expert": 4})
    with pytest.raises(ConfigError, match=r"mesh.expert=4 does not divide the policy's 6 experts"):
        Trainer(cfg)
