"""The gated MLP's activation product (`models.activations.gated_product`, used by dense MLPs and
MoE experts): recomputed in the backward, so the backward keeps gate and up only. Its gradients
equal the plain expression's (SwiGLU and GeGLU), and the compiled gradient program needs less
temporary memory than the plain one, which keeps the activation's intermediates alive."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models.activations import ACTIVATIONS, gated_product

TOKENS, HIDDEN, INTERMEDIATE = 512, 32, 256


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(TOKENS, HIDDEN)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(HIDDEN, INTERMEDIATE)) / HIDDEN ** 0.5, jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(INTERMEDIATE, HIDDEN)) / INTERMEDIATE ** 0.5, jnp.float32)
    return x, (w_gate, w_up, w_down)


def _loss(product, activation):
    def loss(weights, x):
        w_gate, w_up, w_down = weights
        # sin keeps the gradient of the whole chain depending on the activation's values
        return jnp.sum(jnp.sin(product(x @ w_gate, x @ w_up, activation) @ w_down))
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def plain_product(gate, up, activation):
    return ACTIVATIONS[activation](gate) * up


def recomputed_product(gate, up, activation):
    return gated_product(gate, up, activation, jnp.float32)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_gradients_equal_the_plain_product(activation):
    x, weights = _inputs()
    expected = _loss(plain_product, activation)(weights, x)
    got = _loss(recomputed_product, activation)(weights, x)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(got[1]))) > 0.1  # a real gradient, not zeros on both sides


def test_the_backward_keeps_less_memory():
    """Temporary bytes of the compiled gradient: the plain product keeps the activation's
    intermediates (for silu: the sigmoid and the product's factors) as [tokens, intermediate]
    buffers besides gate and up."""
    x, weights = _inputs()
    temp = {name: _loss(product, "silu").lower(weights, x).compile().memory_analysis().temp_size_in_bytes
            for name, product in (("plain", plain_product), ("recomputed", recomputed_product))}
    one_buffer = TOKENS * INTERMEDIATE * 4
    assert temp["recomputed"] <= temp["plain"] - one_buffer, temp
