"""The paged engine: attention equals dense, log-probs equal the trainer's scoring, samples do not
depend on slot count / queue order / pool pressure, and repeated runs do not recompile; `serve`
takes requests that arrive while others decode, each stopped at its own budget."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_fixtures import MESHES, PAD_ID, PROMPTS, PROMPTS8
from test_sampler_logprobs import rescore

from jaxrl_llm.platform.target import CompileTarget, compiling_for
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from jaxrl_llm.sampler.core import FINISH_LENGTH
from jaxrl_llm.sampler.engine import (
    EngineRequest,
    EngineSpec,
    PagedEngine,
    decode_state,
    device_kv_budget,
    plan_num_pages,
    programs,
)
from jaxrl_llm.sampler.paged_attention import paged_decode_attention, paged_decode_attention_xla
from jaxrl_llm.sampler.speculative import SpeculativeSpec

NEW = 10
SAMPLED = SamplingParams(max_new_tokens=NEW, temperature=0.7, top_k=20, top_p=0.9, n=3)


def dense_attention(q, k, v, lengths, window=None):
    """Reference: per slot, softmax over its first `lengths` keys (contiguous [S, kv, T, D])."""
    s, nh, hd = q.shape
    nkv, t = k.shape[1], k.shape[2]
    g = nh // nkv
    kk = jnp.repeat(k, g, axis=1).astype(jnp.float32)
    vv = jnp.repeat(v, g, axis=1).astype(jnp.float32)
    scores = jnp.einsum("shd,shtd->sht", q.astype(jnp.float32), kk) * hd ** -0.5
    pos = jnp.arange(t)
    ok = pos[None] < lengths[:, None]
    if window is not None:
        ok &= pos[None] >= (lengths - window)[:, None]
    scores = jnp.where(ok[:, None], scores, -jnp.inf)
    probs = jnp.where(ok[:, None], jax.nn.softmax(scores, axis=-1), 0.0)
    return jnp.einsum("sht,shtd->shd", jnp.nan_to_num(probs), vv)


@pytest.mark.parametrize("window", [None, 37])
def test_paged_attention_equals_dense(window):
    rng = np.random.default_rng(0)
    slots, nh, nkv, hd, ps, pps = 5, 4, 2, 16, 8, 40  # 320 keys per slot: several 128-key blocks
    lengths = np.array([1, 7, 300, 0, 129], np.int32)
    num_pages = slots * pps + 1
    k_pages = rng.normal(size=(nkv, num_pages, ps, hd)).astype(np.float32)
    v_pages = rng.normal(size=(nkv, num_pages, ps, hd)).astype(np.float32)
    table = 1 + rng.permutation(slots * pps).reshape(slots, pps).astype(np.int32)  # scattered pages
    q = rng.normal(size=(slots, nh, hd)).astype(np.float32)
    got = paged_decode_attention(q, k_pages, v_pages, lengths, table, sliding_window=window, impl="xla")
    # the same KV laid out contiguously per slot
    k = k_pages[:, table].reshape(nkv, slots, pps * ps, hd).transpose(1, 0, 2, 3)
    v = v_pages[:, table].reshape(nkv, slots, pps * ps, hd).transpose(1, 0, 2, 3)
    want = dense_attention(q, k, v, lengths, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(got)[3] == 0)  # empty slot
    # int8 pages (per token per head scales) stay close to the fp32 result
    from jaxrl_llm.sampler.engine.forward import quantize_int8
    kq, ks = quantize_int8(k_pages)
    vq, vs = quantize_int8(v_pages)
    got8 = paged_decode_attention_xla(q, kq, vq, lengths, table, sliding_window=window, k_scales=ks, v_scales=vs)
    np.testing.assert_allclose(np.asarray(got8), np.asarray(want), atol=0.05)


def _engine(cfg, slots, *, num_pages=64, page_size=4, steps=3, kv="auto", precompile=False):
    spec = EngineSpec(max_num_seqs=slots, page_size=page_size, num_pages=num_pages, pages_per_slot=8,
                      kv_cache_dtype=kv)
    # the drain's slot sets compile when first reached (rollout.precompile_drain=False): the same tokens, fewer
    # programs (the recompile test below compiles them all up front, the default)
    return PagedEngine(cfg, spec, steps_per_call=steps, precompile_drain=precompile)


def _args(cfg, sp):
    return sp.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)


def test_greedy_equals_static_sampler_and_logprobs_equal_scoring(llama_tiny):
    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=NEW, do_sample=False, n=2))
    ids, mask = left_pad(PROMPTS, PAD_ID)
    static = sample(params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
    out, stats = _engine(cfg, 3).run(params, PROMPTS, jax.random.key(0), knobs, settings)
    np.testing.assert_array_equal(out.tokens, np.asarray(static.tokens))
    np.testing.assert_array_equal(out.lengths, np.asarray(static.lengths))
    np.testing.assert_array_equal(out.finish_reason, np.asarray(static.finish_reason))
    assert stats.prefill_calls == len(PROMPTS)  # one prefill per prompt for its n = 2 samples
    assert stats.prefill_tokens == sum(map(len, PROMPTS))
    ref = np.asarray(rescore(params, cfg, out, 1.0))
    m = out.response_mask.astype(bool)
    np.testing.assert_allclose(out.log_probs[m], ref[m], atol=1e-5, rtol=0)


def test_sampled_logprobs_equal_scoring_and_do_not_depend_on_slots_or_order(llama_tiny):
    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SAMPLED)
    rng = jax.random.key(7)
    base, _ = _engine(cfg, 3).run(params, PROMPTS, rng, knobs, settings)
    m = base.response_mask.astype(bool)
    assert m.sum() > len(PROMPTS) * 3
    ref = np.asarray(rescore(params, cfg, base, 0.7))
    # fp32 floor: ~1e-5 absolute at log-probs near -3 (a relative 3e-6), hence the rtol
    np.testing.assert_allclose(base.log_probs[m], ref[m], atol=1e-5, rtol=1e-5)
    assert not np.array_equal(base.tokens[0], base.tokens[1])  # samples of a prompt differ
    order = [(i, j) for i in reversed(range(len(PROMPTS))) for j in reversed(range(3))]
    # 2 slots, reversed queue, a pool of 5 pages (+ scratch): requests wait for free pages
    out, stats = _engine(cfg, 2, num_pages=6).run(params, PROMPTS, rng, knobs, settings, order=order)
    np.testing.assert_array_equal(out.tokens, base.tokens)
    # the drain moves sequences to smaller slot sets: XLA:CPU's fp32 matmuls of another row count
    # round the last bits differently (2e-6 seen); the bar is the scoring one above
    np.testing.assert_allclose(out.log_probs, base.log_probs, atol=1e-5, rtol=1e-5)
    assert stats.waits_for_pages > 0 and stats.peak_pages_used <= 5


def test_no_recompile_across_runs_and_utilisation(llama_tiny):
    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SAMPLED)  # the settings and shapes of the test above: no new programs
    engine = _engine(cfg, 3, precompile=True)
    engine.run(params, PROMPTS, jax.random.key(0), knobs, settings)
    jitted = (programs.prefill, programs.prefill_batch, programs.insert, programs.insert_at, programs.generate)
    sizes = [f._cache_size() for f in jitted]
    # other prompts (lengths within the same 16-token bucket), other seeds, other output lengths
    for seed, prompts in ((1, [[3, 4], [5] * 11, [9, 8, 7]]), (2, PROMPTS[::-1] + [[1] * 14])):
        out, stats = engine.run(params, prompts, jax.random.key(seed), knobs, settings)
        assert out.tokens.shape == (len(prompts) * 3, NEW)
        assert 0.5 < stats.utilisation <= 1.0
    assert [f._cache_size() for f in jitted] == sizes
    # rollout.precompile_drain=False (configs/tiny.py's): a drain set's program compiles when first reached, the
    # same tokens and log-probs (the drain above, seed 2, ran through smaller slot sets)
    assert stats.resizes > 0
    lazy = PagedEngine(cfg, engine.spec, steps_per_call=engine.steps_per_call, precompile_drain=False)
    again, again_stats = lazy.run(params, prompts, jax.random.key(2), knobs, settings)
    assert again_stats.resizes == stats.resizes and not lazy._warm
    np.testing.assert_array_equal(again.tokens, out.tokens)
    np.testing.assert_array_equal(again.log_probs, out.log_probs)


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_prefill_equals_one_prompt_per_call(llama_tiny, sampled):
    """New prompts of one length bucket prefill in one call (padded to a power of two rows): the
    same tokens and log-probs as one call per prompt, in fewer calls; prompts of two buckets."""
    cfg, params = llama_tiny
    sp = SAMPLED if sampled else SamplingParams(max_new_tokens=NEW, do_sample=False, n=2)
    settings, knobs = _args(cfg, sp)
    prompts = PROMPTS + [list(range(3, 23)), [7] * 17, [1, 2]]  # buckets of 16 and 32 tokens
    runs = {}
    for batched in (False, True):
        engine = _engine(cfg, 8)
        engine.batch_prefill = batched
        runs[batched] = engine.run(params, prompts, jax.random.key(3), knobs, settings)
    (one, one_stats), (many, many_stats) = runs[False], runs[True]
    np.testing.assert_array_equal(many.tokens, one.tokens)
    np.testing.assert_array_equal(many.lengths, one.lengths)
    # fp32 matmuls over another row count round the last bits differently on XLA:CPU (6e-6 seen)
    np.testing.assert_allclose(many.log_probs, one.log_probs, atol=1e-5, rtol=1e-5)
    assert one_stats.prefill_calls == len(prompts) and many_stats.prefill_calls < len(prompts)
    assert many_stats.prefill_tokens == one_stats.prefill_tokens == sum(map(len, prompts))


def test_prefill_token_budget_and_pool_plan(llama_tiny):
    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SAMPLED)
    free, _ = _engine(cfg, 3).run(params, PROMPTS, jax.random.key(0), knobs, settings)
    engine = _engine(cfg, 3)
    engine.max_num_batched_tokens = 4  # rollout.max_num_batched_tokens: one prompt per round here
    out, stats = engine.run(params, PROMPTS, jax.random.key(0), knobs, settings)
    assert stats.max_prefill_tokens_per_round == max(map(len, PROMPTS))  # a longer prompt still goes alone
    np.testing.assert_array_equal(out.tokens, free.tokens)
    # the pool plan: every slot at full length, capped by a per-device byte budget
    assert plan_num_pages(cfg, max_num_seqs=4, pages_per_slot=8, page_bytes=100, kv_shards=1,
                          budget_bytes=None) == 33
    assert plan_num_pages(cfg, max_num_seqs=4, pages_per_slot=8, page_bytes=100, kv_shards=2,
                          budget_bytes=1000) == 20
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_num_pages(cfg, max_num_seqs=4, pages_per_slot=8, page_bytes=100, kv_shards=1, budget_bytes=500)
    assert device_kv_budget(0.5) is None  # CPU reports no memory limit: the full-length pool


def test_the_pool_gets_what_is_left_and_the_slots_what_the_pool_holds(llama_tiny):
    """gpu_memory_utilization: a fraction of the device's memory less what is in use, or 'auto' (0.9 of it
    less what is in use and the sampling step's logits buffers); then slots beyond the full-length
    sequences the pool holds (a prompt's full pages counted once for its samples) are dropped, down to
    a power of two, where before 64 slots decoded with pages for 8."""
    from jaxrl_llm.platform.target import planning_in_use
    from jaxrl_llm.sampler.engine.setup import LOGITS_BUFFERS, EngineOptions, engine_spec

    cfg = llama_tiny[0]
    memory, in_use = 8 * 2**20, 2 * 2**20
    kwargs = dict(num_requests=64, max_prompt_len=64, max_new_tokens=192, compute_dtype="float32",
                  samples_per_prompt=4)
    page_bytes = EngineSpec(max_num_seqs=1, page_size=16, num_pages=2, pages_per_slot=1).page_bytes(cfg, "float32")
    with compiling_for(CompileTarget("gpu", memory)), planning_in_use(in_use):
        assert device_kv_budget(0.5) == memory // 2 - in_use
        fixed = engine_spec(cfg, EngineOptions(engine="paged", gpu_memory_utilization=0.3), **kwargs)
        auto = engine_spec(cfg, EngineOptions(engine="paged"), **kwargs)
    assert fixed.num_pages == (int(0.3 * memory) - in_use) // page_bytes
    logits = LOGITS_BUFFERS * 64 * cfg.vocab_size * 4
    assert auto.num_pages == (int(0.9 * memory) - in_use - logits) // page_bytes
    for spec in (fixed, auto):
        # 64-token prompts (4 shared pages) + 192 new tokens in 256-token rows: 4 + 4 x 12 pages per group of 4
        held = 4 * (spec.num_pages - 1) // (4 + 4 * 12)
        assert held < 64 and spec.max_num_seqs == 1 << (held.bit_length() - 1), (held, spec)
    assert fixed.max_num_seqs < auto.max_num_seqs


def test_int8_kv_cache_stays_close(llama_tiny):
    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=NEW, do_sample=False, n=2))
    fp, _ = _engine(cfg, 3).run(params, PROMPTS, jax.random.key(0), knobs, settings)
    q8, _ = _engine(cfg, 3, kv="int8").run(params, PROMPTS, jax.random.key(0), knobs, settings)
    # int8 KV changes the numbers slightly; the first tokens (short contexts) agree
    np.testing.assert_array_equal(q8.tokens[:, :2], fp.tokens[:, :2])
    agree = fp.tokens == q8.tokens
    assert agree.mean() > 0.7
    first = np.argmin(agree, axis=1)
    first[agree.all(axis=1)] = NEW
    for row, upto in enumerate(first):  # up to the first differing token, logprobs are close
        np.testing.assert_allclose(q8.log_probs[row, :upto], fp.log_probs[row, :upto], atol=0.15)


class _LateSource:
    """A `RequestSource` whose prompt i+1 arrives only after a request finished (the way multi-turn
    continuations arrive), each request with its own budget (1 to NEW tokens)."""

    def __init__(self, prompts, n):
        self.groups = [[EngineRequest(p, (i, j), i, 1 + (3 * i + 5 * j) % NEW) for j in range(n)]
                       for i, p in enumerate(prompts)]
        self.results, self.polls = {}, 0

    def poll(self):
        self.polls += 1
        return self.groups.pop(0) if self.groups and (self.polls == 1 or self.results) else []

    def finished(self, request, token_ids, log_probs, finish):
        self.results[request.key] = (request, token_ids, log_probs, finish)

    def more_coming(self):
        return bool(self.groups)

    def wait(self):
        pass


def test_serve_late_requests_with_own_budgets_match_run(llama_tiny):
    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SAMPLED)
    rng = jax.random.key(7)
    base, _ = _engine(cfg, 3).run(params, PROMPTS, rng, knobs, settings)
    source = _LateSource(PROMPTS, 3)
    stats = _engine(cfg, 2, num_pages=12).serve(params, source, rng, knobs, settings)
    assert len(source.results) == len(PROMPTS) * 3 and stats.prefill_calls == len(PROMPTS)
    cut = 0
    for (i, j), (req, tokens, log_probs, finish) in source.results.items():
        row, full = i * 3 + j, int(base.lengths[i * 3 + j])
        want = min(full, req.max_new_tokens)  # the same draws, stopped at the request's own budget
        assert len(tokens) == want and len(log_probs) == want
        np.testing.assert_array_equal(tokens, base.tokens[row, :want])
        np.testing.assert_allclose(log_probs, base.log_probs[row, :want], atol=1e-5, rtol=1e-5)
        assert finish == (FINISH_LENGTH if full > req.max_new_tokens else base.finish_reason[row])
        cut += full > req.max_new_tokens
    assert cut > 0
    with pytest.raises(ValueError, match=r"max_new_tokens=11 must be in \[1, 10\]"):
        _engine(cfg, 2).serve(params, _OneRequest(EngineRequest([1, 2], (0, 0), 0, NEW + 1)), rng, knobs, settings)


def test_run_with_per_prompt_budgets_stops_each_at_its_own(llama_tiny):
    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SAMPLED)
    rng = jax.random.key(7)
    base, _ = _engine(cfg, 3).run(params, PROMPTS, rng, knobs, settings)
    budgets = [2, NEW, 1, 4]  # one per prompt (PROMPTS has four)
    out, _ = _engine(cfg, 3).run(params, PROMPTS, rng, knobs, settings, max_new_tokens=budgets)
    for row in range(len(PROMPTS) * 3):  # the same draws, each prompt's samples cut at its budget
        full, budget = int(base.lengths[row]), budgets[row // 3]
        want = min(full, budget)
        assert int(out.lengths[row]) == want
        np.testing.assert_array_equal(out.tokens[row, :want], base.tokens[row, :want])
        assert (out.tokens[row, want:] == PAD_ID).all()
        assert out.finish_reason[row] == (FINISH_LENGTH if full > budget else base.finish_reason[row])
    assert (out.lengths < base.lengths).any()  # some samples were cut
    assert out.tokens.shape == base.tokens.shape  # the width stays settings.max_new_tokens
    with pytest.raises(ValueError, match="2 budgets for 4 prompts"):
        _engine(cfg, 3).run(params, PROMPTS, rng, knobs, settings, max_new_tokens=[1, 2])


class _OneRequest(_LateSource):
    def __init__(self, request):
        self.groups, self.results, self.polls = [[request]], {}, 0


def test_slot_set_shrinks_while_the_queue_drains(llama_tiny, monkeypatch):
    """Same samples with and without resizing; the drain computes fewer slot-steps."""
    from jaxrl_llm.sampler.engine import scheduler

    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SAMPLED)
    rng = jax.random.key(3)
    shrunk, s_stats = _engine(cfg, 8).run(params, PROMPTS, rng, knobs, settings)
    monkeypatch.setattr(scheduler, "DRAIN_FRACTIONS", ())
    fixed, f_stats = _engine(cfg, 8).run(params, PROMPTS, rng, knobs, settings)
    np.testing.assert_array_equal(shrunk.tokens, fixed.tokens)
    np.testing.assert_allclose(shrunk.log_probs, fixed.log_probs, atol=1e-5, rtol=1e-5)
    assert f_stats.resizes == 0 and s_stats.resizes > 0
    assert s_stats.decode_steps == f_stats.decode_steps and s_stats.useful_token_steps == f_stats.useful_token_steps
    assert s_stats.slot_steps < f_stats.slot_steps and s_stats.utilisation > f_stats.utilisation


def test_bf16_pool_is_stored_as_bits_on_cpu_and_reads_the_same(llama_tiny):
    cfg = llama_tiny[0]
    """sampler/kv_bits.py: on CPU a bf16 pool is uint16 bit patterns (XLA:CPU converts a whole bf16
    operand to fp32 around each gather / scatter); the values written and read are exactly the bf16
    ones, so attention over a bits pool equals attention over the bf16 pool bit for bit."""
    from jaxrl_llm.sampler.engine.forward import write_tokens
    from jaxrl_llm.sampler.kv_bits import BITS, from_storage, storage_dtype, to_storage

    assert jax.default_backend() == "cpu" and storage_dtype(jnp.bfloat16) == BITS
    assert storage_dtype(jnp.float32) == jnp.float32
    state = decode_state.init_state(cfg, EngineSpec(max_num_seqs=2, page_size=4, num_pages=8, pages_per_slot=2),
                                4, "bfloat16")
    assert state.pool["k"].dtype == BITS
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, state.pool["k"].shape[1], state.pool["k"].shape[-1])), jnp.float32)
    pool = write_tokens(state.pool, jnp.int32(1), x, 2 * x, jnp.array([1, 1, 3]), jnp.array([0, 2, 1]))
    np.testing.assert_array_equal(np.asarray(from_storage(pool["k"][1, :, 1, 2]), np.float32),
                                  np.asarray(x[1].astype(jnp.bfloat16), np.float32))
    slots, nh, nkv, hd, ps, pps = 3, 4, 2, 16, 8, 6
    k = jnp.asarray(rng.normal(size=(2, nkv, slots * pps + 1, ps, hd)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(2, nkv, slots * pps + 1, ps, hd)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(slots, nh, hd)), jnp.bfloat16)
    table = jnp.asarray(1 + rng.permutation(slots * pps).reshape(slots, pps), jnp.int32)
    lengths = jnp.array([5, 40, 0], jnp.int32)
    want = paged_decode_attention_xla(q, k, v, lengths, table, layer=jnp.int32(1))
    got = paged_decode_attention_xla(q, to_storage(k, BITS), to_storage(v, BITS), lengths, table, layer=jnp.int32(1))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_tpu_pool_stores_lane_padded_head_dims_and_gives_the_same_numbers(llama_tiny):
    """sampler/kv_bits.py: a pool built for a TPU stores each K/V row padded to 128 lanes (zeros), so its
    default device layout is the attention kernel's and no program copies it; written and read through
    the engine (the XLA path, as on CPU), the run's tokens and log-probs are the unpadded pool's exactly."""
    from jaxrl_llm.sampler.kv_bits import storage_head_dim

    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=NEW, temperature=0.8, n=2))
    spec = EngineSpec(max_num_seqs=3, page_size=4, num_pages=64, pages_per_slot=8, attn_impl="xla")
    want, _ = PagedEngine(cfg, spec, steps_per_call=3).run(params, PROMPTS, jax.random.key(3), knobs, settings)
    with compiling_for(CompileTarget("tpu", None)):
        assert storage_head_dim(cfg.head_dim) == 128 and storage_head_dim(192) == 256
        engine = PagedEngine(cfg, spec, steps_per_call=3)
        pool = engine._fresh_state(NEW).pool
        assert pool["k"].shape[-1] == 128 and cfg.head_dim < 128
        got, _ = engine.run(params, PROMPTS, jax.random.key(3), knobs, settings)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.log_probs, want.log_probs)


def test_decode_reads_compute_dtype_weights_and_frees_its_pool(llama_tiny, monkeypatch):
    # fp32 master weights, bf16 compute: every generate call gets the bf16 copy made once per run
    # (not the fp32 weights, cast at every step), and no KV pool outlives the run (the update that
    # follows has the memory; the memory plan counts a pool only beside a pipelined rollout)
    from jaxrl_llm.models.dtypes import matmul_weights_in
    from jaxrl_llm.sampler.engine import programs

    cfg, params = llama_tiny
    settings, knobs = SamplingParams(max_new_tokens=NEW, do_sample=False, n=2).compile_args(
        cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size, compute_dtype="bfloat16")
    seen, real_generate = [], programs.generate

    def spy(params, *args, **kwargs):  # the matmul weights' dtypes (norm scales stay fp32: models/dtypes.py)
        seen.append({x.dtype for path, x in jax.tree_util.tree_leaves_with_path(params)
                     if x.ndim >= 2 and "norm" not in jax.tree_util.keystr(path)})
        return real_generate(params, *args, **kwargs)

    monkeypatch.setattr(programs, "generate", spy)
    engine = PagedEngine(cfg, EngineSpec(max_num_seqs=3, page_size=4, num_pages=61, pages_per_slot=8),
                         compute_dtype="bfloat16", steps_per_call=3)
    pool_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 61, 4, cfg.head_dim)
    live_pools = lambda: sum(a.shape == pool_shape for a in jax.live_arrays())  # noqa: E731
    before = live_pools()
    out, _ = engine.run(params, PROMPTS, jax.random.key(0), knobs, settings)
    assert seen and all(dtypes == {jnp.dtype(jnp.bfloat16)} for dtypes in seen)
    assert live_pools() == before
    # the same tokens as from weights stored in bf16 (the copy holds the values decode read anyway)
    bf16 = matmul_weights_in(params, jnp.bfloat16)
    again, _ = engine.run(bf16, PROMPTS, jax.random.key(0), knobs, settings)
    np.testing.assert_array_equal(out.tokens, again.tokens)
    np.testing.assert_array_equal(out.log_probs, again.log_probs)


def test_batched_prefill_on_a_mesh_equals_one_device(llama_tiny, mesh_name="data2_tensor4"):
    """rollout.batch_prefill under a mesh (params over tensor, the batched prompts' rows replicated):
    the same greedy tokens as one prefill call per prompt on one device."""
    from jaxrl_llm import sharding
    from jaxrl_llm.models import param_logical_axes
    from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged

    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=NEW, do_sample=False, n=2))
    one, _ = sample_paged(jax.device_put(params, jax.devices()[0]), cfg, PROMPTS8, jax.random.key(0), knobs,
                          settings=settings, opts=EngineOptions(engine="paged", max_num_seqs=8))
    mesh = sharding.make_mesh(MESHES[mesh_name])
    placed = sharding.shard_params(params, param_logical_axes(cfg), mesh)
    out, stats = sample_paged(placed, cfg, PROMPTS8, jax.random.key(0), knobs, settings=settings,
                              opts=EngineOptions(engine="paged", max_num_seqs=8, batch_prefill=True), mesh=mesh)
    np.testing.assert_array_equal(out.tokens, one.tokens)
    np.testing.assert_allclose(out.log_probs, one.log_probs, atol=1e-5)
    assert stats.prefill_calls < len(PROMPTS8)


@pytest.mark.parametrize("sampled,speculative", [(False, False), (True, False), (True, True)])
def test_cascade_attention_equals_plain_paged_attention(llama_tiny, sampled, speculative):
    """The n samples of a prompt reading its shared pages once (cascade=True) generate what reading
    them once per sample does: the same tokens, log-probs to 1e-5, through the drain's smaller slot
    sets and the page-wait queue, and through the n-gram verification forward. 'auto' (the default)
    takes no cascade rows on the XLA path (CPU) and samples the same tokens."""
    cfg, params = llama_tiny
    sp = SAMPLED if sampled else SamplingParams(max_new_tokens=NEW, do_sample=False, n=2)
    settings, knobs = _args(cfg, sp)
    prompts = PROMPTS + [[5] * 13, [7, 1] * 6]  # several full 4-token pages to share
    drafts = SpeculativeSpec(num_tokens=3) if speculative else None
    runs = {}
    for cascade in (False, True, "auto"):
        spec = EngineSpec(max_num_seqs=4, page_size=4, num_pages=24, pages_per_slot=8, cascade=cascade,
                          speculative=drafts)
        runs[cascade] = PagedEngine(cfg, spec, steps_per_call=3).run(params, prompts, jax.random.key(3), knobs,
                                                                      settings)
    (plain, plain_stats), (got, stats), (auto, auto_stats) = runs[False], runs[True], runs["auto"]
    np.testing.assert_array_equal(got.tokens, plain.tokens)
    np.testing.assert_allclose(got.log_probs, plain.log_probs, atol=1e-5, rtol=1e-5)
    assert stats.peak_cascade_groups >= 1 and plain_stats.peak_cascade_groups == 0
    assert stats.metrics()["rollout/engine/cascade_groups"] == stats.peak_cascade_groups
    np.testing.assert_array_equal(auto.tokens, plain.tokens)
    assert auto_stats.peak_cascade_groups == 0


def test_auto_cascade_follows_the_decode_attention():
    """cascade='auto': rows only where the dispatcher takes the TPU's Mosaic kernel; none on a GPU (the
    H200 measured it slower), on the XLA path (CPU, impl 'xla', int8 pages) or with the kernel forced
    on CPU (interpreted); True / False as set."""
    def shape(platform: str, **kw):
        spec = EngineSpec(max_num_seqs=8, page_size=4, num_pages=40, pages_per_slot=8, **kw)
        with compiling_for(CompileTarget(platform, None)):
            return decode_state.cascade_shape(spec, 8, 4)

    assert shape("cpu") is None and shape("cpu", attn_impl="xla") is None
    assert shape("tpu") == (4, 4) and shape("tpu", attn_impl="pallas") == (4, 4)
    assert shape("gpu") is None and shape("gpu", attn_impl="pallas") is None
    assert shape("cpu", attn_impl="pallas") is None
    assert shape("tpu", kv_cache_dtype="int8") is None and shape("tpu", attn_impl="xla") is None
    assert shape("cpu", cascade=True) == (4, 4) and shape("tpu", cascade=False) is None
    assert decode_state.cascade_shape(EngineSpec(max_num_seqs=8, page_size=4, num_pages=40, pages_per_slot=8,
                                             cascade=True), 8, 1) is None  # n = 1: nothing shared
    with pytest.raises(ValueError, match="cascade_attention"):
        EngineSpec(max_num_seqs=8, page_size=4, num_pages=40, pages_per_slot=8, cascade="always")


POOL_PROGRAMS = ("insert", "insert_at", "generate")  # the engine's programs that take the pool


@pytest.mark.parametrize("slots,kv,speculative", [(1, "auto", False), (2, "auto", False), (1, "int8", False),
                                                  (1, "auto", True), (2, "auto", True)])
def test_no_engine_program_copies_the_pool_at_any_slot_count(llama_tiny, monkeypatch, slots, kv, speculative):
    """No compiled engine program (prefill's insert, decode, speculative verification, slot clearing)
    copies the KV pool. XLA turned a one-slot step's page write (a one-index scatter) into a
    dynamic-update-slice fused into each reader of the pool, with a copy of the whole pool per
    reader: ~8 per layer and step, a 1-slot step 20x slower than a 3-slot one on SmolLM2. A 1-slot
    engine still gives the static sampler's greedy tokens."""
    import re

    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=NEW, do_sample=False, n=1))
    calls: dict[str, list] = {name: [] for name in POOL_PROGRAMS}

    def spy(name, real):
        def run(*args, **kwargs):
            calls[name].append((args, kwargs))
            return real(*args, **kwargs)
        return run

    for name in POOL_PROGRAMS:
        monkeypatch.setattr(programs, name, spy(name, getattr(programs, name)))
    # pages of 16 tokens, 16 per slot: two attention blocks per slot (with one the copies do not appear)
    engine = PagedEngine(cfg, EngineSpec(max_num_seqs=slots, page_size=16, num_pages=40, pages_per_slot=16,
                                         kv_cache_dtype=kv, speculative=SpeculativeSpec(num_tokens=3)
                                         if speculative else None), steps_per_call=3)
    out, _ = engine.run(params, PROMPTS, jax.random.key(0), knobs, settings)
    monkeypatch.undo()
    if kv == "auto":
        ids, mask = left_pad(PROMPTS, PAD_ID)
        static = sample(params, cfg, ids, mask, jax.random.key(0), knobs, settings=settings)
        np.testing.assert_array_equal(out.tokens, np.asarray(static.tokens))
    checked = []
    for name, recorded in calls.items():
        seen = set()
        for args, kwargs in recorded:
            state = next(a for a in (*args, *kwargs.values()) if isinstance(a, decode_state.DecodeState))
            if state.active.shape in seen:  # one compilation per slot count
                continue
            seen.add(state.active.shape)
            hlo = getattr(programs, name).lower(*args, **kwargs).compile().as_text()
            for key, x in state.pool.items():
                dims = ",".join(map(str, x.shape))
                copies = re.findall(rf"= \w+\[{dims}\]\{{[0-9,]*\}} copy\(", hlo)
                assert not copies, (f"{len(copies)} copies of pool[{key!r}] {x.shape} in {name} at "
                                    f"{state.active.shape[0]} of {slots} slots")
            checked.append(name)
    assert {"generate", "insert"} <= set(checked) or {"generate", "insert_at"} <= set(checked), checked


def test_a_runs_prompt_bound_sizes_one_engine_for_every_batch(llama_tiny):
    """sample_paged(max_prompt_len=data.max_prompt_length): batches whose longest prompts need other
    page-table sizes (16 + 8 tokens fit 256 per slot, 256 + 8 need 512) share one engine and its
    programs, with the tokens of an engine sized by the batch."""
    from jaxrl_llm.sampler.engine.setup import EngineOptions, release_engines, sample_paged

    cfg, params = llama_tiny
    settings, knobs = _args(cfg, SamplingParams(max_new_tokens=8, do_sample=False, n=1))
    opts = EngineOptions(engine="paged", max_num_seqs=2)
    short, long_ = [[3, 4, 5], [7] * 10], [[3, 4, 5], [7] * 250]
    release_engines()
    run = lambda prompts, bound=None: sample_paged(params, cfg, prompts, jax.random.key(0), knobs,  # noqa: E731
                                                   settings=settings, opts=opts, max_prompt_len=bound)[0]
    bounded = run(short, 256)
    compiled = programs.generate._cache_size()
    run(long_, 256)
    assert programs.generate._cache_size() == compiled  # the long batch reused the short one's engine
    np.testing.assert_array_equal(bounded.tokens, run(short).tokens)
    assert programs.generate._cache_size() > compiled  # sized by its own prompts: a 256-token table
    release_engines()
