"""Rows of the batch in another order: `tf.roll` or `tf.reverse` along the
batch's axis, `tf.random.shuffle` of the batch, and `tf.gather` of its rows
at a permutation of their indices (`tf.range` over the rows, reversed or
shuffled). Such a tensor still holds one row per example, so a sum or a
mean over it is the batch's; but where it meets the batch's rows in
their own order (mixup's `x * lam + tf.reverse(x, [0]) * (1 - lam)`, a
shifted copy as negatives), example i meets another example, which on a
replica is one of its own rows and on one device one of the global
batch's: graph/mixing.py names such a loss, and runtime/combining.py
does not join such a fetch as one device's.

Requires: a graph/rows.py reading (its `axis`, `counts_rows`, `memo`).
Guarantees: reads the graph only; `order` is the set of reorderings between
the data and a tensor (empty: the rows in the data's order).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

_PASS = ("Cast", "Identity")
_SHIFTS = ("Sub", "AddV2", "Add")      # n - 1: tf.range(n - 1, -1, -1) starts there


def permutation(t: tf.Tensor, rows) -> bool:
    """Whether `t` holds the indices of the batch's rows in some order:
    `tf.range` from or to their count (reversed: from `n - 1` down), or a
    `tf.random.shuffle` of one."""
    op = _past(t.op)
    if op.type == "RandomShuffle":
        return permutation(op.inputs[0], rows)
    return op.type == "Range" and any(_counts(op.inputs[k], rows) for k in (0, 1))


def reorders(op: tf.Operation, rows) -> tuple | None:
    """A key naming how `op` reorders its input's rows along the batch's
    axis (equal keys: one order), or None where it keeps their order."""
    if not op.inputs:
        return None
    x = op.inputs[0]
    a, rank = rows.axis(x), x.shape.rank
    if a is None or not rank:
        return None
    if op.type in ("Roll", "ReverseV2"):
        axes = tf.get_static_value(op.inputs[2 if op.type == "Roll" else 1])
        if axes is None or a not in {int(v) % rank for v in np.atleast_1d(axes)}:
            return None
        if op.type == "ReverseV2":
            return (op.type,)
        shift = tf.get_static_value(op.inputs[1])
        return op.type, op.inputs[1].name if shift is None else repr(np.ravel(shift).tolist())
    if op.type == "RandomShuffle":
        return (op.type, op.name) if a == 0 else None
    if op.type == "GatherV2" and op.get_attr("batch_dims") == 0:
        at = tf.get_static_value(op.inputs[2])
        if at is not None and int(np.ravel(at)[0]) % rank == a and \
                permutation(op.inputs[1], rows):
            return op.type, _past(op.inputs[1].op).name
    return None


def order(t: tf.Tensor, rows) -> frozenset:
    """The reorderings (`reorders`' keys) between the data and `t`, read
    through the inputs that hold the batch's rows; empty where `t` has no
    batch's axis or keeps the data's order."""
    key = ("order", t.name)
    if key not in rows.memo:
        rows.memo[key] = frozenset()        # (a loop meets itself: none)
        rows.memo[key] = _order(t, rows)
    return rows.memo[key]


def _order(t, rows) -> frozenset:
    op = t.op
    if rows.axis(t) is None or op.name in rows.sources:
        return frozenset()
    if (key := reorders(op, rows)) is not None:     # (reversed twice: the data's order)
        return order(op.inputs[0], rows) ^ {key} if key == ("ReverseV2",) else \
            order(op.inputs[0], rows) | {key}
    ins = [x for x in op.inputs if x.dtype not in (tf.resource, tf.variant) and
           rows.axis(x) is not None]
    return frozenset().union(*(order(x, rows) for x in ins))


def _counts(t, rows) -> bool:
    """Whether scalar `t` is the count of the batch's rows, or it shifted
    by a constant (n - 1)."""
    op = _past(t.op)
    if op.type in _SHIFTS and tf.get_static_value(op.inputs[1]) is not None:
        op = _past(op.inputs[0].op)
    return rows.counts_rows(op)


def _past(op):
    while op.type in _PASS:
        op = op.inputs[0].op
    return op
