"""What a shape vector says about a tensor's first dimension: the values
graph/batch.py reads where a reshape, a SparseToDense or a stack takes its
shape from tensors of the graph (`tf.shape(x)`, `[tf.shape(x)[0], -1]`, a
feature column's `dense_shape[:-1]`), and constant inputs.

Requires: a TrainingGraph (its IR and tf.Graph), or tf ops
(`tensordot_lead`, which graph/rows.py reads). Guarantees: reads the graph
only; each function answers None (or (None, False)) where the graph does
not show what it asks.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .ir import TensorRef


def leading(tg, ref: TensorRef):
    """The first entry of a shape vector: of a constant, or of the constant
    a concatenation or stack starts with ([-1] and the last dimension, as
    the softmax losses flatten their logits); else None."""
    value, parts = const(tg, ref), tg.ir.data_inputs(ref.node)
    if value is None and tg.ir.node(ref.node).op in ("ConcatV2", "Pack") and parts:
        value = const(tg, parts[0])     # a stack's first scalar, a concatenation's first vector
    if isinstance(value, list):
        return value[0] if value else None
    return value


def shape_of(tg, ref: TensorRef, first: dict) -> tuple:
    """(t's first dimension, whether the shape keeps the reshaped tensor's
    rows) where shape vector `ref` is tf.shape(t), or a stack that starts
    with tf.shape(t)[0] (`[tf.shape(x)[0], -1]`), or t's dimensions from
    its first on (tf.tensordot's result; a lookup in a partitioned table
    reshapes its rows to the ids' shape and the row's); else (None, False)."""
    node, parts = tg.ir.node(ref.node), tg.ir.data_inputs(ref.node)
    if node.op == "Shape" and parts:
        return first.get(parts[0]), False
    if node.op == "Pack" and parts and tg.ir.node(parts[0].node).op == "StridedSlice":
        sliced = tg.ir.data_inputs(parts[0].node)
        if tg.ir.node(sliced[0].node).op == "Shape" and \
                [const(tg, r) for r in sliced[1:4]] == [[0], [1], [1]]:
            return first.get(tg.ir.data_inputs(sliced[0].node)[0]), True
    if node.op == "ConcatV2" and len(parts) > 1 and (shaped := shape_head(tg, parts[0])):
        return first.get(shaped), False     # t's shape (or its head: a sparse lookup's), then more
    if node.op == "ConcatV2" and len(parts) > 1:    # tf.tensordot's: t's free dimensions first
        picked = tg.ir.data_inputs(parts[0].node)
        if tg.ir.node(parts[0].node).op == "GatherV2" and len(picked) == 3 and \
                tg.ir.node(picked[0].node).op == "Shape" and \
                leading(tg, picked[1]) == 0 and const(tg, picked[2]) == 0:
            return first.get(tg.ir.data_inputs(picked[0].node)[0]), False
    return None, False


def shape_head(tg, ref: TensorRef, hops: int = 16) -> TensorRef | None:
    """t where the first entry of shape vector (or scalar) `ref` is t's
    first dimension: tf.shape(t), through casts, slices and strided
    slices from 0, stacks and concatenations (their first part), and a
    SparseReshape's new shape (feature columns reshape their sparse ids to
    [tf.shape(x)[0], ...] and their lookups to dense_shape[:-1])."""
    node, parts = tg.ir.node(ref.node), tg.ir.data_inputs(ref.node)
    if not parts or hops == 0:
        return None
    if node.op == "Shape":
        return parts[0]
    if node.op == "SparseReshape" and ref.index == 1:
        return shape_head(tg, parts[2], hops - 1)
    if node.op in ("Slice", "StridedSlice") and (const(tg, parts[1]) or [None])[0] != 0 or \
            node.op == "StridedSlice" and const(tg, parts[3]) != [1]:
        return None
    if node.op in ("Cast", "Identity", "Slice", "StridedSlice", "Pack", "ConcatV2"):
        return shape_head(tg, parts[0], hops - 1)
    return None


def counted(tg, ref: TensorRef) -> bool:
    """Whether `ref`'s first column counts its rows: tf.stack([tf.range(n),
    ...], axis=1) (the Range through a Cast)."""
    node = tg.ir.node(ref.node)
    if node.op != "Pack" or node.attr["axis"].i not in (1, -1):
        return False
    column = tg.ir.past_identities(tg.ir.data_inputs(ref.node)[0])
    while tg.ir.node(column.node).op == "Cast":
        column = tg.ir.data_inputs(column.node)[0]
    if tg.ir.node(column.node).op != "Range":
        return False
    start, _, step = (tf.get_static_value(tg.tensor(r)) for r in tg.ir.data_inputs(column.node))
    return start is not None and step is not None and start == 0 and step == 1


def const(tg, ref: TensorRef):
    """The value of a constant input as a Python int or list, else None."""
    node = tg.ir.node(ref.node)
    if node.op == "Range":      # tf.range(1, tf.rank(x)) of an x of known rank
        value = tf.get_static_value(tg.tensor(ref))
        return None if value is None else value.tolist()
    if node.op != "Const":
        return None
    value = tf.make_ndarray(node.attr["value"].tensor)
    return value.tolist()


def restored_lead(op: tf.Operation):
    """(u, k, v) where Reshape `op` gives a product of v's rows (v reshaped
    to a matrix, times a weight, plus a bias) the shape of u's first k
    axes and more: tf.tensordot's result (u is v, its shape gathered at
    [0 .. k-1] first), or a projection written by hand back to a time-major
    input's layout (`tf.reshape(h @ w, [tf.shape(x)[0], tf.shape(x)[1],
    classes])`); else None. graph/rows.py keeps the batch's axis where u
    and v hold it at one of those k axes."""
    x = op.inputs[0].op
    while x.type in ("BiasAdd", "AddV2", "Add", "Identity") and x.inputs:
        x = x.inputs[0].op
    if x.type != "MatMul" or x.get_attr("transpose_a") or x.inputs[0].op.type != "Reshape":
        return None
    v = x.inputs[0].op.inputs[0]
    u, k = _leading_dims(op.inputs[1].op)
    if v.op.type == "Transpose":       # v's axes in order: the first k kept first
        perm = tf.get_static_value(v.op.inputs[1])
        v = v.op.inputs[0] if perm is not None and list(perm[:k]) == list(range(k)) else v
    return (u, k, v) if k else None


def _leading_dims(shape: tf.Operation) -> tuple:
    """(u, k) where shape vector `shape` starts with u's first k dimensions
    in order: gather(tf.shape(u), [0 .. k-1]) concatenated with more, or a
    stack of tf.shape(u)[0], ..., tf.shape(u)[k-1] and more; else (None, 0)."""
    if shape.type == "ConcatV2" and shape.inputs[0].op.type == "GatherV2" and \
            shape.inputs[0].op.inputs[0].op.type == "Shape":
        picked = shape.inputs[0].op
        at = tf.get_static_value(picked.inputs[1])
        k = 0 if at is None else np.size(at)
        return (picked.inputs[0].op.inputs[0], k) if k and \
            list(np.ravel(at)) == list(range(k)) else (None, 0)
    u, k = None, 0
    for entry in shape.inputs if shape.type == "Pack" else ():
        e = entry.op
        if e.type != "StridedSlice" or e.inputs[0].op.type != "Shape" or \
                not shape_entry(e, k) or \
                u is not None and e.inputs[0].op.inputs[0].name != u.name:
            break
        u, k = e.inputs[0].op.inputs[0], k + 1
    return (u, k) if k >= 2 else (None, 0)


def shape_entry(op: tf.Operation, k: int) -> bool:
    """Whether StridedSlice `op` takes entry k of a vector (`tf.shape(x)[k]`)."""
    begin, strides = (tf.get_static_value(op.inputs[i]) for i in (1, 3))
    return begin is not None and strides is not None and list(np.ravel(begin)) == [k] and \
        list(np.ravel(strides)) == [1] and op.get_attr("shrink_axis_mask") == 1
