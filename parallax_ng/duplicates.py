"""Duplicates: may a sparse gradient leave a worker with its duplicate rows
summed (coalesced)?

An IndexedSlices gradient of an embedding lookup holds one row per id read,
so ids that repeat send the same row several times. TensorFlow's optimizers
sum duplicate rows before a sparse apply (or scatter-add them), so a sum
taken earlier changes nothing there. A use that sees rows one by one would
see a different tensor: the squared norm of the values (`L2Loss`, as
`clip_by_global_norm` computes it) is a sum over rows, and a coalesced row
squares a sum instead of summing squares.

Requires: a TrainingGraph. Guarantees: `coalescing(tg, var)` is None unless
every use of `var`'s gradient values (the autodiff's own aside) reaches,
through ops that scale every row alike (Identity, IdentityN, Neg, Cast, a
product with a scalar), only ops that sum rows by index (sparse applies, scatter adds,
UnsortedSegmentSum) or `L2Loss` of the values themselves; then it lists
those `L2Loss` ops, whose value the aggregation must supply from the rows
before they were summed.
"""
from __future__ import annotations

from . import rules
from .frontend import TrainingGraph
from .ir import TensorRef

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
            if rules.is_autodiff(consumer) and ref == grad.values or (consumer, pos) in seen:
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
