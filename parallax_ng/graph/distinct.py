"""Distinct ids: whether a sparse gradient's indices hold each id once on
one device (TrainingGraph.rows_unique): then the replicas' rows, which
repeat the ids they share, are summed by id before any use sees them
(transforms/aggregate.py), as one device's gradient sums them.

Requires: a TrainingGraph (duck-typed: its IR and `variant`).
Guarantees: `holds_each_id_once(tg, ref)` is true for a Unique's ids, a
sparse segment reduction's gradient's ids (output 1), through Identity,
Reshape, Cast and StopGradient, and for a DynamicPartition's part of ids
computed from one Unique's ids by elementwise math and replica-invariant
operands (a partitioned table's rows); false otherwise.
"""
from __future__ import annotations

from .ir import TensorRef

UNIQUE_OPS = frozenset({"Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2"})
# gradients of sparse segment reductions of a variable: output 1 is its
# distinct ids, sorted (embedding_lookup_sparse on a reference variable)
SEGMENT_GRADS = frozenset({"SparseSegmentSumGradV2", "SparseSegmentMeanGradV2",
                           "SparseSegmentSqrtNGradV2"})
# elementwise ops a partitioned lookup maps ids to their parts' rows with
ROW_MATH = frozenset({"Identity", "Reshape", "Cast", "Select", "SelectV2", "FloorMod",
                      "FloorDiv", "Sub", "Add", "AddV2", "Mul", "Maximum", "Minimum", "Less",
                      "LessEqual", "Greater", "GreaterEqual"})


def holds_each_id_once(tg, ref: TensorRef) -> bool:
    """Whether `ref` holds each id once: a Unique's ids or a sparse
    segment gradient's (through Identity, Reshape, Cast), or a part of
    them by DynamicPartition (a table cut in row ranges: each part's
    ids, mapped to its rows, are distinct)."""
    for _ in range(16):
        node = tg.ir.node(ref.node)
        if node.op in UNIQUE_OPS:
            return ref.index == 0
        if node.op in SEGMENT_GRADS:
            return ref.index == 1
        if node.op == "DynamicPartition":
            return _of_one_unique(tg, tg.ir.data_inputs(ref.node)[0])
        if node.op not in ("Identity", "Reshape", "Cast", "StopGradient") or \
                not node.input:
            return False
        ref = tg.ir.data_inputs(ref.node)[0]
    return False


def _of_one_unique(tg, ref: TensorRef) -> bool:
    """Whether `ref` is computed from one Unique's ids by elementwise
    integer math and replica-invariant operands alone (the row within
    its part that a partitioned lookup computes for each id)."""
    roots, todo, seen = set(), [ref], set()
    while todo:
        r = todo.pop()
        if r in seen:
            continue
        seen.add(r)
        node = tg.ir.node(r.node)
        if node.op in UNIQUE_OPS:
            if r.index != 0:
                return False
            roots.add(r.node)
        elif r.node in tg.variant:
            if node.op not in ROW_MATH:
                return False
            todo.extend(tg.ir.data_inputs(r.node))
    return len(roots) == 1
