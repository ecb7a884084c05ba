"""Pallas paged decode attention (interpret mode on CPU) against a dense reference written here.

Both lowerings run: "triton" through the generic Pallas interpreter and "mosaic" through the TPU
interpreter (its DMAs only land when waited, so a read of a block before its wait would see the
interpreter's NaN-filled scratch). Compiled GPU/TPU runs: bench/paged_attention.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_fixtures import MESHES

from jaxrl_llm import sharding
from jaxrl_llm.sampler.paged_attention import paged_decode_attention
from jaxrl_llm.sampler.paged_attention_pallas import paged_decode_attention_pallas

NUM_PAGES = 48


def dense_reference(q, k_pages, v_pages, lengths, page_indices, sliding_window=None, k_scales=None,
                    v_scales=None):
    """Gather each slot's pages into a dense [T] sequence, mask, softmax in fp32; fp32 result."""
    slots, num_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    k = k_pages.astype(jnp.float32)
    v = v_pages.astype(jnp.float32)
    if k_scales is not None:
        # K dequantised then stored in the compute dtype (the kernel's and the engine's rule).
        k = (k * k_scales[..., None]).astype(q.dtype).astype(jnp.float32)
        v = v * v_scales[..., None]
    k = k[:, page_indices].reshape(kv_heads, slots, -1, head_dim)  # [KV, S, T, D]
    v = v[:, page_indices].reshape(kv_heads, slots, -1, head_dim)
    group = num_heads // kv_heads
    qg = q.astype(jnp.float32).reshape(slots, kv_heads, group, head_dim)
    scores = jnp.einsum("skgd,kstd->skgt", qg, k, precision="highest") * head_dim ** -0.5
    pos = jnp.arange(k.shape[2])[None, :]
    visible = pos < lengths[:, None]
    if sliding_window is not None:
        visible &= pos >= lengths[:, None] - sliding_window
    visible = visible[:, None, None, :]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    probs = jnp.where(visible, probs, 0.0)  # length-0 rows: NaN softmax -> zeros
    out = jnp.einsum("skgt,kstd->skgd", probs, v, precision="highest")
    return out.reshape(slots, num_heads, head_dim)


def make_case(seed, *, group, head_dim, page_size, pages_per_slot=5, kv_heads=2, dtype=jnp.float32,
              int8=False):
    """Lengths 0, 1, one page, one page + 1, two pages, crossing the 3rd page, full; pages shuffled."""
    rng = np.random.default_rng(seed)
    p = page_size
    lengths = np.array([0, 1, p, p + 1, 2 * p, 3 * p - 1, pages_per_slot * p], np.int32)
    slots = len(lengths)
    page_indices = rng.permutation(NUM_PAGES)[: slots * pages_per_slot].reshape(slots, pages_per_slot)
    q = rng.standard_normal((slots, kv_heads * group, head_dim))
    shape = (kv_heads, NUM_PAGES, page_size, head_dim)
    case = dict(q=jnp.asarray(q, dtype), lengths=jnp.asarray(lengths),
                page_indices=jnp.asarray(page_indices, jnp.int32))
    if int8:
        case["k_pages"] = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        case["v_pages"] = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        case["k_scales"] = jnp.asarray(rng.uniform(0.002, 0.02, shape[:3]), jnp.float32)
        case["v_scales"] = jnp.asarray(rng.uniform(0.002, 0.02, shape[:3]), jnp.float32)
    else:
        case["k_pages"] = jnp.asarray(rng.standard_normal(shape), dtype)
        case["v_pages"] = jnp.asarray(rng.standard_normal(shape), dtype)
    return case


def run_kernel(case, **kw):
    return paged_decode_attention_pallas(
        case["q"], case["k_pages"], case["v_pages"], case["lengths"], case["page_indices"],
        k_scales=case.get("k_scales"), v_scales=case.get("v_scales"), interpret=True, **kw)


def reference(case, sliding_window=None):
    return dense_reference(case["q"], case["k_pages"], case["v_pages"], case["lengths"],
                           case["page_indices"], sliding_window, case.get("k_scales"),
                           case.get("v_scales"))


# (variant, GQA group, head_dim, page_size, sliding_window, pages_per_block, num_splits): every
# GQA ratio, head_dim and page size on each lowering, 2 kv heads; windows that start mid-page and
# span blocks; Triton with one program per slot and with the visible blocks split over 3 (the
# other Triton tests get the default split count, > 1 for their few slots). The other tests use
# 1 kv head (interpret-mode compile time grows with the grid).
FP32_CASES = [
    ("triton", 1, 64, 16, None, None, None),
    ("triton", 2, 128, 32, 40, 1, 1),
    ("triton", 4, 64, 16, 21, 2, 3),
    ("mosaic", 1, 128, 32, 40, None, None),
    ("mosaic", 2, 64, 16, None, 2, None),
    ("mosaic", 4, 64, 32, 21, 1, None),
]


@pytest.mark.parametrize("variant,group,head_dim,page_size,window,ppb,splits", FP32_CASES)
def test_fp32_matches_dense_reference(variant, group, head_dim, page_size, window, ppb, splits):
    case = make_case(group * head_dim + page_size, group=group, head_dim=head_dim,
                     page_size=page_size)
    out = run_kernel(case, sliding_window=window, pages_per_block=ppb, variant=variant,
                     num_splits=splits)
    ref = reference(case, window)
    assert out.shape == ref.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    assert not np.any(np.asarray(out[0])), "length-0 slot must give zeros"
    # The window changes the answer wherever a slot is longer than it (the test can fail).
    if window is not None:
        assert not np.allclose(np.asarray(ref), np.asarray(reference(case)), atol=1e-3)


@pytest.mark.parametrize("variant,window", [("triton", 21), ("mosaic", None)])
def test_bf16_within_half_ulp_of_fp32_reference(variant, window):
    # Kernel and reference both do fp32 math on the same bf16 inputs (exact products, fp32 sums):
    # they differ by fp32 summation order (~1e-6) plus the kernel's final rounding to bf16, which
    # is at most half a bf16 ulp = 2**-8 * |x| (8 significant bits).
    case = make_case(7, group=2, head_dim=64, page_size=16, kv_heads=1, dtype=jnp.bfloat16)
    out = run_kernel(case, sliding_window=window, pages_per_block=2, variant=variant)
    assert out.dtype == jnp.bfloat16
    ref = np.asarray(reference(case, window))
    err = np.abs(np.asarray(out, np.float32) - ref)
    assert np.all(err <= 2.0 ** -8 * np.abs(ref) + 1e-5), float(err.max())


@pytest.mark.parametrize("variant,dtype", [("triton", jnp.float32), ("mosaic", jnp.bfloat16)])
def test_int8_pages_with_scales(variant, dtype):
    case = make_case(3, group=2, head_dim=64, page_size=16, kv_heads=1, int8=True, dtype=dtype)
    out = np.asarray(run_kernel(case, sliding_window=40, pages_per_block=2, variant=variant), np.float32)
    ref = np.asarray(reference(case, 40))
    rel = 2.0 ** -8 if dtype == jnp.bfloat16 else 0.0  # half a bf16 ulp, as in the bf16 test
    assert np.all(np.abs(out - ref) <= rel * np.abs(ref) + 1e-5), float(np.abs(out - ref).max())


@pytest.mark.parametrize("variant", ["triton", "mosaic"])
def test_reads_only_visible_blocks(variant):
    # Page 0 is poison (NaN) and every page-table entry outside a slot's visible blocks points at
    # it: any read of a block before the window or past ceil(length / page_size) gives NaN.
    page_size, window = 16, 20
    case = make_case(11, group=2, head_dim=64, page_size=page_size, pages_per_slot=6, kv_heads=1)
    lengths = np.asarray(case["lengths"])
    table = np.asarray(case["page_indices"]) % (NUM_PAGES - 1) + 1  # real pages are 1..N-1
    page = np.arange(table.shape[1])[None, :]
    first = np.maximum(lengths - window, 0)[:, None] // page_size
    last = (lengths[:, None] + page_size - 1) // page_size
    poisoned = dict(case, page_indices=jnp.asarray(np.where((page >= first) & (page < last), table, 0),
                                                   jnp.int32))
    poisoned["k_pages"] = case["k_pages"].at[:, 0].set(jnp.nan)
    poisoned["v_pages"] = case["v_pages"].at[:, 0].set(jnp.nan)
    out = np.asarray(run_kernel(poisoned, sliding_window=window, pages_per_block=1, variant=variant))
    clean = dict(poisoned, k_pages=case["k_pages"], v_pages=case["v_pages"])
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, np.asarray(reference(clean, window)), atol=1e-5, rtol=0)


def test_rejects_bad_inputs():
    case = make_case(0, group=2, head_dim=64, page_size=16)
    q, k, v, lengths, table = (case[n] for n in ("q", "k_pages", "v_pages", "lengths", "page_indices"))
    with pytest.raises(ValueError, match="num_heads a multiple"):
        paged_decode_attention_pallas(q[:, :3], k, v, lengths, table, interpret=True)
    with pytest.raises(ValueError, match="lengths"):
        paged_decode_attention_pallas(q, k, v, lengths[:2], table, interpret=True)
    with pytest.raises(ValueError, match="k_scales and v_scales"):
        paged_decode_attention_pallas(q, k, v, lengths, table, k_scales=k[..., 0], interpret=True)
    with pytest.raises(ValueError, match="int8 pages need k_scales"):
        paged_decode_attention_pallas(q, k.astype(jnp.int8), v.astype(jnp.int8), lengths, table,
                                      interpret=True)
    with pytest.raises(ValueError, match="num_splits=2 needs variant='triton'"):
        paged_decode_attention_pallas(q, k, v, lengths, table, interpret=True, variant="mosaic",
                                      num_splits=2)
    with pytest.raises(ValueError, match="page_size=12 must be a power of 2"):
        paged_decode_attention_pallas(q, k[:, :, :12], v[:, :, :12], lengths, table, interpret=True,
                                      variant="triton")


@pytest.mark.parametrize("platform,variant,custom_call", [
    ("cuda", "triton", "__gpu$xla.gpu.triton"), ("tpu", "mosaic", "tpu_custom_call")])
def test_lowers_for_device_backends(platform, variant, custom_call):
    # Cross-platform lowering on CPU: Pallas -> Triton IR / Mosaic MLIR for the real backends (the
    # steps after it, Triton -> PTX and Mosaic's layout passes, need the device: see the bench).
    from jax import export
    slots, kv_heads, num_pages, page_size, pages_per_slot = 5, 3, 60, 16, 7  # not powers of 2
    spec = jax.ShapeDtypeStruct
    cases = {  # name: (q, pages, scales?, kwargs)
        "bf16_gqa3_window": (spec((slots, 9, 64), jnp.bfloat16), jnp.bfloat16, False,
                             dict(sliding_window=40)),
        "fp32_mha_d128": (spec((slots, 3, 128), jnp.float32), jnp.float32, False, {}),
        "int8_bf16": (spec((slots, 6, 64), jnp.bfloat16), jnp.int8, True, {}),
    }
    for name, (q, kv_dtype, scaled, kw) in cases.items():
        pages = spec((kv_heads, num_pages, page_size, q.shape[2]), kv_dtype)
        scales = [spec((kv_heads, num_pages, page_size), jnp.float32)] * 2 if scaled else []

        def fn(q, k, v, lengths, table, *sc, kw=kw):
            extra = dict(k_scales=sc[0], v_scales=sc[1]) if sc else dict(kw)
            if variant == "triton":  # the split path (partial outputs + merge) lowers too
                extra["num_splits"] = 2
            return paged_decode_attention_pallas(q, k, v, lengths, table, variant=variant, **extra)

        exported = export.export(
            jax.jit(fn), platforms=[platform],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(custom_call)],
        )(q, pages, pages, spec((slots,), jnp.int32), spec((slots, pages_per_slot), jnp.int32), *scales)
        assert custom_call in exported.mlir_module(), name
        assert exported.out_avals[0].shape == q.shape and exported.out_avals[0].dtype == q.dtype


def test_mosaic_splits_large_page_tables_into_slot_chunks(monkeypatch):
    import jaxrl_llm.sampler.paged_attention_mosaic as mosaic
    # The limit is read at trace time: these shapes (1 kv head, fp32, 5 pages, 1 page per block)
    # are traced by no other test, so the patched value is the one traced.
    monkeypatch.setattr(mosaic, "MOSAIC_MAX_TABLE_ENTRIES", 15)  # 3 slots of 5 pages per call
    case = make_case(5, group=2, head_dim=64, page_size=16, kv_heads=1)  # 7 slots: calls of 3, 3, 1
    args = [case[n] for n in ("q", "k_pages", "v_pages", "lengths", "page_indices")]
    kw = dict(interpret=True, variant="mosaic", pages_per_block=1)
    jaxpr = str(jax.make_jaxpr(lambda *a: paged_decode_attention_pallas(*a, **kw))(*args))
    assert jaxpr.count("pallas_call[") == 3
    out = paged_decode_attention_pallas(*args, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference(case)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_engine_xla_path(dtype):
    # The contract: the engine's XLA path and the kernel compute the same numbers (one policy).
    # Both are within half a bf16 ulp of the fp32 result, so within one ulp of each other.
    xla = pytest.importorskip("jaxrl_llm.sampler.paged_attention").paged_decode_attention_xla
    case = make_case(13, group=2, head_dim=64, page_size=16, kv_heads=1, dtype=dtype)
    args = [case[n] for n in ("q", "k_pages", "v_pages", "lengths", "page_indices")]
    out = np.asarray(paged_decode_attention_pallas(*args, sliding_window=21, interpret=True,
                                                   variant="triton"), np.float32)
    ref = np.asarray(xla(*args, sliding_window=21), np.float32)
    rel = 2.0 ** -7 if dtype == jnp.bfloat16 else 0.0
    assert np.all(np.abs(out - ref) <= rel * np.abs(ref) + 1e-5), float(np.abs(out - ref).max())


@pytest.mark.parametrize("path", ["mosaic", "triton", "xla"])
def test_lane_padded_pool_gives_the_unpadded_numbers(path):
    # a TPU pool stores head_dim 64 padded to 128 lanes with zeros (sampler/kv_bits.py): q.k and
    # probs.V are the same sums, the scale is the queries' head_dim**-0.5, the output is q's width
    xla = pytest.importorskip("jaxrl_llm.sampler.paged_attention").paged_decode_attention_xla
    case = make_case(21, group=2, head_dim=64, page_size=16, kv_heads=2)
    args = [case[n] for n in ("q", "k_pages", "v_pages", "lengths", "page_indices")]
    padded = list(args)
    padded[1:3] = [jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, 64))) for x in args[1:3]]
    if path == "xla":
        want, got = xla(*args, sliding_window=37), xla(*padded, sliding_window=37)
    else:
        run = lambda a: paged_decode_attention_pallas(*a, sliding_window=37, interpret=True,  # noqa: E731
                                                      variant=path)
        want, got = run(args), run(padded)
    assert got.shape == want.shape == case["q"].shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("int8", [False, True])
def test_xla_path_reads_one_layer_of_a_stacked_pool(int8):
    # The engine passes the whole [layers, kv, pages, ...] pool and a layer index (no per-step copy of
    # the layer): each layer's result equals the call on that layer's pages alone and the dense
    # reference. Two kv heads, so the flattened (kv head, page) rows are exercised.
    xla = pytest.importorskip("jaxrl_llm.sampler.paged_attention").paged_decode_attention_xla
    cases = [make_case(20 + i, group=2, head_dim=64, page_size=16, kv_heads=2, int8=int8) for i in range(3)]
    names = ("k_pages", "v_pages") + (("k_scales", "v_scales") if int8 else ())
    stacked = {n: jnp.stack([c[n] for c in cases]) for n in names}
    base = cases[0]
    for layer, case in enumerate(cases):
        one = {n: case[n] for n in names}
        out = xla(base["q"], lengths=base["lengths"], page_indices=base["page_indices"], sliding_window=40,
                  layer=jnp.int32(layer), **stacked)
        alone = xla(base["q"], lengths=base["lengths"], page_indices=base["page_indices"], sliding_window=40, **one)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(alone))
        ref = reference({**base, **one}, 40)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant,int8", [("triton", False), ("mosaic", False), ("triton", True), ("mosaic", True)])
def test_kernel_reads_one_layer_of_a_stacked_pool(variant, int8):
    # The engine's pool is [layers, kv, pages, ...]: the kernel gathers the layer's pages by index from
    # the flattened pool. Each layer equals the call on that layer's pages alone, and the lowered
    # program holds no slice of a layer's pool (the copy the engine paid every decode step).
    cases = [make_case(30 + i, group=2, head_dim=64, page_size=16, kv_heads=2, int8=int8) for i in range(3)]
    names = ("k_pages", "v_pages") + (("k_scales", "v_scales") if int8 else ())
    stacked = {n: jnp.stack([c[n] for c in cases]) for n in names}
    base = cases[0]
    kw = dict(sliding_window=40, interpret=True, variant=variant)
    call = jax.jit(lambda layer, st: paged_decode_attention_pallas(base["q"], lengths=base["lengths"],
                                                                   page_indices=base["page_indices"], layer=layer,
                                                                   **st, **kw))
    for layer, case in enumerate(cases):
        alone = paged_decode_attention_pallas(base["q"], lengths=base["lengths"], page_indices=base["page_indices"],
                                              **{n: case[n] for n in names}, **kw)
        np.testing.assert_allclose(np.asarray(call(jnp.int32(layer), stacked)), np.asarray(alone), atol=1e-6, rtol=0)
    # lowered for the kernel's real backend: nothing outside the kernel slices the pool
    from jax import export
    platform, target = {"triton": ("cuda", "__gpu$xla.gpu.triton"), "mosaic": ("tpu", "tpu_custom_call")}[variant]
    device_call = jax.jit(lambda layer, st: paged_decode_attention_pallas(
        base["q"], lengths=base["lengths"], page_indices=base["page_indices"], layer=layer, **st,
        sliding_window=40, variant=variant))
    module = export.export(device_call, platforms=[platform],
                           disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(
        jnp.int32(0), stacked).mlir_module()
    assert target in module and "dynamic_slice" not in module


@pytest.mark.parametrize("stacked", [False, True])
def test_dispatcher_runs_the_kernel_per_kv_head_shard(stacked):
    # impl='pallas' on a mesh whose 'tensor' axis splits the kv heads: the kernel runs per shard under
    # shard_map (sampler/kv_shards.py), one layer's pages or the stacked pool read by layer, and each
    # (slot, kv head) equals the one-device call
    mesh = sharding.make_mesh(MESHES["data2_tensor4"])
    case = make_case(9, group=2, head_dim=64, page_size=16, kv_heads=4)
    pages = {k: case[k] for k in ("k_pages", "v_pages")}
    layer = None
    if stacked:  # a 2-layer pool, layer 1 read
        pages = {k: jnp.stack([-v, v]) for k, v in pages.items()}
        layer = jnp.int32(1)
    args = (case["q"], pages["k_pages"], pages["v_pages"], case["lengths"], case["page_indices"])
    sharded = jax.jit(lambda *a: paged_decode_attention(*a, impl="pallas", layer=layer, mesh=mesh))(*args)
    one = paged_decode_attention(*args, impl="pallas", layer=layer)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(one), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(one), np.asarray(reference(case)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_dim,group,splits", [(80, 3, 1), (576, 72, None)])
def test_triton_reads_a_head_dim_that_is_not_a_power_of_two_in_pieces(head_dim, group, splits):
    # 576: DeepSeek's latent + rope key (one kv head, every query head in its group: 72 heads are 128 padded
    # rows, two programs of 64), read as the keys and the values (the engine passes the pool twice);
    # 80 = 64 + 16 with one program per slot. The kernel refused both before (Triton blocks are powers of 2).
    from jaxrl_llm.sampler.paged_attention_pallas import triton_supports
    from jaxrl_llm.shapes import head_pieces
    assert head_pieces(576) == ((0, 512), (512, 64)) and head_pieces(80) == ((0, 64), (64, 16))
    assert triton_supports(576, 16) and not triton_supports(40, 16) and not triton_supports(64, 12)
    case = make_case(head_dim + group, group=group, head_dim=head_dim, page_size=16, pages_per_slot=3, kv_heads=1)
    case["v_pages"] = case["k_pages"]
    out, lse = run_kernel(case, variant="triton", num_splits=splits, return_lse=True)
    ref = reference(case)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    plain = run_kernel(case, variant="triton", num_splits=splits)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(ref), atol=1e-5, rtol=0)
    k = np.asarray(case["k_pages"], np.float64)[0][np.asarray(case["page_indices"])].reshape(len(ref), -1, head_dim)
    scores = np.einsum("shd,std->sht", np.asarray(case["q"], np.float64), k) * head_dim ** -0.5
    visible = np.arange(k.shape[1])[None, None, :] < np.asarray(case["lengths"])[:, None, None]
    with np.errstate(divide="ignore"):
        expected = np.log(np.sum(np.where(visible, np.exp(scores), 0.0), axis=-1))
    np.testing.assert_allclose(np.asarray(lse), expected, atol=1e-4, rtol=0)


def test_triton_latent_pool_lowers_for_cuda():
    # DeepSeek-V3's decode shapes: 128 query heads over one kv head of 576, bf16, with and without splits
    from jax import export
    spec = jax.ShapeDtypeStruct
    slots, num_pages, page_size, pages_per_slot = 4, 40, 16, 9
    q = spec((slots, 128, 576), jnp.bfloat16)
    pool = spec((1, num_pages, page_size, 576), jnp.bfloat16)
    for splits in (1, 2):
        exported = export.export(
            jax.jit(lambda q, k, lengths, table, splits=splits: paged_decode_attention_pallas(
                q, k, k, lengths, table, variant="triton", num_splits=splits)),
            platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(q, pool, spec((slots,), jnp.int32), spec((slots, pages_per_slot), jnp.int32))
        assert "__gpu$xla.gpu.triton" in exported.mlir_module()
        assert exported.out_avals[0].shape == q.shape


def _pool_operands(fn, case):
    """How many operands of each kernel call in fn's program are pool-shaped (one per head_dim piece and pool
    read)."""
    def calls(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
            else:
                params = [x for v in eqn.params.values() for x in (v if isinstance(v, (tuple, list)) else (v,))]
                inner = [getattr(v, "jaxpr", v) for v in params]  # jit's jaxpr, cond's branches
                yield from (c for j in inner if hasattr(j, "eqns") for c in calls(j))

    return [sum(v.aval.ndim == 3 and v.aval.shape[1:] == case["k_pages"].shape[-2:] for v in c.invars)
            for c in calls(jax.make_jaxpr(fn)(case).jaxpr)]


@pytest.mark.parametrize("variant,head_dim,int8", [("triton", 48, False), ("triton", 64, True), ("mosaic", 64, False),
                                                   ("mosaic", 64, True)])
def test_a_latent_pool_is_read_once_as_keys_and_values(variant, head_dim, int8):
    # MLA passes its one pool as keys and values: with values_are_keys each block is loaded (Triton) or
    # DMA'd (Mosaic) once and serves as both, with the same numbers as reading it twice
    case = make_case(5, group=4, head_dim=head_dim, page_size=16, kv_heads=1, int8=int8)
    case["v_pages"], case["v_scales"] = case["k_pages"], case.get("k_scales")

    def run(case, shared):
        return run_kernel(case, variant=variant, sliding_window=40, values_are_keys=shared)

    once, twice = run(case, True), run(case, False)
    np.testing.assert_array_equal(np.asarray(once), np.asarray(twice))
    np.testing.assert_allclose(np.asarray(once), np.asarray(reference(case, 40)), atol=1e-5, rtol=0)
    pieces = 2 if head_dim == 48 and variant == "triton" else 1
    assert _pool_operands(lambda c: run(c, True), case) == [pieces]
    assert _pool_operands(lambda c: run(c, False), case) == [2 * pieces]
    if variant == "triton" and not int8:  # the engine's dispatcher passes the pool twice: read once by each kernel
        def dispatched(c):
            return paged_decode_attention(c["q"], c["k_pages"], c["k_pages"], c["lengths"], c["page_indices"],
                                          impl="pallas")
        assert _pool_operands(dispatched, case) == [2, 1, 2]  # the cuda (Triton), tpu (Mosaic), cpu branches
