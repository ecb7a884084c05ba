"""Exact rollouts (`actor_rollout_ref.model.batch_invariant`, models/invariant.py): in bf16 the log-prob of
every sampled token equals the trainer's recomputation bit for bit, through both engines, and in a GRPO
step (`rollout_corr/max_abs_log_ratio` 0); with the mode off they differ (the mismatch the mode removes)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.roles.forward import response_log_probs
from jaxrl_llm.sampler import SamplingParams, left_pad, sample
from jaxrl_llm.sampler.engine.setup import EngineOptions, sample_paged
from jaxrl_llm.sampler.speculative import SpeculativeSpec

NEW_TOKENS = 12
TEMPERATURE = 0.7  # a division both sides must do alike (models/invariant.py `vocab_scan`)


def _model(arch: str, **dims):
    """A tiny random model with peaked logits (weights x 10, norms left at 1), and 8 prompts of 3..20 ids."""
    cfg = ModelConfig.tiny(arch, **dims)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x * 10.0, init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, size=int(n))) for n in rng.integers(3, 20, size=8)]
    return cfg, params, prompts


_score = jax.jit(response_log_probs, static_argnums=(1, 4), static_argnames=("temperature", "compute_dtype"))


def _sample(cfg, params, prompts, engine: str, seed: int = 0, n: int = 1, opts: EngineOptions | None = None,
            draft_params: dict | None = None, stats: list | None = None, replay: bool = False):
    """The bf16 rollout of `prompts` (`n` samples each, NEW_TOKENS each) by `engine`; `stats` gets the paged
    engine's; `replay`: record the experts per token (a MoE policy)."""
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, ignore_eos=True, n=n)
    settings, knobs = sp.compile_args(cfg.eos_token_ids, 0, vocab_size=cfg.vocab_size, compute_dtype="bfloat16")
    settings = dataclasses.replace(settings, record_routing=replay)
    if engine == "paged":
        # every sequence runs NEW_TOKENS (ignore_eos): no drain, so none of its slot sets' programs is compiled
        opts = dataclasses.replace(opts or EngineOptions(engine="paged"), precompile_drain=False)
        out, engine_stats = sample_paged(params, cfg, prompts, jax.random.key(seed), knobs, settings=settings,
                                         opts=opts, draft_params=draft_params)
        if stats is not None:
            stats.append(engine_stats)
        return out
    ids, mask = left_pad(prompts, 0)
    return sample(params, cfg, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed), knobs, settings=settings)


def _rollout_vs_trainer(cfg, params, prompts, engine: str, seed: int = 0, n: int = 1,
                        opts: EngineOptions | None = None, draft_params: dict | None = None,
                        stats: list | None = None, replay: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(the sampler's, the trainer's) bf16 log-probs of the response tokens (flattened); `n` samples a prompt.
    `stats` gets the paged engine's; `replay`: the trainer runs the experts the sampler recorded (a MoE policy)."""
    out = _sample(cfg, params, prompts, engine, seed, n, opts, draft_params, stats, replay)
    ids = jnp.concatenate([jnp.asarray(out.prompt_ids), jnp.asarray(out.tokens)], axis=1)
    mask = jnp.concatenate([jnp.asarray(out.prompt_mask), jnp.asarray(out.response_mask)], axis=1)
    train = _score(params, cfg, ids, mask, NEW_TOKENS, temperature=TEMPERATURE, compute_dtype="bfloat16",
                   replay=jnp.asarray(out.routing) if replay else None)
    real = np.asarray(out.response_mask) > 0
    return np.asarray(out.log_probs)[real], np.asarray(train)[real]


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_bf16_rollout_log_probs_equal_the_trainers_bit_for_bit(engine):
    cfg, params, prompts = _model("llama")
    rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params, prompts, engine)
    assert rollout.size == 8 * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)
    # the mode off: XLA's kernels sum the decode step, the prefill and the training forward in other orders
    rollout, trainer = _rollout_vs_trainer(cfg, params, prompts, engine)
    assert np.abs(rollout - trainer).max() > 0 and np.mean(rollout == trainer) < 0.99


@pytest.mark.parametrize("variant", ["chunked_prefill", "cascade_and_batch_prefill", "ngram_speculative",
                                     "draft_speculative"])
def test_the_paged_engines_prefill_and_decode_variants_stay_exact(variant):
    """Prompts of 3..19 ids prefilled in chunks of 4 over their growing cache; or a prompt's 2 samples sharing its
    pages (cascade attention on) with a round's prompts prefilled in one call; or speculative decoding, whose
    verification forward scores a slot's last token and its drafts as rows of one decode step (n-gram drafts, or
    a draft model: the policy itself without the mode, so most drafts are kept and tokens come from every row
    of the verification): the same bits as the trainer."""
    cfg, params, prompts = _model("llama")
    exact = dataclasses.replace(cfg, batch_invariant=True)
    opts = {"chunked_prefill": EngineOptions(engine="paged", max_num_batched_tokens=4, enable_chunked_prefill=True),
            "cascade_and_batch_prefill": EngineOptions(engine="paged", cascade_attention=True, batch_prefill=True),
            "ngram_speculative": EngineOptions(engine="paged", cascade_attention=True,
                                               speculative=SpeculativeSpec("ngram", num_tokens=3)),
            "draft_speculative": EngineOptions(engine="paged", speculative=SpeculativeSpec(
                "draft", num_tokens=3, draft_cfg=cfg))}[variant]
    draft_params = params if variant == "draft_speculative" else None
    stats: list = []
    rollout, trainer = _rollout_vs_trainer(exact, params, prompts, "paged", n=2, opts=opts,
                                           draft_params=draft_params, stats=stats)
    assert rollout.size == 2 * 8 * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)
    if variant == "ngram_speculative":  # (random prompts give n-gram drafts the policy rejects)
        assert stats[0].spec_proposed > 0
    if variant == "draft_speculative":
        assert stats[0].spec_accepted > stats[0].spec_proposed / 2, stats[0]
        # the mode off: the verification rows' log-probs are XLA's, off by bf16 noise
        rollout, trainer = _rollout_vs_trainer(cfg, params, prompts, "paged", n=2, opts=opts,
                                               draft_params=draft_params)
        assert np.abs(rollout - trainer).max() > 0


def test_packed_rows_are_exact_when_each_sequence_starts_a_key_block():
    """The trainer's packed rows (model.use_remove_padding; batching/plan.py): in the mode each sequence starts at
    a multiple of the attention's key block (`StepRows.aligned`), so its keys fall in the blocks the sampler's
    cache cut. Packed back to back (the layout without the mode) a sequence of 30..260 tokens spans other
    blocks, whose partial sums round otherwise (seen: 9% of the tokens off, by up to 2e-2)."""
    from jaxrl_llm.batching import StepRows, plan_chunks
    from jaxrl_llm.models.invariant import KEY_BLOCK

    cfg, params, _ = _model("llama")
    exact = dataclasses.replace(cfg, batch_invariant=True)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(3, cfg.vocab_size, size=int(n))) for n in rng.integers(20, 250, size=8)]
    out = _sample(exact, params, prompts, "static")
    ids = jnp.concatenate([jnp.asarray(out.prompt_ids), jnp.asarray(out.tokens)], axis=1)
    mask = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.response_mask)], axis=1)
    real = np.asarray(out.response_mask) > 0
    rows = StepRows.of_mask(mask, NEW_TOKENS)
    for align, equal in ((KEY_BLOCK, True), (1, False)):
        layout = jax.tree.map(lambda x: x[0], plan_chunks(rows.aligned(align), 8, 1))  # the one chunk of 8 rows
        seg = np.asarray(layout.segment_ids)[0]  # [rows, width] of the chunk's one shard
        starts = np.nonzero(np.diff(seg, axis=1, prepend=0) > 0)[1]  # each sequence's first column in its row
        assert len(starts) == 8 and starts.max() > 0 and (np.all(starts % KEY_BLOCK == 0) == equal), starts
        train = _score(params, exact, ids, jnp.asarray(mask), NEW_TOKENS, temperature=TEMPERATURE,
                       compute_dtype="bfloat16", packing=layout)
        rollout, trainer = np.asarray(out.log_probs)[real], np.asarray(train)[real]
        if equal:
            np.testing.assert_array_equal(rollout, trainer)
        else:
            assert np.abs(rollout - trainer).max() > 0


def test_exact_after_the_weights_move_and_with_a_sliding_window():
    """The paged engine's weight copy keeps the stacked norm scales in fp32 (models/dtypes.py): once an update
    moves them off bf16 values the rollout still equals the trainer; a Mistral-style sliding window (shorter
    than the rows) attends over the same anchored key blocks on both sides."""
    cfg, params, prompts = _model("mistral", sliding_window=8)
    cfg = dataclasses.replace(cfg, batch_invariant=True)
    moved = jax.tree.map(lambda x: x * 1.01, params)  # norm scales 1.01: not a bf16 value
    for engine in ("paged", "static"):
        rollout, trainer = _rollout_vs_trainer(cfg, moved, prompts, engine, seed=1)
        np.testing.assert_array_equal(rollout, trainer)


MOE_REPLAY = {"actor_rollout_ref.model.path": "tiny:qwen3_moe", "actor_rollout_ref.actor.router_replay": "rollout"}


@pytest.mark.parametrize("tensor, policy, packed", [(1, {}, True), (2, MOE_REPLAY, False)],
                         ids=["fsdp_packed", "moe_tensor"])
def test_grpo_steps_log_zero_mismatch(tmp_path, smollm2_gguf, tensor, policy, packed):
    """A bf16 GRPO run of the tiny config with the mode on (paged engine) on 8 devices: fsdp 8 with packed rows
    (each sequence at a key block's start), and the tiny Qwen3-MoE with routing replay on fsdp 4 x tensor 2: at
    every step the trainer's log-probs of the rollout's tokens are the sampler's (max_abs_log_ratio 0, every
    token exact). On the tensor split each GEMM (attention's projections, split by columns and by rows as a dense
    MLP's are, and the routed experts') sums each output column of its rows on one device. (Each logging 0 too, in
    CI until 2026-12-06: the tiny Llama on fsdp 4 x tensor 2, the same splits as this case's attention; by hand on
    2026-12-06: the tiny Qwen3.5 with packed rows on fsdp 8, `actor_rollout_ref.model.path=tiny:qwen3_5_text`,
    70 s at -O0: CI keeps its rollout and context-split cases below.)"""
    from tiny_runs import read_metrics, tiny_config

    from jaxrl_llm.trainer import Trainer

    Trainer(tiny_config(tmp_path, **{
        "actor_rollout_ref.model.dtype": "bfloat16", "actor_rollout_ref.model.batch_invariant": True,
        "actor_rollout_ref.model.use_remove_padding": packed, "actor_rollout_ref.rollout.engine": "paged",
        "actor_rollout_ref.rollout.temperature": TEMPERATURE, "mesh.tensor": tensor, **policy})).fit()
    rows = [r for r in read_metrics(tmp_path) if "rollout_corr/max_abs_log_ratio" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["rollout_corr/max_abs_log_ratio"] == 0.0 and row["rollout_corr/exact_token_frac"] == 1.0, row


def test_a_cpu_run_is_told_to_compile_with_the_classic_emitters():
    """XLA:CPU's default fusion emitters round some programs otherwise (a context split: 5 of 96 log-probs), so a
    batch-invariant run on CPU without the suite's classic emitters gets a warning naming the flag."""
    from jaxrl_llm.models.invariant import CPU_EXACT_FLAG, cpu_codegen_caveat

    assert CPU_EXACT_FLAG in cpu_codegen_caveat("cpu", "--xla_force_host_platform_device_count=8")
    assert cpu_codegen_caveat("cpu", f"--xla_force_host_platform_device_count=8 {CPU_EXACT_FLAG}") is None
    assert cpu_codegen_caveat("gpu", "") is None


def test_int8_pages_are_refused_by_name():
    """int8 KV pages are dequantised in the sampler only: its keys are not the trainer's, whatever the order."""
    from tiny_runs import tiny_config

    from jaxrl_llm.config import validate_config

    overrides = {"actor_rollout_ref.model.batch_invariant": True, "actor_rollout_ref.rollout.kv_cache_dtype": "int8"}
    with pytest.raises(ConfigError, match="int8 pages"):
        validate_config(tiny_config("/tmp/unused", **overrides), dp_size=1)


@pytest.mark.parametrize("arch, longest, shapes", [
    ("llama", 260, ({"fsdp": 4, "context": 2}, {"context": 8})), ("qwen3_5_text", 90, ({"fsdp": 4, "context": 2},))],
    ids=["llama", "qwen35"])
def test_a_context_split_scores_as_one_device_does(arch, longest, shapes):
    """Context parallelism (`mesh.context`, models/context_parallel.py) in the mode: each device gathers the row's
    keys and values and runs its own query rows through the invariant kernel, so a query's sum never crosses
    devices; Qwen3.5's delta-net layers gather their rows' inputs and run the recurrence over the whole row (the
    default split folds the devices' states from affine maps, another sum). The trainer's bf16 log-probs are one
    device's bit for bit on fsdp 4 x context 2 and (Llama) on context 8, rows of 30 tokens up to `longest`.
    Without the mode the split changes them."""
    from jaxrl_llm import sharding
    from jaxrl_llm.models import param_logical_axes

    cfg, params, _ = _model(arch)
    rng = np.random.default_rng(2)
    rows = [list(rng.integers(3, cfg.vocab_size, size=int(n))) for n in rng.integers(30, longest, size=8)]
    ids, mask = left_pad(rows, 0)
    pad = (-ids.shape[1]) % 8  # the tokens split up to 8 ways
    ids, mask = jnp.asarray(np.pad(ids, ((0, 0), (pad, 0)))), jnp.asarray(np.pad(mask, ((0, 0), (pad, 0))))
    for exact in (True, False):
        model = dataclasses.replace(cfg, batch_invariant=exact)
        one_device = np.asarray(_score(params, model, ids, mask, NEW_TOKENS, temperature=TEMPERATURE,
                                       compute_dtype="bfloat16"))
        for shape in shapes:
            mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, **shape})
            placed, (split_ids, split_mask) = (sharding.shard_params(params, param_logical_axes(model), mesh),
                                               sharding.shard_batch((ids, mask), mesh))
            with sharding.mesh_context(mesh):
                split = np.asarray(_score(placed, model, split_ids, split_mask, NEW_TOKENS, temperature=TEMPERATURE,
                                          compute_dtype="bfloat16"))
            if exact:
                np.testing.assert_array_equal(split, one_device, err_msg=str(shape))
            else:
                assert np.abs(split - one_device).max() > 0, shape


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_a_mixture_of_experts_policy_with_routing_replay_is_exact(engine):
    """Tiny Qwen3-MoE: the router's softmax and renormalisation by fixed trees, every token (a decode step's
    few too) through the blocked experts' fixed tiles, a token's k expert outputs mixed by a fixed tree; the
    trainer replays the experts the sampler recorded. Off: the mismatch the mode removes."""
    cfg, params, prompts = _model("qwen3_moe")
    rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params, prompts, engine,
                                           replay=True)
    assert rollout.size == 8 * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)
    rollout, trainer = _rollout_vs_trainer(cfg, params, prompts, engine, replay=True)
    assert np.abs(rollout - trainer).max() > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_an_expert_split_mixes_a_tokens_experts_as_one_device_does(family):
    """Expert parallelism (models/expert_parallel.py) in the mode: a token's k expert outputs come home unmixed
    (each slot from the one device that holds its expert, the others adding exact zeros) and are weighted and
    mixed there by one device's expression, so the routed experts' fp32 output is one device's bit for bit on
    fsdp 2 x expert 4 and on expert 8 (top-4 of 8, and GPT-OSS's experts' output bias). Mixed on each device
    and then summed over `expert` (the default path's exchange) 35-55% of the outputs differ."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from moe_cases import with_random_biases

    from jaxrl_llm import sharding
    from jaxrl_llm.models import invariant, param_logical_axes
    from jaxrl_llm.models.expert_parallel import routed_experts
    from jaxrl_llm.models.moe import route

    cfg = dataclasses.replace(ModelConfig.tiny(family, num_experts=8, num_experts_per_tok=4), batch_invariant=True)
    layer = jax.tree.map(lambda x: x[0], with_random_biases(init_params(cfg, jax.random.key(0)))["layers"]["moe"])
    axes = jax.tree.map(lambda a: a[1:], param_logical_axes(cfg)["layers"]["moe"]["experts"],
                        is_leaf=lambda a: isinstance(a, tuple))
    tokens = jax.random.normal(jax.random.key(1), (64, cfg.hidden_size)).astype(jnp.bfloat16)

    @jax.jit
    def mixed(experts, tokens):
        with invariant.mode(True):
            routing = route(cfg, layer["router"]["kernel"], tokens, router_bias=layer["router"].get("bias"))
            return routed_experts(experts, tokens, routing, cfg, dtype=jnp.bfloat16)

    one_device = np.asarray(mixed(layer["experts"], tokens))
    for shape in ({"fsdp": 2, "expert": 4}, {"expert": 8}):
        mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, **shape})
        placed = jax.device_put(tokens, NamedSharding(mesh, P(sharding.batch_axes(mesh))))
        with sharding.mesh_context(mesh):
            split = np.asarray(mixed(sharding.shard_params(layer["experts"], axes, mesh), placed))
        np.testing.assert_array_equal(split, one_device, err_msg=str(shape))


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_gemma4_with_experts_and_shared_kv_layers_is_exact(engine):
    """Tiny Gemma 4 (models/gemma4.py): sliding and full layers of their own head widths and kv heads (k = v on the
    full ones), per-layer inputs, the last two layers reading earlier layers' K / V, 8 experts with routing
    replay: both attention types anchor their key blocks at the row's first token. Off (static engine): the
    mismatch."""
    cfg, params, prompts = _model("gemma4_text", num_hidden_layers=6, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32, norm_topk_prob=True)
    assert cfg.typed_layers and cfg.kv_shared_layers and cfg.is_moe
    rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params, prompts, engine,
                                           replay=True)
    np.testing.assert_array_equal(rollout, trainer)
    if engine == "static":
        rollout, trainer = _rollout_vs_trainer(cfg, params, prompts, engine, replay=True)
        assert np.abs(rollout - trainer).max() > 0


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_qwen35_is_exact_on_both_engines(engine):
    """Tiny Qwen3.5: its gated delta-net layers run the recurrence in training, prefill and decoding alike (the
    chunked form rounds otherwise), state-times-vector sums and L2 norms by fixed trees; its gated attention
    rounds the attention's output to bf16 before the gate on every path (the paged kernels return bf16, the
    dense attention fp32: the gate on the unrounded output put every paged decode token off by up to 0.1).
    Both engines' rollouts are the trainer's bit for bit, the paged one's with prompts prefilled 4 tokens at a
    time and 2 samples a prompt sharing its pages. Off (static engine): the chunked training form's mismatch."""
    cfg, params, prompts = _model("qwen3_5_text")
    assert cfg.hybrid and cfg.attention_output_gate
    opts = EngineOptions(engine="paged", max_num_batched_tokens=4, enable_chunked_prefill=True,
                         cascade_attention=True) if engine == "paged" else None
    n = 2 if engine == "paged" else 1
    rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params, prompts, engine,
                                           n=n, opts=opts)
    assert rollout.size == n * 8 * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)
    if engine == "static":
        rollout, trainer = _rollout_vs_trainer(cfg, params, prompts, engine)
        assert np.abs(rollout - trainer).max() > 0


@pytest.mark.parametrize("variant", ["triton", "mosaic"])
def test_the_device_attention_kernels_are_exact_end_to_end_in_the_interpreter(variant):
    """The GPU (Triton) / TPU (Mosaic) attention kernels of the mode, run by Pallas's interpreter on CPU
    (`invariant.kernels_interpreted`): the paged engine's decode reads its pages in place with the paged kernel
    (prefill in chunks of 4, two samples a prompt), the trainer's forward runs the contiguous kernel with its
    token mask; every sampled token's log-prob `==` the trainer's. The interpreter's arithmetic is XLA's; the
    tiles, padding, masks, pages and skipped blocks are the kernels' own (the device's order: the device kit)."""
    from jaxrl_llm.models import invariant

    cfg, params, prompts = _model("llama")
    opts = EngineOptions(engine="paged", max_num_batched_tokens=4, enable_chunked_prefill=True)
    count = 4 if variant == "triton" else 2  # Mosaic's interpreter runs a grid step at a time: 4x Triton's time
    with invariant.kernels_interpreted(variant):
        rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params,
                                               prompts[:count], "paged", n=2, opts=opts)
    assert rollout.size == 2 * count * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)


def test_mla_is_exact_with_the_gpu_kernel_in_head_pieces():
    """Tiny DeepSeek-V3 in the mode with the Triton kernels interpreted: MLA attends in its absorbed form on
    every path, a head width (latent + rope key) that is not a power of 2, read in pieces (`triton_pieces`) by the
    training forward's kernel and by the decode step's (the paged engine gathers its pages for it); every
    sampled log-prob `==` the trainer's."""
    from jaxrl_llm.models import invariant
    from jaxrl_llm.models.invariant_attention import triton_pieces

    cfg, params, prompts = _model("deepseek_v3")
    width = cfg.kv_lora_rank + cfg.head_dim  # the latent and the rope key
    assert len(triton_pieces(width)) > 1, width
    opts = EngineOptions(engine="paged", max_num_batched_tokens=4, enable_chunked_prefill=True)
    with invariant.kernels_interpreted("triton"):
        rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params, prompts[:2],
                                               "paged", opts=opts, replay=cfg.is_moe)
    assert rollout.size == 2 * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)


def test_the_cascade_is_exact_end_to_end_in_the_interpreter():
    """Cascade attention in the mode (sampler/paged_attention.py `invariant_cascade`), the Triton kernels
    interpreted: two samples a prompt, prompts of 70-90 ids (one or more whole 64-key blocks shared by the
    samples, the rest their own), chunked prefill; every sampled token's log-prob `==` the trainer's."""
    from jaxrl_llm.models import invariant

    cfg, params, _ = _model("llama")
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, cfg.vocab_size, size=int(n))) for n in (70, 90)]
    opts = EngineOptions(engine="paged", max_num_batched_tokens=16, enable_chunked_prefill=True,
                         cascade_attention=True)
    with invariant.kernels_interpreted("triton"):
        rollout, trainer = _rollout_vs_trainer(dataclasses.replace(cfg, batch_invariant=True), params, prompts,
                                               "paged", n=2, opts=opts)
    assert rollout.size == 2 * 2 * NEW_TOKENS
    np.testing.assert_array_equal(rollout, trainer)
