"""Cascade (shared-prefix) decode attention equals plain paged attention.

Groups of 1-8 slots share their prompt's full pages (the scheduler's layout: the partial last
prompt page and the response pages are each slot's own); lengths end mid-page; some members have
finished (length 0); a few slots are in no group; rows past the groups are unused. The XLA path
runs with sliding windows and int8 pages too; the Pallas kernels (interpreted) on both lowerings.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.sampler.cascade_attention import Cascade, cascade_decode_attention_xla
from jaxrl_llm.sampler.paged_attention import paged_decode_attention, paged_decode_attention_xla

PAGE = 16
PAGES_PER_SLOT = 9
GROUP_SIZES = (1, 2, 3, 5, 8)


def make_groups(seed, *, kv_heads=2, group=2, head_dim=64, dtype=jnp.float32, int8=False, loose=3,
                group_sizes=GROUP_SIZES, pages_per_slot=PAGES_PER_SLOT, prompt_pages=(1, 4)):
    """Slots of groups of `group_sizes` (then `loose` slots in no group): (args, kwargs, cascade). A group's
    prompt fills prompt_pages[0] to prompt_pages[1] - 1 full pages, then part of one."""
    rng = np.random.default_rng(seed)
    slots = sum(group_sizes) + loose
    num_pages = 1 + slots * pages_per_slot
    free = list(rng.permutation(np.arange(1, num_pages)))
    table = np.zeros((slots, pages_per_slot), np.int32)
    lengths = np.zeros((slots,), np.int32)
    rows_slots = np.full((slots // 2, 8), -1, np.int32)
    rows_pages = np.zeros((slots // 2,), np.int32)
    slot = 0
    order = rng.permutation(slots)  # members are not adjacent slots
    for row, size in enumerate(group_sizes):
        prompt = int(rng.integers(prompt_pages[0] * PAGE, prompt_pages[1] * PAGE))
        shared = [free.pop() for _ in range(prompt // PAGE)]
        for m in range(size):
            s = int(order[slot])
            slot += 1
            length = prompt + int(rng.integers(1, (pages_per_slot - prompt_pages[1]) * PAGE))
            own = [free.pop() for _ in range(pages_per_slot - len(shared))]
            table[s] = shared + own
            lengths[s] = 0 if (size > 2 and m == 1) else length  # a finished member
            rows_slots[row, m] = s
        rows_pages[row] = len(shared)
    for _ in range(loose):
        s = int(order[slot])
        slot += 1
        table[s] = [free.pop() for _ in range(pages_per_slot)]
        lengths[s] = int(rng.integers(1, pages_per_slot * PAGE))
    shape = (kv_heads, num_pages, PAGE, head_dim)
    q = jnp.asarray(rng.standard_normal((slots, kv_heads * group, head_dim)), dtype)
    kw = {}
    if int8:
        k = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        v = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        kw = dict(k_scales=jnp.asarray(rng.uniform(0.002, 0.02, shape[:3]), jnp.float32),
                  v_scales=jnp.asarray(rng.uniform(0.002, 0.02, shape[:3]), jnp.float32))
    else:
        k = jnp.asarray(rng.standard_normal(shape), dtype)
        v = jnp.asarray(rng.standard_normal(shape), dtype)
    args = (q, k, v, jnp.asarray(lengths), jnp.asarray(table))
    return args, kw, Cascade(jnp.asarray(rows_slots), jnp.asarray(rows_pages))


@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (300, None), (None, 30.0)])
def test_xla_cascade_equals_paged_fp32(window, softcap):
    args, kw, cascade = make_groups(0)
    plain = paged_decode_attention_xla(*args, sliding_window=window, softcap=softcap)
    got = cascade_decode_attention_xla(*args, cascade, sliding_window=window, softcap=softcap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), atol=1e-6, rtol=1e-6)
    assert np.all(np.asarray(got)[np.asarray(args[3]) == 0] == 0)  # finished slots: zeros


@pytest.mark.parametrize("window", [None, 40])
def test_xla_cascade_equals_paged_int8_pages(window):
    args, kw, cascade = make_groups(1, int8=True)
    plain = paged_decode_attention_xla(*args, sliding_window=window, **kw)
    got = cascade_decode_attention_xla(*args, cascade, sliding_window=window, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), atol=1e-6, rtol=1e-6)


def test_xla_cascade_bf16_within_an_ulp_of_paged():
    # only the order of the probs.V sum over blocks differs: at most one bf16 rounding apart
    args, kw, cascade = make_groups(2, dtype=jnp.bfloat16)
    plain = np.asarray(paged_decode_attention_xla(*args), np.float32)
    got = np.asarray(cascade_decode_attention_xla(*args, cascade), np.float32)
    assert np.all(np.abs(got - plain) <= 2.0 ** -7 * np.abs(plain) + 1e-6)


def test_xla_cascade_reads_a_stacked_pool_by_layer():
    cases = [make_groups(3 + i) for i in range(2)]
    args, _, cascade = cases[0]
    k = jnp.stack([c[0][1] for c in cases])
    v = jnp.stack([c[0][2] for c in cases])
    for layer, case in enumerate(cases):
        got = cascade_decode_attention_xla(args[0], k, v, args[3], args[4], cascade, layer=jnp.int32(layer))
        plain = paged_decode_attention_xla(args[0], case[0][1], case[0][2], args[3], args[4])
        np.testing.assert_allclose(np.asarray(got), np.asarray(plain), atol=1e-6, rtol=1e-6)


def test_empty_cascade_rows_are_the_plain_path():
    args, _, cascade = make_groups(5)
    none = Cascade(jnp.full_like(cascade.group_slots, -1), jnp.zeros_like(cascade.prefix_pages))
    np.testing.assert_array_equal(np.asarray(cascade_decode_attention_xla(*args, none)),
                                  np.asarray(paged_decode_attention_xla(*args)))


def test_cascade_reads_each_shared_page_once_per_group():
    # The XLA program's K gathers: rows of the shared loop = groups, not slots (what cuts the traffic).
    args, _, cascade = make_groups(6)
    text = jax.jit(lambda *a: cascade_decode_attention_xla(*a[:5], Cascade(*a[5:]))).lower(
        *args, *cascade).as_text()
    rows = cascade.group_slots.shape[0]
    assert f"tensor<{rows}x2x" in text  # a [G, kv, ...] gather of pages


@pytest.mark.parametrize("impl_variant", ["triton", "mosaic"])
def test_pallas_cascade_equals_paged(impl_variant):
    from jaxrl_llm.sampler.cascade_attention import cascade_decode_attention_pallas
    args, _, cascade = make_groups(7, kv_heads=1, loose=1)
    plain = paged_decode_attention_xla(*args)
    got = cascade_decode_attention_pallas(*args, cascade, variant=impl_variant, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), atol=1e-5, rtol=1e-5)


def test_dispatcher_takes_the_cascade():
    args, _, cascade = make_groups(8)
    plain = paged_decode_attention(*args, impl="xla", sliding_window=40)
    got = paged_decode_attention(*args, impl="xla", sliding_window=40, cascade=cascade)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), atol=1e-6, rtol=1e-6)
    # the kernel route keeps the plain kernel in a windowed layer and the cascade elsewhere
    one_head, _, c1 = make_groups(9, kv_heads=1, loose=0)
    got = paged_decode_attention(*one_head, impl="pallas", cascade=c1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(paged_decode_attention_xla(*one_head)), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("platform,custom_call", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_cascade_lowers_for_device_backends(platform, custom_call, sinks):
    # The engine's dispatch ('auto') on a GPU / TPU: the kernel twice (shared rows, own pages) and the
    # merge, lowered here for the real backends (Triton IR / Mosaic MLIR); with GPT-OSS's attention sinks
    # joined by the merged log-sum-exp.
    from jax import export

    from jaxrl_llm.platform.target import CompileTarget, compiling_for
    args, _, cascade = make_groups(10, kv_heads=1, loose=1)
    spec = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*args, *cascade)]
    spec.append(jax.ShapeDtypeStruct(args[0].shape[1:2], jnp.float32) if sinks else None)

    def fn(q, k, v, lengths, table, group_slots, prefix_pages, sinks):
        return paged_decode_attention(q, k, v, lengths, table, cascade=Cascade(group_slots, prefix_pages),
                                      sinks=sinks)

    with compiling_for(CompileTarget("gpu" if platform == "cuda" else platform, None)):
        exported = export.export(jax.jit(fn), platforms=[platform],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(custom_call)])(*spec)
    assert exported.mlir_module().count(custom_call) >= 2  # the shared call and the own call
    assert exported.out_avals[0].shape == args[0].shape


@pytest.mark.parametrize("variant", ["triton", "mosaic"])
def test_the_batch_invariant_cascade_has_the_plain_walks_bits(variant):
    """model.batch_invariant's cascade (paged_attention.py `invariant_cascade`, the kernels in Pallas's
    interpreter): a group's whole shared key blocks walked once for its members, each member's walk continued
    from that exact state, `==` the plain mode kernel per slot. bf16, GPT-OSS sinks, Gemma 2's soft cap; prompts of
    9-13 full pages (2-3 of Triton's 64-key blocks, 1 of Mosaic's 128: the block holding the prompt's end is
    each member's own); finished members, slots in no group; on one device and per kv-head shard of a tensor
    split of 2 (the sinks split per head); a head width of 48 (Triton: pieces of 32 and 16, the state's too)."""
    from jax.sharding import Mesh

    from jaxrl_llm.models import invariant
    from jaxrl_llm.sampler.paged_attention import paged_decode_attention_invariant

    args, _, cascade = make_groups(11, kv_heads=2, group=3, head_dim=48, dtype=jnp.bfloat16, loose=2,
                                   group_sizes=(1, 3, 4), pages_per_slot=18, prompt_pages=(9, 14))
    q, k, v, lengths, table = args
    sinks = jnp.linspace(-0.5, 0.5, q.shape[1])
    kw = dict(layer=jnp.int32(1), softcap=30.0, sinks=sinks)
    pool = [jnp.stack([x[::-1], x]) for x in (k, v)]  # a stacked pool read at layer 1
    tensor = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    with invariant.kernels_interpreted(variant):
        plain = jax.jit(lambda *a: paged_decode_attention_invariant(*a, **kw))(q, *pool, lengths, table)
        for mesh in (None, tensor):
            got = jax.jit(lambda *a, mesh=mesh: paged_decode_attention_invariant(
                *a[:5], cascade=Cascade(*a[5:]), mesh=mesh, **kw))(q, *pool, lengths, table, *cascade)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    assert np.abs(np.asarray(plain, np.float32)).max() > 0
