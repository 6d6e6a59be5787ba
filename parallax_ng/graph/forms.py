"""Forms of a tensor over the batch: its rows (`batch_rows`, graph/rows.py), whether a
scalar of the data is a mean or a sum over the batch (`loss_form`), and the losses a
graph differentiates (`autodiff_losses`), from which graph/averaging.py reads how the
replicas' gradients combine.

Requires: tf.Tensors of a graph and the names of its data sources (the placeholders and
iterators that give the batch), or a graph/rows.py reading of them that several
questions share. Guarantees: both read the graph only. `loss_form` names the divisors
that make a sum a mean (a layer-by-layer step divides by a micro-batch's size instead,
parallax_ng/l2l/); a value it cannot read is None, never a guess. Used by layer-by-layer
execution and the state-sync pass (a per-replica mean added up is averaged, not summed)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import tensorflow as tf

from .. import compat
from ..errors import GraphError
from . import batch_sums, selections
from .recorders import GRAD_YS, input_gradients, seeded
from .rows import batch_axis, batch_rows, counts_rows, reading
from .constants import SOURCE_TYPES, constant_value, other_axis_size
from .rules import ENTRIES


# the collection of a traced TF2 step's graph that names what its tapes
# differentiated (graph/tracing.py records them as the step is traced)
TAPE_TARGETS = "parallax_ng_tape_targets"
# the collection of a traced step's graph that names outputs its program joins
# by rows (Keras's predict): the replicas' parts of them are joined so, unread
JOINED_ROWS = "parallax_ng_joined_rows"


def autodiff_losses(graph: tf.Graph) -> list[tf.Tensor]:
    """The tensors whose gradients the graph computes: what tf.gradients
    was called on (`seeded`), and the targets of a traced TF2 step's
    tapes; not a call with respect to the step's inputs rather than its
    variables (graph/recorders.py `input_gradients`: FGSM's, a penalty's)."""
    found = []
    for name in graph.get_collection(TAPE_TARGETS):
        try:
            found.append(graph.get_tensor_by_name(name))
        except (KeyError, ValueError):
            pass
    inputs = {seed for _, seeds in input_gradients(graph) for seed in seeds}
    for op in graph.get_operations():
        if op.type == "Fill" and GRAD_YS.search(op.name) and op.outputs[0].name not in inputs:
            found.extend(seeded(op))
    return list({t.name: t for t in found}.values())


def sources(graph: tf.Graph) -> list[str]:
    """The names of `graph`'s data sources (SOURCE_TYPES)."""
    return [op.name for op in graph.get_operations() if op.type in SOURCE_TYPES]


_REDUCTIONS = ("Sum", "Mean")


@dataclass
class LossForm:
    kind: str | None            # "mean", "sum" or None (the graph does not show)
    # the divisors equal to the batch size that make a sum a mean: (op, input
    # index, True when the op multiplies by 1/B); a micro-batch divides by its size
    by_batch: list[tuple[str, int, bool]] = field(default_factory=list)
    scaled: bool = False        # a sum times or over a number that is not the batch size
    # the divisions of a sum over the batch by a count the data sets (a masked
    # mean): input 1 is the count (transforms/state_sync.py shares it)
    by_count: list[str] = field(default_factory=list)
    # where a sum over the batch adds a term that does not depend on the data
    # (a regularizer): (op, input index of the term); one device adds it once
    # (transforms/state_sync.py divides it among replicas whose gradients are summed)
    once: list[tuple[str, int]] = field(default_factory=list)
    # where the form is None because added terms mix sums over the batch and
    # means not divided by a count: (a summed term, whether it is scaled by a
    # number); no one rule for the replicas' gradients gives one device's
    mixed: list[tuple[str, bool]] = field(default_factory=list)
    # where a sum over the batch adds means that divide a sum by a count
    # (Keras's and tf.compat.v1.losses' means, a static batch's size: `by_batch`'s
    # op) or Means over it (tf.reduce_mean): the divisions (or products by 1 /
    # the size, or by 1 / rows counted) whose count becomes the job's (N times a replica's)
    # where the replicas' gradients are summed (transforms/state_sync.py), and
    # the Means that then divide by N, forward and in the gradient
    # (transforms/selected_means.py)
    widened: list[str] = field(default_factory=list)
    # means over the batch (scalars or not) that a function not linear in them takes (an
    # RMSE's): every replica uses the job's, forward and in the gradient (state_sync's)
    exchanged: list[str] = field(default_factory=list)
    # Sums over the batch that such a function takes (a Dice loss's ratio), then the
    # incoming gradient of each: the job's sum of both (graph/batch_sums.py)
    summed: list[str] = field(default_factory=list)
    # Means over rows a mask picks from the batch (graph/selections.py): each
    # replica's count is its own, the job's is their sum
    # (transforms/selected_means.py divides every replica's sum by it)
    selected: list[str] = field(default_factory=list)
    # the Means over the batch (tf.reduce_mean) a mean takes, and its sums times 1 / count
    averaged: list[str] = field(default_factory=list)


# element-wise ops: of means, a loss needs their job-wide values (LossForm.exchanged)
SCALAR_FUNCTIONS = frozenset({
    "Sqrt", "Rsqrt", "Log", "Log1p", "Exp", "Expm1", "Square", "Pow", "Reciprocal", "Inv",
    "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Abs", "Tanh", "Sigmoid",
    "Softplus", "SquaredDifference", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu"})


def loss_form(loss: tf.Tensor, sources, batch: int | None, constant=None,
              strict: bool = True) -> LossForm:
    """How the loss depends on the number of examples in the batch: "mean" (a mean over the
    batch, or a sum over it divided by the batch size `batch`, as tf.compat.v1.losses
    computes it, or by a count the data sets), "sum" (a sum over the batch, times or over a
    number that does not depend on the data), or None when the graph does not show it.
    `constant(t)`: the value of a tensor that does not depend on the data, or None if it is
    not known (default: `constant_value`). Raises GraphError for a sum over the batch plus a
    term that does not depend on the data (a regularizer): each micro-batch would add it
    once (with `strict` False, it is a sum and `once` names where the term enters). Without
    `strict`, a sum plus means of a sum over a count is a sum whose means are `widened`."""
    rows = reading(sources, loss.graph)     # one reading for every question below
    sources = rows.sources                  # (the caller's, if it passes one)
    constant = constant or constant_value
    dependent = set()
    stack, order, visited = [loss.op], [], set()
    while stack:        # the loss's ancestors that depend on a data source
        op = stack.pop()
        if op.name in visited:
            continue
        visited.add(op.name)
        order.append(op)
        stack.extend(t.op for t in op.inputs)
    order.sort(key=lambda o: o._id)           # noqa: SLF001 (creation order)
    grown = True
    while grown:        # to a fixed point: a loop's back edge reaches an op made before it
        grown = False
        for op in order:
            if op.name not in dependent and (op.name in sources or any(t.op.name in dependent
                                                                       for t in op.inputs)) \
                    and not other_axis_size(op, rows.axis):     # (every replica's alike)
                dependent.add(op.name)
                grown = True
    by_batch, by_count, once, mixed, widened, exchanged, selected = [], [], [], [], [], [], []
    summed, averaged = [], []       # averaged: Means over the batch, sums over its rows' count
    others = (by_batch, averaged, exchanged, summed, selected)      # means made not by a count

    def data(t):
        return t.op.name in dependent

    per_row = {}            # a sum's tensor -> the elements it added per example
    scaled, tallies = [False], set()        # tallies: the rows' counts (scaled: still sums)

    def through(t, x):      # t computes x's form: it is a sum of as many per example
        kind = form(x)
        if x.name in per_row:
            per_row[t.name] = per_row[x.name]
        if x.name in tallies and t.op.type in ("Identity", "Snapshot", "Cast", "Mul"):
            tallies.add(t.name)
        return kind

    def form(t):
        op = t.op
        if not data(t):
            return "constant"
        if op.type in ("Identity", "Snapshot", "Neg", "Cast"):
            return through(t, op.inputs[0])
        if op.type == "IdentityN":      # an inlined call's outputs (graph/inlining.py)
            return through(t, op.inputs[t.value_index])
        if counts_rows(op, rows) or selections.counted(op, rows):
            tallies.add(t.name)
            return "sum"        # the batch's rows (or elements, or picked ones) counted
        if op.type in ENTRIES and batch_axis(op.inputs[0], rows) is None and \
                batch_axis(t, rows) is None:
            return through(t, op.inputs[0])     # (entries of a tensor of sums or means)
        if op.type in ("RealDiv", "Div", "DivNoNan") and data(op.inputs[1]) and \
                op.inputs[1].shape.rank == 0 and form(op.inputs[0]) == "sum" and \
                not batch_sums.no_count(op.inputs[1], data, rows) and \
                not batch_sums.differentiable(op.inputs[1]):
            by_count.append(op.name)
            return "mean"       # a sum over the batch divided by a count the data sets
        if op.type in ("Mul", "RealDiv", "Div", "DivNoNan") and not data(op.inputs[1]):
            inner = through(t, op.inputs[0])
            value = constant(op.inputs[1]) if inner == "sum" and batch else None
            if value is not None and np.ndim(value) == 0:
                counts = {batch, batch * per_row.get(op.inputs[0].name, 1)}
                if any(np.isclose(value, n if op.type != "Mul" else 1.0 / n, rtol=1e-6)
                       for n in counts):
                    by_batch.append((op.name, 1, op.type == "Mul"))
                    return "mean"       # a sum over the batch over its size (in elements)
            scaled[0] |= inner == "sum" and t.name not in tallies
            return inner
        if op.type in ("Select", "SelectV2") and present(op.inputs[0]):
            zero = [x for x in op.inputs[1:] if not data(x) and _zero(x, constant)]
            if len(zero) == 1:      # tf.where(count > 0, loss, 0): zero where no row counts
                return through(t, op.inputs[2 if zero[0] is op.inputs[1] else 1])
        if op.type == "Mul" and not data(op.inputs[0]):
            inner = through(t, op.inputs[1])
            scaled[0] |= inner == "sum" and t.name not in tallies
            return inner
        if op.type == "Mul" and t.shape.rank == 0 and all(map(data, op.inputs)):
            for m, c in (op.inputs, op.inputs[::-1]):   # a mean of the rows times their count
                if (n := reciprocal_of(c, constant)) is not None and form(n) == "sum" and \
                        n.name in tallies and form(m) == "sum":     # (before c's form: a
                    averaged.append(op.name)        # function of the count, its job's)
                    return "mean"       # a sum times 1 / the rows' count
                notes = (len(by_count), len(by_batch), len(selected), len(exchanged))
                if form(c) == "sum" and c.name in tallies and form(m) == "mean" and \
                        notes == (len(by_count), len(by_batch), len(selected), len(exchanged)):
                    return "sum"
        if op.type == "MatMul" and op.get_attr("transpose_a") and not op.get_attr(
                "transpose_b") and {batch_axis(x, rows) for x in op.inputs} == {0}:
            return "sum"    # each example's outer product summed over the batch (a gram)
        terms = added_terms(op)
        if terms is not None:
            kinds = []
            for x in terms.inputs:      # (a mean's counts and Means, whether they are all)
                before, scaled[0], counted = scaled[0], False, len(by_count)
                made = [len(found) for found in others]
                kind, sized, means = form(x), by_batch[made[0]:], averaged[made[1]:]
                alone = [len(found) for found in others] == [
                    made[0] + len(sized), made[1] + len(means), *made[2:4],
                    made[4] + len(set(selected[made[4]:]) & set(means))] and all(
                    loss.graph.get_operation_by_name(m).type in ("Mean", "Mul") for m in means)
                kinds.append((x, kind, scaled[0], by_count[counted:] + means + [
                    op for op, _, _ in sized] if alone else []))
                scaled[0] |= before
            forms = {kind for _, kind, _, _ in kinds} - {"constant"}
            if forms == {"sum", "mean"}:
                means = [c for _, kind, _, c in kinds if kind == "mean"]
                if strict or not all(means):    # (a mean of another form beside: not widened)
                    mixed.extend((x.name, s) for x, kind, s, _ in kinds if kind == "sum")
                    return None
                widened.extend(op for c in means for op in c)
                once.extend(at for x, kind, _, _ in kinds if kind == "mean"     # (their
                            for at in free_terms(x, data))      # regularizers: 1/N each)
                forms = {"sum"}         # each mean a sum over the job's count
            if forms == {"sum"} and any(not data(x) for x in terms.inputs):
                once.extend((terms.name, i) for i, x in enumerate(terms.inputs) if not data(x))
                return "sum"
            return forms.pop() if len(forms) == 1 else None
        if batch_sums.per_segment(op, rows):
            return "sum"        # the batch's rows summed per class
        if op.type == "L2Loss" and op.inputs[0].shape.rank:    # half a sum of squares
            return reduced(t, op.inputs[0], np.arange(op.inputs[0].shape.rank))
        if op.type in _REDUCTIONS and op.inputs[0].shape.rank == 0:
            return through(t, op.inputs[0])          # a sum of one number
        if op.type in _REDUCTIONS:
            return reduced(t, op.inputs[0], constant(op.inputs[1]))
        if op.type in SCALAR_FUNCTIONS and batch_axis(t, rows) is None:
            means = [x for x in op.inputs if data(x)]       # (a vector of means too)
            kinds = [form(x) if batch_axis(x, rows) is None else None for x in means]
            sums = [x for x, kind in zip(means, kinds) if kind == "sum"]
            found = batch_sums.under(sums, rows, data, op, autodiff_losses) \
                if sums and set(kinds) <= {"mean", "sum"} else []
            if set(kinds) <= {"mean", "sum"} and found is not None:
                exchanged.extend(x.name for x, kind in zip(means, kinds) if kind == "mean")
                summed.extend(found)
                return "mean"       # of the job's means and sums, in every replica
        return None

    def present(c):         # `count > 0` (or != 0) for a count of the batch's rows or
        op = c.op           # weights, or a condition the data does not set
        return c.shape.rank == 0 and (not data(c) or op.type in ("Greater", "NotEqual") and (
            not data(op.inputs[1]) and _zero(op.inputs[1], constant) and
            form(op.inputs[0]) == "sum"))

    def reduced(t, x, axes):
        """A Sum or Mean over `axes` of x: over the batch's axis (wherever x
        has it), or over a tensor already reduced over the batch (the
        per-time means of a sequence loss, summed over time), its form."""
        shape, a = x.shape, batch_axis(x, rows)
        if t.op.type == "Mean" and a is not None:   # (a picked rows' Mean: `selected`)
            averaged.append(t.op.name)          # (if it is a mean over the batch's rows)
        if a is not None and shape.rank is None and _every_axis(t.op.inputs[1], x):
            return "mean" if t.op.type == "Mean" else "sum"     # of a shape known at run time
        if axes is None or not shape.rank:
            return None
        axes = {int(v) % shape.rank for v in np.atleast_1d(axes)}
        dims = shape.as_list()
        rest = [d for i, d in enumerate(dims) if i != a and i in axes]
        if t.shape.rank == 0 and (a is None or a in axes) and selections.picked(x, rows):
            if t.op.type == "Mean":         # over a count the data sets
                selected.append(t.op.name)
            return "mean" if t.op.type == "Mean" else "sum"
        if a is not None and a in axes:
            if len(axes) == shape.rank and None not in rest:
                per_row[t.name] = int(np.prod(rest, dtype=np.int64))
            return "mean" if t.op.type == "Mean" else "sum"
        if a is not None:
            return None
        inner = form(x)
        if inner in ("sum", "mean"):
            added = int(np.prod(rest, dtype=np.int64)) if None not in rest else None
            if t.op.type == "Sum" and added is not None and (inner == "sum" or x.name in per_row):
                per_row[t.name] = per_row.get(x.name, 1) * added
            elif x.name in per_row:
                per_row[t.name] = per_row[x.name]
            return inner
        return None
    kind = form(loss)
    if strict and kind == "sum" and once:       # (not where a function of sums takes it)
        raise GraphError(
            f"the loss {loss.name!r} sums over the batch and adds a term that does not "
            f"depend on the data ({once[0][0]!r}, a regularizer?); layer-by-layer "
            "execution sums the micro-batches' losses and would add it once per "
            "micro-batch: divide the sum by the batch size (a mean), or set "
            "l2l.micro_batches: 1")
    if kind == "mean":      # Keras's masked mean: each kept element weighs count / kept
        by_count += [op.name for op in order if op.type in ("RealDiv", "Div", "DivNoNan") and
                     op.name not in by_count and batch_sums.counts_elements(op.inputs[0], rows) and
                     op.inputs[1].shape.rank == 0 and data(op.inputs[1]) and
                     form(op.inputs[1]) == "sum"]
    return LossForm(None if kind == "constant" else kind, by_batch if kind == "mean" else [],
                    scaled[0] and kind == "sum", by_count if kind == "mean" else [],
                    once if kind == "sum" else [], mixed if kind is None else [],
                    widened if kind == "sum" else [], exchanged if kind == "mean" else [],
                    summed if kind == "mean" else [], selected if kind == "mean" else [],
                    averaged if kind == "mean" else [])


def reciprocal_of(t: tf.Tensor, constant=constant_value) -> tf.Tensor | None:
    """c where t is 1 / c (tf.math.reciprocal(c), 1.0 / c), else None."""
    op = t.op
    if op.type in ("Reciprocal", "Inv") or op.type in ("RealDiv", "Div") and \
            np.ndim(one := constant(op.inputs[0])) == 0 and one is not None and one == 1:
        return op.inputs[-1]
    return None


def _every_axis(axes: tf.Tensor, x: tf.Tensor) -> bool:
    """Whether `axes` is tf.range(tf.rank(x)): every axis of x, whose rank
    the graph does not know (tf.reduce_mean of tf.edit_distance's)."""
    op = axes.op
    return op.type == "Range" and op.inputs[1].op.type == "Rank" and \
        op.inputs[1].op.inputs[0] is x and tf.get_static_value(op.inputs[0]) == 0 and \
        tf.get_static_value(op.inputs[2]) == 1


def _zero(t: tf.Tensor, constant) -> bool:
    value = constant(t)
    return value is not None and not np.any(value)


def added_terms(op):
    """The op whose inputs `op` adds (itself for Add, AddV2, Sub, AddN; the
    Pack of scalars that a Sum over all its axes adds, as Keras 3 adds a
    loss and its regularizers), or None."""
    if op.type in ("Add", "AddV2", "Sub", "AddN"):
        return op
    if op.type == "Sum" and op.inputs[0].op.type == "Pack" and op.inputs[0].shape.rank == 1 \
            and all(x.shape.rank == 0 for x in op.inputs[0].op.inputs):
        axes = tf.get_static_value(op.inputs[1])
        if axes is not None and set(np.atleast_1d(axes).tolist()) <= {0, -1}:
            return op.inputs[0].op
    return None


def free_terms(t: tf.Tensor, data) -> list[tuple[str, int]]:
    """(op, input index) of the terms without data (`data(x)` false) that
    `t` adds in linearly (through sums and scalings by such numbers): a
    regularizer in a mean that a sum over the batch widens."""
    out, stack = [], [t]
    while stack:
        op = stack.pop().op
        if op.type in ("Identity", "Snapshot", "Cast", "Neg") or op.type in ("Sum", "Mean") \
                and op.inputs[0].shape.rank == 0:       # (a sum of one number)
            stack.append(op.inputs[0])
        elif op.type in ("Mul", "RealDiv", "Div") and not data(op.inputs[1]):
            stack.append(op.inputs[0])
        elif op.type == "Mul" and not data(op.inputs[0]):
            stack.append(op.inputs[1])
        elif (terms := added_terms(op)) is not None:
            out += [(terms.name, i) for i, x in enumerate(terms.inputs) if not data(x)]
            stack += [x for x in terms.inputs if data(x)]
    return out


# ops that pass a value on unchanged (an identity, a cast, a squeeze or reshape: tf.norm's)
KEEPING = frozenset({"Identity", "Snapshot", "Cast", "Squeeze", "Reshape"})


def through(op):
    """`op`, or the op whose value it passes on unchanged (KEEPING)."""
    while op.type in KEEPING:
        op = op.inputs[0].op
    return op


def scalar_kind(t: tf.Tensor, sources) -> str | None:
    """"sum" or "mean" over the batch for a scalar the replicas compute (a
    loss, a metric's increment), as `averages` reads the losses (a TF1 sum
    over a number not shown to be the batch size: a mean); None if unshown."""
    return scalar_form(t, sources)[0]


def scalar_form(t: tf.Tensor, sources) -> tuple[str | None, bool, LossForm]:
    """`scalar_kind`'s answer, whether it is the guess that a scaled TF1
    sum is a mean, and the form read (graph/averaging.py reads the losses so)."""
    traced, rows = bool(t.graph.get_collection(TAPE_TARGETS)), reading(sources, t.graph)
    batch = None if traced else replica_batch(t.graph, rows.sources)
    form = loss_form(t, rows, batch, strict=False)
    if not traced and batch is None:        # a scaled TF1 sum is taken as a mean
        if form.kind == "sum" and form.scaled:
            return "mean", True, form
        kept = [(term, s) for term, s in form.mixed if not s]
        if form.mixed and not kept:         # the sums added to means all scaled: means
            return "mean", True, replace(form, mixed=[])
        form = replace(form, mixed=kept)
    return form.kind, False, form


def over_widened(t: tf.Tensor, sources, widened) -> bool:
    """Whether the scalar `t` is a mean over a count whose division, or a
    Mean, is one of `widened` (each replica's value 1/N of its share: they
    are summed)."""
    return bool(widened) and widened_in(scalar_form(t, sources)[2], widened)


def widened_in(form: LossForm, widened) -> bool:
    """Whether a scalar of `form` is linear in a mean whose division (or
    Mean, or static size) is one of `widened`: each replica's value is its
    share, the replicas' sum one device's; not a function of the job's
    means (`exchanged`, `summed`: every replica's alike)."""
    return not form.exchanged and not form.summed and any(
        op in widened for op in form.by_count + form.averaged + [op for op, _, _ in form.by_batch])


def replica_batch(graph: tf.Graph, data) -> int | None:
    """A replica's batch size where the graph shows it: the data sources'
    static first dimension, else the one size the input pipeline batches
    by (a Batch dataset op's constant); None otherwise."""
    dims = {compat.dim(t.shape, 0) for name in data
            for t in graph.get_operation_by_name(name).outputs if t.shape.rank}
    if len(dims) == 1 and None not in dims:
        return dims.pop()
    sizes = {int(tf.make_ndarray(op.inputs[1].op.get_attr("value")))
             for op in graph.get_operations() if op.type in _BATCH_DATASETS
             and op.inputs[1].op.type == "Const"}
    return sizes.pop() if len(sizes) == 1 else None


_BATCH_DATASETS = ("BatchDataset", "BatchDatasetV2", "PaddedBatchDataset",
                   "PaddedBatchDatasetV2", "ParallelBatchDataset")
