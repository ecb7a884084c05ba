"""HBM bytes a compiled TPU program moves, counted from its optimized HLO text (loop bodies once, as XLA's own
cost analysis counts them; planning/roofline.py multiplies the loops in).

Why not XLA's `cost_analysis()["bytes accessed"]`: on TPU it charges a fusion that slices one layer out of
the stacked weights inside a nested fusion with the whole stack, and an in-place update of a buffer with the
whole buffer. Measured with libtpu 0.0.42.1 (tests/planning/test_hbm_bytes.py): a scan over 24 layers whose
layer reads 17.4 MB of weights counts 18 MB, but 105 MB with two layers a trip (`lax.scan(unroll=2)`) and
52 MB with its one layer unrolled; the paged engine's 0.5B decode step on v5e-8 counted ~38-74 MB a layer for
a chip's ~4 MB share of the weights. The plan read its per-layer cost from such differences.

What is counted, per instruction of the entry computation and, once each, of the loop bodies and called
computations it runs:
- a fusion reads its operands and writes its result. An operand the fused code only slices (dynamic-slice,
  slice, gather, through bitcasts and nested fusions) is read for the slices' bytes; a result that updates an
  operand in place (a dynamic-update-slice or scatter at the fusion's root) writes the update's bytes and does
  not read the rest of that operand;
- any other instruction likewise (a copy, a collective's local read and write, a sort);
- what lives in on-chip memory (a layout's memory space S(1) and up: VMEM, SMEM) costs nothing;
- a custom call (a Pallas kernel) with a cost estimate of its own (`pl.CostEstimate` in its backend config: the
  batch-invariant GEMM, models/invariant.py) reads its operands and writes its result as any instruction does
  (once each: a block fetched again for another block of the grid is not counted); one without costs nothing:
  planning/kernel_costs.py adds the attention kernels' work by formula, as it did against XLA's count, which
  does not look into them either;
- bookkeeping (parameters, constants, tuples, bitcasts, the `-done` half of an async pair) costs nothing.
A conditional counts its largest branch.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5, "token": 0}
# an array type with its optional layout: bf16[24,896,608]{2,1,0:T(8,128)(2,1)S(1)}
ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
# `%name = TYPE op(` at the start of an instruction line (TYPE: an array or a parenthesised tuple)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
FREE_OPS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
                      "replica-id", "iota", "opt-barrier", "add-dependency", "custom-call", "domain"})
SLICING_OPS = frozenset({"dynamic-slice", "slice", "gather"})
IN_PLACE_OPS = {"dynamic-update-slice": 1, "scatter": 2}  # op -> the operand holding the update
_KERNEL_ESTIMATE = '"cost_estimate":{'  # a custom call's backend config: a Pallas kernel that gives its costs


def array_bytes(type_text: str, on_chip: bool = False) -> float:
    """Bytes of the arrays in an HLO type (an array or a tuple of arrays) that live in HBM: a layout's memory
    space S(1) and up is on-chip (`on_chip`: those count too)."""
    total = 0.0
    for dtype, dims, layout in ARRAY.findall(type_text):
        if dtype not in _DTYPE_BYTES:
            continue
        space = _SPACE.search(layout or "")
        if space and int(space.group(1)) > 0 and not on_chip:
            continue
        total += _DTYPE_BYTES[dtype] * float(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type_text: str
    op: str
    operands: tuple[str, ...]
    arguments: str  # the operand list's text (a parameter's number)
    attributes: str  # the text after the operand list
    root: bool


def _split_operands(rest: str) -> tuple[tuple[str, ...], str, str]:
    """(the %names in the operand list, its text, the attributes after it) of an instruction's text after
    `op(`."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
            if depth == 0:
                end = i
                break
    return tuple(re.findall(r"%([\w.\-]+)", rest[:end])), rest[:end], rest[end + 1:]


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """({computation name: its instructions}, the entry computation's name) of an HLO module's text."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            name, type_text, op, rest = match.groups()
            operands, arguments, attributes = _split_operands(rest)
            computations[current].append(Instruction(name, type_text, op, operands, arguments, attributes,
                                                     line.lstrip().startswith("ROOT")))
    return computations, entry


class _Counter:
    def __init__(self, text: str) -> None:
        self.computations, self.entry = parse_module(text)
        self.types = {i.name: i.type_text for body in self.computations.values() for i in body}
        self._reads: dict[tuple[str, int], float | None] = {}
        self._runs: dict[str, float] = {}

    def parameter_read(self, computation: str, index: int) -> float | None:
        """Bytes a fused computation reads of its parameter `index` when it only slices it (through bitcasts
        and nested fusions), else None (read whole). 0.0 where it is only the target of an in-place update."""
        if (computation, index) not in self._reads:
            self._reads[computation, index] = self._parameter_read(computation, index)
        return self._reads[computation, index]

    def _parameter_read(self, computation: str, index: int) -> float | None:
        body = self.computations.get(computation, [])
        name = next((i.name for i in body if i.op == "parameter" and i.arguments.strip() == str(index)), None)
        return None if name is None else self._slice_read(computation, name)

    def _slice_read(self, computation: str, name: str) -> float | None:
        body = self.computations[computation]
        if any(i.root and i.name == name for i in body):
            return None  # the computation's result: read whole by whoever reads it
        total = 0.0
        users = [i for i in body if name in i.operands]
        for user in users:
            if user.op in SLICING_OPS and user.operands[0] == name:
                total += array_bytes(user.type_text)
            elif user.op == "bitcast":
                inner = self._slice_read(computation, user.name)
                if inner is None:
                    return None
                total += inner
            elif user.op in IN_PLACE_OPS and user.operands[0] == name and name not in user.operands[1:]:
                continue  # updated in place: the untouched part is neither read nor written
            elif user.op == "fusion":
                called = _CALLED.search(user.attributes)
                inner = None if called is None else self.parameter_read(called.group(1), user.operands.index(name))
                if inner is None:
                    return None
                total += inner
            else:
                return None
        return total

    def written(self, computation: str | None, instruction: Instruction) -> float:
        """Bytes an instruction writes to HBM: its result (where its own type places it: the fused code's types
        do not say), less what an in-place update at the root leaves untouched."""
        results = [array_bytes(f"{d}[{dims}]{layout}") for d, dims, layout in ARRAY.findall(instruction.type_text)]
        if computation is None:
            roots, named = [instruction], {}
        else:
            body = self.computations.get(computation, [])
            named = {i.name: i for i in body}
            root = next((i for i in body if i.root), instruction)
            roots = [named[o] for o in root.operands if o in named] if root.op == "tuple" else [root]
        total = sum(results)
        for result, root in zip(results, roots):
            while root.op == "bitcast" and root.operands and root.operands[0] in named:
                root = named[root.operands[0]]
            if root.op in IN_PLACE_OPS and result > 0:  # only the update is written
                total -= result - min(result, array_bytes(self.types.get(root.operands[IN_PLACE_OPS[root.op]], "")))
        return total

    def computation_bytes(self, computation: str) -> float:
        """HBM bytes of one run of `computation` (module doc)."""
        if computation not in self._runs:
            self._runs[computation] = sum(self.instruction_bytes(i) for i in self.computations.get(computation, []))
        return self._runs[computation]

    def instruction_bytes(self, inst: Instruction) -> float:
        op = inst.op
        kernel = op == "custom-call" and _KERNEL_ESTIMATE in inst.attributes  # counted as any instruction
        if (op in FREE_OPS and not kernel) or op.endswith("-done"):
            return 0.0
        if op == "while":
            return sum(self.computation_bytes(c) for c in _CALLED.findall(inst.attributes))
        if op == "conditional":
            branches = _BRANCHES.search(inst.attributes)
            names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else _CALLED.findall(inst.attributes)
            return max((self.computation_bytes(c) for c in names), default=0.0)
        if op in ("call", "async-start"):
            return sum(self.computation_bytes(c) for c in _CALLED.findall(inst.attributes))
        called = _CALLED.search(inst.attributes) if op == "fusion" else None
        fused = called.group(1) if called else None
        read = 0.0
        for index, operand in enumerate(inst.operands):
            whole = array_bytes(self.types.get(operand, ""))
            if fused is not None:
                part = self.parameter_read(fused, index)
                read += whole if part is None else min(part, whole)
            elif op in IN_PLACE_OPS and index == 0:
                continue  # the buffer updated in place
            elif op in SLICING_OPS and index == 0:
                read += array_bytes(inst.type_text)
            else:
                read += whole
        if op == "slice-start":  # staged into on-chip memory: reads the slice of its HBM operand
            parts = ARRAY.findall(inst.type_text)
            return array_bytes("{}[{}]".format(*parts[-2][:2]), on_chip=True) if len(parts) >= 2 else read
        if op.endswith("-start") and inst.type_text.startswith("("):
            # an async pair's tuple: copy-start's is (destination, source, context), a collective's (operand,
            # result, ...): the destination is what it writes
            parts = [array_bytes(f"{d}[{dims}]{layout}") for d, dims, layout in ARRAY.findall(inst.type_text)]
            return read + (parts[0] if op == "copy-start" else parts[1] if len(parts) > 1 else 0.0)
        return read + self.written(fused, inst)


@functools.lru_cache(maxsize=2)
def _counter(text: str) -> _Counter:
    """One parse of a program's text for both counts (the paged sampler asks for its total and its prologue)."""
    return _Counter(text)


def hbm_bytes_of(text: str) -> float:
    """HBM bytes of a compiled program's HLO text (`compiled.as_text()`), loop bodies counted once."""
    counter = _counter(text)
    return 0.0 if counter.entry is None else counter.computation_bytes(counter.entry)


def outside_loops_bytes(text: str) -> float:
    """The part of `hbm_bytes_of(text)` outside the entry computation's loops: what one call moves before and
    after them (a decode call's prologue: weights relaid out or staged into on-chip memory), which the
    loops' trips do not repeat."""
    counter = _counter(text)
    if counter.entry is None:
        return 0.0
    return sum(counter.instruction_bytes(i) for i in counter.computations[counter.entry] if i.op != "while")


# a layer scan's while loop (models/remat.py LAYER_SCAN): `layer_scan/while`, or under a transformation's name
# (`transpose(jvp(layer_scan))/while`: the backward's)
_LAYER_LOOP = re.compile(r'op_name="[^"]*\blayer_scan\)*/while"')


def layer_loop_bytes(text: str) -> float:
    """HBM bytes of one trip of each of the program's layer scans (models/remat.py `scan_layers`: a training
    step's forward and backward scans, a decode step's), summed: what each layer past the first adds to
    `hbm_bytes_of(text)`, read from the program itself (planning/memory.py `Planner.costed`). Compiling another
    program with more layers a trip to see the difference moved the weights XLA keeps in on-chip memory between
    the two (on 0.5B v5e-8: the LM head staged once a call in one, every step in the other), and then that
    difference was not a layer's cost."""
    counter = _counter(text)
    return sum(counter.computation_bytes(c) for body in counter.computations.values() for inst in body
               if inst.op == "while" and _LAYER_LOOP.search(inst.attributes)
               for c in _CALLED.findall(inst.attributes))
