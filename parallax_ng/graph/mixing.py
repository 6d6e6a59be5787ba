"""Ops that mix the batch's examples: a loss that compares its examples with
each other (the hardest k of the batch, a softmax or a running sum along
the batch's axis, a log of a sum over it, a count of each label among the
batch's examples, every example scored against every other as in-batch
negatives are or compared with every other by broadcasting as a triplet
loss's mining does, a division by a sum of the model's outputs over the
batch as Dice losses divide, the batch's rows met with themselves in
another order as mixup meets them, a statistic of each group of examples
that share a label: class centers, prototypes, the batch's rows joined to
a queue of rows kept in a variable, statistics of virtual batches whose
examples lie a stride apart) is computed by each replica over its own
rows, and no rule for combining the replicas' gradients makes that one
device's over the global batch. `mixing` finds the first such op between
the data and a loss, for the warning graph/averaging.py gives. (Batch
normalization's statistics, computed over each replica's rows, are the
known case that docs/limits.md states; they are not flagged here.)

Requires: a tf.Tensor of a graph and the names of its data sources.
Guarantees: reads the graph only, through graph/rows.py's batch axes; None
where no op it knows mixes examples, never a guess.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import compat
from . import rules
from .applied import taken_back
from .forms import autodiff_losses, through
from .orders import order
from .rows import batch_axis, reading

_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
_UNIQUE_COUNTS = ("UniqueWithCounts", "UniqueWithCountsV2")
_BINCOUNTS = ("Bincount", "DenseBincount", "SparseBincount")
_MOST_OPS = 4096        # ops read back from a divisor
# reductions of the batch's rows into groups by an id per example
_SEGMENTS = frozenset({"UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin",
                       "UnsortedSegmentProd", "SegmentSum", "SegmentMean", "SegmentMax",
                       "SegmentMin", "SegmentProd", "SegmentSumV2", "SegmentMaxV2",
                       "SegmentMinV2", "SegmentProdV2"})
# ops whose output carries only their input's shape, not its values: a
# count built from `ones_like(losses)` (TF1 losses' weights) reads no value
_SHAPE_ONLY = ("OnesLike", "ZerosLike", "Shape", "ShapeN", "Size", "Rank",
               "BroadcastArgs", "BroadcastGradientArgs")


def mixing(loss: tf.Tensor, sources, exchanged=()) -> tuple[str, str] | None:
    """(op name, what it does) of the first op, in the graph's order, between
    the data and `loss` that mixes the batch's examples; None if none does.
    `exchanged`: scalar means the replicas exchange (forms.LossForm), by
    which a division does not mix (each replica divides by the job's), and
    statistics of the data they exchange (counts per class a loss weighs
    its rows by: graph/normalization.py `data_statistics`)."""
    return reading(sources, loss.graph).guarded(lambda r: _first(loss, r, set(exchanged)))


def _first(loss, rows, exchanged):
    found, seen, stack = [], set(), [loss.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        what = _mixes(op, rows, exchanged)
        if what:
            found.append((op._id, op.name, what))    # noqa: SLF001 (creation order)
        stack.extend(x.op for x in op.inputs)
    return min(found)[1:] if found else None


def _mixes(op, rows, exchanged) -> str | None:
    kind = op.type
    if not op.inputs:
        return None
    counts = [x.op.inputs[0] for x in op.inputs if x.op.type in _UNIQUE_COUNTS and
              x.value_index == 2]           # each example's value's count, by its index
    per_row = kind == "DenseBincount" and op.inputs[0].shape.rank == 2    # (one-hot codes)
    if any(rows.axis(c) is not None for c in counts) or kind in _BINCOUNTS and not per_row \
            and rows.axis(op.inputs[0]) is not None and op.outputs[0].name not in exchanged \
            and not rules.row_ids(op.inputs[0], rows.rows):
        return "a count of each value among the batch's examples (unique_with_counts, bincount)"
    if kind in _SEGMENTS and op.outputs[0].name not in exchanged and \
            (what := _grouped(op, rows)):       # (a sum per class the replicas add up)
        return what
    if kind in ("Mean", "Sum", "Max", "Min") and _strided(op, rows):
        return ("statistics over groups of the batch's examples whose size is the batch's "
                "over k (its rows reshaped to [k, -1, ...] and reduced along one of the two: "
                "ghost batch normalization's virtual batches, `virtual_batch_size`)")
    if kind == "ConcatV2" and queued(op, rows):
        return ("the batch's rows joined along their axis with rows that are not examples "
                "(a queue of the batch's rows kept in a variable, as MoCo keeps its keys; rows "
                "appended)")
    if len({order(x, rows) for x in op.inputs if rows.axis(x) is not None}) > 1:
        return ("the batch's rows met with themselves in another order (tf.roll, tf.reverse, "
                "tf.random.shuffle or a tf.gather of a permutation along the batch's axis: "
                "mixup, shifted pairs)")
    x = op.inputs[0]
    rank, a = x.shape.rank, None
    if kind in ("TopKV2", "Softmax", "LogSoftmax", "Cumsum", "Cumprod"):
        a = rows.axis(x)
        if a is None or not rank:
            return None
    if kind == "TopKV2" and a == rank - 1:
        return "the top k along the batch's axis"
    if kind in ("Softmax", "LogSoftmax") and a == rank - 1:
        return "a softmax across the batch's examples"
    if kind in ("Cumsum", "Cumprod"):
        at = tf.get_static_value(op.inputs[1])
        if at is not None and int(at) % rank == a:
            return "a running total along the batch's axis"
    if kind == "MatMul" or kind in _MATMULS:
        return _pairs(op, rows)
    if kind == "Einsum":
        return _einsum_pairs(op, rows)
    if kind in rules.ELEMENTWISE and len(op.inputs) >= 2 and _broadcast_pairs(op, rows):
        return "every example compared with every other (broadcast pairs)"
    if kind in ("RealDiv", "Div", "DivNoNan") and len(op.inputs) == 2 and \
            op.inputs[1].name not in exchanged and rows.axis(op.outputs[0]) is None:
        return _ratio(op.inputs[1], rows, exchanged)   # (rows over a statistic: normalization's)
    if taken_back(op, x, rows) and rows.axis(x) is None and _of_the_batch(x, rows, exchanged):
        return ("a statistic over the batch taken back to each example at its id (class "
                "centers of a one-hot product, or counts, gathered at the labels)")
    if kind in ("Log", "Log1p") and _summed(x, rows) and x.name not in exchanged:
        return "a log of a sum over the batch's examples (a log-sum-exp across them)"
    return None


def _grouped(op, rows) -> str | None:
    """A segment reduction of the batch's rows by an id per example (a
    label, not the row numbers a sparse batch's values carry) whose result
    the loss reads other than as a sum of the examples' terms: a largest,
    smallest or product per group, or a sum per group divided by a count
    of it or met with the rows again (a class's center, a prototype)."""
    data, ids = op.inputs[:2]
    if rows.axis(data) != 0 or rows.axis(ids) != 0 or rules.row_ids(ids, rows.rows):
        return None
    what = "a statistic per group of the batch's examples (by a label: class centers, prototypes)"
    if "Sum" not in op.type:
        return what
    seen, stack = set(), [op.outputs[0]]
    while stack and len(seen) < 64:
        t = stack.pop()
        for c in t.consumers():
            if c.name in seen or rules.is_autodiff(c.name):
                continue
            seen.add(c.name)
            if any(x is not t and rows.axis(x) is not None for x in c.inputs) or \
                    c.type in _BENDING or c.type in ("RealDiv", "Div", "DivNoNan") and \
                    c.inputs[1] is t:
                return what
            stack.extend(c.outputs)
    return None


def _of_the_batch(t, rows, exchanged) -> bool:
    """Whether `t` (no batch axis) is computed from the batch's rows by an
    op that reduces their axis away (a Sum, a product with the rows
    transposed), past the statistics the replicas exchange (`exchanged`)
    and shapes, within _MOST_OPS ops."""
    seen, stack = set(), [t]
    while stack and len(seen) < _MOST_OPS:
        x = stack.pop()
        if x.name in seen or x.name in exchanged or x.op.type in _SHAPE_ONLY or \
                x.dtype == tf.bool:
            continue
        seen.add(x.name)
        if any(rows.axis(i) is not None for i in x.op.inputs):
            return True     # (x has no batch axis: `t`'s way holds none)
        stack.extend(x.op.inputs)
    return False


def _strided(op, rows) -> bool:
    """Whether reduction `op` reduces axis 0 or axis 1, not both, of the
    batch's rows reshaped to [k, -1, ...] (k > 1 fixed; read back through
    element-wise ops, a variance's difference from the mean): along axis 0
    group j holds rows j, j + m, j + 2m... of the batch (m its row count
    over k; tf_keras's virtual batches), along axis 1 rows jm to jm + m - 1
    (their legacy form under v1 behaviour), which on a replica are its own
    and on one device the global batch's."""
    axes, x = tf.get_static_value(op.inputs[1]), op.inputs[0]
    if axes is None or len({0, 1} & {int(v) % (x.shape.rank or 1)
                                     for v in np.atleast_1d(axes)}) != 1:
        return False
    for _ in range(4):
        if x.op.type in ("Reshape", "Identity", "Cast"):
            break
        if x.op.type not in rules.ELEMENTWISE or not x.op.inputs:
            return False
        x = x.op.inputs[0]
    while x.op.type in ("Identity", "Cast"):
        x = x.op.inputs[0]
    if x.op.type != "Reshape" or (x.shape.rank or 0) < 2 or rows.axis(x.op.inputs[0]) != 0:
        return False
    k = compat.dim(x.shape, 0)      # (a v1 Dimension: compared as an int)
    return k is not None and k > 1 and compat.dim(x.op.inputs[0].shape, 0) != k


def queued(op, rows) -> bool:
    """Whether ConcatV2 `op` joins, along the batch's axis, the batch's rows
    and tensors that no data source computes (a variable's rows, constants;
    a slice as long as the batch's rows counts them: its shape only). One
    device joins the global batch's rows, a replica its own."""
    at = tf.get_static_value(op.inputs[-1])
    rank = op.outputs[0].shape.rank
    if at is None or not rank:
        return False
    at = int(np.ravel(at)[0]) % rank
    parts = [rows.axis(x) for x in op.inputs[:-1]]
    return at in parts and any(a is None and data_free(x, rows)
                               for a, x in zip(parts, op.inputs[:-1]))


def data_free(t, rows) -> bool:
    """Whether no data source computes `t`'s values (past shapes and the
    flags of tf.cond's branches, within _MOST_OPS ops)."""
    seen, stack = set(), [t.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in rows.sources or len(seen) > _MOST_OPS:
            return False
        flag = 1 if op.type in ("Switch", "RefSwitch") else None     # a branch's predicate
        stack.extend(x.op for at, x in enumerate(op.inputs)
                     if x.op.type not in _SHAPE_ONLY and at != flag)
    return True


def _summed(t, rows) -> bool:
    """Whether `t` is a sum over the batch's axis (past an Identity): the
    log of one (tf.reduce_logsumexp over the batch, a softmax's normalizer
    written by hand) is not a sum of per-example terms."""
    op = through(t.op)
    return op.type == "Sum" and _over_batch(op, rows)


def _over_batch(op, rows) -> bool:
    """Whether reduction `op` (Sum, Mean) reduces its input's batch axis."""
    rank = op.inputs[0].shape.rank
    if not rank:
        return False
    axes, a = tf.get_static_value(op.inputs[1]), rows.axis(op.inputs[0])
    return a is not None and axes is not None and \
        a in {int(v) % rank for v in np.atleast_1d(axes)}


# ops not linear in their input: a custom gradient that applies one to the
# gradient it receives (a clip) is not a sum of per-example parts
_BENDING = frozenset({
    "Minimum", "Maximum", "ClipByValue", "Sign", "Abs", "Square", "Sqrt", "Rsqrt", "Relu",
    "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Log", "Log1p", "Pow", "Softplus",
    "L2Loss", "Reciprocal", "Round", "Floor", "Ceil", "Less", "Greater", "LessEqual",
    "GreaterEqual", "Equal", "NotEqual", "EuclideanNorm", "Max", "Min", "TopKV2"})


def bent_gradient(graph: tf.Graph) -> tuple[str, str] | None:
    """(op, its type) in a custom gradient's function (`tf.custom_gradient`,
    `gradient_override_map`) that is not linear in the gradient it
    receives (a clip by value, a sign, a norm): for a mean loss each
    replica's incoming gradient is N times one device's per example, so
    the mean of such replicas' results is not one device's. Such an op
    takes a gradient and gives one back to the autodiff, and no loss reads
    it (a gradient penalty's norm is read by its loss: per example, exact).
    None if there is none."""
    custom = tuple(scope for op in graph.get_operations()
                   if "_gradient_op_type" in op.node_def.attr
                   for scope in [f"{op.name}_grad/"] + [f"gradients/{tail}_grad/"
                                                        for tail in rules.tails(op.name)])
    if not custom:
        return None
    read, stack = set(), [t.op for t in autodiff_losses(graph)]   # the losses' ancestors
    while stack:
        op = stack.pop()
        if op.name not in read:
            read.add(op.name)
            stack.extend(x.op for x in op.inputs)
    carries, found = set(), []      # ops whose output carries a gradient (floats)
    for op in graph.get_operations():
        took = [x for x in op.inputs if x.dtype.is_floating and x.op.name in carries]
        inside = any(c in op.name for c in custom)      # a TF1 custom function's scope
        if took or rules.is_autodiff(op.name) and op.type != "Const" and not inside:
            carries.add(op.name)
        if op.name in read or not took or op.type not in _BENDING and (
                op.type not in ("Mul", "RealDiv", "Div", "MatMul") or len(took) < 2):
            continue
        if not rules.is_autodiff(op.name) or inside:
            found.append(op)
    back = {op.name for op in graph.get_operations() if rules.is_autodiff(op.name)}
    for op in found:        # a custom function's: in its scope (TF1), or feeding the autodiff
        if (rules.is_autodiff(op.name) or reaches(op, back, _MOST_OPS)) and \
                not _nan_tested(op):
            return op.name, op.type
    return None


def _nan_tested(op) -> bool:
    """Whether `op`'s outputs reach only tests for NaN (`x == x`, `is_nan`,
    past casts and reshapes), which hold for every finite value: how
    tf.recompute_grad's gradient orders its recomputation after the
    incoming gradient (a max of it, cast to bool, compared with itself)."""
    ends = [c for t in op.outputs for c in t.consumers()]
    while ends:
        c = ends.pop()
        if c.type in ("Cast", "Reshape", "Identity", "Squeeze"):
            ends.extend(x for t in c.outputs for x in t.consumers())
        elif not (c.type in ("IsNan", "IsFinite", "IsInf") or c.type in ("Equal", "NotEqual")
                  and c.inputs[0].name == c.inputs[1].name):
            return False
    return True


def reaches(op, targets: set, most: int | None = None) -> bool:
    """Whether a consumer of `op`'s outputs, or of theirs, is one of
    `targets` (names), looking at `most` ops where given."""
    seen, stack = set(), [op]
    while stack and (most is None or len(seen) < most):
        x = stack.pop()
        for c in (c for t in x.outputs for c in t.consumers()):
            if c.name in targets:
                return True
            if c.name not in seen:
                seen.add(c.name)
                stack.append(c)
    return False


def _ratio(divisor, rows, exchanged=frozenset()) -> str | None:
    """A division by a sum over the batch of what the model computes (Dice,
    IoU and F1 losses; a count of examples or of a mask's entries, which
    reads no variable's value, is a mean's divisor, not this)."""
    summed, reads, seen, stack = False, False, set(), [divisor.op]
    while stack and len(seen) < _MOST_OPS and not (summed and reads):
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        reads |= op.type in ("ReadVariableOp", "VariableV2", "ResourceGather")
        summed |= op.type in ("Sum", "Mean") and _over_batch(op, rows) and \
            op.outputs[0].name not in exchanged     # (the job's: graph/batch_sums.py)
        stack.extend(x.op for x in op.inputs if x.op.type not in _SHAPE_ONLY and
                     x.dtype != tf.bool)        # a count of a condition counts, not sums
    if summed and reads:
        return "a division by a sum over the batch of the model's outputs (a Dice or IoU loss)"
    return None


def _pairs(op, rows) -> str | None:
    """A product whose two operands each keep their batch's axis in the
    result: every example of one against every example of the other."""
    left, right = op.inputs[0], op.inputs[1]
    if left.shape.rank is None or right.shape.rank is None:
        return None
    if op.type == "MatMul":
        flip = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    else:
        flip = op.get_attr("adj_x"), op.get_attr("adj_y")
    kept_left = left.shape.rank - (1 if flip[0] else 2)      # the rows of the product
    kept_right = right.shape.rank - (2 if flip[1] else 1)    # its columns
    if rows.axis(left) == kept_left and rows.axis(right) == kept_right:
        return "every example scored against every other (in-batch pairs)"
    return None


def _broadcast_pairs(op, rows) -> bool:
    """An element-wise op whose inputs hold the batch's rows on different
    axes of its output (`x[:, None] - x[None, :]`, labels compared pairwise
    as a triplet loss's mining does): every example against every other."""
    rank, axes = op.outputs[0].shape.rank, set()
    if op.type in ("Switch", "Merge") or rank is None:    # a branch's data and its flag
        return False
    for x in op.inputs:
        a = rows.axis(x) if x.shape.rank else None      # (a scalar fed: no rows)
        if a is not None and a < x.shape.rank:
            axes.add(a + rank - x.shape.rank)       # broadcast aligns the last axes
    return len(axes) > 1


def _einsum_pairs(op, rows) -> str | None:
    spec = op.get_attr("equation").decode().replace(" ", "")
    terms, _, result = spec.partition("->")
    letters = set()
    for term, x in zip(terms.split(","), op.inputs):
        a = rows.axis(x)
        if "." not in term and a is not None and a < len(term) and term[a] in result:
            letters.add(term[a])
    if len(letters) > 1:
        return f"every example scored against every other (einsum {spec!r})"
    return None


def extreme(t: tf.Tensor, sources) -> str | None:
    """"max" or "min" where `t` is a largest or smallest value over the
    batch (tf.reduce_max of predictions, over every axis or the batch's):
    the replicas' values combine so; None otherwise."""
    op = through(t.op)
    if op.type not in ("Max", "Min"):
        return None
    x, axes = op.inputs[0], tf.get_static_value(op.inputs[1])
    if axes is None or not x.shape.rank:
        return None
    a = batch_axis(x, sources)
    if a is None:           # a largest of largest values over the batch
        return op.type.lower() if extreme(x, sources) == op.type.lower() else None
    return op.type.lower() if a in {int(v) % x.shape.rank for v in np.atleast_1d(axes)} \
        else None
