"""Statistics over the batch that a step applies to its rows: a Mean, Sum,
Max or Min over the batch's axis, or a sum or count per class of the
batch's rows (`per_segment`, a bincount of a fixed length), whose result
meets the batch's rows in an element-wise op (`(x - mean) / std`, a
masked mean's `sum(x * m) / sum(m)`, `x * rsqrt(sum(x * x))`, a log
prior per class added to the logits) or is taken back to each row at its
id (`1 / counts[y]`: a weight per class from the batch's counts), through
ops that keep it a statistic (`applied`); the batch's row counts that
meet its rows alone (`l / n` summed: a mean written per row,
`counts_applied`); whether one reads the data alone (`of_data`); and what
scales a Sum on its way to the rows (`alone`), which decides whether its
exchange, with those, makes the rows one device's.
graph/normalization.py names and exchanges them.

Requires: a tf.Graph and a reading of its batch's rows (graph/rows.py).
Guarantees: reads the graph only.
"""
from __future__ import annotations

import tensorflow as tf

from .constants import SOURCE_TYPES
from .recorders import input_gradients
from .rules import is_autodiff, row_ids

# ops a batch statistic passes through to where it meets the rows
_CARRIES = frozenset({"Squeeze", "Reshape", "ExpandDims", "Identity", "StopGradient", "Cast",
                      "Sqrt", "Rsqrt", "AddV2", "Add", "Sub", "Mul", "MulNoNan", "RealDiv",
                      "Div", "DivNoNan", "Maximum", "Minimum", "Neg", "Square", "Reciprocal",
                      "Log", "Log1p", "Exp", "Pow", "Abs"})     # (a log prior per class)
_MOST_READ = 4096
_SHAPED = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"})  # values none
_MEETS = frozenset({"Sub", "AddV2", "Add", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan",
                    "SquaredDifference", "Maximum", "Minimum"})
_GATHERS = ("GatherV2", "Gather")
_BINCOUNTS = ("Bincount", "DenseBincount")


def per_segment(op, rows, kind: str = "UnsortedSegmentSum") -> bool:
    """Whether `op` sums the batch's rows into segments the data names per
    row, as many as the graph fixes (tf.math.unsorted_segment_sum of each
    example's hit at its class: a count or sum per class, of no batch
    axis): the replicas' values add up to one device's; `kind`
    UnsortedSegmentMax takes the largest per class instead."""
    return op.type == kind and rows.axis(op.inputs[0]) == 0 and \
        rows.axis(op.inputs[1]) == 0 and tf.get_static_value(op.inputs[2]) is not None and \
        not row_ids(op.inputs[1], rows.rows)        # (a sparse batch's values by their row)


def fixed_bincount(op, rows) -> bool:
    """Whether `op` counts each value among the batch's examples in a
    vector whose length the graph fixes (tf.math.bincount with minlength
    and maxlength alike: the replicas' counts add up to one device's)."""
    if op.type not in _BINCOUNTS or op.inputs[0].shape.rank != 1 or \
            rows.axis(op.inputs[0]) is None or row_ids(op.inputs[0], rows.rows):
        return False
    size = op.inputs[1].op
    if size.type != "Minimum":
        return tf.get_static_value(op.inputs[1]) is not None
    low = size.inputs[1].op
    bounds = [tf.get_static_value(size.inputs[0])] + (
        [tf.get_static_value(low.inputs[0])] if low.type == "Maximum" else [None])
    return None not in bounds and int(bounds[0]) == int(bounds[1])


def taken_back(c, t, rows) -> bool:
    """Whether op `c` takes statistic `t`'s entries back to the batch's
    rows at an id per row (a count per class gathered at each label)."""
    axis = 0 if c.type == "Gather" or len(c.inputs) < 3 else tf.get_static_value(c.inputs[2])
    return c.type in _GATHERS and c.inputs[0] is t and rows.axis(c.inputs[1]) == 0 and \
        axis is not None and int(axis) % max(t.shape.rank or 1, 1) == 0 and \
        not row_ids(c.inputs[1], rows.rows)


def applied(op, rows, anywhere: bool = False) -> bool:
    """Whether `op` is a Mean, a Sum, a Max or a Min (forward, not the
    autodiff's) over the batch's axis of the batch's rows, or a sum or
    count of them per class (`per_segment`, `fixed_bincount`), whose result
    an element-wise op meets with the rows, or a gather takes back to them
    at an id per row (through a few ops that keep it a statistic: a sum
    divided by a count, a log, Keras 3's masked BatchNormalization's). A
    sum of a mask (a count: tf_keras's `ignore_class` weighs the valid rows
    by the rows' count over it) is a statistic only where it meets the rows
    with constants alone on the way (`l * m / sum(m)` summed): where a loss
    divides by it, graph/forms.py reads it as a count the data sets.
    `anywhere`: whatever reads the result."""
    if is_autodiff(op.name) or not (op.type in ("Mean", "Sum", "Max", "Min") and
                                    over_the_batch(op, rows) or per_segment(op, rows)
                                    or fixed_bincount(op, rows)):
        return False
    counted = op.inputs[0]
    while counted.op.type in ("Reshape", "Identity", "ExpandDims", "Squeeze"):
        counted = counted.op.inputs[0]
    if op.type == "Sum" and counted.op.type == "Cast" and counted.op.inputs[0].dtype == tf.bool:
        return not anywhere and _meets_alone(op, rows)      # (`l * m / sum(m)`, per row)
    if anywhere:
        return True
    seen, stack = set(), [op.outputs[0]]
    while stack and len(seen) < 64:
        t = stack.pop()
        for c in t.consumers():
            if c.name in seen or is_autodiff(c.name):
                continue
            seen.add(c.name)
            if taken_back(c, t, rows) or c.type in _MEETS and any(
                    i is not t and rows.axis(i) is not None for i in c.inputs):
                return True
            if c.type in _CARRIES:
                stack.extend(c.outputs)
    return False


def counts_applied(graph, rows) -> list:
    """The casts of the batch's row count to a float (`_row_count`) whose
    every use meets the batch's rows (`tf.reduce_sum(l / n)`, `l * (1 /
    n)`: a mean written per row) through `_CARRIES` with constants alone
    on the way: one device takes them over the global batch's count."""
    return [op for op in graph.get_operations()
            if not is_autodiff(op.name) and _row_count(op, rows) and _meets_alone(op, rows)]


def _meets_alone(count, rows, most: int = 16) -> bool:
    """Whether every use of `count`'s value meets the batch's rows (or is
    taken back to them at their ids) through `_CARRIES`, with constants
    alone on the way."""
    seen, stack, met = set(), [count.outputs[0]], False
    while stack:
        t = stack.pop()
        users = [c for c in t.consumers() if not is_autodiff(c.name)]
        if not users:
            return False            # read as it is (a fetch)
        for c in users:
            if c.name in seen:
                continue
            seen.add(c.name)
            if taken_back(c, t, rows):
                met = True
                continue
            if len(seen) > most or c.type not in _CARRIES:
                return False
            others = [i for i in c.inputs if i is not t]
            if c.type in _MEETS and any(rows.axis(i) is not None for i in others):
                met = True
                continue
            if any(tf.get_static_value(i) is None for i in others):
                return False        # met with another value: a mean's divisor, a scale
            stack.extend(c.outputs)
    return met


def alone(total, rows, exchanged=frozenset(), path=frozenset()) -> list | None:
    """The data's Sums and Means over the batch that scale the Sum `total`
    on its way to the batch's rows through `_CARRIES` (a masked mean's
    count: to be the job's too), and the batch's row counts that do where
    they reach nothing but `path` (`carried` of the Sums exchanged: `sum /
    n`, n - 1, one n for a mean and a variance), or None where a shape or
    size otherwise, or a statistic of what the variables compute, other
    than those `exchanged` (names), does."""
    seen, others = carried(total, rows)
    scales = []
    for i in others:
        if (found := _scales(i.op, rows, exchanged, seen | path)) is None:
            return None
        scales += found
    return scales


def carried(total, rows) -> tuple[set[str], list]:
    """(the ops through `_CARRIES` from the Sum `total` to where it meets
    the batch's rows, the other operands it meets on the way)."""
    seen, stack, others = set(), [total.outputs[0]], []
    while stack and len(seen) < 64:
        t = stack.pop()
        for c in t.consumers():
            if c.name in seen or is_autodiff(c.name) or c.type not in _CARRIES:
                continue
            seen.add(c.name)
            met = [i for i in c.inputs if i is not t] if c.type in _MEETS else []
            if any(rows.axis(i) is not None for i in met):
                continue            # the rows: what follows is theirs
            others += met
            stack.extend(c.outputs)
    return seen, others


def _scales(op, rows, exchanged, path=frozenset(), most: int = 32) -> list | None:
    """The data's Sums and Means over the batch `op` reads (not past
    them), and the batch's row counts whose every use leads into `path`;
    None if it reads a shape or size otherwise, another statistic over the
    batch (but those `exchanged`), or more than `most` ops."""
    seen, stack, out = set(), [op], []
    while stack:
        o = stack.pop()
        if o.name in seen:
            continue
        seen.add(o.name)
        if o.type in ("Sum", "Mean") and over_the_batch(o, rows):
            if o.name in exchanged:
                continue
            if not of_data(o):
                return None
            out.append(o)
            continue
        if _row_count(o, rows) and _leads_into(o, path):
            out.append(o)
            continue
        if o.type in ("Shape", "ShapeN", "Size") or len(seen) > most:
            return None
        stack.extend(i.op for i in o.inputs)
    return out


def _leads_into(op, path, most: int = 16) -> bool:
    """Whether every use of `op`'s value (not the autodiff's) reaches ops
    of `path` and nothing else: a count the exchange gives every use of."""
    seen, stack = set(), [op]
    while stack:
        x = stack.pop()
        users = [c for t in x.outputs for c in t.consumers() if not is_autodiff(c.name)]
        if not users or len(seen) > most:
            return False                    # read besides (a loss, a fetch)
        for c in users:
            if c.name not in seen and c.name not in path:
                seen.add(c.name)
                stack.append(c)
    return True


def _row_count(op, rows) -> bool:
    """Whether `op` casts the batch's row count to a float: the size of the
    batch's axis of a tensor of its rows (`tf.cast(tf.shape(z)[0], f)`),
    or the size of such a tensor (`tf.size(z)`: its rows times a number)."""
    if op.type != "Cast" or not op.outputs[0].dtype.is_floating:
        return False
    t = op.inputs[0]
    while t.op.type in ("Identity", "Squeeze", "Reshape"):
        t = t.op.inputs[0]
    if t.op.type == "Size":
        return rows.axis(t.op.inputs[0]) is not None
    if t.op.type != "StridedSlice" or t.op.inputs[0].op.type != "Shape":
        return False
    begin = tf.get_static_value(t.op.inputs[1])
    shaped = t.op.inputs[0].op.inputs[0]
    return t.shape.rank == 0 and begin is not None and begin.size == 1 and \
        rows.axis(shaped) == int(begin[0]) % max(shaped.shape.rank or 1, 1)


def of_data(op) -> bool:
    """Whether statistic `op` reads the data alone (no variable's value,
    within _MOST_READ ops; the shape of what the variables compute, as a
    mask broadcast to it, is the data's), in a graph that takes no
    gradient with respect to its inputs (through which one would pass the
    statistic: FGSM's)."""
    if input_gradients(op.graph):
        return False
    seen, stack = set(), [op.inputs[0].op]
    while stack:
        o = stack.pop()
        if o.name in seen:
            continue
        seen.add(o.name)
        if len(seen) > _MOST_READ or o.type not in SOURCE_TYPES and \
                any(x.dtype == tf.resource for x in o.inputs) or \
                o.type in ("VariableV2", "VarHandleOp") or o.outputs and \
                o.outputs[0].dtype == tf.resource:
            return False
        if o.type not in _SHAPED and o.type not in SOURCE_TYPES:    # (an iterator's: data)
            stack.extend(x.op for x in o.inputs)
    return True


def over_the_batch(op, rows) -> bool:
    """Whether reduction `op`'s axes hold its input's batch axis."""
    axes, rank = axes_of(op), op.inputs[0].shape.rank
    return axes is not None and rank is not None and \
        rows.axis(op.inputs[0]) in {a % rank for a in axes}


def axes_of(op) -> set[int] | None:
    value = tf.get_static_value(op.inputs[1])
    return None if value is None else {int(a) for a in value.reshape(-1)}
