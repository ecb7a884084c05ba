"""The memory plan's roofline (planning/roofline.py): collectives' wire bytes read from compiled HLO,
the bound that holds, every layer and loop trip in a program's cost, and the decode step's count
free of what XLA's generic cost model charges a KV pool write with (the whole pool)."""
from __future__ import annotations

import pytest
from test_memory_plan import _spec

from jaxrl_llm.planning.memory import Planner
from jaxrl_llm.planning.roofline import Cost, link_bytes_of, roofline
from jaxrl_llm.platform.chips import chip_for

HLO = "\n".join([
    "%all-gather.1 = bf16[1024,896]{1,0} all-gather(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}",
    "%all-reduce.2 = (f32[256,4864]{1,0:T(8,128)}, f32[256,128]{1,0}) all-reduce(%a, %b), channel_id=2, "
    "replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, to_apply=%add",
    "%reduce-scatter.3 = f32[128]{0} reduce-scatter(%g), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, "
    "dimensions={0}",
    "%all-gather-start.4 = (f32[16]{0}, f32[64]{0}) all-gather-start(%x), channel_id=4, replica_groups=[2,4]<=[8]",
    "%all-gather-done.4 = f32[64]{0} all-gather-done(%all-gather-start.4)",
    "%collective-permute.5 = f32[32]{0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}",
    "%all-reduce.6 = f32[8]{0} all-reduce(%z), replica_groups={{0},{1}}, to_apply=%add",
])


def test_collective_wire_bytes_follow_the_ring_factors():
    gather = 3 / 4 * 1024 * 896 * 2  # a group of 4: 3/4 of the result comes over the wire
    reduce = 2 * 7 / 8 * (256 * 4864 + 256 * 128) * 4  # a tuple all-reduce over 8
    scatter = 3 * 128 * 4  # reduce-scatter: (n - 1) x the result
    started = 3 / 4 * 64 * 4  # the async pair counts once, at its start, by its result
    permute = 32 * 4
    assert link_bytes_of(HLO) == pytest.approx(gather + reduce + scatter + started + permute)  # groups of 1: free


def test_the_largest_bound_holds():
    chip = chip_for("TPU v5 lite")
    assert chip is not None
    r = roofline(Cost(flops=197e12, hbm_bytes=2 * 819e9, link_bytes=100e9), chip, chip.bf16_flops)
    assert (r.compute_s, r.hbm_s, r.link_s) == pytest.approx((1.0, 2.0, 0.25))
    assert r.bound == "hbm" and r.seconds == pytest.approx(2.0)
    cpu = roofline(Cost(flops=1e9, hbm_bytes=1e12), None, 1e10)  # no bandwidth figure: compute only
    assert cpu.bound == "compute" and cpu.hbm_s == 0.0


def test_costs_count_every_layer(tmp_path):
    """The sampler's and the update's costs grow by the same amount with each layer (the compiled count
    holds one layer; the plan adds the others from the program compiled with its layer twice a trip)."""
    costs = {}
    for layers in (2, 3, 4):
        spec, mesh, tok = _spec(tmp_path / str(layers), **{"actor_rollout_ref.model.tiny.num_hidden_layers": layers,
                                                           "actor_rollout_ref.rollout.engine": "paged"})
        planner = Planner(spec, mesh, tok)
        for p in planner.programs:
            if p.name in ("sample", "update_actor"):
                costs[layers, p.name] = planner.costed(p, spec.plan).cost
    for name in ("sample", "update_actor"):
        first, second = costs[3, name] - costs[2, name], costs[4, name] - costs[3, name]
        assert first.flops > 0 and second.flops == pytest.approx(first.flops, rel=0.05), (name, first, second)
        assert first.hbm_bytes > 0 and second.hbm_bytes > 0, name
        if name == "update_actor":
            # (the sampler's slots are split over the 8 devices, 2 each (sampler/engine/slot_shards.py), and XLA:CPU
            # counts a layer's pool writes as dynamic-update-slices whose bytes do not add up over the layers a
            # scan trip holds: 981 kB a decode step at one a trip, 695 kB at two, on 2 layers; its FLOPs do)
            assert second.hbm_bytes == pytest.approx(first.hbm_bytes, rel=0.25), name


def test_a_hybrid_models_programs_count_its_layer_scan_trips(tmp_path):
    """A hybrid model (Qwen3.5) scans a period of layers a trip (models/hybrid.py), so the plan's programs add
    their other trips, not their other layers, to the compiled count of one (it added layers until 2026-12-07:
    each a period's work, Qwen3.5's layers counted 4x at its period of 4)."""
    import dataclasses

    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.models.hybrid import layer_scan_trips

    qwen35 = dataclasses.replace(ModelConfig.tiny("qwen3_5_text"), num_hidden_layers=24,
                                 linear_layers=tuple(i for i in range(24) if i % 4 != 3))
    assert layer_scan_trips(qwen35) == 6 and layer_scan_trips(ModelConfig.tiny("llama")) == 2
    spec, mesh, tok = _spec(tmp_path, **{"actor_rollout_ref.model.path": "tiny:qwen3_5_text",  # period 2
                                         "actor_rollout_ref.model.tiny.num_hidden_layers": 6,
                                         "actor_rollout_ref.rollout.engine": "paged"})
    programs = {p.name: p.layers for p in Planner(spec, mesh, tok).programs}
    assert programs["sample"] == programs["update_actor"] == 3, programs


def test_costs_can_name_the_programs_to_cost(tmp_path):
    """The device kit costs the one program it reports (`costs=("update_actor",)`): the others keep their
    memory rows without a cost; a name the step does not run is refused by name."""
    from jaxrl_llm.planning.memory import plan_memory

    spec, mesh, tok = _spec(tmp_path, **{"actor_rollout_ref.model.tiny.num_hidden_layers": 1})
    plan = plan_memory(spec, mesh, tok, check=False, costs=("update_actor",))
    assert [p.name for p in plan.programs if p.cost is not None] == ["update_actor"]
    assert plan.roofline(plan.program("update_actor")).seconds > 0 and plan.roofline(plan.program("sample")) is None
    with pytest.raises(ValueError, match="'updat_actor'"):
        plan_memory(spec, mesh, tok, check=False, costs=("updat_actor",))


def test_the_decode_step_is_not_charged_the_whole_pool_per_write(tmp_path, monkeypatch):
    """XLA:CPU charges each layer's K and V writes into the pool (and its gathers) with the whole pool; the
    plan takes out what the step's count grows with the pool (one more compile on half the pages):
    2 x the pool per layer and decode step, as measured on CPU."""
    import dataclasses
    import os
    import subprocess
    import sys

    from compile_flags import CLASSIC_EMITTERS

    from jaxrl_llm.planning import memory as memory_plan

    if CLASSIC_EMITTERS in os.environ.get("XLA_FLAGS", ""):
        # what XLA:CPU charges a pool write depends on its emitters: the suite's classic ones charge the
        # write alone; the default fusion emitters (a user's --plan) charge the pool, which is the case here
        env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"].replace(CLASSIC_EMITTERS, ""),
               "JAXRL_LLM_TEST_XLA_FLAGS": "--xla_cpu_parallel_codegen_split_count=1"}
        name = "test_the_decode_step_is_not_charged_the_whole_pool_per_write"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"{__file__}::{name}"], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
        return
    spec, mesh, tok = _spec(tmp_path, **{"actor_rollout_ref.model.tiny.num_hidden_layers": 2,
                                         "actor_rollout_ref.rollout.engine": "paged"})
    planner = Planner(spec, mesh, tok)
    sample = next(p for p in planner.programs if p.name == "sample")
    corrected = planner.costed(sample, spec.plan)
    monkeypatch.setattr(memory_plan, "_CACHE", {})
    charged = planner.costed(dataclasses.replace(sample, pool_pages=0), spec.plan)
    steps = spec.plan.response_length  # one wave: every sequence has its slot
    pool = corrected.kv_bytes
    removed = (charged.cost.hbm_bytes - corrected.cost.hbm_bytes) / steps
    assert removed == pytest.approx(2 * 2 * pool, rel=0.1), (removed, pool)


def test_the_invariant_attention_kernels_work_is_added_where_the_mode_is_on():
    """`model.batch_invariant`'s attention is a custom call XLA's count does not see: the plan adds its reads (K and
    V per tile of query rows over the keys it visits, the token mask) and products, growing with t^2; nothing
    without the mode."""
    import dataclasses

    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.planning.kernel_costs import invariant_attention_cost
    from jaxrl_llm.platform.target import CompileTarget, compiling_for

    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=1000, hidden_size=896,
                      intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      head_dim=64)
    assert invariant_attention_cost(cfg, 4.0, 1024, 1, "bfloat16") == Cost()
    on = dataclasses.replace(cfg, batch_invariant=True)
    with compiling_for(CompileTarget("tpu", None)):  # 128-row tiles, 128-key blocks
        cost = invariant_attention_cost(on, 4.0, 1024, 2, "bfloat16")
        longer = invariant_attention_cost(on, 4.0, 2048, 2, "bfloat16")
    visited = 1024 / 2 + 64
    tiles = 7 * 8  # 7 query heads a kv head, 1024 tokens in tiles of 128
    want_bytes = 2 * 4.0 * 24 * (2 * tiles * visited * 2 * 64 * 2 + 7 * 1024 * visited)
    assert cost.hbm_bytes == pytest.approx(want_bytes)
    assert cost.flops == pytest.approx(2 * 4.0 * 6 * 24 * 14 * 64 * 1024 * visited)
    assert 3.5 < longer.hbm_bytes / cost.hbm_bytes < 4.5 and 3.5 < longer.flops / cost.flops < 4.5
    # MLA attends in its absorbed form in the mode: one kv head, kv_lora_rank + head_dim wide, for every query head
    mla = dataclasses.replace(ModelConfig.tiny("deepseek_v3"), batch_invariant=True)
    width, heads, layers = mla.kv_lora_rank + mla.head_dim, mla.num_attention_heads, mla.num_hidden_layers
    with compiling_for(CompileTarget("tpu", None)):
        cost = invariant_attention_cost(mla, 4.0, 1024, 1, "bfloat16")
    tiles = heads * 8
    assert cost.flops == pytest.approx(4.0 * 6 * layers * heads * width * 1024 * visited)
    assert cost.hbm_bytes == pytest.approx(4.0 * layers * (tiles * visited * 2 * width * 2 + heads * 1024 * visited))


def test_the_rollouts_cascade_credit_is_the_shared_prompt_keys():
    """The rollout plan's prompt keys read once per group (cascade rows): none without rows, the whole prompt on
    the default path, and with `model.batch_invariant` the whole key blocks of the prompt's full pages where the
    mode's paged kernel runs (TPU: 128 keys a block, GPU: 64 at head width 64), none on CPU's gathered form."""
    import dataclasses
    from types import SimpleNamespace

    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.planning.sample_program import _cascade_shared_tokens
    from jaxrl_llm.platform.target import CompileTarget, compiling_for

    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=1000, hidden_size=896,
                      intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      head_dim=64)
    engine = SimpleNamespace(page_size=16)

    def shared(cfg, platform: str, prompt: int = 1000, cascade: bool = True) -> int:
        with compiling_for(CompileTarget(platform, None)):
            return _cascade_shared_tokens(SimpleNamespace(actor=SimpleNamespace(cfg=cfg), prompt_width=prompt),
                                          engine, cascade)

    on = dataclasses.replace(cfg, batch_invariant=True)
    assert shared(cfg, "tpu", cascade=False) == 0 and shared(cfg, "tpu") == 1000
    assert shared(on, "tpu") == 896 and shared(on, "gpu") == 960  # 62 full pages = 992 keys
    assert shared(on, "cpu") == 0 and shared(on, "tpu", prompt=100) == 0


def test_the_rollouts_decode_attention_counts_mlas_absorbed_width():
    """The rollout's decode attention FLOPs at the width the sampler computes: MLA's absorbed q.k over the latent
    and the rope key and p.v over the latent (3.4x the expanded width at DeepSeek-V3's dims), every other model
    at `attention_width`; the prefill (the trainer's forward) at the expanded width."""
    import dataclasses
    from types import SimpleNamespace

    from jaxrl_llm.bookkeeping.metrics import per_token_forward_flops
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.planning.sample_program import _rollout_cost
    from jaxrl_llm.sampler.engine.decode_state import EngineSpec

    mla = ModelConfig(architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3", vocab_size=1000,
                      hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=128,
                      num_key_value_heads=128, head_dim=64, kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)
    assert mla.decode_attention_width == 128 * (512 + 64 + 512) / 2
    assert round(mla.decode_attention_width / mla.attention_width, 1) == 3.4  # expanded: 128 x (128 + 64 + 128) / 2
    gqa = dataclasses.replace(mla, model_type="llama", architecture="LlamaForCausalLM", kv_lora_rank=0,
                              qk_nope_head_dim=0, v_head_dim=0, num_key_value_heads=8)
    assert gqa.decode_attention_width == gqa.attention_width

    prompt, rows, n, r, params = 256, 8, 4, 64, 10**9
    engine = EngineSpec(max_num_seqs=32, page_size=16, num_pages=10_000, pages_per_slot=32)
    for cfg in (mla, gqa):
        ctx = SimpleNamespace(actor=SimpleNamespace(cfg=cfg, num_params=params), prompt_width=prompt,
                              mesh=SimpleNamespace(shape={}, size=1),
                              spec=SimpleNamespace(actor=SimpleNamespace(compute_dtype="bfloat16")))
        cost = _rollout_cost(ctx, engine, None, Cost(), rows=rows, n=n, r=r, shared_tokens=0, weight_bytes=0,
                             weight_split=1.0)
        keys_read = rows * r * (prompt + (r + 1) / 2)
        prefill = rows // n * prompt * per_token_forward_flops(params, 4, cfg.attention_width, (prompt + 1) / 2)
        assert cost.flops == pytest.approx(4.0 * 4 * cfg.decode_attention_width * keys_read + prefill)
        # decode weights split 4 ways (engine/decode_layout.py): a device runs a quarter of each prompt's prefill
        split = _rollout_cost(ctx, engine, None, Cost(), rows=rows, n=n, r=r, shared_tokens=0, weight_bytes=0,
                              weight_split=4.0)
        assert cost.flops - split.flops == pytest.approx(prefill * 3 / 4)


def test_the_rollouts_decode_attention_counts_every_pair_and_the_modes_padded_tiles():
    """Every (query, key) pair is computed once per sample, shared prompt keys (cascade) included: a group reads
    them once (bytes), its members each attend to them (FLOPs). With `model.batch_invariant` on a TPU the paged
    kernel computes whole 128-row tiles: a slot's g query heads per kv head (g = 7 here: 128 / 7 rows computed
    per real one), a group's n x g stacked on the shared keys (28: 128 / 28)."""
    import dataclasses
    from types import SimpleNamespace

    from jaxrl_llm.bookkeeping.metrics import per_token_forward_flops
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.planning.sample_program import _rollout_cost
    from jaxrl_llm.platform.target import CompileTarget, compiling_for
    from jaxrl_llm.sampler.engine.decode_state import EngineSpec

    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=1000, hidden_size=896,
                      intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      head_dim=64)
    prompt, rows, n, r, params, shared = 256, 8, 4, 64, 10**9, 256
    engine = EngineSpec(max_num_seqs=32, page_size=16, num_pages=10_000, pages_per_slot=32)

    def cost(cfg: ModelConfig, shared_tokens: int) -> Cost:
        ctx = SimpleNamespace(actor=SimpleNamespace(cfg=cfg, num_params=params), prompt_width=prompt,
                              mesh=SimpleNamespace(shape={}, size=1),
                              spec=SimpleNamespace(actor=SimpleNamespace(compute_dtype="bfloat16")))
        with compiling_for(CompileTarget("tpu", None)):
            return _rollout_cost(ctx, engine, None, Cost(), rows=rows, n=n, r=r, shared_tokens=shared_tokens,
                                 weight_bytes=0, weight_split=1.0)

    prefill = rows // n * prompt * per_token_forward_flops(params, 24, cfg.attention_width, (prompt + 1) / 2)
    pair_flops = 4.0 * 24 * cfg.attention_width  # per (query, key) pair, all layers
    own, shared_pairs = rows * r * (r + 1) / 2, rows * r * shared
    plain, cascade = cost(cfg, 0), cost(cfg, shared)
    assert plain.flops == pytest.approx(pair_flops * (own + shared_pairs) + prefill) == cascade.flops
    assert cascade.hbm_bytes < plain.hbm_bytes  # the shared keys read once per group
    on = cost(dataclasses.replace(cfg, batch_invariant=True), shared)
    assert on.flops == pytest.approx(pair_flops * (own * 128 / 7 + shared_pairs * 128 / 28) + prefill)
