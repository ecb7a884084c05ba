"""Kernels on a multi-device mesh run per shard (XLA cannot partition their custom calls): on 8 CPU
devices, interpreted, they give the XLA path's values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.losses.logprob import token_logprobs
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.paged_attention import paged_decode_attention, paged_decode_attention_xla
from jaxrl_llm.sharding import make_mesh

# the 8 virtual CPU devices of tests/conftest.py; a one-GPU host (the device kit) has too few
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (the CPU suite's virtual ones)")


def test_fused_logprob_kernel_per_row_shard_equals_xla():
    mesh = make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    h = jax.random.normal(k[0], (64, 48))  # H = 48: three pieces of 16 in the Triton kernel's inner loop
    w = jax.random.normal(k[1], (48, 640)) * 0.5
    t = jax.random.randint(k[2], (64,), 0, 640)
    c = jax.random.normal(k[3], (64,))
    h = jax.device_put(h, NamedSharding(mesh, P(("data", "fsdp"), None)))

    def loss(h, w, impl, mesh):
        lp, ent = token_logprobs(h, w, t, return_entropy=True, impl=impl, mesh=mesh)
        return jnp.sum(lp * c) + 0.3 * jnp.sum(ent)

    ref_v, ref_g = jax.value_and_grad(loss, (0, 1))(h, w, "xla", None)
    fn = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=(2, 3))
    v, g = fn(h, w, "pallas", mesh)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert "shard_map" in str(jax.make_jaxpr(loss, static_argnums=(2, 3))(h, w, "pallas", mesh))


def test_paged_attention_kernel_per_kv_head_shard_equals_xla():
    mesh = make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    rng = np.random.default_rng(0)
    layers, kv, pages, page_size, hd, slots, per_slot = 2, 4, 24, 8, 16, 5, 3
    k_pages = jnp.asarray(rng.standard_normal((layers, kv, pages, page_size, hd)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((layers, kv, pages, page_size, hd)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((slots, 2 * kv, hd)), jnp.float32)
    lengths = jnp.asarray([0, 1, 8, 13, 24], jnp.int32)
    table = jnp.asarray(rng.permutation(pages)[: slots * per_slot].reshape(slots, per_slot), jnp.int32)
    pool = NamedSharding(mesh, P(None, "tensor"))
    k_pages, v_pages = jax.device_put(k_pages, pool), jax.device_put(v_pages, pool)
    attend = jax.jit(lambda q, k, v, layer: paged_decode_attention(q, k, v, lengths, table, layer=layer,
                                                                   sliding_window=10, impl="pallas", mesh=mesh))
    for layer in range(layers):
        out = attend(q, k_pages, v_pages, jnp.int32(layer))
        ref = paged_decode_attention_xla(q, k_pages, v_pages, lengths, table, layer=jnp.int32(layer),
                                         sliding_window=10)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    # cascade groups (slots 2 and 4 share their first page; slot 3 alone): the kernel twice per shard
    cascade = Cascade(jnp.asarray([[2, 4], [-1, -1]], jnp.int32), jnp.asarray([1, 0], jnp.int32))
    shared_table = table.at[4, 0].set(table[2, 0])
    grouped = jax.jit(lambda q, k, v, layer: paged_decode_attention(q, k, v, lengths, shared_table, layer=layer,
                                                                    impl="pallas", mesh=mesh, cascade=cascade))
    for layer in range(layers):
        out = grouped(q, k_pages, v_pages, jnp.int32(layer))
        ref = paged_decode_attention_xla(q, k_pages, v_pages, lengths, shared_table, layer=jnp.int32(layer))
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
