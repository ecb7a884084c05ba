"""The memory plan (planning/memory.py): every program of a step compiled on abstract inputs,
refusal before anything is loaded or written, 'auto' micro-batch sizes, and `launch/train.py --plan`.

Compile-heavy, so kept tiny: probes are cached per process across tests of equal programs
(the fingerprint leaves out the run dir), and most tests plan only the sampler and the actor update.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
from tiny_runs import ROOT, tiny_config

from jaxrl_llm.config import ConfigError, resolve, resolve_data, validate_config
from jaxrl_llm.hf import load_tokenizer
from jaxrl_llm.planning.context import bytes_per_device
from jaxrl_llm.planning.memory import Planner, plan_memory, planning_context
from jaxrl_llm.planning.report import GiB, MemoryPlanError
from jaxrl_llm.sharding import batch_axis_size, make_mesh

PEAK = 1e12  # a fixed FLOP/s figure: no matmul measurement in tests
ACTOR_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_device"


# planning loads no weights and runs no step: a one-layer model with a small vocabulary compiles faster
SMALL = {"actor_rollout_ref.model.tiny.num_hidden_layers": 1, "actor_rollout_ref.model.tiny.vocab_size": 1024}


def _spec(tmp_path: pathlib.Path, **overrides):
    cfg = tiny_config(tmp_path / "run", **{**SMALL, **overrides})
    mesh = make_mesh(cfg.mesh)
    checked = validate_config(cfg, dp_size=batch_axis_size(mesh))
    return resolve(checked, dp_size=batch_axis_size(mesh)), mesh, load_tokenizer(resolve_data(checked).tokenizer)


def program_totals(spec, mesh, tok, micro: int = 1) -> dict[str, int]:
    """Each program's total bytes per device with the actor's micro-batch at `micro`, traced inside
    `planning_context` as plan_memory traces them (outside it they compile to other byte counts, which
    the plan's per-process cache would then serve to a plan_memory of the same spec)."""
    with planning_context(mesh, None):
        planner = Planner(spec, mesh, tok)
        plan = spec.plan.with_micro("actor", micro)
        return {p.name: planner.analyse(p, plan).total_bytes for p in planner.programs}


# 16 prompts x n=2 = 32 sequences over the 8 test devices: 4 per device, so 'auto' chooses among 1, 2, 4
AUTO = {"data.train_batch_size": 16, "actor_rollout_ref.actor.ppo_mini_batch_size": 16, ACTOR_MICRO: "auto",
        "actor_rollout_ref.actor.remat_policy": "none"}  # activations kept: the update outgrows the sampler


def test_plan_lists_every_program_with_real_bytes(tmp_path):
    # gae (critic), a KL loss (reference) and bf16 compute with 2 PPO epochs (old log-probs
    # recomputed; with one optimizer step the update's forward would supply them): all six programs
    spec, mesh, tok = _spec(tmp_path, **{"algorithm.adv_estimator": "gae", "actor_rollout_ref.actor.use_kl_loss": True,
                                         "actor_rollout_ref.model.dtype": "bfloat16",
                                         "actor_rollout_ref.actor.ppo_epochs": 2,
                                         "critic.model.dtype": "bfloat16"})
    plan = plan_memory(spec, mesh, tok, peak_flops=PEAK)
    names = [p.name for p in plan.programs]
    assert names == ["sample", "ref_log_prob", "old_log_prob", "values", "update_critic", "update_actor"]
    table = plan.table()
    for p in plan.programs:
        assert p.argument_bytes > 0 and p.temp_bytes > 0 and p.flops > 0, p
        assert p.total_bytes == p.peak_bytes + p.resident_bytes
        assert p.name in table
    planner = Planner(spec, mesh, tok)
    actor_params = bytes_per_device(planner.ctx.states["actor_params"])
    update = plan.program("update_actor")
    # the update holds the actor's params and Adam's two moments (same shapes, fp32) among its arguments
    assert update.params_bytes == actor_params
    assert 2 * actor_params <= update.opt_state_bytes <= 2 * actor_params + 4096
    assert update.alias_bytes >= update.params_bytes  # params and optimizer state are donated
    # while the actor updates, the critic (params + Adam) and the reference stay resident
    critic_state = planner.state_bytes["critic_params"] + planner.state_bytes["critic_opt"]
    assert update.resident_bytes == critic_state + planner.state_bytes["ref_params"]
    # the reference is stored in the compute dtype: half the fp32 policy's bytes
    assert planner.state_bytes["ref_params"] * 2 == pytest.approx(actor_params, rel=0.01)
    assert plan.program("sample").kv_bytes > 0
    assert "update_actor" in table and "TFLOP" in table


def test_auto_picks_the_largest_micro_batch_that_fits(tmp_path):
    spec, mesh, tok = _spec(tmp_path, **AUTO)
    assert spec.plan.auto_passes[0] == "actor"
    by_micro = {d: program_totals(spec, mesh, tok, micro=d) for d in (1, 2, 4)}
    totals = {d: rows["update_actor"] for d, rows in by_micro.items()}
    sample = by_micro[1]["sample"]
    assert totals[1] < totals[2] < totals[4]  # activations grow with the micro-batch
    assert sample < totals[2]  # so the limit below is set by the update alone

    def picked(limit_bytes: int) -> tuple[int, int]:
        # no lever (tests/planning/test_memory_levers.py): the micro-batch alone decides
        s = dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, device_memory_gb=limit_bytes / GiB,
                                                                  memory_levers=()))
        plan = plan_memory(s, mesh, tok, peak_flops=PEAK)
        seq_len = spec.plan.max_tokens_per_sequence
        return plan.program("update_actor").micro, plan.batch_plan.update_split(plan.batch_plan.actor, 32, seq_len)[1]

    assert picked((totals[2] + totals[4]) // 2) == (2, 2)  # 4 rows per device: 2 micro-batches of 2
    assert picked(totals[4] + 1) == (4, 1)  # more memory: a larger micro-batch
    with pytest.raises(MemoryPlanError, match=r"actor_rollout_ref.actor.ppo_micro_batch_size_per_device=1 does not"):
        picked(totals[1] - 1)


def test_too_small_device_memory_refuses_before_loading_or_writing(tmp_path, monkeypatch):
    from jaxrl_llm.trainer import Trainer
    from jaxrl_llm.trainer import build as build_module

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(build_module, "load_model", no_load)
    cfg = tiny_config(tmp_path / "run", **{**SMALL, **AUTO, ACTOR_MICRO: 4, "trainer.memory_plan": True,
                                           "trainer.device_memory_gb": 1e-4})
    with pytest.raises(MemoryPlanError) as err:
        Trainer(cfg)
    message = str(err.value)
    assert "program 'sample'" in message and "per device" in message
    assert "data.train_batch_size=16" in message and "actor_rollout_ref.model.lora_rank" in message
    assert "mesh.fsdp" in message
    assert isinstance(err.value, ConfigError)  # launch/train.py prints it as one `config error:` line
    assert not (tmp_path / "run").exists()


def test_auto_is_accepted_only_where_documented(tmp_path):
    with pytest.raises(ConfigError, match="expected an int or 'auto'"):
        _spec(tmp_path, **{ACTOR_MICRO: "big"})
    spec, _, _ = _spec(tmp_path, **AUTO)
    # derived keys inherit 'auto'; --dry_run's summary prints it without resolving it
    assert set(spec.plan.auto_passes) == {"actor", "ref_log_prob", "old_log_prob"}
    assert "auto (largest that fits)" in spec.plan.summary()


def test_plan_cli_prints_the_table_and_exits_without_training(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    train, config = ROOT / "launch" / "train.py", ROOT / "configs" / "tiny.py"
    proc = subprocess.run([sys.executable, str(train), f"--config={config}", "--plan", "--",
                           f"trainer.default_local_dir={run_dir}", *(f"{k}={v}" for k, v in SMALL.items())],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "memory plan (per device" in proc.stdout
    for name in ("sample", "update_actor"):
        assert f"\n{name} " in proc.stdout
    assert not run_dir.exists()  # nothing written, no step run


@pytest.mark.slow
def test_smollm2_config_is_read_from_the_gguf_header_without_weights(smollm2_gguf):
    from jaxrl_llm.config.spec import ModelSpec
    from jaxrl_llm.hf import load_gguf
    from jaxrl_llm.roles.trained import model_config_of

    model = ModelSpec(path=str(smollm2_gguf), param_dtype="float32", tiny=(),
                      override_config=(("rope_theta", 20000.0),))
    cfg = model_config_of(model, tokenizer=None)
    loaded = load_gguf(smollm2_gguf)[0]
    assert cfg.num_hidden_layers == loaded.num_hidden_layers == 30 and cfg.hidden_size == 576
    assert cfg == dataclasses.replace(loaded, rope_theta=20000.0)  # override_config applied, as load_model does


def test_lora_plan_trains_adapters_and_reads_the_base_as_reference(tmp_path):
    spec, mesh, tok = _spec(tmp_path, **{"actor_rollout_ref.model.lora_rank": 4,
                                         "actor_rollout_ref.actor.use_kl_loss": True})
    plan = plan_memory(spec, mesh, tok, peak_flops=PEAK)
    assert [p.name for p in plan.programs] == ["sample", "ref_log_prob", "update_actor"]
    planner = Planner(spec, mesh, tok)
    base = planner.state_bytes["actor_base_params"]
    adapters = planner.state_bytes["actor_params"]
    assert "ref_params" not in planner.state_bytes and 0 < adapters < base / 4
    update = plan.program("update_actor")
    # arguments: the frozen base + the adapters; Adam's moments only for the adapters
    assert update.params_bytes == base + adapters
    assert 2 * adapters <= update.opt_state_bytes <= 2 * adapters + 4096
    assert plan.program("ref_log_prob").params_bytes == base


def test_planned_flops_count_every_layer(tmp_path):
    # XLA counts the layer scan's body once: the plan adds the other layers (one layer's count from
    # the program lowered with its layer twice per scan trip). Remat off: the update is the textbook 6N.
    import jax

    from jaxrl_llm.planning.memory import layer_flops

    flops, layer = {}, {}
    for n_layers in (2, 4):
        spec, mesh, tok = _spec(tmp_path / str(n_layers), **{"actor_rollout_ref.model.tiny.num_hidden_layers": n_layers,
                                                            "actor_rollout_ref.actor.remat_policy": "none"})
        planner = Planner(spec, mesh, tok)
        for p in planner.programs:
            if p.name in ("sample", "update_actor"):
                # less the decode tokens after the first, counted analytically (2 x params x rows)
                flops[n_layers, p.name] = planner.analyse(p, spec.plan).flops - p.extra_flops(spec.plan)
                layer[n_layers, p.name] = layer_flops(p, spec.plan, p.lower(spec.plan), mesh.size) * p.trips(spec.plan)
    for name in ("sample", "update_actor"):
        assert layer[2, name] > 0 and layer[4, name] == pytest.approx(layer[2, name], rel=0.01)
        # two more layers add two layers' count, nothing else
        assert flops[4, name] - flops[2, name] == pytest.approx(2 * layer[2, name], rel=0.03)
        assert flops[4, name] > 1.5 * flops[2, name]

    # the update against the analytic count (Kaplan et al.): 6 x params x tokens for the layers, plus
    # 12 x layers x seq_len x width per token for attention, plus 6 x head params x scored tokens
    cfg = planner.ctx.actor.cfg
    paths = jax.tree_util.tree_flatten_with_path(planner.ctx.actor.params)[0]
    layer_params = sum(x.size for path, x in paths if "layers" in jax.tree_util.keystr(path))
    seq, resp, rows = planner.ctx.seq_len, spec.plan.response_length, spec.plan.sequences
    tokens = spec.actor.ppo_epochs * rows * seq / mesh.size  # per device
    analytic = (6 * layer_params * tokens + 12 * cfg.num_hidden_layers * seq * cfg.num_attention_heads * cfg.head_dim
                * tokens + 6 * cfg.vocab_size * cfg.hidden_size * tokens * resp / seq)
    assert flops[4, "update_actor"] == pytest.approx(analytic, rel=0.2)


def test_planned_flops_count_the_routed_experts(tmp_path):
    # the blocked expert kernel is a loop over row blocks whose body XLA counts once: the plan adds the
    # routed experts analytically (tokens x k per sparse layer), so a MoE update counts about as much as
    # the dense model of its active shape (an MLP k x moe_intermediate_size wide), which XLA counts whole
    from jaxrl_llm.models.moe import active_params
    from jaxrl_llm.models.moe_experts import uncounted_expert_flops

    def update_flops(path: str, **tiny) -> tuple[float, float, Planner]:
        spec, mesh, tok = _spec(tmp_path / path, **{"actor_rollout_ref.model.path": path,
                                                    "actor_rollout_ref.actor.remat_policy": "none", **tiny})
        planner = Planner(spec, mesh, tok)
        update = next(p for p in planner.programs if p.name == "update_actor")
        return planner.analyse(update, spec.plan).flops, update.extra_flops(spec.plan), planner

    moe, experts, planner = update_flops("tiny:qwen3_moe")
    cfg = planner.ctx.actor.cfg
    width = cfg.num_experts_per_tok * cfg.moe_intermediate_size
    dense, _, dense_planner = update_flops("tiny:qwen3", **{"actor_rollout_ref.model.tiny.intermediate_size": width})
    assert active_params(cfg, planner.ctx.actor.num_params) == pytest.approx(  # + the router
        dense_planner.ctx.actor.num_params, abs=cfg.hidden_size * cfg.num_experts)
    rows, seq = planner.ctx.spec.plan.sequences, planner.ctx.seq_len
    assert experts == uncounted_expert_flops(cfg, 3 * rows * seq) / planner.ctx.mesh.size > 0.25 * dense
    assert moe == pytest.approx(dense, rel=0.12)  # without the experts' count it would be > 25% short


def test_pipeline_weight_copies_are_resident(tmp_path):
    # offset 1 / interval 1: at a sync the copy of step k - 1 (its rollout still running) and step k's
    spec, mesh, tok = _spec(tmp_path, **{"synchronizer.sync_offset": 1})
    assert spec.sync.weight_copies == 2
    plan = plan_memory(spec, mesh, tok, peak_flops=PEAK)
    planner = Planner(spec, mesh, tok)
    actor_params = planner.state_bytes["actor_params"]
    assert planner.state_bytes["rollout_params"] == 2 * actor_params
    sync_spec, _, _ = _spec(tmp_path)
    sync_plan = plan_memory(sync_spec, mesh, tok, peak_flops=PEAK)
    sync_update = sync_plan.program("update_actor")
    # and the sampler's KV, since the pipelined rollout runs beside the update (a synchronous one ends first)
    kv = plan.program("sample").kv_bytes
    assert kv > 0 and planner.state_bytes["kv_pool"] == kv
    assert "kv_pool" not in Planner(sync_spec, mesh, tok).state_bytes
    assert plan.program("update_actor").resident_bytes == sync_update.resident_bytes + 2 * actor_params + kv
    # the sampler holds its KV itself (not counted twice as resident)
    assert plan.program("sample").resident_bytes == sync_plan.program("sample").resident_bytes + 2 * actor_params


def test_paged_engine_plan_holds_its_kv_pool(tmp_path):
    from jaxrl_llm.sampler.engine.setup import engine_spec

    spec, mesh, tok = _spec(tmp_path, **{"actor_rollout_ref.rollout.engine": "paged"})
    plan = plan_memory(spec, mesh, tok, peak_flops=PEAK)
    sample = plan.program("sample")
    planner = Planner(spec, mesh, tok)
    ways = batch_axis_size(mesh)  # the generator pads the prompts to the mesh's batch ways
    rows = -(-spec.plan.prompts // ways) * ways * spec.train_sampling.n
    engine = engine_spec(planner.ctx.actor.cfg, spec.rollout_engine, num_requests=rows,
                         max_prompt_len=spec.plan.max_prompt_length, max_new_tokens=spec.plan.response_length,
                         compute_dtype=spec.actor.compute_dtype, mesh=mesh)
    # the pool (every slot at full length on CPU) is an argument, its pages split over the batch axes with the
    # slots (sampler/engine/slot_shards.py): a device holds its shard's
    assert engine.slot_shards == ways > 1
    pool = engine.shard_pages * engine.page_bytes(planner.ctx.actor.cfg, spec.actor.compute_dtype)
    assert sample.kv_bytes == pool and sample.argument_bytes >= pool + sample.params_bytes
    assert sample.flops > 0 and any("max_num_seqs" in k for k in sample.keys)


def test_paged_engine_plan_holds_a_hybrid_models_state(tmp_path, monkeypatch):
    """A Qwen3.5 model's engine: the decode program's arguments hold the pool (its attention layers only) and
    every slot's delta-net state, and under a device budget the state comes out of the pool's share."""
    from jaxrl_llm.models.hybrid import recurrent_bytes
    from jaxrl_llm.sampler.engine import setup

    spec, mesh, tok = _spec(tmp_path, **{"actor_rollout_ref.rollout.engine": "paged",
                                         "actor_rollout_ref.model.path": "tiny:qwen3_5_text",
                                         "actor_rollout_ref.model.tiny.num_hidden_layers": 2})
    sample = plan_memory(spec, mesh, tok, peak_flops=PEAK).program("sample")
    cfg = Planner(spec, mesh, tok).ctx.actor.cfg
    ways = batch_axis_size(mesh)
    rows = -(-spec.plan.prompts // ways) * ways * spec.train_sampling.n

    def engine():
        return setup.engine_spec(cfg, spec.rollout_engine, num_requests=rows,
                                 max_prompt_len=spec.plan.max_prompt_length, max_new_tokens=spec.plan.response_length,
                                 compute_dtype=spec.actor.compute_dtype, mesh=mesh)

    unbounded = engine()
    page = unbounded.page_bytes(cfg, spec.actor.compute_dtype)
    # a device holds its slot shard's slots and pages (sampler/engine/slot_shards.py)
    slots = unbounded.max_num_seqs // unbounded.slot_shards
    state = slots * recurrent_bytes(cfg)
    assert state == slots * 4 * (3 * 64 + 4 * 8 * 8)  # 1 delta-net layer: window, state (fp32)
    assert page == 1 * 2 * 2 * 16 * 16 * 4  # 1 attention layer x (k, v) x 2 kv heads x 16 tokens x 16 dims
    assert sample.argument_bytes >= unbounded.shard_pages * page + sample.params_bytes + state
    budget = 20 * page + state  # room for 20 pages a device (of the 33 the shard's slots need) once the state is held
    monkeypatch.setattr(setup, "device_kv_budget", lambda *a, **k: budget)
    assert unbounded.shard_pages == 33 and engine().shard_pages == 20


def test_paged_engine_plan_counts_its_decode_weight_copies(tmp_path):
    """The engine decodes from a copy of the matmul weights in the compute dtype and, on the 8 test devices
    (its slots split over them), in its decode layout (sampler/engine/decode_layout.py), while the fp32
    masters stay alive; with rollout.unroll_layers, from per-layer copies of the layers too: the sampler's row
    holds them."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models.dtypes import is_uncast_matmul_weight, uncast_matmul_weights
    from jaxrl_llm.sampler.engine import decode_layout, slot_shards

    def sample_and_planner(**overrides):
        spec, mesh, tok = _spec(tmp_path, **{"actor_rollout_ref.rollout.engine": "paged", **overrides})
        planner = Planner(spec, mesh, tok)
        return plan_memory(spec, mesh, tok, peak_flops=PEAK).program("sample"), planner

    def states_beside(planner):  # the step's states the sampler does not take as arguments
        return sum(b for s, b in planner.state_bytes.items() if s != "actor_params")

    def copied(planner, dtype):  # (the masters of the leaves the engine copies: cast or moved, those copies)
        axes = slot_shards.batch_split(planner.mesh)[0]
        masters = copies = 0
        for path, x in jax.tree_util.tree_leaves_with_path(planner.ctx.states["actor_params"]):
            placed = decode_layout.decode_sharding(x, planner.mesh, axes, decode_layout.leaf_names(path))
            cast = is_uncast_matmul_weight(path, x, dtype)
            if cast or placed != x.sharding:
                masters += bytes_per_device(x)
                copies += bytes_per_device(jax.ShapeDtypeStruct(x.shape, dtype if cast else x.dtype, sharding=placed))
        return masters, copies

    sample, planner = sample_and_planner()
    params = planner.ctx.states["actor_params"]
    matmul = uncast_matmul_weights(params, jnp.bfloat16)  # not the stacked norm scales: they stay fp32
    masters, copies = copied(planner, jnp.float32)
    # fp32: the masters moved into the decode layout (a weight's fsdp split onto its mlp / heads / vocab dim)
    assert 0 < masters == copies < sum(bytes_per_device(x) for x in jax.tree.leaves(params))
    assert sample.resident_bytes == states_beside(planner) + masters

    bf16 = {"actor_rollout_ref.model.dtype": "bfloat16"}
    sample, planner = sample_and_planner(**bf16)
    masters = copied(planner, jnp.bfloat16)[0]
    assert masters >= sum(bytes_per_device(x) for x in matmul)  # every cast weight's master, and moved norms
    assert sample.resident_bytes == states_beside(planner) + masters  # the masters beside the bf16 copy

    decode = next(p for p in planner.programs if p.name == "sample")
    assert decode.layers == planner.ctx.actor.cfg.num_hidden_layers  # one layer's count, the scan's trips

    unroll = {"actor_rollout_ref.rollout.unroll_layers": True}
    sample, planner = sample_and_planner(**unroll)
    decode = next(p for p in planner.programs if p.name == "sample")
    # the step is compiled over the per-layer copies, one layer after another: no layer scan to count once
    assert decode.layers == 1 and "layer_scan" not in decode.lower(planner.ctx.spec.plan).as_text()
    fp32_moved = copied(planner, jnp.float32)[0]
    assert sample.resident_bytes == states_beside(planner) + fp32_moved + bytes_per_device(params["layers"])
    assert any("unroll_layers" in k for k in sample.keys)

    sample, planner = sample_and_planner(**bf16, **unroll)
    bf16_layers = sum(bytes_per_device(x) // (2 if is_uncast_matmul_weight(path, x, jnp.bfloat16) else 1)
                      for path, x in jax.tree_util.tree_leaves_with_path(params["layers"]))
    assert all(x.dtype == jnp.float32 for x in matmul) and 0 < bf16_layers < bytes_per_device(params["layers"])
    assert sample.resident_bytes == states_beside(planner) + masters + bf16_layers

    # a pipelined rollout runs beside the other programs: its copies (not the masters) are resident then
    spec, mesh, tok = _spec(tmp_path, **{"actor_rollout_ref.rollout.engine": "paged", **bf16,
                                         "synchronizer.sync_offset": 1})
    planner = Planner(spec, mesh, tok)
    assert planner.state_bytes["decode_weights"] == copied(planner, jnp.bfloat16)[1]


def test_a_program_the_compiler_refused_never_fits():
    """The TPU compiler refuses a program whose temporaries exceed its usable HBM, which is below the
    published figure: the plan records the bytes it asked for, and the row does not fit even when those
    bytes add up to less than the chip's HBM (v6e-8 refused 24.8 GiB of temporaries against 32 GiB)."""
    from jaxrl_llm.planning.report import MemoryPlan, ProgramMemory

    row = dict(name="update_actor", argument_bytes=GiB, output_bytes=0, alias_bytes=0, temp_bytes=20 * GiB,
               code_bytes=0, resident_bytes=0, params_bytes=GiB, opt_state_bytes=0, kv_bytes=0, flops=0.0, micro=8,
               keys=(f"{ACTOR_MICRO}=8",))
    compiled, refused = ProgramMemory(**row), ProgramMemory(**row, note="the compiler ran out of device memory")
    assert compiled.fits(32 * GiB) and not refused.fits(32 * GiB)
    plan = lambda p: MemoryPlan((p,), 32 * GiB, "published HBM", None, None)  # noqa: E731 - check() reads no batch plan
    plan(compiled).check()
    with pytest.raises(MemoryPlanError, match=r"the compiler ran out of device memory: its temporaries alone asked "
                                              r"for 20.000G\) but the device has 32.000G"):
        plan(refused).check()


def test_longest_response_per_program_is_the_last_length_that_fits(tmp_path):
    """`--plan --longest`: per program, the reported length fits the device memory at one sequence per
    device and the next step does not (memory-bound rows), or the model's context ends first."""
    import copy

    from jaxrl_llm.planning.longest import longest_sequences
    from jaxrl_llm.planning.memory import plan_for_config

    overrides = {**SMALL, "actor_rollout_ref.model.tiny.max_position_embeddings": 4096 + 64,
                 "trainer.device_memory_gb": 0.12, "actor_rollout_ref.actor.remat_policy": "none"}
    cfg = validate_config(tiny_config(tmp_path / "run", **overrides), num_devices=8)
    report = longest_sequences(cfg, step=1024, max_tokens=4096)  # a bisection over 4 lengths: 2 plans
    rows = {r.program: r for r in report.rows}
    assert set(rows) >= {"sample", "update_actor"} and report.prompt_tokens == 64
    assert rows["update_actor"].bound == "memory" and 0 < rows["update_actor"].response_tokens < 4096
    assert rows["update_actor"].response_tokens <= rows["sample"].response_tokens  # the update holds more
    assert "longest response per device" in report.table()

    def fits(response: int) -> bool:  # the plain memory plan at that length, one sequence per device
        probe = copy.deepcopy(cfg)
        probe.data.max_response_length = probe.actor_rollout_ref.rollout.response_length = response
        probe.actor_rollout_ref.actor.ppo_micro_batch_size_per_device = 1
        plan = plan_for_config(probe, check=False, costs=False)
        return plan.program("update_actor").fits(plan.device_memory)

    longest = rows["update_actor"].response_tokens
    assert fits(longest) and not fits(longest + 1024)
    assert not any(tmp_path.iterdir())  # nothing written
    # context parallelism: each sequence's tokens over 4 devices, so the update fits a longer response
    split = validate_config(tiny_config(tmp_path / "run", **overrides, **{"mesh.context": 4}), num_devices=8)
    report = longest_sequences(split, step=1024, max_tokens=4096)
    assert report.context_parallel == 4 and "context-parallel size 4" in report.table()
    assert {r.program: r for r in report.rows}["update_actor"].response_tokens > longest
