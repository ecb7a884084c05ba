"""The CPU paged decode attention kernel (jaxrl_llm/sampler/native): the contract's numbers (the XLA
path's and a dense reference's), a stacked pool read by layer, a sharded mesh, the dispatcher's
choice, the engine on it, and the build (cache, fallback without a compiler)."""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_fixtures import MESHES, PAD_ID, PROMPTS8
from test_paged_attention_pallas import make_case, reference

from jaxrl_llm import sharding
from jaxrl_llm.sampler import SamplingParams, native
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.engine import EngineSpec, PagedEngine
from jaxrl_llm.sampler.paged_attention import paged_decode_attention, paged_decode_attention_xla

ARGS = ("q", "k_pages", "v_pages", "lengths", "page_indices")
TARGET = "jaxrl_llm_paged_attention_cpu"

# only a host without a C++ compiler (or whose default backend is an accelerator, where the kernel is
# never taken) skips; with one, a kernel that does not build fails these tests
pytestmark = pytest.mark.skipif(native.compiler() is None or jax.default_backend() != "cpu",
                                reason="no C++ compiler to build the CPU kernel, or not a CPU backend")


# (GQA group, head_dim, page_size, sliding window, softcap): lengths 0 .. a full table (make_case),
# windows starting mid-page; the vector path's head dims (64 / 128 / 256 unrolled, 80 at run time) with
# groups of 1-8 (row blocks of 4, then the rest), and the scalar path's (72: not a multiple of 16 lanes)
@pytest.mark.parametrize("group,head_dim,page_size,window,softcap", [
    (1, 64, 16, None, None), (3, 64, 16, 21, None), (2, 128, 32, 40, None), (4, 80, 16, None, 30.0),
    (3, 64, 8, 5, 50.0), (5, 64, 16, 37, None), (8, 256, 16, None, None), (3, 72, 16, 19, 30.0)])
def test_equals_the_xla_path_and_the_dense_reference(group, head_dim, page_size, window, softcap):
    case = make_case(3, group=group, head_dim=head_dim, page_size=page_size, kv_heads=2)
    args = [case[n] for n in ARGS]
    out = jax.jit(native.paged_decode_attention_cpu, static_argnames=("sliding_window", "softcap"))(
        *args, sliding_window=window, softcap=softcap)
    want = paged_decode_attention_xla(*args, sliding_window=window, softcap=softcap)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6, rtol=0)
    if softcap is None:
        np.testing.assert_allclose(np.asarray(out), np.asarray(reference(case, window)), atol=1e-5, rtol=0)
    assert np.all(np.asarray(out)[0] == 0)  # the empty slot (length 0)


def test_reads_one_layer_of_a_stacked_pool():
    # the engine passes the whole [layers, kv, pages, ...] pool and a traced layer index
    cases = [make_case(40 + i, group=2, head_dim=64, page_size=16, kv_heads=2) for i in range(3)]
    stacked = {n: jnp.stack([c[n] for c in cases]) for n in ("k_pages", "v_pages")}
    base = cases[0]
    run = jax.jit(lambda layer: native.paged_decode_attention_cpu(
        base["q"], stacked["k_pages"], stacked["v_pages"], base["lengths"], base["page_indices"], layer=layer,
        sliding_window=40))
    for layer, case in enumerate(cases):
        alone = native.paged_decode_attention_cpu(base["q"], case["k_pages"], case["v_pages"], base["lengths"],
                                                  base["page_indices"], sliding_window=40)
        np.testing.assert_array_equal(np.asarray(run(jnp.int32(layer))), np.asarray(alone))


def test_on_a_mesh_equals_one_device():
    # kv heads over 'tensor' (4 of them on 4 shards), run per shard under shard_map: each (slot, kv
    # head) is computed as on one device, so the results are identical
    mesh = sharding.make_mesh(MESHES["data2_tensor4"])
    case = make_case(5, group=2, head_dim=64, page_size=16, kv_heads=4)
    args = [case[n] for n in ARGS]
    one = native.paged_decode_attention_cpu(*args, sliding_window=21)
    sharded = jax.jit(lambda *a: native.paged_decode_attention_cpu(*a, sliding_window=21, mesh=mesh))(*args)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(one))


def _lowered(impl: str, case: dict, **kw) -> str:
    fn = lambda *a: paged_decode_attention(*a, impl=impl, **kw)  # noqa: E731
    return jax.jit(fn).lower(*[case[n] for n in ARGS]).as_text()


def test_dispatch_auto_takes_the_kernel_for_fp32_pages_only():
    case = make_case(6, group=2, head_dim=64, page_size=16, kv_heads=2)
    assert TARGET in _lowered("auto", case) and TARGET in _lowered("cpu", case)
    assert TARGET not in _lowered("xla", case)
    bf16 = make_case(6, group=2, head_dim=64, page_size=16, kv_heads=2, dtype=jnp.bfloat16)
    assert TARGET not in _lowered("auto", bf16)
    groups = Cascade(jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([1], jnp.int32))
    assert TARGET not in _lowered("auto", case, cascade=groups)  # cascade rows keep the XLA path
    int8 = make_case(6, group=2, head_dim=64, page_size=16, kv_heads=2, int8=True)
    assert TARGET not in _lowered("auto", int8, k_scales=int8["k_scales"], v_scales=int8["v_scales"])
    with pytest.raises(ValueError, match=r"rollout.paged_attention='cpu' takes fp32 pages.*int8"):
        _lowered("cpu", int8, k_scales=int8["k_scales"], v_scales=int8["v_scales"])


def test_engine_on_the_kernel_equals_the_xla_path(llama_tiny):
    # the same sampled tokens, and log-probs within the fp32 scoring floor
    cfg, params = llama_tiny
    settings, knobs = SamplingParams(max_new_tokens=12, temperature=0.8, n=2).compile_args(
        cfg.eos_token_ids, int(PAD_ID), vocab_size=cfg.vocab_size)
    outs = {}
    for impl in ("cpu", "xla"):
        spec = EngineSpec(max_num_seqs=4, page_size=4, num_pages=64, pages_per_slot=8, attn_impl=impl)
        outs[impl], _ = PagedEngine(cfg, spec, steps_per_call=4).run(params, PROMPTS8[:4], jax.random.key(3), knobs,
                                                                     settings)
    np.testing.assert_array_equal(outs["cpu"].tokens, outs["xla"].tokens)
    m = outs["cpu"].response_mask.astype(bool)
    assert m.sum() > 20
    np.testing.assert_allclose(outs["cpu"].log_probs[m], outs["xla"].log_probs[m], atol=1e-5, rtol=1e-5)


def test_build_is_cached(monkeypatch, tmp_path):
    """One compile into the cache folder, renamed from its temporary, then read from there. The compile itself
    stands in here (the suite's other tests run the real one): it writes the library it is asked for."""
    monkeypatch.setenv("JAXRL_LLM_NATIVE_CACHE", str(tmp_path))
    compiles = []
    run = subprocess.run

    def compile_or_run(cmd, **kw):
        if "-shared" not in cmd:
            return run(cmd, **kw)
        compiles.append(cmd)
        pathlib.Path(cmd[cmd.index("-o") + 1]).write_bytes(b"library")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", compile_or_run)
    built = native.build()
    assert built.parent == tmp_path and built.read_bytes() == b"library" and len(compiles) == 1
    assert "-O3" in compiles[0] and str(native._SOURCE) in compiles[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build.lock", built.name]  # no temporary left behind
    assert native.build() == built and len(compiles) == 1  # cached: not compiled again


FALLBACK = """
import warnings, jax, jax.numpy as jnp
from jaxrl_llm.sampler import native
from jaxrl_llm.sampler.paged_attention import paged_decode_attention
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert not native.available()
assert "no C++ compiler" in native.unavailable_reason() and "XLA path" in str(seen[0].message)
q, pages = jnp.ones((2, 2, 8)), jnp.ones((1, 4, 4, 8))
args = (q, pages, pages, jnp.array([3, 0], jnp.int32), jnp.array([[1, 2], [3, 0]], jnp.int32))
text = jax.jit(lambda *a: paged_decode_attention(*a, impl="auto")).lower(*args).as_text()
assert "jaxrl_llm_paged_attention_cpu" not in text
try:
    paged_decode_attention(*args, impl="cpu")
except RuntimeError as e:
    assert "rollout.paged_attention='cpu': no C++ compiler" in str(e), e
else:
    raise AssertionError("impl='cpu' ran without a kernel")
print("ok")
"""


def test_without_a_compiler_auto_keeps_the_xla_path(tmp_path):
    # a process whose PATH holds no compiler: the kernel is unavailable with the reason (a warning),
    # 'auto' lowers the XLA path, and 'cpu' says why it cannot run
    env = {**os.environ, "PATH": str(tmp_path), "JAXRL_LLM_NATIVE_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("CXX", None)
    done = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
