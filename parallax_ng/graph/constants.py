"""Values the graph fixes before any data flows: a tensor's value where
constants alone make it (`constant_value`: folded by TensorFlow, or
computed once), where the size of an axis other than the batch's counts
as a constant (a feature count, `tf.shape(y)[1]` of y [None, 3]: the same
on every replica), and the op types that give the data.

Requires: tf.Tensors of a graph. Guarantees: reads the graph only (a
computed value runs a copy of the few ops that make it, in a graph of its
own).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import compat

# ops that give data: an input pipeline's, a queue's, a fed placeholder's (a
# SparseTensor's shape is a PlaceholderWithDefault)
SOURCE_TYPES = ("IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue", "Placeholder",
                "PlaceholderWithDefault", "QueueDequeueV2", "QueueDequeueManyV2",
                "QueueDequeueUpToV2", "QueueDequeue", "QueueDequeueMany", "QueueDequeueUpTo")
_MOST_OPS = 256     # a count or a scale is a few ops; a larger graph is not evaluated


def constant_value(t: tf.Tensor):
    """The value of `t` where constants alone make it: folded by TensorFlow,
    or computed by running the ops between it and its constants once
    (tf.compat.v1.losses counts a batch of static shape so: the Sum of a
    broadcast of ones), with the static size of an axis read from a
    tensor's shape (`static_size`) a constant; None where one of them reads
    data or state, draws, or calls a function."""
    value = tf.get_static_value(t)
    if value is not None:
        return value
    ops, stack = {}, [t.op]
    while stack:
        op = stack.pop()
        if op.name in ops:
            continue
        if (size := static_size(op)) is not None:
            ops[op.name] = _const(size, op.outputs[0].dtype)
            continue
        if len(ops) >= _MOST_OPS or op.type in SOURCE_TYPES or op._is_stateful or \
                op.graph._is_function(op.type):       # noqa: SLF001 (TensorFlow's own flags)
            return None
        ops[op.name] = op.node_def
        stack.extend([x.op for x in op.inputs] + list(op.control_inputs))
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(t.graph.graph_def_versions)
    for name, node_def in ops.items():
        node = graph_def.node.add()
        node.CopyFrom(node_def)
        node.name = name
        node.device = ""                      # the user's placement is not this one's
        node.attr.pop("_class", None)
    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as sess:
            return sess.run(t.name)
    except (tf.errors.OpError, ValueError):
        return None


def _const(value, dtype: tf.DType):
    node = tf.compat.v1.NodeDef(op="Const")
    node.attr["dtype"].type = dtype.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype))
    return node


def static_size(op: tf.Operation) -> int | None:
    """The size of axis k > 0 of x where `op` is `tf.shape(x)[k]` and x's
    shape fixes it (not the first: a batch's, which TensorFlow folds only
    where the whole shape is fixed); else None."""
    x, k = _entry(op)
    return None if x is None or k == 0 else compat.dim(x.shape, k)


def other_axis_size(op: tf.Operation, axis_of) -> bool:
    """Whether `op` is `tf.shape(x)[k]` for an axis k of x other than its
    batch's (`axis_of(x)`: a feature count), the same on every replica."""
    x, k = _entry(op)
    return x is not None and axis_of(x) not in (None, k)


def _entry(op: tf.Operation):
    """(x, k) where `op` is `tf.shape(x)[k]` (k a constant, counted from
    the first axis of x, whose rank is known); else (None, None)."""
    if op.type != "StridedSlice" or op.inputs[0].op.type != "Shape" or \
            not op.get_attr("shrink_axis_mask") & 1:
        return None, None
    x, k = op.inputs[0].op.inputs[0], tf.get_static_value(op.inputs[1])
    if k is None or not x.shape.rank:
        return None, None
    return x, int(np.ravel(k)[0]) % x.shape.rank
