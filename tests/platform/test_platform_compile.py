"""Every program of a step, and each kernel at real shapes, compiled by the real TPU compiler for
v5e:2x2 and v6e:2x2 (libtpu on this CPU host) and lowered for CUDA (Pallas -> Triton runs here).

Asserted: the program compiled; its bytes per chip are under the chip's HBM; the lowered /
compiled module holds the kernel's custom call (no silent XLA fallback where a kernel serves)."""
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from tiny_runs import tiny_config

from jaxrl_llm.config import validate_config
from jaxrl_llm.hf import load_tokenizer
from jaxrl_llm.losses.logprob import token_logprobs
from jaxrl_llm.platform import export_for_cuda, kernel_calls, tpu_target
from jaxrl_llm.platform.target import CompileTarget, compiling_for
from jaxrl_llm.platform.tpu import libtpu_installed
from jaxrl_llm.sampler.paged_attention_pallas import paged_decode_attention_pallas
from jaxrl_llm.sharding import batch_axis_size, make_mesh, mesh_context

needs_libtpu = pytest.mark.skipif(not libtpu_installed(), reason="libtpu not installed (pip install '.[tpu-plan]')")
TOPOLOGIES = ("v5e:2x2", "v6e:2x2")
# (hidden, vocab, vocab_major): SmolLM2-135M (tied), Qwen2-0.5B (tied), Qwen2-1.5B, Qwen2-7B
HEADS = [(576, 49152, True), (896, 151936, True), (1536, 151936, False), (3584, 151936, False)]
# paged sampler, reference pass, critic (values pass and update)
STEP = {"actor_rollout_ref.rollout.engine": "paged", "actor_rollout_ref.actor.use_kl_loss": True,
        "algorithm.adv_estimator": "gae"}


def _programs(cfg, devices):
    from jaxrl_llm.config import resolve as resolve_spec
    from jaxrl_llm.config import resolve_data
    from jaxrl_llm.planning.context import make_context
    from jaxrl_llm.planning.programs import PROGRAM_BUILDERS

    mesh = make_mesh(cfg.mesh, devices=devices)
    spec = resolve_spec(cfg, dp_size=batch_axis_size(mesh))
    ctx = make_context(spec, mesh, load_tokenizer(resolve_data(cfg).tokenizer))
    return spec, [p for p in (build(ctx) for build in PROGRAM_BUILDERS) if p is not None]


def _compiled_program(tmp_path, overrides: dict, name: str):
    """(program `name` of the tiny run with `overrides` on a v5e:2x2 plan, its TPU compile)."""
    from jaxrl_llm.config import resolve as resolve_spec
    from jaxrl_llm.planning.memory import Planner, planning_context, planning_setup

    cfg = validate_config(tiny_config(tmp_path, **overrides), num_devices=4)
    target, mesh, tokenizer = planning_setup(cfg)
    spec = resolve_spec(cfg, dp_size=batch_axis_size(mesh))
    with planning_context(mesh, target):
        program = next(p for p in Planner(spec, mesh, tokenizer).programs if p.name == name)
        return program, program.lower(spec.plan).compile()


@needs_libtpu
@pytest.mark.parametrize("topology,model", list(zip(TOPOLOGIES, ("tiny:llama", "tiny:gpt_oss"), strict=True)))
def test_every_program_of_a_step_compiles_for_tpu(tmp_path, topology, model, caplog):
    """On v6e with GPT-OSS: attention sinks in the Mosaic kernels (plain and cascade) and the trainer's
    attention, expert biases in the grouped matmul, sliding and full layers."""
    from jaxrl_llm.planning.memory import plan_for_config

    cfg = validate_config(tiny_config(tmp_path, **STEP, **{"trainer.plan_topology": topology,
                                                          "actor_rollout_ref.model.path": model}), num_devices=4)
    # the rooflines of the decode loop and the update, on one of the two slices (a compile or two more each; every
    # program is costed the same way, and test_plan_cli_compiles_for_a_named_slice costs a whole step)
    costs = ("sample", "update_actor") if topology == "v5e:2x2" else ()
    with caplog.at_level("INFO", logger="jaxrl_llm"):
        plan = plan_for_config(cfg, costs=costs)
    # compiled for this slice, not read from the other slice's plan (both number their four chips 0-3)
    compiled = {r.getMessage().split()[3] for r in caplog.records if r.getMessage().startswith("memory plan: compiled")}
    assert compiled == {p.name for p in plan.programs}, compiled
    target = tpu_target(topology)
    assert {p.name for p in plan.programs} == {"sample", "ref_log_prob", "values", "update_critic",
                                               "update_actor"}
    assert plan.device_memory == target.chip.hbm_bytes
    for p in plan.programs:
        assert 0 < p.total_bytes < target.chip.hbm_bytes and p.flops > 0, p
        roofline = plan.roofline(p)
        assert (roofline is not None) == (p.name in costs), p.name
        if roofline is not None:
            assert roofline.seconds > 0 and roofline.cost.hbm_bytes > 0 and roofline.cost.link_bytes > 0, p.name
    if costs:
        assert "estimated step:" in plan.table() and "estimated update_actor MFU" in plan.table()
    # the kernels are in the compiled TPU programs (the plan's rows list them, as its table does): paged
    # attention in the sampler, the fused head elsewhere
    for p in plan.programs:
        calls = dict(p.kernels)
        # the critic's passes read a value head: no vocabulary, no kernel (a MoE model's grouped matmul, XLA's
        # ragged dot, is a Mosaic call in every program)
        assert bool(calls) == ("critic" not in p.name and p.name != "values" or model == "tiny:gpt_oss"), p.name
        if p.name == "sample":  # rollout.n = 2: cascade attention, the Mosaic kernel twice
            assert calls["tpu_custom_call"] >= 2, p.name
    assert "kernels (Pallas calls compiled in): sample tpu_custom_call x" in plan.table()


@pytest.mark.parametrize("engine", ["paged", "static"])
def test_every_program_of_a_step_lowers_for_cuda(tmp_path, engine):
    # cascade attention set on: its 'auto' is off on GPU (slower on an H200), and its lowering is checked here
    cfg = validate_config(tiny_config(tmp_path, **{**STEP, "actor_rollout_ref.rollout.engine": engine,
                                                   "actor_rollout_ref.rollout.cascade_attention": True}),
                          num_devices=8)
    with compiling_for(CompileTarget("gpu", None)):
        spec, programs = _programs(cfg, jax.devices())
        for program in programs:
            text = program.lower(spec.plan, platforms=("cuda",)).as_text()
            calls = kernel_calls(text, "cuda")
            # on GPU only the paged sampler runs a kernel (paged attention): `auto` gives the log-prob head
            # the XLA path there (faster than the Triton kernel on an H200); the static sampler's logits
            # are [rows, V] per token and the critic reads a value head
            assert bool(calls) == (program.name == "sample" and engine == "paged"), program.name
            if calls and program.name == "sample":  # rollout.n = 2: cascade attention, the kernel twice
                assert sum(calls.values()) >= 2, calls


def _head(hidden, vocab, vocab_major, dtype, mesh, impl="auto"):
    rows = 256
    shard = (lambda spec: NamedSharding(mesh, spec)) if mesh is not None else (lambda spec: None)
    h = jax.ShapeDtypeStruct((rows, hidden), dtype, sharding=shard(P("data", None)))
    w = jax.ShapeDtypeStruct((vocab, hidden) if vocab_major else (hidden, vocab), dtype, sharding=shard(P(None, None)))
    t = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=shard(P("data")))

    def loss(h, w, t):
        lp, ent = token_logprobs(h, w, t, return_entropy=True, vocab_major=vocab_major, mesh=mesh, impl=impl)
        return jnp.sum(lp) + 0.1 * jnp.sum(ent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (h, w, t)


@needs_libtpu
# each dtype on one chip (the kernel's tiles depend on the dtype; the chips differ in VMEM): the grid's other
# half compiled the same kernels again for 35 s of the suite
@pytest.mark.parametrize("topology, dtype", list(zip(TOPOLOGIES, (jnp.bfloat16, jnp.float32), strict=True)))
def test_fused_logprob_head_compiles_for_tpu_at_real_shapes(topology, dtype):
    target = tpu_target(topology)
    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, devices=target.devices)
    for hidden, vocab, vocab_major in HEADS:
        fn, args = _head(hidden, vocab, vocab_major, dtype, mesh)
        with compiling_for(CompileTarget("tpu", target.chip.hbm_bytes)):  # as the planner builds for a slice
            compiled = fn.lower(*args).compile()
        assert kernel_calls(compiled.as_text(), "tpu"), (hidden, vocab)
        assert compiled.memory_analysis().temp_size_in_bytes < target.chip.hbm_bytes


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_logprob_head_lowers_for_cuda_at_real_shapes(dtype):
    # failed before: "requires ... power of 2. Encountered an array of shape (64, 576)". The kernel when
    # asked for ("pallas"); `auto` gives GPU programs the XLA path
    for hidden, vocab, vocab_major in HEADS:
        fn, args = _head(hidden, vocab, vocab_major, dtype, None, impl="pallas")
        assert kernel_calls(export_for_cuda(fn, *args).mlir_module(), "cuda"), (hidden, vocab)
        fn, args = _head(hidden, vocab, vocab_major, dtype, None)
        assert not kernel_calls(export_for_cuda(fn, *args).mlir_module(), "cuda"), (hidden, vocab)


def _paged_cases():
    # (head_dim, q heads, kv heads, q dtype, kv dtype, sliding window)
    return [(64, 9, 3, jnp.bfloat16, jnp.bfloat16, None), (128, 8, 2, jnp.bfloat16, jnp.bfloat16, 4096),
            (128, 4, 4, jnp.float32, jnp.float32, None), (64, 14, 2, jnp.bfloat16, jnp.int8, 512)]


@needs_libtpu
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_paged_attention_compiles_for_tpu(topology):
    device = tpu_target(topology).devices[0]
    sharding = SingleDeviceSharding(device)
    layers, pages, page_size, slots, per_slot = 4, 512, 16, 64, 64
    for head_dim, heads, kv_heads, q_dtype, kv_dtype, window in _paged_cases():
        spec = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
        pool = spec((layers, kv_heads, pages, page_size, head_dim), kv_dtype)
        scales = [spec((layers, kv_heads, pages, page_size), jnp.float32)] * 2 if kv_dtype == jnp.int8 else []

        def attend(q, k, v, lengths, table, layer, *sc, window=window):
            extra = dict(k_scales=sc[0], v_scales=sc[1]) if sc else {}
            return paged_decode_attention_pallas(q, k, v, lengths, table, layer=layer, sliding_window=window,
                                                 variant="mosaic", **extra)

        compiled = jax.jit(attend).lower(spec((slots, heads, head_dim), q_dtype), pool, pool,
                                         spec((slots,), jnp.int32), spec((slots, per_slot), jnp.int32),
                                         spec((), jnp.int32), *scales).compile()
        assert kernel_calls(compiled.as_text(), "tpu"), (head_dim, kv_dtype)


@needs_libtpu
def test_plan_cli_compiles_for_a_named_slice(tmp_path):
    import os
    import subprocess
    import sys

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    config = root / "configs" / "tiny.py"
    # two slices of four chips, one per 'data' row: every program compiled for the multislice mesh
    done = subprocess.run([sys.executable, str(root / "launch" / "train.py"), f"--config={config}",
                           "--plan", "--topology=v5e-4", "--num_slices=2", "--", "mesh.data=2",
                           f"trainer.default_local_dir={tmp_path}"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled for v5e-4 (v5e:2x2 x 2 slices: 8 TPU v5e chips" in done.stdout
    assert "hosts: 2 processes x 4 devices, 2 slice(s)" in done.stdout
    assert "collectives over mesh axes 'data' cross slices (DCN)" in done.stdout
    assert "the target chip's published HBM" in done.stdout and "update_actor" in done.stdout
    assert not list(tmp_path.iterdir())  # a plan writes nothing
    bad = subprocess.run([sys.executable, str(root / "launch" / "train.py"), f"--config={root / 'configs' / 'tiny.py'}",
                          "--plan", "--topology=v5e-3"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "config error: " in bad.stderr and "v5e-3" in bad.stderr


@needs_libtpu
def test_a_multi_host_plan_says_what_each_process_loads_and_which_axes_cross_slices():
    """v5e-32 is 8 hosts of 4 chips, v5e-8 one of 8; two v5e-8 slices join over DCN along 'data' (the outermost axis the
    slice count divides), every other axis staying on a slice's ICI. No compile: the mesh and the lines."""
    import types

    from jaxrl_llm.planning.report import ProgramMemory, hosts_lines, slice_crossing_axes

    update = ProgramMemory("update_actor", 0, 0, 0, 0, 0, 0, params_bytes=1 << 30, opt_state_bytes=2 << 30,
                           kv_bytes=0, flops=0.0, micro=1, keys=())
    plan = types.SimpleNamespace(prompts=64, sequences=512)
    pod = make_mesh({"fsdp": -1}, devices=tpu_target("v5e-32").devices)
    assert slice_crossing_axes(pod) == ()
    (line,) = hosts_lines(pod, plan, (update,))
    assert line.startswith("hosts: 8 processes x 4 devices, 1 slice(s); each process reads 8 of the step's 64 "
                           "prompts (64 of 512 sequences) and holds 12.000G of params and optimizer state"), line
    assert "one slice: every collective on ICI" in line
    two = tpu_target("v5e-8", num_slices=2)
    mesh = make_mesh({"data": 2, "fsdp": -1}, devices=two.devices)
    assert dict(mesh.shape)["data"] == 2 and slice_crossing_axes(mesh) == ("data",)
    slices = [{d.slice_index for d in row.flat} for row in mesh.devices]  # each data row: one slice
    assert slices == [{0}, {1}]
    (line,) = hosts_lines(mesh, plan, (update,))
    assert "2 processes x 8 devices, 2 slice(s)" in line and "mesh axes 'data' cross slices (DCN)" in line
    assert slice_crossing_axes(make_mesh({"fsdp": -1}, devices=two.devices)) == ("fsdp",)
    assert hosts_lines(make_mesh({"fsdp": -1}, devices=jax.devices()), plan, (update,)) == ()  # one process


@needs_libtpu
def test_a_context_parallel_step_compiles_for_tpu_and_lowers_for_cuda(tmp_path):
    """Every program of a step on (fsdp 2, context 2): ring attention in the training passes, compiled for
    v5e:2x2 and lowered for CUDA; and a 4096-token row's blockwise attention (value and gradient)
    compiled for one v5e chip."""
    from jaxrl_llm.models.blockwise import causal_blockwise_attend
    from jaxrl_llm.planning.memory import plan_for_config

    split = {**STEP, "mesh.fsdp": 2, "mesh.context": 2}
    cfg = validate_config(tiny_config(tmp_path, **split, **{"trainer.plan_topology": "v5e:2x2"}), num_devices=4)
    plan = plan_for_config(cfg, costs=False)
    assert all(0 < p.total_bytes for p in plan.programs) and len(plan.programs) == 5
    cfg = validate_config(tiny_config(tmp_path, **split), num_devices=4)
    with compiling_for(CompileTarget("gpu", None)), mesh_context(make_mesh(cfg.mesh, devices=jax.devices()[:4])):
        spec, programs = _programs(cfg, jax.devices()[:4])
        for program in programs:  # the ring's ppermute in the training passes (the sampler does not split)
            text = program.lower(spec.plan, platforms=("cuda",)).as_text()
            assert ("collective_permute" in text) == (program.name != "sample"), program.name

    device = tpu_target("v5e:2x2").devices[0]
    shaped = functools.partial(jax.ShapeDtypeStruct, sharding=SingleDeviceSharding(device))
    tokens, heads, kv_heads, head_dim = 4096, 8, 2, 64

    def loss(q, k, v, allowed):
        return jnp.sum(causal_blockwise_attend(q, k, v, allowed, None, kv_heads, None))  # no sinks, no cap

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        shaped((1, tokens, heads, head_dim), jnp.bfloat16), shaped((1, kv_heads, tokens, head_dim), jnp.bfloat16),
        shaped((1, kv_heads, tokens, head_dim), jnp.bfloat16), shaped((1, tokens, tokens), jnp.bool_)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2 ** 20


@needs_libtpu
@pytest.mark.parametrize("attention", ["auto", "xla"])
def test_the_samplers_temporaries_stay_under_a_tenth_of_its_pool_on_tpu(tmp_path, attention):
    """The paged engine's decode program (`sample`) compiled for v5e:2x2 in bf16 at head_dim 64 holds its
    weights and its shard of the pool (slots and pages split 4 ways: sampler/engine/slot_shards.py), and
    temporaries under 10% of the pool; no copy of the pool. Before
    sampler/kv_bits.py's layout (rows written one scatter index each, head dims lane-padded) the TPU
    compiler kept the pool in a layout of its own and copied it into the kernel's: temporaries of
    5.0x the pool here (Mosaic; 2.0x on the XLA path), 4-6x at Qwen2-0.5B's shape (bench/tpu_plan.py). The
    decode step gathers its slots' rows, not the big weights."""

    overrides = {"actor_rollout_ref.rollout.engine": "paged", "actor_rollout_ref.model.dtype": "bfloat16",
                 "actor_rollout_ref.rollout.paged_attention": attention, "trainer.plan_topology": "v5e:2x2",
                 "data.max_prompt_length": 64, "data.max_response_length": 256, "data.train_batch_size": 8,
                 "actor_rollout_ref.rollout.n": 16, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
                 "actor_rollout_ref.model.tiny.num_hidden_layers": 8,
                 "actor_rollout_ref.model.tiny.max_position_embeddings": 1024,
                 "actor_rollout_ref.model.tiny.hidden_size": 256,  # 4 heads of 64; 32 slots a chip of v5e:2x2
                 "actor_rollout_ref.model.tiny.intermediate_size": 1024,
                 "actor_rollout_ref.model.tiny.vocab_size": 2048}
    program, compiled = _compiled_program(tmp_path, overrides, "sample")
    memory = compiled.memory_analysis()
    assert program.kv_bytes >= 64 * 2**20  # too large for the compiler to keep a copy in on-chip memory
    assert memory.temp_size_in_bytes < 0.1 * program.kv_bytes, (memory.temp_size_in_bytes, program.kv_bytes)
    text = compiled.as_text()
    pool_shapes = set(re.findall(r"bf16\[8,2,\d+,16,128\]", text))
    assert pool_shapes, "the pool is stored lane-padded: [layers, kv heads, pages, page size, 128]"
    for shape in pool_shapes:
        assert not re.findall(re.escape(shape) + r"\{[^}]*\} copy(?:-start)?\(", text), shape
    # the decode layout (sampler/engine/decode_layout.py): the MLP's and the embedding's weights stay split over
    # the 4 chips (on their mlp / vocab dim) and a step gathers the slots' rows instead (with the trainer's FSDP
    # layout every step gathered every layer's [256, 1024] MLP weights and the [2048, 256] embedding)
    gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
    assert gathered and not [shape for shape in gathered if re.search(r"[\[,](1024|2048)[,\]]", shape)], gathered
    # nor q_proj's / o_proj's ([256, 4 heads, 64], split over the heads): q / k / v and the attention's output
    # move into and out of the slot shards (engine/forward.py)
    weights = r"\[(1,)?(256,4,64|256,256|4,(1,)?64,256)\]"
    assert not [shape for shape in gathered if re.search(weights, shape)], gathered


def test_deepseek_latent_pool_decodes_with_the_triton_kernel_on_gpu(tmp_path):
    """DeepSeek-V3's paged decode lowered for CUDA: the latent pool (32 + 16 = 48 numbers a token, read in
    power-of-2 pieces) goes through the Triton kernel; before, any width but a power of 2 took the XLA path."""
    overrides = {"actor_rollout_ref.rollout.engine": "paged", "actor_rollout_ref.model.dtype": "bfloat16",
                 "actor_rollout_ref.model.path": "tiny:deepseek_v3", "actor_rollout_ref.model.tiny.head_dim": 16}
    cfg = validate_config(tiny_config(tmp_path, **overrides), num_devices=8)
    with compiling_for(CompileTarget("gpu", None)):
        spec, programs = _programs(cfg, jax.devices())
        sample = next(p for p in programs if p.name == "sample")
        text = sample.lower(spec.plan, platforms=("cuda",)).as_text()
    assert re.search(r"tensor<\d+x1x\d+x\d+x48xbf16>", text)  # [layers, 1 kv head, pages, page size, 48]
    assert kernel_calls(text, "cuda")


@needs_libtpu
def test_deepseek_latent_pool_decodes_with_the_mosaic_kernel_on_tpu(tmp_path):
    """DeepSeek-V3's paged decode compiled for v5e:2x2 in bf16: one pool array (the latent + rope key, no
    values) of one kv head, lane-padded to 128, read once by the Mosaic kernel as keys and values, with no copy
    of it; its bytes are the plan's."""

    overrides = {"actor_rollout_ref.rollout.engine": "paged", "actor_rollout_ref.model.dtype": "bfloat16",
                 "trainer.plan_topology": "v5e:2x2", "actor_rollout_ref.model.path": "tiny:deepseek_v3",
                 "actor_rollout_ref.model.tiny.num_key_value_heads": 4}
    program, compiled = _compiled_program(tmp_path, overrides, "sample")
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the Mosaic kernel, not the XLA fallback
    # each call's operands: lengths, page table, queries and the pool ONCE (values_are_keys: each block is
    # DMA'd once and read as keys and values; 5 operands before)
    calls = [line.split("custom-call(")[1].split(")")[0] for line in text.splitlines()
             if "tpu_custom_call" in line and "custom-call(" in line]
    assert calls and all(len(args.split(", ")) == 4 for args in calls), calls
    pool_shapes = set(re.findall(r"bf16\[2,1,\d+,\d+,128\]", text))  # [layers, 1 kv head, pages, page, 40 -> 128]
    assert pool_shapes
    for shape in pool_shapes:
        assert not re.findall(re.escape(shape) + r"\{[^}]*\} copy(?:-start)?\(", text), shape
    # the decode layout (sampler/engine/decode_layout.py): the MLP's and the embedding's weights stay split over
    # the 4 chips (on their mlp / vocab dim) and a step gathers the slots' rows instead (with the trainer's FSDP
    # layout every step gathered every layer's [256, 1024] MLP weights and the [2048, 256] embedding)
    gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
    assert gathered and not [shape for shape in gathered if re.search(r"[\[,](1024|2048)[,\]]", shape)], gathered
    # nor q_proj's / o_proj's ([256, 4 heads, 64], split over the heads): q / k / v and the attention's output
    # move into and out of the slot shards (engine/forward.py)
    weights = r"\[(1,)?(256,4,64|256,256|4,(1,)?64,256)\]"
    assert not [shape for shape in gathered if re.search(weights, shape)], gathered
    assert program.kv_bytes > 0


@needs_libtpu
def test_inserting_a_prompt_does_not_copy_the_pool_on_tpu():
    """The engine's `insert` (a prompt's KV into its slot's pages) compiled for a v5e chip: no copy of the
    pool, temporaries under 1% of it. With the prefix written as [L, kv, D] windows (before
    sampler/kv_bits.py's `write_rows`) the compiler copied the pool 4 times per inserted prompt
    (256 MiB of temporaries beside a 128 MiB pool here)."""

    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.sampler.engine import decode_state, programs
    from jaxrl_llm.sampler.params import SamplingParams

    target = tpu_target("v5e:2x2")
    shaped = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(  # noqa: E731
        target.devices[0]))
    cfg = ModelConfig.tiny("llama", num_hidden_layers=8, hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64)
    layers, kv, bucket, slots, new = cfg.num_hidden_layers, cfg.num_key_value_heads, 64, 32, 256
    settings, knobs = SamplingParams(max_new_tokens=new).compile_args(list(cfg.eos_token_ids), 0,
                                                                     vocab_size=cfg.vocab_size)
    with compiling_for(CompileTarget("tpu", target.chip.hbm_bytes)):
        spec = decode_state.EngineSpec(max_num_seqs=slots, page_size=16, num_pages=4097, pages_per_slot=32)
        state = jax.tree.map(lambda x: shaped(x.shape, x.dtype),
                             jax.eval_shape(lambda: decode_state.init_state(cfg, spec, new, "bfloat16")))
        kv_rows = shaped((layers, kv, bucket, cfg.head_dim), jnp.bfloat16)
        prefix = decode_state.Prefix(k=kv_rows, v=kv_rows, logits=shaped((cfg.vocab_size,), jnp.float32),
                                 length=shaped((), jnp.int32), ids=shaped((bucket,), jnp.int32))
        knobs = jax.tree.map(lambda x: shaped(jnp.shape(x), jnp.asarray(x).dtype), knobs)
        scalar = shaped((), jnp.int32)
        compiled = programs.insert.lower(prefix, state, scalar, shaped((spec.pages_per_slot,), jnp.int32),
                                         shaped((2,), jnp.int32), scalar, shaped((2,), jnp.uint32), knobs,
                                         settings=settings).compile()
    pool_bytes = 2 * state.pool["k"].size * 2
    assert state.pool["k"].shape == (layers, kv, 4097, 16, 128)
    assert compiled.memory_analysis().temp_size_in_bytes < 0.01 * pool_bytes
    text = compiled.as_text()
    assert not re.findall(r"bf16\[8,2,4097,16,128\]\{[^}]*\} copy(?:-start)?\(", text)


@needs_libtpu
def test_the_update_keeps_its_rows_split_over_fsdp_on_tpu(tmp_path):
    """An FSDP update at one sequence per chip, compiled for v5e:2x2, holds one row's [tokens, intermediate]
    activations per chip, not the four rows of the mesh. Without models/decoder.py's `batch_rows` the
    compiler carried the kernels' split of their contracting (embed) dim over to the activations and
    computed every row on every chip: f32[4, 512, 4096] buffers here (a Qwen2-7B
    update on v5e-32 asked for 43 GiB; 10.8 GiB with it)."""

    overrides = {"trainer.plan_topology": "v5e:2x2", "actor_rollout_ref.model.dtype": "bfloat16",
                 "data.max_prompt_length": 64, "data.max_response_length": 448, "data.train_batch_size": 2,
                 "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_device": 1,
                 "actor_rollout_ref.model.tiny.max_position_embeddings": 512,
                 "actor_rollout_ref.model.tiny.hidden_size": 512,
                 "actor_rollout_ref.model.tiny.intermediate_size": 4096,
                 "actor_rollout_ref.model.tiny.num_attention_heads": 8}
    _, compiled = _compiled_program(tmp_path, overrides, "update_actor")
    text = compiled.as_text()
    assert "f32[1,512,4096]" in text  # one row's MLP activations per chip
    assert not re.findall(r"f32\[4,512,4096\]|f32\[4096,4096\]", text)  # not the four rows of the mesh
    assert compiled.memory_analysis().temp_size_in_bytes < 100 * 2**20


@needs_libtpu
def test_gemma4_decode_and_update_compile_for_tpu(tmp_path):
    """A Gemma 4 model (sliding / full layers of different head shapes, shared KV, per-layer inputs) on v6e:2x2:
    the paged engine's decode runs the Mosaic kernel on each attention type's pool (each its own shape,
    lane-padded), and the actor update compiles with the per-kind weight stacks split over the mesh."""

    overrides = {"actor_rollout_ref.rollout.engine": "paged", "actor_rollout_ref.model.path": "tiny:gemma4_text",
                 "actor_rollout_ref.model.tiny.num_hidden_layers": 6, "actor_rollout_ref.model.dtype": "bfloat16",
                 "actor_rollout_ref.rollout.paged_attention": "pallas", "trainer.plan_topology": "v6e:2x2"}
    program, compiled = _compiled_program(tmp_path, overrides, "sample")
    assert dict(kernel_calls(compiled.as_text(), "tpu")).get("tpu_custom_call", 0) >= 2  # a kernel per type
    text = compiled.as_text()
    # sliding: 2 producing layers x 2 kv heads x head_dim 16; full: 2 x 1 kv head x 32 (both lane-padded)
    assert re.findall(r"bf16\[2,2,\d+,\d+,128\]", text) and re.findall(r"bf16\[2,1,\d+,\d+,128\]", text)
    _, update = _compiled_program(tmp_path, overrides, "update_actor")
    assert update.memory_analysis().temp_size_in_bytes > 0


@needs_libtpu
def test_qwen35_decode_and_update_compile_for_tpu(tmp_path):
    """A tiny Qwen3.5 (8 layers, delta-net and attention alternating) on v5e:2x2 in bf16: the paged decode runs the
    Mosaic kernel on the attention layers' pool ([4 layers, 2 kv heads, ...], lane-padded) and carries the slots'
    delta-net state ([4 layers, slots, 4 heads, 8, 8] fp32) with no copy of either and no conditional; the actor
    update (the chunked delta rule and its gradient) compiles."""

    overrides = {"actor_rollout_ref.rollout.engine": "paged", "actor_rollout_ref.model.path": "tiny:qwen3_5_text",
                 "actor_rollout_ref.model.tiny.num_hidden_layers": 8, "actor_rollout_ref.model.dtype": "bfloat16",
                 "trainer.plan_topology": "v5e:2x2"}
    program, compiled = _compiled_program(tmp_path, overrides, "sample")
    text = compiled.as_text()
    assert "tpu_custom_call" in text and " conditional(" not in text
    pools = set(re.findall(r"bf16\[4,2,\d+,\d+,128\]", text))
    states = set(re.findall(r"f32\[4,\d+,4,8,8\]", text))
    assert pools and states
    for shape in pools | states:
        assert not re.findall(re.escape(shape) + r"\{[^}]*\} copy(?:-start)?\(", text), shape
    _, update = _compiled_program(tmp_path, overrides, "update_actor")
    # the delta rule's chunks run as the Pallas kernel (models/delta_rule_pallas.py) in the update's forward
    assert dict(kernel_calls(update.as_text(), "tpu")).get("tpu_custom_call", 0) >= 1


@needs_libtpu
def test_delta_rule_chunk_kernel_compiles_for_tpu_at_real_shapes(topology="v6e:2x2"):
    """The gated delta rule's chunk kernel at Qwen3.5's per-chunk shapes (chunks of 64, key / value heads of 128;
    two chunks of two heads) compiled by Mosaic for v6e (the Qwen3.5 update above: v5e, with its backward, XLA's
    recompute of the chunk)."""
    from jaxrl_llm.models.delta_rule import chunked_delta_rule
    from jaxrl_llm.models.delta_rule_pallas import chunk_terms_pallas

    spec = functools.partial(jax.ShapeDtypeStruct, sharding=SingleDeviceSharding(tpu_target(topology).devices[0]))
    b, t, h, d = 1, 128, 2, 128
    args = (spec((b, t, h, d), jnp.float32), spec((b, t, h, d), jnp.float32), spec((b, t, h, d), jnp.float32),
            spec((b, t, h), jnp.float32), spec((b, t, h), jnp.float32), spec((b, t), jnp.bool_))

    def out(q, k, v, g, beta, starts):
        return jnp.sum(chunked_delta_rule(q, k, v, g, beta, starts=starts, chunk=64, terms=chunk_terms_pallas)[0])

    forward = jax.jit(out).lower(*args).compile()
    assert dict(kernel_calls(forward.as_text(), "tpu")).get("tpu_custom_call") == 1


@needs_libtpu
def test_batch_invariant_programs_compile_for_tpu_and_lower_for_cuda(tmp_path):
    """`model.batch_invariant` on v5e:2x2 (fsdp 4) in bf16, paged engine with cascade attention: the sampler
    (prefill and decode) and the actor update compile with the mode's kernels (models/invariant_attention.py's
    attention, its paged form in the decode step, the cascade's shared and continued walks, and the fixed-tile
    GEMMs, each under a shard_map: Mosaic calls cannot be partitioned), and both lower for CUDA with the Triton
    ones."""
    overrides = {"actor_rollout_ref.rollout.engine": "paged", "actor_rollout_ref.model.dtype": "bfloat16",
                 "trainer.plan_topology": "v5e:2x2", "actor_rollout_ref.model.batch_invariant": True,
                 "actor_rollout_ref.rollout.cascade_attention": True}
    for name in ("sample", "update_actor"):
        _, compiled = _compiled_program(tmp_path, overrides, name)
        text = compiled.as_text()
        assert dict(kernel_calls(text, "tpu")).get("tpu_custom_call", 0) >= 4, name
        # the engine's steps read the pool in place (no gathered copy of the page table), the update's forward
        # runs the contiguous kernel
        kernel = "invariant_paged_attention_mosaic" if name == "sample" else "invariant_attention_mosaic"
        assert text.count(kernel) >= 2, name
        if name == "sample":
            assert all(f"{kernel}_{role}" in text for role in ("shared", "continued"))
    cfg = validate_config(tiny_config(tmp_path, **{**overrides, "trainer.plan_topology": None}), num_devices=8)
    with compiling_for(CompileTarget("gpu", None)):
        spec, programs = _programs(cfg, jax.devices())
        texts = {p.name: p.lower(spec.plan, platforms=("cuda",)).as_text() for p in programs
                 if p.name in ("sample", "update_actor")}
    assert all(f"invariant_paged_attention_triton_{role}" in texts["sample"] for role in ("shared", "continued"))
    assert "invariant_attention_triton" in texts["update_actor"]
