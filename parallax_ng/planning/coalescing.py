"""Duplicates: may a sparse gradient leave a worker with its duplicate rows
summed (coalesced)?

An IndexedSlices gradient of an embedding lookup holds one row per id read,
so ids that repeat send the same row several times. TensorFlow's optimizers
sum duplicate rows before a sparse apply (or scatter-add them), so a sum
taken earlier changes nothing there. A use that sees rows one by one would
see a different tensor: the squared norm of the values (`L2Loss`, as
`clip_by_global_norm` computes it) is a sum over rows, and a coalesced row
squares a sum instead of summing squares.

The forward pass has duplicates too: a lookup reads one row per id. With
`lookups(tg, var)` a pass finds the ops that gather rows of a variable, so
it can fetch each distinct row once and expand the rows where they are used.

Requires: a TrainingGraph. Guarantees: `coalescing(tg, var)` is None unless
every use of `var`'s gradient values (the autodiff's own aside) reaches,
through ops that scale every row alike (Identity, IdentityN, Neg, Cast, a
product with a scalar), only ops that sum rows by index (sparse applies, scatter adds,
UnsortedSegmentSum) or `L2Loss` of the values themselves; then it lists
those `L2Loss` ops, whose value the aggregation must supply from the rows
before they were summed. `lookups(tg, var)` lists the top-level ops that
read rows of `var` by index along axis 0 in the forward pass: ResourceGather
of its handle, and Gather/GatherV2 of a whole read of it (ReadVariableOp, a
reference variable's `read`, Identities after them), each with the reads in
between. A gather on the update side (after the gradients: an optimizer
slot's rows at the summed gradient's ids, graph/row_updates.py) is not a
lookup: its ids are alike on every replica and it runs with the update.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from ..graph import rules
from ..graph.frontend import TrainingGraph
from ..graph.ir import TensorRef

ROW_SUMS = frozenset({"UnsortedSegmentSum", "ResourceScatterAdd", "ResourceScatterSub",
                      "ScatterAdd", "ScatterSub"})
APPLY_PREFIXES = ("ResourceSparseApply", "SparseApply")


def coalescing(tg: TrainingGraph, var: str) -> tuple[str, ...] | None:
    grad = tg.gradients[var]
    if not grad.sparse:
        return None
    norms, todo, seen = [], [(grad.values, False)], set()
    while todo:
        ref, scaled = todo.pop()
        for consumer, pos in tg.ir.consumers.get(ref, ()):
            if rules.is_autodiff_use(tg.ir.node(consumer)) and ref == grad.values or \
                    (consumer, pos) in seen:
                continue
            seen.add((consumer, pos))
            op = tg.ir.node(consumer).op
            if op == "L2Loss" and not scaled:
                norms.append(consumer)
            elif op in ROW_SUMS or op.startswith(APPLY_PREFIXES):
                continue
            elif op == "Identity":
                todo.append((TensorRef(consumer, 0), scaled))
            elif op == "IdentityN":       # tf_keras optimizers pass gradients through one
                todo.append((TensorRef(consumer, pos), scaled))
            elif op in ("Neg", "Cast") or op == "Mul" and _by_a_scalar(tg, consumer, ref):
                todo.append((TensorRef(consumer, 0), True))
            else:
                return None
    return tuple(sorted(norms))


def _by_a_scalar(tg: TrainingGraph, name: str, ref: TensorRef) -> bool:
    others = [r for r in tg.ir.data_inputs(name) if r != ref]
    return len(others) == 1 and tg.tensor(others[0]).shape.rank == 0


@dataclass(frozen=True)
class Lookup:
    op: str                     # the gather
    via: tuple[str, ...] = ()   # whole reads of the variable between it and the gather


GATHERS = ("GatherV2", "Gather")


def lookups(tg: TrainingGraph, var: str) -> tuple[Lookup, ...]:
    ir, update_side = tg.ir, tg.after_gradients
    out, todo = [], [(var, ())]
    while todo:
        name, via = todo.pop()
        for consumer, pos in ir.consumers.get(TensorRef(name, 0), ()):
            nd = ir.node(consumer)
            if pos != 0 or _batch_dims(nd) or consumer in update_side:
                continue
            if nd.op == "ResourceGather" and name == var:
                out.append(Lookup(consumer))
            elif nd.op in GATHERS and via and _axis_zero(tg, nd):
                out.append(Lookup(consumer, via))
            elif nd.op == "ReadVariableOp" and name == var or nd.op == "Identity":
                todo.append((consumer, via + (consumer,)))
    return tuple(sorted(out, key=lambda lk: lk.op))


def _batch_dims(nd) -> int:
    return nd.attr["batch_dims"].i if "batch_dims" in nd.attr else 0


def _axis_zero(tg: TrainingGraph, nd) -> bool:
    if nd.op == "Gather":
        return True
    axis = tg.ir.data_inputs(nd.name)[2]
    const = tg.ir.node(axis.node)
    if const.op != "Const" or axis.index:
        return False
    return int(tf.make_ndarray(const.attr["value"].tensor)) == 0
