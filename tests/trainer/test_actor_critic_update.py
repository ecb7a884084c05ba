"""The jitted actor / critic updates: exact under micro-batching, equal on 1 and 8 devices, and
the loss equals the formula (policy loss - entropy bonus + KL loss) recomputed by hand."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tiny_models import random_rollout

from jaxrl_llm.config import ActorSpec, CriticSpec
from jaxrl_llm.losses.agg import agg_loss
from jaxrl_llm.losses.kl import kl_penalty
from jaxrl_llm.losses.policy import compute_policy_loss
from jaxrl_llm.models import ModelConfig, compute_logits, init_params
from jaxrl_llm.roles.actor import actor_loss, update_actor
from jaxrl_llm.roles.critic import update_critic
from jaxrl_llm.roles.experience import Experience
from jaxrl_llm.roles.forward import response_log_probs
from jaxrl_llm.roles.update import denominators

CFG = ModelConfig.tiny("llama", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)
N, P, R = 8, 5, 6


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    ids, mask, resp_mask, _, _ = random_rollout(rng, N, P, R)
    return Experience(
        input_ids=jnp.asarray(ids),
        attention_mask=jnp.asarray(mask),
        response_mask=jnp.asarray(resp_mask, jnp.float32),
        old_log_probs=jnp.asarray(rng.normal(-3.0, 0.3, (N, R)), jnp.float32),
        ref_log_probs=jnp.asarray(rng.normal(-3.0, 0.3, (N, R)), jnp.float32),
        advantages=jnp.asarray(rng.normal(size=(N, R)), jnp.float32),
        values=jnp.asarray(rng.normal(size=(N, R)), jnp.float32),
        returns=jnp.asarray(rng.normal(size=(N, R)), jnp.float32),
    )


SETTINGS = ActorSpec(loss_mode="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                     clip_ratio_c=3.0, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                     kl_loss_type="low_var_kl", temperature=0.7, compute_dtype="float32", remat="none",
                     loss_scale_factor=None, loss_kwargs=(), ppo_epochs=1, shuffle=False)


def test_response_log_probs_match_full_logits():
    params = init_params(CFG, jax.random.PRNGKey(0))
    b = _batch()
    lp = response_log_probs(params, CFG, b.input_ids, b.attention_mask, R, temperature=0.7)
    logits = compute_logits(params, CFG, b.input_ids, b.attention_mask) / 0.7
    logp = jax.nn.log_softmax(logits[:, P - 1:-1], -1)
    want = jnp.take_along_axis(logp, b.input_ids[:, P:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want), atol=1e-5)


def test_actor_loss_equals_formula():
    params = init_params(CFG, jax.random.PRNGKey(0))
    b = _batch()
    d = denominators(b.response_mask)
    loss, metrics = actor_loss(params, b, d, model_cfg=CFG, s=SETTINGS)
    lp, ent = response_log_probs(params, CFG, b.input_ids, b.attention_mask, R, temperature=0.7,
                                 with_entropy=True)
    m = b.response_mask
    pg, _ = compute_policy_loss("vanilla", b.old_log_probs, lp, b.advantages, m,
                                loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28)
    want = pg - 0.01 * agg_loss(ent, m, "token-mean") + 0.1 * agg_loss(
        kl_penalty(lp, b.ref_log_probs, "low_var_kl"), m, "token-mean")
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert set(metrics) >= {"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac",
                            "actor/ppo_kl", "actor/pg_clipfrac_lower"}


@pytest.mark.parametrize("level,normalize", [("token", False), ("sequence", True)])
def test_bypass_reinforce_loss_is_the_is_weighted_policy_gradient(level, normalize):
    """veRL's bypass mode with loss_type reinforce: -A * w * log pi, w = sg(pi / pi_rollout) per token or per
    sequence (its summed log-ratio), truncated at the threshold, with batch normalisation mean 1 over the
    micro-batch's valid tokens (token) or non-empty rows (sequence); values and gradients."""
    params = init_params(CFG, jax.random.PRNGKey(0))
    b = _batch()
    lp0 = response_log_probs(params, CFG, b.input_ids, b.attention_mask, R, temperature=0.7)
    rng = np.random.default_rng(3)  # the sampler's log-probs: the trainer's, moved by up to a few tenths
    b = dataclasses.replace(b, old_log_probs=lp0 + jnp.asarray(rng.normal(0, 0.3, lp0.shape), jnp.float32))
    s = dataclasses.replace(SETTINGS, loss_mode="reinforce", entropy_coeff=0.0, use_kl_loss=False,
                            rollout_is_in_loss=level, rollout_is_threshold=1.5, rollout_is_batch_normalize=normalize)
    m = b.response_mask

    def want_loss(p):
        lp = response_log_probs(p, CFG, b.input_ids, b.attention_mask, R, temperature=0.7)
        log_ratio = jnp.where(m > 0, jax.lax.stop_gradient(lp) - b.old_log_probs, 0.0)
        if level == "sequence":
            log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, -1, keepdims=True), log_ratio.shape)
        w = jnp.minimum(jnp.exp(log_ratio), 1.5) * m
        if normalize:
            rows = jnp.sum(m, -1) > 0
            w = w / (jnp.sum(jnp.sum(w, -1) / jnp.maximum(jnp.sum(m, -1), 1) * rows) / jnp.sum(rows))
        return jnp.sum(-b.advantages * w * lp * m) / jnp.sum(m)

    ours = lambda p: actor_loss(p, b, denominators(m), model_cfg=CFG, s=s)  # noqa: E731
    (loss, metrics), grads = jax.value_and_grad(ours, has_aux=True)(params)
    want, want_grads = jax.value_and_grad(want_loss)(params)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-4), grads, want_grads)
    # ppo_kl against the sampler's log-probs, as veRL's reinforce loss reports it
    np.testing.assert_allclose(float(metrics["actor/ppo_kl"]),
                               float(jnp.sum((b.old_log_probs - lp0) * m) / jnp.sum(m)), rtol=1e-4)
    plain = dataclasses.replace(s, rollout_is_in_loss=None)  # without the weights the loss moves
    assert abs(float(actor_loss(params, b, denominators(m), model_cfg=CFG, s=plain)[0]) - float(loss)) > 1e-3


def _run_actor(num_micro, mesh=None, mode="token-mean"):
    params = init_params(CFG, jax.random.PRNGKey(0))
    tx = optax.sgd(0.5)
    b = _batch()
    sharding = None
    if mesh is not None:
        sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
        b = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(
            mesh, PartitionSpec(("data", "fsdp"), *([None] * (v.ndim - 1))))), b)
    s = dataclasses.replace(SETTINGS, loss_agg_mode=mode, ppo_epochs=2, shuffle=True)
    update = jax.jit(functools.partial(update_actor, model_cfg=CFG, s=s, tx=tx, num_mini_batches=2,
                                       num_micro_batches=num_micro, rows_sharding=sharding))
    new, _, metrics = update(params, tx.init(params), b, jax.random.PRNGKey(1))
    return jax.device_get(new), jax.device_get(metrics)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_update_exact_under_micro_batching(mode):
    p1, m1 = _run_actor(1, mode=mode)
    p4, m4 = _run_actor(2, mode=mode)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5), p1, p4)
    for k in m1:
        np.testing.assert_allclose(m1[k], m4[k], atol=1e-5, rtol=1e-4, err_msg=k)
    assert np.isfinite(m1["actor/grad_norm"]) and m1["actor/grad_norm"] > 0


def test_actor_update_same_on_8_devices():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    p1, m1 = _run_actor(2)
    p8, m8 = _run_actor(2, mesh=mesh)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5), p1, p8)
    np.testing.assert_allclose(m1["actor/pg_loss"], m8["actor/pg_loss"], rtol=1e-5)


def test_critic_update_reduces_value_loss():
    params = init_params(CFG, jax.random.PRNGKey(0), head="value")
    tx = optax.adam(1e-2)
    opt = tx.init(params)
    b = _batch()
    s = CriticSpec(cliprange_value=100.0, loss_agg_mode="token-mean", compute_dtype="float32", remat="none",
                   ppo_epochs=1, shuffle=False)
    update = jax.jit(functools.partial(update_critic, model_cfg=CFG, s=s, tx=tx, num_mini_batches=1,
                                       num_micro_batches=2))
    losses = []
    for i in range(5):
        params, opt, m = update(params, opt, b, jax.random.PRNGKey(i))
        losses.append(float(m["critic/vf_loss"]))
    assert losses[-1] < losses[0]


def test_m2po_update_masks_over_the_whole_mini_batch():
    """M2PO's token selection is not separable: the update's pre-pass computes it over the whole mini-batch
    with the step's params, so 1 or 4 micro-batches give the plain full-batch gradient step, and a mask
    taken per micro-batch would not."""
    from jaxrl_llm.losses.policy import m2po_keep_mask

    params = init_params(CFG, jax.random.PRNGKey(0))
    b = _batch()
    lp0 = response_log_probs(params, CFG, b.input_ids, b.attention_mask, R, temperature=0.7)
    rng = np.random.default_rng(5)  # the sampler's log-probs (bypass mode): the policy's, moved a little
    b = dataclasses.replace(b, old_log_probs=lp0 + jnp.asarray(rng.normal(0, 0.2, lp0.shape), jnp.float32))
    s = dataclasses.replace(SETTINGS, loss_mode="m2po", loss_kwargs=(("m2_threshold", 0.01),), entropy_coeff=0.0,
                            use_kl_loss=False)
    tx = optax.sgd(0.5)

    def run(num_micro):
        update = jax.jit(functools.partial(update_actor, model_cfg=CFG, s=s, tx=tx, num_mini_batches=1,
                                           num_micro_batches=num_micro))
        return jax.device_get(update(params, tx.init(params), b, jax.random.PRNGKey(1)))

    def full_batch_loss(p):
        lp = response_log_probs(p, CFG, b.input_ids, b.attention_mask, R, temperature=0.7)
        return compute_policy_loss("m2po", b.old_log_probs, lp, b.advantages, b.response_mask, m2_threshold=0.01)[0]

    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, jax.grad(full_batch_loss)(params))
    (p1, _, m1), (p4, _, m4) = run(1), run(4)
    for got in (p1, p4):
        jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, atol=2e-6, rtol=1e-5), got, want)
    keep = m2po_keep_mask(lp0 - b.old_log_probs, b.response_mask, b.advantages, 0.01)
    dropped = float(jnp.sum(b.response_mask * (1 - keep)) / jnp.sum(b.response_mask))
    assert 0 < dropped < 0.5
    np.testing.assert_allclose(m1["actor/pg_clipfrac"], dropped, rtol=1e-5)
    np.testing.assert_allclose(m4["actor/pg_clipfrac"], dropped, rtol=1e-5)
    per_half = jnp.concatenate([m2po_keep_mask(x, m, a, 0.01) for x, m, a in zip(
        jnp.split(lp0 - b.old_log_probs, 2), jnp.split(b.response_mask, 2), jnp.split(b.advantages, 2))])
    assert not np.array_equal(np.asarray(per_half), np.asarray(keep))  # a per-micro-batch mask would differ
