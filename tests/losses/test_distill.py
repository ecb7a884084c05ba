"""Distillation signals (losses/distill.py) against dense references: the reverse-KL advantage
formula, the teacher's top-k, and the coarsened top-k forward KL with its gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses.distill import reverse_kl_advantages, teacher_topk, topk_forward_kl, topk_log_probs


def _dense_log_probs(h, w, temperature, vocab_major, softcap=None):
    z = h @ (w.T if vocab_major else w)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    return jax.nn.log_softmax(z / temperature, axis=-1)


def test_reverse_kl_advantage_formula():
    rng = np.random.default_rng(0)
    lp, tlp = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], np.float32)
    np.testing.assert_allclose(reverse_kl_advantages(lp, tlp, mask), -(lp - tlp) * mask, rtol=1e-6)
    gamma = 0.5
    expect = np.zeros_like(lp)
    for i in range(3):
        running = 0.0
        for t in reversed(range(5)):
            running = mask[i, t] * (tlp[i, t] - lp[i, t]) + gamma * running
            expect[i, t] = running * mask[i, t]
    np.testing.assert_allclose(reverse_kl_advantages(lp, tlp, mask, gamma), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab_major,chunk,softcap", [(True, 16, None), (False, 7, None), (True, 9, 5.0)])
def test_topk_matches_dense(vocab_major, chunk, softcap):
    key = jax.random.PRNGKey(0)
    kh, kw, kt = jax.random.split(key, 3)
    m, hdim, vocab, k, temp = 12, 8, 50, 6, 0.7
    # moderate logits: the rest-of-vocabulary bucket stays well above fp32 rounding (1 - P_S ~ 0.3)
    h = 0.4 * jax.random.normal(kh, (m, hdim))
    w = jax.random.normal(kw, (vocab, hdim) if vocab_major else (hdim, vocab))
    teacher_h = 0.4 * jax.random.normal(kt, (m, hdim))
    top = teacher_topk(teacher_h, w, k=k, temperature=temp, chunk=chunk, vocab_major=vocab_major, softcap=softcap)
    dense_t = _dense_log_probs(teacher_h, w, temp, vocab_major, softcap)
    ref_lp, ref_ids = jax.lax.top_k(dense_t, k)
    np.testing.assert_array_equal(top.ids, ref_ids)
    np.testing.assert_allclose(top.log_probs, ref_lp, rtol=1e-5, atol=1e-5)

    def fused(h, w):
        s = topk_log_probs(h, w, top.ids, temperature=temp, chunk=chunk, vocab_major=vocab_major, softcap=softcap)
        return topk_forward_kl(s, top.log_probs).sum(), s

    def dense(h, w):
        s = jnp.take_along_axis(_dense_log_probs(h, w, temp, vocab_major, softcap), top.ids, axis=1)
        return topk_forward_kl(s, top.log_probs).sum(), s

    (v_f, s_f), g_f = jax.value_and_grad(fused, argnums=(0, 1), has_aux=True)(h, w)
    (v_d, s_d), g_d = jax.value_and_grad(dense, argnums=(0, 1), has_aux=True)(h, w)
    np.testing.assert_allclose(s_f, s_d, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v_f, v_d, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_f, g_d):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_topk_kl_is_zero_with_zero_gradient_when_equal():
    key = jax.random.PRNGKey(1)
    h, w = jax.random.normal(key, (5, 4)), jax.random.normal(jax.random.fold_in(key, 1), (30, 4))
    top = teacher_topk(h, w, k=4, chunk=8)
    kl, grads = jax.value_and_grad(
        lambda h, w: topk_forward_kl(topk_log_probs(h, w, top.ids, chunk=8), top.log_probs).sum(), argnums=(0, 1))(h, w)
    assert abs(float(kl)) < 1e-6
    for g in grads:
        assert float(jnp.abs(g).max()) < 1e-6


def test_topk_kl_with_full_vocab_is_the_forward_kl():
    key = jax.random.PRNGKey(2)
    w = jax.random.normal(key, (20, 4))
    ht = jax.random.normal(jax.random.fold_in(key, 1), (3, 4))
    hs = jax.random.normal(jax.random.fold_in(key, 2), (3, 4))
    top = teacher_topk(ht, w, k=20, chunk=8)
    got = topk_forward_kl(topk_log_probs(hs, w, top.ids, chunk=8), top.log_probs)
    pt, ps = _dense_log_probs(ht, w, 1.0, True), _dense_log_probs(hs, w, 1.0, True)
    np.testing.assert_allclose(got, jnp.sum(jnp.exp(pt) * (pt - ps), -1), rtol=1e-4, atol=1e-5)


def test_never_materialises_full_logits():
    """The teacher's top-k and the student's top-k KL (value and gradient) hold no [N, V] fp32
    buffer: their compiled temp memory stays well under one such array."""
    n, hid, vocab, k = 512, 32, 8192, 16
    h, w = jnp.zeros((n, hid)), jnp.zeros((vocab, hid))
    teacher = jax.jit(lambda h, w: teacher_topk(h, w, k=k, chunk=512))
    assert teacher.lower(h, w).compile().memory_analysis().temp_size_in_bytes < 0.25 * n * vocab * 4
    ids, lp = jnp.zeros((n, k), jnp.int32), jnp.full((n, k), -5.0)
    loss = jax.value_and_grad(lambda h, w: topk_forward_kl(topk_log_probs(h, w, ids, chunk=512), lp).sum(), (0, 1))
    assert jax.jit(loss).lower(h, w).compile().memory_analysis().temp_size_in_bytes < 0.25 * n * vocab * 4
