"""The frozen reference policy (roles/reference.py): stored in `ref.param_dtype` (default: the
compute dtype), its own buffers on the policy's shardings, in pinned host memory with
`ref.param_offload` where the backend has it (else one warning), and scoring the same log-probs as
the full fp32 copy it replaces."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import random_rollout

from jaxrl_llm.config import default_config, resolve_config
from jaxrl_llm.config.spec import RefSpec
from jaxrl_llm.models import ModelConfig, init_params, param_logical_axes
from jaxrl_llm.models import remat as remat_mod
from jaxrl_llm.roles import reference as ref_mod
from jaxrl_llm.roles.experience import log_probs_no_grad
from jaxrl_llm.roles.reference import is_offloaded, make_reference, reference_on_device
from jaxrl_llm.sharding import logical_to_sharding, make_mesh

CFG = ModelConfig.tiny("llama", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)
N, P, R = 8, 5, 6


def _policy():
    mesh = make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    params = init_params(CFG, jax.random.PRNGKey(0))
    return jax.device_put(params, logical_to_sharding(param_logical_axes(CFG), params, mesh))


def _rollout(seed=0):
    ids, mask, resp_mask, _, _ = random_rollout(np.random.default_rng(seed), N, P, R)
    return jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(resp_mask, jnp.float32)


def _log_probs(params, compute_dtype):
    ids, mask, resp = _rollout()
    return np.asarray(log_probs_no_grad(params, ids, mask, resp, model_cfg=CFG, temperature=0.7,
                                        compute_dtype=compute_dtype, micro_rows=4)), np.asarray(resp, bool)


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("compute_dtype,param_dtype,atol", [
    ("float32", "float32", 1e-6), ("bfloat16", "bfloat16", 1e-2), ("bfloat16", "float32", 1e-6)])
def test_reference_dtype_size_and_log_probs_match_the_fp32_copy(compute_dtype, param_dtype, atol):
    policy = _policy()
    ref = make_reference(policy, RefSpec(param_dtype=param_dtype, param_offload=False))
    assert {x.dtype for x in jax.tree.leaves(ref)} == {jnp.dtype(param_dtype)}
    assert _nbytes(ref) == _nbytes(policy) * jnp.dtype(param_dtype).itemsize // 4
    for p, r in zip(jax.tree.leaves(policy), jax.tree.leaves(ref)):
        assert r.sharding == p.sharding and not is_offloaded({"x": r})
        # its own buffers: the actor update donates (overwrites) the policy's
        pointer = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()  # noqa: E731
        assert pointer(r) != pointer(p)
    want, valid = _log_probs(policy, compute_dtype)  # what the former full fp32 copy scored
    got, _ = _log_probs(ref, compute_dtype)
    err = np.abs(got - want)[valid].max()
    assert err <= atol, err
    assert np.isfinite(got).all() and want[valid].mean() < -1.0  # real log-probs over a 64-token vocabulary


def test_param_offload_keeps_the_reference_in_pinned_host_memory():
    assert ref_mod.offload_supported()  # CPU jax has pinned_host memory; the next test mocks a backend without
    policy = _policy()
    ref = make_reference(policy, RefSpec(param_dtype="bfloat16", param_offload=True))
    assert is_offloaded(ref)
    for p, r in zip(jax.tree.leaves(policy), jax.tree.leaves(ref)):
        assert r.sharding.memory_kind == "pinned_host" and r.dtype == jnp.bfloat16
        assert r.sharding.spec == p.sharding.spec and r.sharding.mesh == p.sharding.mesh
    on_device = reference_on_device(ref)
    assert not is_offloaded(on_device)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(on_device)} == {"device"}
    assert is_offloaded(ref)  # the stored copy stays on the host
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)),
                 on_device, ref)
    resident = make_reference(policy, RefSpec(param_dtype="bfloat16", param_offload=False))
    np.testing.assert_array_equal(_log_probs(on_device, "bfloat16")[0], _log_probs(resident, "bfloat16")[0])
    assert reference_on_device(resident) is resident


def test_param_offload_warns_once_and_stays_on_device_without_host_memory(monkeypatch, caplog):
    monkeypatch.setattr(ref_mod, "offload_supported", lambda: False)
    monkeypatch.setattr(remat_mod, "_warned", set())
    policy = _policy()
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        refs = [make_reference(policy, RefSpec(param_dtype="float32", param_offload=True)) for _ in range(2)]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "param_offload: no effect on this backend" in warned[0]
    assert not is_offloaded(refs[0])
    assert {x.sharding.memory_kind for x in jax.tree.leaves(refs[0])} == {"device"}


def test_ref_config_defaults_to_the_compute_dtype_and_rejects_unknown_dtypes():
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = "tiny:llama"
    cfg.actor_rollout_ref.model.dtype = "bfloat16"
    cfg.data.train_files = cfg.data.tokenizer = "unused"
    cfg.data.train_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    spec = resolve_config(cfg, dp_size=1, check_paths=False, num_train_samples=16)
    assert spec.ref == RefSpec(param_dtype="bfloat16", param_offload=False)
    cfg.actor_rollout_ref.ref.param_dtype = "float32"
    cfg.actor_rollout_ref.ref.param_offload = True
    assert resolve_config(cfg, dp_size=1, check_paths=False, num_train_samples=16).ref == RefSpec("float32", True)
    cfg.actor_rollout_ref.ref.param_dtype = "float16"
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.ref.param_dtype='float16': unknown name"):
        resolve_config(cfg, dp_size=1, check_paths=False, num_train_samples=16)


def test_trainer_step_with_a_bf16_offloaded_reference_and_offload_remat(tmp_path, smollm2_gguf, capsys):
    import importlib.util
    import pathlib

    from jaxrl_llm.trainer import Trainer

    root = pathlib.Path(__file__).resolve().parents[2]
    module_spec = importlib.util.spec_from_file_location("tiny_config", root / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.data.tokenizer = str(smollm2_gguf)
    cfg.trainer.default_local_dir = str(tmp_path / "run")
    cfg.trainer.total_training_steps = 1
    cfg.trainer.test_freq = -1
    arr = cfg.actor_rollout_ref
    arr.model.dtype = "bfloat16"
    arr.actor.use_kl_loss = True
    arr.actor.remat_policy = "offload"
    arr.ref.param_offload = True
    trainer = Trainer(cfg)
    assert "reference: on (bfloat16, pinned host memory)" in capsys.readouterr().out
    assert trainer.spec.actor.remat == "offload"
    leaves = jax.tree.leaves(trainer.reference.params)
    assert {x.dtype for x in leaves} == {jnp.dtype("bfloat16")}
    assert {x.sharding.memory_kind for x in leaves} == {"pinned_host"}
    assert {x.dtype for x in jax.tree.leaves(trainer.actor.params)} == {jnp.dtype("float32")}  # fp32 master
    metrics = trainer.fit()
    # step 1: the reference is the policy itself, so the KL loss is ~0 (bf16 rounding only)
    assert np.isfinite(metrics["actor/pg_loss"]) and abs(metrics["actor/kl_loss"]) < 1e-3
    assert {x.sharding.memory_kind for x in jax.tree.leaves(trainer.reference.params)} == {"pinned_host"}
