"""Sums across replicas that the program asks for itself, through
`tf.distribute`'s `ReplicaContext.all_reduce`: synchronized batch
normalization (Keras 3's `BatchNormalization(synchronized=True)`,
tf_keras's and `tf.keras.layers.experimental.SyncBatchNormalization`)
all-reduces each replica's count, sum and sum of squares, so its
statistics are the whole batch's. Built with no strategy, as a program
for one device is, TensorFlow's default replica context has one replica:
each such all-reduce is an IdentityN whose custom gradient is the
all-reduce of the incoming gradient. In a parallel step each is the sum
(or mean) over every replica of the job, and so is its gradient's
(transforms/state_sync.py), which makes the statistics those of the
global batch, forward and backward, as one device computes them. The
all-reduce Keras 3's optimizers apply to the gradients before their
update is left alone: the plan's aggregation is that one.

Requires: a graph built in this process (a custom gradient's function is
found in TensorFlow's gradient registry by the op's `_gradient_op_type`).
Guarantees: reads the graph only; `points` gives, in graph order, every
value such an all-reduce returns and whether it is a mean.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

from . import rules

# the qualified name of the gradient function tf.distribute gives each
# all-reduce of a replica context: the all-reduce of the incoming gradients
_ALL_REDUCE_GRADIENT = "all_reduce.<locals>.grad_wrapper.<locals>.<lambda>"


def points(graph: tf.Graph, gradients: set[str]) -> list[tuple[str, bool]]:
    """(tensor name, mean) of each value the graph's replica-context
    all-reduces return: those of the forward computation, and those of the
    autodiff (the gradients of the former). An all-reduce computed from
    `gradients` (names of the variables' gradients) that gives no autodiff
    op its results is an optimizer's, of the gradients (after its
    clipping, loss scale or accumulation): not one of them."""
    out, after = [], _computed_from(graph, gradients)
    for op in graph.get_operations():
        if op.type != "IdentityN" or "_gradient_op_type" not in op.node_def.attr or \
                (reduce_op := _reduction(op)) is None:
            continue
        n = len(op.outputs) // 2        # (results..., arguments...) of tf.custom_gradient
        if op.name in after and not any(
                rules.is_autodiff(c.name) and c.type not in rules.CONTROL_FLOW_ENTRIES
                for t in op.outputs[:n] for c in t.consumers()):
            continue
        out += [(t.name, reduce_op == tf.distribute.ReduceOp.MEAN) for t in op.outputs[:n]]
    return out


def _computed_from(graph: tf.Graph, tensors: set[str]) -> set[str]:
    """Names of the ops whose inputs hold, through data edges, any of
    `tensors` (a variable's value written from them and read again is not
    followed: that is an order, by control edges)."""
    seen, stack = set(), [graph.get_tensor_by_name(name) for name in tensors]
    while stack:
        for op in stack.pop().consumers():
            if op.name not in seen:
                seen.add(op.name)
                stack.extend(op.outputs)
    return seen


def _reduction(op) -> tf.distribute.ReduceOp | None:
    """The ReduceOp of a replica context's all-reduce that `op` is; None if
    its custom gradient is another function."""
    try:
        fn = tf_ops.get_gradient_function(op)
    except LookupError:        # registered in another process: not one of this graph's
        return None
    for _ in range(4):          # the registry's wrapper, the tape's, then the program's
        cells = dict(zip(fn.__code__.co_freevars, map(_contents, fn.__closure__ or ())))
        if fn.__qualname__.endswith(_ALL_REDUCE_GRADIENT):
            found = cells.get("reduce_op")
            return found if isinstance(found, tf.distribute.ReduceOp) else None
        inner = [v for v in cells.values() if callable(v) and hasattr(v, "__code__")]
        if len(inner) != 1:
            return None
        fn = inner[0]
    return None


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:          # a cell not yet filled
        return None
