"""Batching: how a step's rows are split and packed for the no-grad passes and the updates.

    layout.py  the types: `StepRows` (host metadata of a step's rows), `PackedLayout`, `UpdateLayout`
    plan.py    host planning (numpy): packed layouts, token-budget layouts, epoch orders
    ops.py     device side: packed forward, scatter back to the padded response layout
    step.py    `StepBatching`: one step's plan for every pass, from the run's `BatchPlan`
"""
from jaxrl_llm.batching.layout import PackedLayout, StepRows, UpdateLayout, sequence_spans
from jaxrl_llm.batching.ops import (
    filled_slots,
    pack_response,
    packed_response_hidden,
    response_coverage,
    unless_empty,
    unpack_response,
)
from jaxrl_llm.batching.plan import (
    balanced_orders,
    bucket,
    build_capacity_layout,
    build_layout,
    capacity_shape,
    epoch_orders,
    packing_stats,
    plan_capacity_chunks,
    plan_chunks,
    plan_update,
    prompt_groups,
    row_width,
    update_metrics,
)
from jaxrl_llm.batching.step import NO_PADS, PassLayout, StepBatching, UpdateSplit

__all__ = ["NO_PADS", "PackedLayout", "PassLayout", "StepBatching", "StepRows", "UpdateLayout", "UpdateSplit",
           "balanced_orders", "bucket", "build_capacity_layout", "build_layout", "capacity_shape", "epoch_orders",
           "filled_slots", "pack_response", "packed_response_hidden", "packing_stats", "plan_capacity_chunks",
           "plan_chunks", "plan_update", "prompt_groups", "response_coverage", "row_width", "sequence_spans",
           "unless_empty", "unpack_response", "update_metrics"]
