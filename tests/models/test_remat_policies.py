"""Remat policies (models/remat.py): the actor loss's gradients do not depend on the policy, each
policy reaches the compiled program (its `jax.checkpoint` policy in the jaxpr, residuals moved to
host memory for offload, less temporary memory than no remat), offload falls back with one warning
where the backend has no pinned host memory, and the config derives the policy from
`enable_gradient_checkpointing`."""
import dataclasses
import logging
import re

import jax
import numpy as np
import pytest
from tiny_models import random_rollout

from jaxrl_llm.config import ActorSpec, default_config, resolve_config
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.models import remat as remat_mod
from jaxrl_llm.models.remat import REMAT_POLICIES, checkpoint_policy, remat_name
from jaxrl_llm.roles.actor import actor_loss
from jaxrl_llm.roles.experience import Experience
from jaxrl_llm.roles.update import denominators

CFG = ModelConfig.tiny("llama", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)
N, P, R = 8, 5, 6
SETTINGS = ActorSpec(loss_mode="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                     clip_ratio_c=3.0, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                     kl_loss_type="low_var_kl", temperature=0.7, compute_dtype="float32", remat="none",
                     loss_scale_factor=None, loss_kwargs=(), ppo_epochs=1, shuffle=False)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    ids, mask, resp_mask, _, _ = random_rollout(rng, N, P, R)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return Experience(
        input_ids=ids, attention_mask=mask, response_mask=f32(resp_mask),
        old_log_probs=f32(rng.normal(-3.0, 0.3, (N, R))), ref_log_probs=f32(rng.normal(-3.0, 0.3, (N, R))),
        advantages=f32(rng.normal(size=(N, R))), returns=f32(rng.normal(size=(N, R))))


def _grad_fn(policy):
    b = _batch()
    d = denominators(b.response_mask)
    s = dataclasses.replace(SETTINGS, remat=policy)
    return jax.jit(jax.grad(lambda p: actor_loss(p, b, d, model_cfg=CFG, s=s)[0]))


def test_policies_give_equal_gradients_and_different_programs():
    """One compile per policy: its gradients (equal to no remat's) and what it compiled to."""
    params = init_params(CFG, jax.random.PRNGKey(0))
    grads, policies, temp = {}, {}, {}
    for policy in REMAT_POLICIES:
        fn = _grad_fn(policy)
        jaxpr = str(jax.make_jaxpr(fn)(params))
        policies[policy] = " ".join(re.findall(r"policy=(<function [\w.<>]+|\S+)", jaxpr))
        # offload: the saved matmul outputs are residuals placed in host memory
        assert ("device_put" in jaxpr and "MemorySpace.Host" in jaxpr) == (policy == "offload"), policy
        compiled = fn.lower(params).compile()
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
        grads[policy] = jax.device_get(compiled(params))
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads["none"]))
    assert scale > 1e-3  # a real gradient, not zeros
    for policy in REMAT_POLICIES[1:]:
        err = max(float(np.abs(a - b).max()) for a, b in
                  zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[policy])))
        assert err <= 1e-6, (policy, err)
    # no layer remat: no layer checkpoint; the only checkpoint left is the MLP's gated product
    # (decoder.gated_product, recomputed from gate and up: no policy); the attention core has its
    # own backward instead
    assert set(policies["none"].split()) == {"None"}, policies["none"]
    assert "nothing_saveable" in policies["full"]
    assert "DotsSaveable(only_if_no_batch_dims=False)" in policies["dots_saveable"]
    assert "offload_dot_with_no_batch_dims" in policies["offload"]
    # recomputing in the backward pass keeps fewer activations alive than saving them all
    assert temp["none"] > temp["dots_saveable"] > temp["full"], temp


def test_offload_falls_back_with_one_warning_without_host_memory(monkeypatch, caplog):
    monkeypatch.setattr(remat_mod, "supports_pinned_host", lambda device=None: False)
    monkeypatch.setattr(remat_mod, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        policies = [checkpoint_policy("offload") for _ in range(3)]
    assert all(p is jax.checkpoint_policies.dots_with_no_batch_dims_saveable for p in policies)
    assert [r.getMessage() for r in caplog.records] == [
        "remat_policy=offload: no effect on this backend (cpu has no pinned_host memory); "
        "using dots_with_no_batch_dims_saveable instead"]


def test_policy_names_and_bools():
    assert (remat_name(True), remat_name(False), remat_name(None)) == ("full", "none", "none")
    assert checkpoint_policy("none") is None
    assert checkpoint_policy("full") is jax.checkpoint_policies.nothing_saveable
    with pytest.raises(ValueError, match="unknown remat policy 'dots'"):
        remat_name("dots")


def _spec(**keys):
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = "tiny:llama"
    cfg.data.train_files = cfg.data.tokenizer = "unused"
    cfg.data.train_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    cfg.algorithm.adv_estimator = "gae"  # a critic too
    for key, value in keys.items():
        section, leaf = key.rsplit(".", 1)
        node = cfg
        for part in section.split("."):
            node = node[part]
        node[leaf] = value
    return resolve_config(cfg, dp_size=1, check_paths=False, num_train_samples=16)


def test_config_derives_the_policy_from_gradient_checkpointing():
    spec = _spec()
    assert (spec.actor.remat, spec.critic.remat) == ("full", "full")
    spec = _spec(**{"actor_rollout_ref.model.enable_gradient_checkpointing": False,
                    "critic.model.enable_gradient_checkpointing": False})
    assert (spec.actor.remat, spec.critic.remat) == ("none", "none")
    spec = _spec(**{"actor_rollout_ref.actor.remat_policy": "offload", "critic.remat_policy": "dots_saveable",
                    "actor_rollout_ref.model.enable_gradient_checkpointing": False})
    assert (spec.actor.remat, spec.critic.remat) == ("offload", "dots_saveable")
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.actor.remat_policy='selective': unknown name; valid: "
                                         r"dots_saveable, full, none, offload"):
        _spec(**{"actor_rollout_ref.actor.remat_policy": "selective"})
