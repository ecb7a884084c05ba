"""The paged engine's slots and KV pages split over the mesh's batch axes (sampler/engine/slot_shards.py)."""
import dataclasses

import jax
import numpy as np
import pytest
from sampler_fixtures import MESHES, PAD_ID, PROMPTS

from jaxrl_llm import sharding
from jaxrl_llm.models import param_logical_axes
from jaxrl_llm.sampler import SamplingParams
from jaxrl_llm.sampler.engine import EngineSpec, PagedEngine, slot_shards
from jaxrl_llm.sampler.engine.pages import PagePool
from jaxrl_llm.sampler.engine.setup import EngineOptions, engine_spec
from jaxrl_llm.sampler.speculative import SpeculativeSpec

# a prompt longer than the others shares several full 4-token pages; 6 prompts x 2 samples over 8 slots wait
# for pages and slots, and drain through the smaller sets
LONG_PROMPTS = PROMPTS + [[5] * 13, [7, 1] * 6]
BUDGETS = [10, 2, 7, 3, 9, 1]
SAMPLED = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=40, n=2, seed=3)


def _run(cfg, params, spec, mesh=None, sp=SAMPLED):
    settings, knobs = sp.compile_args(cfg.eos_token_ids, PAD_ID, vocab_size=cfg.vocab_size)
    engine = PagedEngine(cfg, spec, steps_per_call=3, mesh=mesh, precompile_drain=False)
    if mesh is not None:
        params = sharding.shard_params(params, param_logical_axes(cfg), mesh)
    # budgets of their own: sequences end at different steps, and the slot set shrinks as they do
    return engine, *engine.run(params, LONG_PROMPTS, jax.random.key(3), knobs, settings, max_new_tokens=BUDGETS)


@pytest.mark.parametrize("mesh_name,speculative,slots,num_pages",
                         [("fsdp8", False, 16, 8 * 10), ("data2_tensor4", True, 8, 2 * 12)])
def test_slot_shards_generate_what_one_device_does(llama_tiny, mesh_name, speculative, slots, num_pages):
    """16 slots over 8 shards (8 over 2), each shard its own pages and scratch page: the same tokens and log-probs
    as one device, through cascade rows of local slots (a prompt's samples in one shard read its pages once), the
    page-wait queue (2-way: 11 pages a shard for 4 slots), the drain's smaller sets (each slot kept in its
    shard) and, on the 2-way split, n-gram verification rows. The pool's pages and the slot arrays are split
    over the batch axes: each device holds 1/shards of the pool."""
    cfg, params = llama_tiny
    mesh = sharding.make_mesh(MESHES[mesh_name])
    shards = slot_shards.batch_split(mesh)[1]
    drafts = SpeculativeSpec(num_tokens=2) if speculative else None
    spec = EngineSpec(max_num_seqs=slots, page_size=4, num_pages=num_pages, pages_per_slot=8, cascade=True,
                      speculative=drafts)
    _, ref, ref_stats = _run(cfg, params, spec)
    engine, got, stats = _run(cfg, params, dataclasses.replace(spec, slot_shards=shards), mesh)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    np.testing.assert_allclose(got.log_probs, ref.log_probs, atol=1e-5, rtol=1e-5)
    assert engine.slot_axes == tuple(a for a in ("data", "fsdp") if dict(mesh.shape)[a] > 1)
    # (8 shards of 2 slots: a shard runs one prompt's two samples, which end together: no set to shrink to)
    assert stats.peak_cascade_groups >= 1 and stats.resizes >= (shards == 2) and stats.waits_for_pages >= (shards == 2)
    state = engine._fresh_state(SAMPLED.max_new_tokens)
    k = state.pool["k"]
    assert {s.data.shape[2] for s in k.addressable_shards} == {spec.num_pages // shards}
    assert {s.data.shape[0] for s in state.tokens.addressable_shards} == {spec.max_num_seqs // shards}
    assert all(size % shards == 0 for size in engine.drain_sizes())


def test_engine_spec_splits_slots_and_pages_over_the_batch_axes(llama_tiny):
    """`engine_spec` on a mesh: slot shards = the batch split (a scratch page per shard), slots raised to one
    per shard; 1 where rollout.max_num_seqs does not split evenly (the replicated engine)."""
    cfg, _ = llama_tiny
    mesh = sharding.make_mesh(MESHES["fsdp8"])
    kw = dict(max_prompt_len=20, max_new_tokens=16, compute_dtype="float32", mesh=mesh)
    spec = engine_spec(cfg, EngineOptions(max_num_seqs=64), num_requests=3, **kw)
    assert spec.slot_shards == 8 and spec.max_num_seqs == 8 and spec.num_pages % 8 == 0
    assert spec.shard_pages == spec.max_num_seqs // 8 * spec.pages_per_slot + 1
    assert engine_spec(cfg, EngineOptions(max_num_seqs=12), num_requests=3, **kw).slot_shards == 1
    assert engine_spec(cfg, EngineOptions(max_num_seqs=64), num_requests=3, max_prompt_len=20, max_new_tokens=16,
                       compute_dtype="float32").slot_shards == 1
    with pytest.raises(ValueError, match="slot_shards=3"):
        EngineSpec(max_num_seqs=8, page_size=4, num_pages=12, pages_per_slot=2, slot_shards=3)


def test_host_bookkeeping_keeps_each_slot_in_its_shard():
    # 8 slots over 2 shards shrink to 4: each shard's running slots move to the start of its new block
    assert slot_shards.kept_in_shards([1, 3, 5], 8, 4, 2) == [1, 3, 5, -1]
    assert slot_shards.free_by_shard([3, 0, 6], 8, 2) == [[0, 3], [6]]
    pools = [PagePool(10), PagePool(10)]
    pools[0].alloc(7)
    free = [[0], [4, 5]]
    # a new group takes the shard with room for its 3 + 2 pages and the most free slots
    assert slot_shards.choose_shard({}, free, pools, total=5, shared_n=3) == 1
    # a group already in shard 0 goes there when its own 2 pages fit (its prompt pages are there)
    assert slot_shards.choose_shard({0: [1, 2, 3]}, free, pools, total=4, shared_n=2) == 0
    # nothing fits anywhere: the request waits
    assert slot_shards.choose_shard({}, [[], []], pools, total=1, shared_n=0) is None


def test_the_decode_layout_moves_a_weights_fsdp_split_onto_its_tensor_dim():
    """sampler/engine/decode_layout.py on fsdp=2 x tensor=4: a projection's fsdp split leaves its embed dim for its
    mlp / heads / vocab dim (after 'tensor'), or the dim after it where that one does not divide; a small weight
    without such a dim is held whole, a large one keeps the trainer's layout; nothing moves without slot axes; the
    q rows a step constrains follow a heads split over every slot axis, and only that."""
    from jax.sharding import PartitionSpec as P

    from jaxrl_llm.sampler.engine.decode_layout import WHOLE_BELOW_BYTES, decode_spec, head_rows_spec

    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    axes = ("fsdp",)
    assert decode_spec(P(None, "fsdp", "tensor"), (2, 64, 128), 2, mesh, axes) == P(None, None, ("tensor", "fsdp"))
    assert decode_spec(P("tensor", "fsdp"), (256, 64), 2, mesh, axes) == P(("tensor", "fsdp"), None)  # embedding
    # 4 heads split 4 ways leave no room for 'fsdp': it goes to the head dim
    assert decode_spec(P(None, "fsdp", "tensor", None), (2, 64, 4, 16), 2, mesh, axes) == P(None, None, "tensor",
                                                                                              "fsdp")
    assert decode_spec(P("fsdp"), (64,), 4, mesh, axes) == P(None)  # a norm scale: whole
    big = (WHOLE_BELOW_BYTES // 4 // 6 * 2, 6)  # no dim 'tensor' splits, too large to hold whole
    assert decode_spec(P("fsdp", None), big, 4, mesh, axes) == P("fsdp", None)
    assert decode_spec(P(None, "fsdp", "tensor"), (2, 64, 128), 2, mesh, ()) == P(None, "fsdp", "tensor")
    # a step's q rows [S, 1, heads, head_dim] as the projection makes them from whole rows: over its heads split only
    assert head_rows_spec(mesh, axes, 64, 8, 16) == P(None, None, ("tensor", "fsdp"), None)
    assert head_rows_spec(mesh, axes, 64, 4, 16) is None  # its head dim split: RoPE pairs across it
    wide = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})  # 'data' splits the slots, not the weights
    assert head_rows_spec(wide, ("data", "fsdp"), 64, 8, 16) is None


def test_the_batch_invariant_decode_layout_splits_each_weight_by_its_output_columns(llama_tiny):
    """With `model.batch_invariant` (engine/decode_layout.py `column_spec`) no weight splits its contraction: an
    input projection splits its heads / mlp dim, a weight writing the residual stream its embed dim, the embedding
    its vocabulary, each over 'tensor' and the slot axes; a weight whose dim does not divide is held whole when
    small; norms, biases and expert stacks keep the usual rule. The engine's copy on fsdp8 is laid out so."""
    from jax.sharding import PartitionSpec as P

    from jaxrl_llm.sampler.engine import decode_layout

    assert decode_layout.output_dim(("layers", "embed", "heads", "head_dim")) == 2
    assert decode_layout.output_dim(("layers", "heads", "head_dim", "embed")) == 3
    assert decode_layout.output_dim(("layers", "mlp", "embed")) == 2
    assert decode_layout.output_dim(("vocab", "embed")) == 0 and decode_layout.output_dim(("embed", "vocab")) == 1
    assert decode_layout.output_dim(("layers", None)) is None
    assert decode_layout.output_dim(("layers", "expert", "mlp", "embed")) is None
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    assert decode_layout.column_axes(mesh, ("fsdp",)) == ("tensor", "fsdp")
    down = decode_layout.column_spec(P(None, "tensor", "fsdp"), (2, 512, 64), 2, mesh, ("fsdp",), 2)
    assert down == P(None, None, ("tensor", "fsdp"))
    assert decode_layout.column_spec(P(None, "fsdp", "tensor", None), (2, 64, 4, 16), 2, mesh, ("fsdp",), 2) == P()

    cfg, params = llama_tiny
    mesh = sharding.make_mesh(MESHES["fsdp8"])
    placed = sharding.shard_params(params, param_logical_axes(cfg), mesh)
    copy = decode_layout.decode_weights(placed, "bfloat16", mesh, ("fsdp",), by_columns=True)
    layers = copy["layers"]
    assert layers["mlp"]["up_proj"]["kernel"].sharding.spec == P(None, None, "fsdp")
    assert layers["mlp"]["down_proj"]["kernel"].sharding.spec == P(None, None, "fsdp")
    assert copy["embedding"].sharding.spec == P("fsdp", None)
    for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(copy)):
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x.astype(y.dtype), np.float32))


def test_the_batch_invariant_prefill_computes_its_columns_instead_of_gathering_the_weights(llama_tiny):
    """The engine's prefill reads the decode layout's copy (split by output columns over fsdp8 in the mode): within
    `decode_layout.matmul_columns` each device computes its columns of every prompt token, so the compiled program
    gathers activations, never a weight (without it every layer's weights were gathered for every prompt); the
    prefix is the same bits either way."""
    import re

    import jax.numpy as jnp

    from jaxrl_llm.sampler.engine import decode_layout, programs

    cfg, params = llama_tiny
    cfg = dataclasses.replace(cfg, batch_invariant=True)
    mesh = sharding.make_mesh(MESHES["fsdp8"])
    placed = sharding.shard_params(params, param_logical_axes(cfg), mesh)
    copy = decode_layout.decode_weights(placed, "bfloat16", mesh, ("fsdp",), by_columns=True)
    ids = jnp.asarray(np.arange(3, 27, dtype=np.int32))  # a bucket of 24: no weight dim is 24
    run = {}
    for slot_axes in (("fsdp",), ()):
        compiled = programs.prefill.lower(copy, cfg, ids, np.int32(19), compute_dtype="bfloat16", mesh=mesh,
                                          slot_axes=slot_axes).compile()
        gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", compiled.as_text())
        weights = [g for g in gathered if re.search(r"\[(2,)?(64,128|128,64|256,64|64,4,16|4,16,64|64,2,16)\]", g)]
        assert bool(weights) == (not slot_axes), (slot_axes, gathered)
        run[slot_axes] = compiled(copy, ids, np.int32(19))  # the program just compiled (its dynamic arguments)
    for by_columns, gathered_weights in zip(jax.tree.leaves(run[("fsdp",)]), jax.tree.leaves(run[()])):
        np.testing.assert_array_equal(np.asarray(by_columns, np.float32), np.asarray(gathered_weights, np.float32))


def test_the_engine_decodes_from_a_copy_in_the_decode_layout(llama_tiny):
    """On fsdp8 the engine's copy of the weights (once per rollout) is cast to the compute dtype and laid out for
    decoding, values unchanged; with the slots replicated, fp32 weights are read as they are (no copy)."""
    from jaxrl_llm.sampler.engine import decode_layout

    cfg, params = llama_tiny
    mesh = sharding.make_mesh(MESHES["fsdp8"])
    placed = sharding.shard_params(params, param_logical_axes(cfg), mesh)
    copy = decode_layout.decode_weights(placed, "bfloat16", mesh, ("fsdp",))
    for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(copy)):
        assert y.sharding == decode_layout.decode_sharding(x, mesh, ("fsdp",))
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x.astype(y.dtype), np.float32))
    mlp = copy["layers"]["mlp"]["up_proj"]["kernel"]
    assert mlp.sharding.spec == jax.sharding.PartitionSpec(None, None, ("tensor", "fsdp"))
    assert decode_layout.decode_weights(placed, "float32", mesh, ()) is placed


@pytest.mark.parametrize("mesh_shape", [{"expert": 8}, {"fsdp": 2, "expert": 4}])
def test_the_decode_layout_leaves_an_expert_stack_where_the_experts_shard_map_reads_it(mesh_shape):
    """The MoE's shard_map takes the expert stacks in the trainer's layout (models/expert_parallel.py): the decode
    copy keeps them there while the dense weights move. (Moved onto their mlp dim, as until 2026-12-07, every
    decode step moved each layer's experts back: on 30B-A3B v5p-32 an all-to-all and five copies a layer.)"""
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.models.param_init import init_params
    from jaxrl_llm.sampler.engine import decode_layout

    cfg = ModelConfig.tiny("qwen3_moe")  # 8 experts of width 32: the mlp dim takes 8 ways
    mesh = sharding.make_mesh(mesh_shape)
    placed = sharding.shard_params(init_params(cfg, jax.random.key(0)), param_logical_axes(cfg), mesh)
    axes = slot_shards.batch_split(mesh)[0]
    copy = decode_layout.decode_weights(placed, "bfloat16", mesh, axes)
    for name, matrix in copy["layers"]["moe"]["experts"].items():
        trainer = placed["layers"]["moe"]["experts"][name]["kernel"].sharding
        assert matrix["kernel"].sharding.is_equivalent_to(trainer, 4), (name, matrix["kernel"].sharding.spec)
    if "fsdp" in mesh_shape:  # a dense weight's fsdp split moves to its heads
        dense = copy["layers"]["attn"]["q_proj"]["kernel"]
        assert dense.sharding.spec == jax.sharding.PartitionSpec(None, None, ("tensor", "fsdp"), None), dense.sharding
