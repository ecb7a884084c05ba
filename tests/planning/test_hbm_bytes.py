"""HBM bytes counted from a compiled TPU program's text (planning/hbm_bytes.py): what each kind of instruction
moves, on hand-written HLO, and a layer scan compiled by the real TPU compiler, where XLA's own count is off."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from jaxrl_llm.planning.hbm_bytes import array_bytes, hbm_bytes_of, layer_loop_bytes, outside_loops_bytes
from jaxrl_llm.platform.tpu import libtpu_installed

MB = 1e6
# a stacked weight [4, 1000, 250] bf16 (2 MB, 0.5 MB a layer) sliced by a nested fusion; an in-place write of
# one row into a [64, 1000] f32 buffer; a while loop whose body runs both; on-chip (S(1)) buffers, a kernel
HLO = """HloModule test

%slice_layer (p0: bf16[4,1000,250], p1: s32[]) -> bf16[1000,250] {
  %p0 = bf16[4,1000,250]{2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,1000,250]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,1000,250}
  ROOT %b = bf16[1000,250]{1,0} bitcast(%ds)
}

%matmul (q0: bf16[4,1000,250], q1: s32[], q2: bf16[8,1000]{1,0}) -> f32[8,250] {
  %q0 = bf16[4,1000,250]{2,1,0:T(8,128)(2,1)} parameter(0)
  %q1 = s32[]{:T(128)} parameter(1)
  %q2 = bf16[8,1000]{1,0} parameter(2)
  %w = bf16[1000,250]{1,0} fusion(%q0, %q1), kind=kLoop, calls=%slice_layer
  ROOT %dot = f32[8,250]{1,0} convolution(%q2, %w), dim_labels=bf_io->bf
}

%write_row (r0: f32[64,1000], r1: f32[1,1000], r2: s32[]) -> f32[64,1000] {
  %r0 = f32[64,1000]{1,0} parameter(0)
  %r1 = f32[1,1000]{1,0} parameter(1)
  %r2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[64,1000]{1,0} dynamic-update-slice(%r0, %r1, %r2, %z)
}

%body (t: CARRY) -> CARRY {
  %t = CARRY parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %stack = bf16[4,1000,250]{2,1,0} get-tuple-element(%t), index=1
  %buffer = f32[64,1000]{1,0} get-tuple-element(%t), index=2
  %x = bf16[8,1000]{1,0} get-tuple-element(%t), index=3
  %y = f32[8,250]{1,0} fusion(%stack, %i, %x), kind=kOutput, calls=%matmul
  %row = f32[1,1000]{1,0:T(8,128)S(1)} custom-call(%y, %stack), custom_call_target="tpu_custom_call"
  %written = f32[64,1000]{1,0} fusion(%buffer, %row, %i), kind=kLoop, calls=%write_row
  %staged = f32[8,250]{1,0:T(8,128)S(1)} copy(%y)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = CARRY tuple(%next, %stack, %written, %x)
}

%cond (u: CARRY) -> pred[] {
  %u = CARRY parameter(0)
  %k = s32[] get-tuple-element(%u), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%k, %four), direction=LT
}

ENTRY %main (a: bf16[4,1000,250], b: f32[64,1000], x: bf16[8,1000]) -> f32[64,1000] {
  %a = bf16[4,1000,250]{2,1,0} parameter(0)
  %b = f32[64,1000]{1,0} parameter(1)
  %x = bf16[8,1000]{1,0} parameter(2)
  %cs = (bf16[4,1000,250]{2,1,0:T(8,128)(2,1)S(1)}, bf16[4,1000,250]{2,1,0}, u32[]{:S(2)}) copy-start(%a)
  %cd = bf16[4,1000,250]{2,1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %ss = ((bf16[4,1000,250]{2,1,0}), bf16[1,1000,250]{2,1,0:S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[0:1]}
  %zero = s32[] constant(0)
  %init = CARRY tuple(%zero, %a, %b, %x)
  %loop = CARRY while(%init), condition=%cond, body=%body
  ROOT %result = f32[64,1000]{1,0} get-tuple-element(%loop), index=2
}
""".replace("CARRY", "(s32[], bf16[4,1000,250]{2,1,0}, f32[64,1000]{1,0}, bf16[8,1000]{1,0})")


def test_each_instruction_moves_what_it_reads_and_writes():
    layer = 1000 * 250 * 2  # the one layer the nested fusion slices out of the 2 MB stack
    rows = 8 * 1000 * 2 + 8 * 250 * 4  # x in, y out
    write = 1000 * 4  # the kernel's row (on chip: read free) written in place, not the whole 256 kB buffer
    body = layer + rows + write + 8 * 250 * 4  # + y read by the copy into on-chip memory (its write is on chip)
    prologue = 4 * layer + layer  # the prefetch reads the stack (its on-chip copy is free), the staged slice a layer
    assert outside_loops_bytes(HLO) == pytest.approx(prologue)
    # the loop's body once, the kernel's call free (and a few bytes of scalar arithmetic)
    assert hbm_bytes_of(HLO) == pytest.approx(prologue + body, abs=64)


def test_on_chip_buffers_are_free_and_tuples_add_up():
    assert array_bytes("f32[8,128]{1,0:T(8,128)S(1)}") == 0
    assert array_bytes("f32[8,128]{1,0:T(8,128)S(1)}", on_chip=True) == 8 * 128 * 4
    assert array_bytes("(bf16[2,3]{1,0}, s32[4]{0}, pred[])") == 2 * 3 * 2 + 4 * 4 + 1


def test_a_kernel_with_a_cost_estimate_moves_its_operands_and_result():
    """A custom call whose backend config carries a cost estimate (the batch-invariant GEMM: models/invariant.py)
    reads its operands and writes its result where they live in HBM; one without stays free (its work is added
    by formula: planning/kernel_costs.py)."""
    estimated = HLO.replace('custom_call_target="tpu_custom_call"',
                            'custom_call_target="tpu_custom_call", backend_config={"cost_estimate":{"flops":"1"}}')
    y, stack = 8 * 250 * 4, 4 * 1000 * 250 * 2  # its operands in HBM; its row result is on chip (S(1)): free
    assert hbm_bytes_of(estimated) - hbm_bytes_of(HLO) == pytest.approx(y + stack)


def test_the_layer_loops_are_found_by_their_name_forward_and_backward():
    """`layer_loop_bytes`: the bodies of the while loops named as the layer scans (models/remat.py `scan_layers`),
    also under a transformation's name (a training step's backward scan), and no other loop."""
    loop = "condition=%cond, body=%body"
    assert HLO.count(loop) == 1
    named = HLO.replace(loop, loop + ', metadata={op_name="jit(step)/transpose(jvp(layer_scan))/while"}')
    body = hbm_bytes_of(HLO) - outside_loops_bytes(HLO)
    assert layer_loop_bytes(HLO) == 0  # an unnamed loop (a decode loop, a micro-batch loop)
    assert layer_loop_bytes(named) == pytest.approx(body, abs=64)
    other = named.replace("layer_scan", "layer_scanner")
    assert layer_loop_bytes(other) == 0


def _scan(layers: int, repeat: int, unroll: int = 1, named: bool = False):
    """A scan over `layers` layers of two bf16 [896, 4864] weights (17.4 MB a layer), each trip running its
    layer `repeat` times on 32 rows: the text the TPU compiler gives it, and XLA's own byte count. `named`: run
    by the models' `scan_layers` (one trip's bytes then readable by `layer_loop_bytes`)."""
    from jaxrl_llm.platform import tpu_target

    device = tpu_target("v5e:2x2").devices[0]
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))  # noqa: E731

    def run(w_in, w_out, x):
        def trip(h, weights):
            for _ in range(repeat):
                u = jnp.dot(h, weights[0], preferred_element_type=jnp.float32)
                h = jnp.dot(jax.nn.silu(u).astype(jnp.bfloat16), weights[1], preferred_element_type=jnp.float32)
                h = h.astype(jnp.bfloat16)
            return h, None
        if named:
            from jaxrl_llm.models.remat import scan_layers

            return scan_layers(trip, None, 1, x, (w_in, w_out))[0]
        return jax.lax.scan(trip, x, (w_in, w_out), unroll=unroll)[0]

    compiled = jax.jit(run).lower(spec(layers, 896, 4864), spec(layers, 4864, 896), spec(32, 896)).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return compiled.as_text(), analysis["bytes accessed"]


@pytest.mark.skipif(not libtpu_installed(), reason="libtpu not installed (pip install '.[tpu-plan]')")
def test_a_layer_scan_counts_one_layer_a_trip_on_tpu():
    """The plan reads a layer's cost as the program with each trip running its layer twice less the program as
    it runs (`ModelConfig.scan_repeat`). Counted from the text, that is one layer's weights; XLA's TPU count of
    the two-layers-a-trip program the plan used before (`lax.scan(unroll=2)`) charged ~5x that."""
    layer = 2 * 896 * 4864 * 2
    once, _ = _scan(24, 1)
    twice, _ = _scan(24, 2)
    assert hbm_bytes_of(once) == pytest.approx(layer, rel=0.02)
    assert hbm_bytes_of(twice) - hbm_bytes_of(once) == pytest.approx(layer, rel=0.02)
    _, unrolled_by_xla = _scan(24, 1, unroll=2)
    assert unrolled_by_xla - layer > 4 * layer  # (105 MB for a 17.4 MB layer with libtpu 0.0.42.1)
    # what the plan reads on TPU: the layer loop's body in the program as it runs
    named, _ = _scan(24, 1, named=True)
    assert layer_loop_bytes(named) == pytest.approx(layer, rel=0.02)


def test_the_plans_layer_count_repeats_the_layer():
    """scan_repeat runs each trip's layer that many times (the memory plan compiles it, a run never does)."""
    from jaxrl_llm.models import ModelConfig, forward_hidden, init_params

    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8)
    params = init_params(cfg, jax.random.PRNGKey(0))
    ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    mask = jnp.ones_like(ids)
    repeated, _ = forward_hidden(params, dataclasses.replace(cfg, scan_repeat=2), ids, mask)
    # the same layer twice a trip: layers (0, 0, 1, 1, 2, 2) of a six-layer stack
    doubled = jax.tree.map(lambda x: jnp.repeat(x, 2, axis=0), params["layers"])
    six = dataclasses.replace(cfg, num_hidden_layers=6)
    expected, _ = forward_hidden({**params, "layers": doubled}, six, ids, mask)
    assert jnp.allclose(repeated, expected, atol=1e-5), float(jnp.max(jnp.abs(repeated - expected)))
