"""Rows a mask picks from the batch: `tf.boolean_mask(x, mask)`,
`tf.gather(x, tf.where(mask)...)` and `tf.dynamic_partition(x, parts, n)`,
where x and the mask (or the partitions) hold the batch's examples (or
their elements) first. Their count is the data's: a replica
picks its own number of rows, maybe none. So a mean over picked rows is a
sum over the batch divided by a count the data sets, and one device's mean
over the global batch is the replicas' sum over the sum of their counts
(transforms/selected_means.py makes each replica divide so).

Requires: tf.Tensors of a graph and a graph/rows.py reading of its data
sources. Guarantees: reads the graph only; `picked` answers False where
the ops do not show a mask's selection of the batch's rows.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import rules
from .rows import reading
from .rules import ELEMENTWISE

# ops that pass the indices of tf.where on: tf.boolean_mask squeezes them,
# scripts slice (`[:, 0]`), reshape or cast them
_INDEX_PATHS = ("Squeeze", "Reshape", "StridedSlice", "Cast", "Identity")
# ops that keep picked rows rows (the control-flow forms aside)
_ROW_WISE = (ELEMENTWISE - {"Enter", "Exit", "Merge", "Switch", "NextIteration"}) | {
    "SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"}
# ops that keep a tensor's first axis the batch's rows (or their elements,
# flattened): tf.boolean_mask reshapes x and the mask so
_FLATTENING = ("Reshape", "Identity")


def picked(x: tf.Tensor, sources, hops: int = 16) -> bool:
    """Whether `x` is rows of a tensor of the batch's examples picked at the
    places a mask of the batch is true: a GatherV2 along axis 0 (or a
    Gather, or a GatherNd) at indices that tf.where makes of that mask, an
    output of a DynamicPartition of the batch's rows by the batch's, or
    a row-wise function of such rows (elementwise ops with scalars or
    tensors of static shape, a cross-entropy of picked logits and labels,
    a product with a weight, a reduction over other axes), at most `hops`
    such functions after the pick (a loss's are a few: the walk stays short
    on a deep model's tensors, which are not picked)."""
    rows, op = reading(sources, x.graph), x.op
    if op.type in _ROW_WISE or op.type in ("MatMul", "Sum", "Mean", "Max", "Min", "Prod"):
        return hops > 0 and _row_wise(op, rows, hops - 1)
    if op.type == "DynamicPartition":   # the rows whose partition is this output's
        return _first_rows(op.inputs[0], rows) and _first_rows(op.inputs[1], rows)
    if op.type == "GatherV2":
        axis = tf.get_static_value(op.inputs[2])
        if axis is None or int(np.ravel(axis)[0]) != 0 or op.get_attr("batch_dims"):
            return False
    elif op.type not in ("Gather", "GatherNd"):
        return False
    mask = mask_of(op.inputs[1], op.type != "GatherNd")
    return mask is not None and _first_rows(mask, rows) and _first_rows(op.inputs[0], rows)


def mask_of(indices: tf.Tensor, squeezed: bool = True) -> tf.Tensor | None:
    """The mask whose true places `indices` are (`tf.where(mask)`, squeezed,
    reshaped, sliced or cast after where `squeezed`), or None."""
    where = indices.op
    while where.type in _INDEX_PATHS and squeezed:
        where = where.inputs[0].op
    if where.type == "Cast":
        where = where.inputs[0].op
    return where.inputs[0] if where.type == "Where" and len(where.inputs) == 1 else None


def _row_wise(op: tf.Operation, rows, hops: int) -> bool:
    """Whether `op` is a row-wise function of picked rows (`picked`)."""
    if op.type == "MatMul":             # picked rows times a weight
        return not op.get_attr("transpose_a") and picked(op.inputs[0], rows, hops)
    if op.type in ("Sum", "Mean", "Max", "Min", "Prod"):
        axes, rank = tf.get_static_value(op.inputs[1]), op.inputs[0].shape.rank
        return bool(rank) and axes is not None and \
            0 not in np.atleast_1d(axes) % rank and picked(op.inputs[0], rows, hops)
    ins = [t for t in op.inputs if t.shape.rank != 0 and not t.shape.is_fully_defined()]
    return bool(ins) and all(picked(t, rows, hops) for t in ins)


def counted(op: tf.Operation, sources) -> bool:
    """Whether `op` counts rows a mask picks: tf.size of them, or
    tf.shape(x)[0] (maybe cast). The replicas' counts add up to one
    device's."""
    while op.type == "Cast":
        op = op.inputs[0].op
    if op.type == "Size":
        return picked(op.inputs[0], sources)
    if op.type != "StridedSlice" or op.inputs[0].op.type != "Shape" or \
            not op.get_attr("shrink_axis_mask"):
        return False
    at = tf.get_static_value(op.inputs[1])
    return at is not None and int(np.ravel(at)[0]) == 0 and \
        picked(op.inputs[0].op.inputs[0], sources)


def _first_rows(t: tf.Tensor, rows) -> bool:
    """Whether t's first axis holds the batch's examples, or their elements
    (a reshape of such a tensor that flattens its leading axes)."""
    while not rows.guarded(lambda r: r.rows(t)):
        if t.op.type not in _FLATTENING:
            return False
        t = t.op.inputs[0]
    return True


def gradient_divisions(mean: tf.Operation) -> list[tf.Operation]:
    """The autodiff's divisions by the count of a Mean's input (tf's
    gradient of a mean whose input shape is known at run time only:
    RealDiv(grad, Cast(Prod(Gather(Shape(x), axes))))): they take the
    count the mean divides by."""
    x, out = mean.inputs[0], []
    for shape in x.consumers():
        if shape.type != "Shape":
            continue
        for gather in shape.outputs[0].consumers():
            for prod in gather.outputs[0].consumers() if gather.type == "GatherV2" else ():
                for cast in prod.outputs[0].consumers() if prod.type == "Prod" else ():
                    out += [c for c in cast.outputs[0].consumers() if cast.type == "Cast"
                            and c.type == "RealDiv" and c.inputs[1] is cast.outputs[0]]
    return out


def used_per_row(mean: tf.Operation, sources) -> str | None:
    """The first op (not the autodiff's) that takes `mean`'s value into a
    tensor of rows (the batch's, or picked ones: a normalization by it),
    or None where it flows into scalars only (a loss, a metric)."""
    rows, stack, seen = reading(sources, mean.graph), [mean], {mean.name}
    while stack and len(seen) < _MOST_OPS:
        for t in stack.pop().outputs:
            for c in t.consumers():
                if c.name in seen or rules.is_autodiff(c.name):
                    continue
                seen.add(c.name)
                if any(o.shape.rank != 0 and (rows.guarded(lambda r: r.axis(o)) is not None
                                              or picked(o, rows)) for o in c.outputs):
                    return c.name
                stack.append(c)
    return None


_MOST_OPS = 2000    # a loss's and its metrics' scalar ops are a few
