"""Sums over the batch that a loss takes through a function not linear in
them: a Dice or Tversky loss's ratio `1 - 2 sum(y p) / (sum(y) + sum(p))`,
a sum over a squared count, a mean over classes of each class's mean
(sums per class: tf.math.unsorted_segment_sum of the batch's rows at their
labels, whose gradient is gathered back to the rows at the labels). Each
replica computing the function of its own
rows' sums gives no gradient whose mean or sum over the replicas is one
device's; with every such Sum replaced by the job's (the replicas' sum,
forward) each replica computes one device's value, and with the Sum's
incoming gradient replaced by the replicas' sum of it too (N times what
each replica's copy of the function gives it), the mean of the replicas'
gradients is one device's: for any function f of sums S_j,
(1/N) sum_r N df/dS_j dS_j^r = df/dS_j dS_j, the chain rule over the global
batch (transforms/state_sync.py exchanges both; graph/forms.py reads such
a loss as a mean).

Requires: scalars of a graph with a graph/rows.py reading of its data
sources. Guarantees: reads the graph only; None wherever a value is not
made of such Sums alone, or a Sum's incoming gradient is not found where
the autodiff differentiates it (never half an exchange). `differentiable`
and `no_count` tell graph/forms.py which divisors are no count of the
batch (a gradient flows through them, or they are a statistic of it),
`counts_elements` which count a batch tensor's elements (Keras's masked
mean divides by one).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import selections
from .applied import over_the_batch, per_segment
from .mean_gradients import Autodiff, incoming_segments, incoming_sum
from .rows import batch_axis, counts_rows, reading
from .rules import is_autodiff

_SHAPE_ONLY = ("OnesLike", "ZerosLike", "Shape", "ShapeN", "Size", "Rank")
_VARIABLE_READS = ("ReadVariableOp", "VariableV2", "ResourceGather")


def differentiable(t: tf.Tensor, most: int = 4096) -> bool:
    """Whether a gradient can flow from `t` into a variable: `t` reads one
    through floating values (not a mask's count, whose booleans stop it,
    nor a count of shapes)."""
    seen, stack = set(), [t]
    while stack and len(seen) < most:
        x = stack.pop()
        if x.name in seen or not x.dtype.is_floating:
            continue
        seen.add(x.name)
        if x.op.type in _VARIABLE_READS:
            return True
        if x.op.type not in _SHAPE_ONLY and x.op.type != "StopGradient":
            stack.extend(x.op.inputs)
    return False


# ops a count passes through that make it no count the exchange knows (a
# square root, a square or a power of one is: transforms/counts.py floored)
_BENT = frozenset({"Rsqrt", "Exp", "Log", "Reciprocal", "Inv"})
# reductions over the batch whose value is a statistic of it, no count
_STATISTICS = frozenset({"Mean", "Max", "Min", "Prod", "EuclideanNorm"})


def no_count(divisor: tf.Tensor, data, rows, most: int = 32) -> bool:
    """Whether `divisor` is a function of the data (`data(t)`) that is none
    of a count (of entries, or a sum over the batch: an R-squared's total)
    the exchange makes the job's: through _BENT, a product of two counts
    (`n * n`), a power by an exponent the data sets, a mean, largest,
    smallest value, product or norm over the batch's rows (a statistic: a
    normalized error's mean square of the targets)."""
    seen, stack = set(), [divisor.op]
    while stack and len(seen) < most:
        op = stack.pop()
        if op.name in seen or not data(op.outputs[0]):
            continue
        seen.add(op.name)
        if op.type in _BENT or op.type in ("Mul", "RealDiv", "Div", "DivNoNan", "Pow") and \
                all(data(x) for x in op.inputs) or op.type in _STATISTICS \
                and over_the_batch(op, rows):
            return True
        if op.type not in ("Shape", "ShapeN", "Size", "Rank", "OnesLike", "ZerosLike", "Sum",
                           "Mean"):     # a count of entries, or a sum the data sets: a count
            stack.extend(x.op for x in op.inputs)
    return False


# reductions of the batch's rows per class and how the replicas' combine
PER_SEGMENT = {"UnsortedSegmentSum": "sum", "UnsortedSegmentMax": "max",
               "UnsortedSegmentMin": "min"}


def per_class(op, sources) -> str | None:
    """How the replicas' values of `op` combine ("sum", "max", "min") where
    it reduces the batch's rows per class (`per_segment`), else None.
    `sources`: the data sources' names, or a graph/rows.py reading."""
    kind = PER_SEGMENT.get(op.type)
    return kind if kind and reading(sources, op.graph).guarded(
        lambda r: per_segment(op, r, op.type)) else None


def under(tensors, rows, data, taker: tf.Operation, losses) -> list[str] | None:
    """The names of the Sums over the batch's axis (and the batch's row
    counts) that `tensors` (scalars or vectors without the batch's axis,
    the inputs of op `taker`) are computed from, each Sum's incoming
    gradient after it where the autodiff differentiates it, as the spread
    over the Sum's input takes it (this Sum's alone: the gradient may go
    on to other Sums' too, as a soft IoU's `sum(y + p) - sum(y p)` passes
    it). None where a value with the batch's rows reaches them other than
    through such a Sum (a Mean, a Max), a variable enters on the way (its
    gradient would be the replicas' sum too), a value on the way is used
    elsewhere than on it (that use would read the job's sum), or a
    gradient is not found where a loss the autodiff differentiates
    (`losses(graph)`) takes the Sum. `data(t)`: whether t depends on a
    data source."""
    found, seen, stack, index, region = [], set(), list(tensors), None, {taker.name}
    targets = None          # the losses' op names, read once where a gradient is missing
    while stack:
        t = stack.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        if not data(t):
            if differentiable(t):
                return None
            continue
        op = t.op
        region.add(op.name)
        if rows.axis(t) is not None or op.name in rows.sources:
            return None
        if rows.counts_rows(op) or selections.counted(op, rows):
            found.append(t.name)        # a count of rows: no gradient
            continue
        if per_segment(op, rows):       # a sum per class: its gradient gathered at the ids
            index = index or Autodiff(op.graph)
            grads = incoming_segments(index, op) or ()
            if not grads and differentiable(op.inputs[0]):
                targets = targets or {t.op.name for t in losses(op.graph)}
                if _trained(op, targets):
                    return None
            if any(len(grad.consumers()) > 1 for grad in grads):
                return None
            found += [t.name] + [grad.name for grad in grads]
            continue
        if op.type in ("Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm", "L2Loss") and \
                rows.axis(op.inputs[0]) is not None:
            if op.type != "Sum" or not over_the_batch(op, rows):
                return None
            index = index or Autodiff(op.graph)
            grads = incoming_sum(index, op, fed=True) or incoming_sum(      # (by its name
                index, op, index.named_each(op), fed=True) or ()            # alone)
            if not grads and differentiable(op.inputs[0]):
                if targets is None:
                    targets = {t.op.name for t in losses(op.graph)}
                if _trained(op, targets):
                    return None
            if any(len(grad.consumers()) > 1 for grad in grads):
                return None         # (a gradient other Sums' gradients are taken from)
            found += [t.name] + [grad.name for grad in grads]
            continue
        stack.extend(op.inputs)
    uses = {c.name for name in region - {taker.name}
            for x in taker.graph.get_operation_by_name(name).outputs for c in x.consumers()
            if not is_autodiff(c.name)}
    return found if uses <= region else None


def _trained(op, targets: set) -> bool:
    """Whether one of the ops named `targets` (the losses) is computed from `op`."""
    seen, stack = {op.name}, [op]
    while stack:
        x = stack.pop()
        if x.name in targets:
            return True
        for c in (c for t in x.outputs for c in t.consumers()):
            if c.name not in seen and not is_autodiff(c.name):
                seen.add(c.name)
                stack.append(c)
    return False


def counts_elements(t: tf.Tensor, sources) -> bool:
    """Whether the scalar `t` counts the elements of a tensor of the
    batch's rows (the product of its shape, or its size), maybe cast."""
    op = t.op
    while op.type == "Cast":
        op = op.inputs[0].op
    shape = op.inputs[0].op if op.type == "Prod" else None
    if shape is not None and shape.type == "Shape":
        return batch_axis(shape.inputs[0], sources) is not None
    if shape is not None and shape.type == "Pack":     # (rows, other dims ...)
        return counts_rows(shape.inputs[0].op, sources) and all(
            tf.get_static_value(x) is not None or _other_dim(x, sources)
            for x in shape.inputs[1:])
    return counts_rows(op, sources)


def _other_dim(t: tf.Tensor, sources) -> bool:
    """Whether `t` is `tf.shape(x)[k]` of a tensor of the batch's rows, k
    not their axis (a padded batch's length, the same on every replica)."""
    op = t.op
    if op.type != "StridedSlice" or op.inputs[0].op.type != "Shape" or \
            not op.get_attr("shrink_axis_mask"):
        return False
    x, k = op.inputs[0].op.inputs[0], tf.get_static_value(op.inputs[1])
    axis = batch_axis(x, sources) if k is not None and x.shape.rank else None
    return axis is not None and int(np.ravel(k)[0]) % x.shape.rank != axis
