"""The gated delta rule (models/delta_rule.py): the chunked form against the token-by-token recurrence (values,
final state and gradients; chunk sizes that do and do not divide the length; an initial state; packed
sequences restarting the state) and both against transformers' reference implementations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from jaxrl_llm.models import invariant
from jaxrl_llm.models.delta_rule import (
    chunked_delta_rule,
    invariant_delta_rule,
    l2_normalize,
    recurrent_delta_rule,
)

B, T, H, DK, DV = 2, 45, 3, 8, 6


def _inputs(seed: int = 0, t: int = T):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = l2_normalize(jax.random.normal(keys[0], (B, t, H, DK)))
    k = l2_normalize(jax.random.normal(keys[1], (B, t, H, DK)))
    v = jax.random.normal(keys[2], (B, t, H, DV))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, t, H)))  # log-decays <= 0
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, t, H)))
    state = 0.3 * jax.random.normal(keys[5], (B, H, DK, DV))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [8, 9, 64])  # divides T + padding, does not, longer than T
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_the_recurrence_in_values_state_and_gradients(chunk, with_state):
    q, k, v, g, beta, state = _inputs()
    state = state if with_state else None
    want, want_state = recurrent_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got_state, want_state, atol=2e-5, rtol=1e-5)
    w_out, w_state = jax.random.normal(jax.random.key(9), want.shape), jax.random.normal(jax.random.key(8),
                                                                                       want_state.shape)

    def loss(fn, *args):
        out, s = fn(*args)
        return jnp.sum(out * w_out) + jnp.sum(s * w_state)

    args = (q, k, v, g, beta) + (() if state is None else (state,))
    argnums = tuple(range(len(args)))
    want_grads = jax.grad(lambda *a: loss(recurrent_delta_rule, *a), argnums)(*args)
    got_grads = jax.grad(lambda *a: loss(lambda *b: chunked_delta_rule(*b, chunk=chunk), *a), argnums)(*args)
    for name, gw, gg in zip("q k v g beta state".split(), want_grads, got_grads):
        np.testing.assert_allclose(gg, gw, atol=5e-5, rtol=1e-4, err_msg=name)
        assert float(jnp.abs(gw).max()) > 1e-3, name  # every input matters


@pytest.mark.parametrize("chunk", [8, 16])
def test_packed_sequences_restart_the_state(chunk):
    """Three sequences in each row (starts inside a chunk and on a chunk's first token): every token's output
    equals its sequence's alone, from a zero state, in both forms; the final state is the last sequence's."""
    q, k, v, g, beta, state = _inputs(1)
    bounds = [(0, 13), (13, 32), (32, T)]  # 32 = a chunk boundary for both chunk sizes
    starts = np.zeros((B, T), bool)
    for s, _ in bounds:
        starts[:, s] = True
    for fn in (recurrent_delta_rule, lambda *a, **kw: chunked_delta_rule(*a, **kw, chunk=chunk)):
        out, final = fn(q, k, v, g, beta, state, starts=jnp.asarray(starts))
        for s, e in bounds:
            alone, alone_final = recurrent_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e])
            np.testing.assert_allclose(out[:, s:e], alone, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(final, alone_final, atol=2e-5, rtol=1e-5)


def test_both_forms_match_transformers_reference():
    """transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (the Qwen3.5 / Qwen3-Next
    fallbacks), with fewer key heads than value heads as the released models have (repeated per value head)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    rng = np.random.default_rng(0)
    t, hk, hv = 70, 2, 4
    q, k = rng.normal(size=(B, t, hk, DK)).astype(np.float32), rng.normal(size=(B, t, hk, DK)).astype(np.float32)
    v = rng.normal(size=(B, t, hv, DV)).astype(np.float32)
    g = -np.log1p(np.exp(rng.normal(size=(B, t, hv)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, t, hv))))).astype(np.float32)
    state = rng.normal(size=(B, hv, DK, DV)).astype(np.float32) * 0.3
    tq, tk, tv, tg, tb, ts = (torch.from_numpy(x) for x in (q, k, v, g, beta, state))
    want_chunk, want_chunk_state = torch_chunk_gated_delta_rule(tq, tk, tv, tg, tb, chunk_size=64, initial_state=ts,
                                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_rec, want_rec_state = torch_recurrent_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=ts,
                                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    qh = l2_normalize(jnp.repeat(jnp.asarray(q), hv // hk, axis=2))
    kh = l2_normalize(jnp.repeat(jnp.asarray(k), hv // hk, axis=2))
    got_chunk, got_chunk_state = chunked_delta_rule(qh, kh, v, g, beta, jnp.asarray(state), chunk=64)
    got_rec, got_rec_state = recurrent_delta_rule(qh, kh, v, g, beta, jnp.asarray(state))
    for got, want in ((got_chunk, want_chunk), (got_chunk_state, want_chunk_state), (got_rec, want_rec),
                      (got_rec_state, want_rec_state)):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("alike", [0.0, 0.9])
def test_chunked_form_stays_accurate_with_alike_keys_and_slow_decay(alike):
    """Trained models' keys are far from independent: with keys 90% one shared direction and almost no decay,
    (I + A)'s inverse by the power series (I - A)(I + A^2)(I + A^4)... was 1e8 off in fp32 (cancellation); the
    block-doubling inverse keeps the chunked form within 1e-6 of a float64 recurrence, as the fp32 recurrence."""
    from jaxrl_llm.models.delta_rule import unit_lower_inverse

    rng = np.random.default_rng(0)
    t, h, d = 256, 2, 8
    k = alike * rng.normal(size=(1, 1, h, d)) + (1 - alike) * rng.normal(size=(1, t, h, d))
    q, v = rng.normal(size=(1, t, h, d)), rng.normal(size=(1, t, h, d))
    k, q = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (k, q))
    g, beta = -0.001 * rng.uniform(size=(1, t, h)), rng.uniform(size=(1, t, h))
    state, want = np.zeros((1, h, d, d)), np.zeros((1, t, h, d))
    for i in range(t):  # the definition in float64
        state = state * np.exp(g[:, i])[..., None, None]
        delta = (v[:, i] - np.einsum("bhkv,bhk->bhv", state, k[:, i])) * beta[:, i][..., None]
        state = state + k[:, i][..., :, None] * delta[..., None, :]
        want[:, i] = np.einsum("bhkv,bhk->bhv", state, q[:, i] * d ** -0.5)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    got, _ = chunked_delta_rule(*f32, chunk=64)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    lower = np.tril(rng.normal(size=(3, 9, 9)), -1)  # and the inverse itself, at a size that is not a power of two
    np.testing.assert_allclose(np.asarray(unit_lower_inverse(jnp.asarray(lower))), np.linalg.inv(np.eye(9) + lower),
                               atol=1e-4, rtol=1e-5)


def test_context_parallel_rule_passes_the_state_between_devices():
    """With the tokens split over 4 devices of the 'context' axis, each device's block folds the earlier blocks'
    affine maps into its incoming state: outputs and gradients equal the unsplit chunked rule, with packed
    sequences starting inside a block, on a block's first token and running across block boundaries."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_llm import sharding
    from jaxrl_llm.models.context_parallel import context_parallel_delta_rule

    t = 96  # 24 tokens a device, chunks of 8: several chunks per block
    q, k, v, g, beta, _ = _inputs(3, t)
    starts = np.zeros((B, t), bool)
    starts[:, 0] = True
    starts[0, [30, 48, 50]] = True  # inside the second block, on the third block's first token, inside it
    starts = jnp.asarray(starts)
    w = jax.random.normal(jax.random.key(4), (B, t, H, DV))

    def loss(fn, q, k, v, g, beta):
        return jnp.sum(fn(q, k, v, g, beta) * w)

    def unsplit(*a):
        return chunked_delta_rule(*a, starts=starts, chunk=8)[0]

    def split(*a):
        return context_parallel_delta_rule(*a, starts, chunk=8)

    want, want_grads = jax.value_and_grad(lambda *a: loss(unsplit, *a), argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "context": 4, "expert": 1, "tensor": 1})
    args = jax.device_put((q, k, v, g, beta), NamedSharding(mesh, PartitionSpec()))
    with sharding.mesh_context(mesh):
        got, grads = jax.jit(jax.value_and_grad(lambda *a: loss(split, *a), argnums=(0, 1, 2, 3, 4)))(*args)
        out = jax.jit(split)(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(unsplit(q, k, v, g, beta)), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for a, b in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=1e-4)


def test_the_invariant_rule_gives_the_recurrences_bits_and_the_chunked_gradient(capsys):
    """Batch-invariant mode's training rule: outputs and final state are the recurrence's bits (what a decode step
    computes), the gradient is the chunked form's (close to the recurrence's), and the backward keeps no state per
    token: the recurrence's own autodiff saves T of them [B, H, Dk, Dv]."""
    q, k, v, g, beta, _ = _inputs(5)
    starts = jnp.zeros((B, T), bool).at[:, 0].set(True).at[1, 20].set(True)
    w = jax.random.normal(jax.random.key(6), (B, T, H, DV))
    with invariant.mode(True):
        want, want_state = jax.jit(lambda *a: recurrent_delta_rule(*a, starts=starts))(q, k, v, g, beta)
        got, got_state = jax.jit(lambda *a: invariant_delta_rule(*a, starts, chunk=8))(q, k, v, g, beta)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got_state), np.asarray(want_state))
        grads = jax.grad(lambda *a: jnp.sum(invariant_delta_rule(*a, starts, chunk=8)[0] * w), (0, 1, 2, 3, 4))(
            q, k, v, g, beta)
        want_grads = jax.grad(lambda *a: jnp.sum(recurrent_delta_rule(*a, starts=starts)[0] * w), (0, 1, 2, 3, 4))(
            q, k, v, g, beta)
        for name, got_g, want_g in zip("q k v g beta".split(), grads, want_grads):
            np.testing.assert_allclose(got_g, want_g, atol=5e-5, rtol=1e-4, err_msg=name)
        per_token_states = f"f32[{T},{B},{H},{DK},{DV}]"
        print_saved_residuals(lambda *a: recurrent_delta_rule(*a, starts=starts)[0], q, k, v, g, beta)
        assert per_token_states in capsys.readouterr().out  # (what the check below would see)
        print_saved_residuals(lambda *a: invariant_delta_rule(*a, starts, chunk=8)[0], q, k, v, g,
                                                beta)
        saved = capsys.readouterr().out
        assert saved and per_token_states not in saved, saved


def test_the_invariant_context_split_runs_the_whole_rows_recurrence():
    """The mode's context split (models/context_parallel.py): every device gathers the row and runs the recurrence,
    keeping its block: outputs are the unsplit invariant rule's bits, gradients the unsplit chunked form's."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_llm import sharding
    from jaxrl_llm.models.context_parallel import context_parallel_invariant_delta_rule
    from jaxrl_llm.models.delta_rule import chunk_terms

    t = 48
    q, k, v, g, beta, _ = _inputs(7, t)
    starts = jnp.zeros((B, t), bool).at[:, 0].set(True).at[0, 30].set(True)
    w = jax.random.normal(jax.random.key(8), (B, t, H, DV))

    def split(*a):
        return context_parallel_invariant_delta_rule(*a, starts, chunk=8, terms=chunk_terms)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "context": 4, "expert": 1, "tensor": 1})
    args = jax.device_put((q, k, v, g, beta), NamedSharding(mesh, PartitionSpec()))
    with invariant.mode(True), sharding.mesh_context(mesh):
        out = jax.jit(split)(*args)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(split(*a) * w), (0, 1, 2, 3, 4)))(*args)
    with invariant.mode(True):
        want = jax.jit(lambda *a: recurrent_delta_rule(*a, starts=starts)[0])(q, k, v, g, beta)
    want_grads = jax.grad(lambda *a: jnp.sum(chunked_delta_rule(*a, starts=starts, chunk=8)[0] * w),
                          (0, 1, 2, 3, 4))(q, k, v, g, beta)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    for name, got_g, want_g in zip("q k v g beta".split(), grads, want_grads):
        np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), atol=5e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("chunk", [8, 16])
def test_pallas_chunk_kernel_equals_xla_in_values_and_gradients(chunk):
    """The chunks' parallel part as one Pallas kernel per chunk (models/delta_rule_pallas.py, run interpreted on
    the CPU; compiled for v5e in tests/platform/test_platform_compile.py) gives `chunk_terms`' numbers inside the
    chunked rule, with packed sequences restarting inside chunks; its custom backward (XLA's recompute of the
    chunk) gives the same gradients."""
    import functools

    from jaxrl_llm.models.delta_rule import chunk_terms
    from jaxrl_llm.models.delta_rule_pallas import chunk_terms_pallas, delta_rule_impl

    q, k, v, g, beta, state = _inputs(5)
    starts = np.zeros((B, T), bool)
    starts[:, 0] = True
    starts[0, [10, 16, 30]] = True
    starts = jnp.asarray(starts)
    kernel = functools.partial(chunk_terms_pallas, interpret=True)

    def run(terms, q, v, beta):
        return chunked_delta_rule(q, k, v, g, beta, state, starts=starts, chunk=chunk, terms=terms)

    want, got = run(chunk_terms, q, v, beta), run(kernel, q, v, beta)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)

    def loss(terms, *a):
        out, s = run(terms, *a)
        return jnp.sum(out ** 2) + jnp.sum(s)

    want_grads = jax.grad(functools.partial(loss, chunk_terms), argnums=(0, 1, 2))(q, v, beta)
    grads = jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2))(q, v, beta)
    for a, b in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    assert delta_rule_impl("tpu", 64) == "pallas" and delta_rule_impl("gpu", 64) == delta_rule_impl("tpu", 9) == "xla"
