"""Averaging: whether the replicas' gradients are averaged or summed for
one device's, read from the losses a graph differentiates (`averages`),
where a summed loss adds a term without data that each replica then
adds 1/N of (`added_once`), and the scalars Keras's loss tracker adds
times the replica's row count (`tracker_products`).

Requires: a graph with the losses' gradients (tf.gradients, or a traced
TF2 step's tapes). Guarantees: reads the graph only, through
graph/forms.py's forms of the losses; the same graph gives the same
answer on every worker. Used by the planner (the plan's averaging), by
layer-by-layer execution and by the state-sync pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from .. import compat
from .batch import split_as_parts
from .constants import static_size
from .forms import (added_terms, autodiff_losses, constant_value, counts_rows, loss_form,
                    scalar_form, sources)
from .mixing import bent_gradient, mixing, reaches
from .normalization import data_statistics
from .randomness import is_random, seed_input
from .rows import FED, batch_axis, reading
from .rules import from_autodiff, is_autodiff
from .selections import used_per_row


def averages(config, graph: tf.Graph, sites: list | None = None) -> tuple[bool, bool, str]:
    """(average dense, average sparse, a warning or ""): the config's
    `average_dense`/`average_sparse`, where "auto" follows the losses the
    graph differentiates. One device's gradient of a sum over the global
    batch is the sum of the replicas' (`tf.reduce_sum` of per-example
    losses, or a sum times a number that is not a replica's batch size, as
    `tf.nn.compute_average_loss(..., global_batch_size=B)` in a TF2 step),
    of a mean their mean. A TF1 sum scaled by a number, where the graph
    does not show a replica's batch size, is taken as a mean (a sum over
    `batch_size`, the usual script), and the warning says so; where
    `sites` is a list, such a loss whose numbers `scaled_sums` finds (or a
    sum over a batch size fed beside the batch, a loss whose form is
    otherwise unread), and such scalars read beside the losses (`_beside`:
    a hand-written accuracy), are not warned about and their numbers are
    added to it: transforms/scaled_sums.py decides them each step, from
    the rows fed. A sum that
    adds a term without data (a regularizer) is a sum: the replicas' sum of
    it is exact where each adds 1/N of the term (`added_once`); so is a sum
    plus means over counts (`LossForm.widened`). A loss that adds a sum
    over the batch to another mean is averaged, and the warning says its
    summed part is 1/N of one device's; so is a loss whose form the graph
    does not show, and the warning names it. A loss that reads no data (a
    regularizer differentiated on its own) is neither: its gradient is
    every replica's alike, and added to a summed one each replica adds 1/N
    of it (transforms/state_sync.py). A loss that mixes the batch's
    examples (graph/mixing.py) is warned about first: no combination of the
    replicas' gradients equals one device there; so is, where gradients
    are averaged, a custom gradient not linear in what it receives."""
    wanted = (config.average_dense, config.average_sparse)
    if "auto" not in wanted:
        return (*wanted, "")
    free = set(data_free(graph))        # neither a sum nor a mean: every replica's alike
    losses = [loss for loss in autodiff_losses(graph) if loss.name not in free]
    # one reading of the batch's axes for every loss; micro-batches' rows are the batch's
    data = reading(sources(graph), graph, parts=split_as_parts(graph))
    sums, unsure, once, mixed, unread = [], [], [], [], []
    read = {loss.name: scalar_form(loss, data) for loss in losses
            if not (loss.shape.rank and batch_axis(loss, data) is not None)}
    stats = [op.outputs[0].name for op in data_statistics(graph, data)]    # the job's
    pairs = next(((loss.name, *m) for loss in losses for m in [mixing(
        loss, data, stats + (read[loss.name][2].exchanged + read[loss.name][2].summed
                             if loss.name in read else []))] if m), None)
    for loss in losses:
        if loss.name not in read:
            sums.append(loss.name)      # a value per example: the autodiff sums them
            continue
        kind, guessed, form = read[loss.name]
        if (guessed or kind is None or _fed_count(form, data)) and sites is not None and \
                (found := scaled_sums(loss, data)):
            sites.extend(found)
        elif guessed:
            unsure.append(loss.name)
        elif kind == "sum":
            sums.append(loss.name)
            once.extend((loss.name, op) for op, _ in form.once)
        elif form.mixed:
            mixed.append((loss.name, form.mixed[0][0]))
        elif kind is None:
            unread.append(loss.name)
    summed = bool(losses) and len(sums) == len(losses)
    note = ""
    if pairs:
        note = (f"the loss {pairs[0]!r} mixes the batch's examples ({pairs[1]!r}: {pairs[2]}); "
                "each replica computes it over its own rows, so the step differs from one "
                "device with the global batch, as batch normalization's statistics do. A loss "
                "that reduces over the batch only at its end (per-example terms, summed or "
                "averaged) equals one device")
    elif mixed:
        note = (f"the loss {mixed[0][0]!r} adds a sum over the batch ({mixed[0][1]!r}) to a "
                "mean over it; the replicas' gradients are averaged, which makes the sum's "
                "part 1/N of one device's (summed, the mean's part would be N times). Give "
                "its terms one reduction, or write the mean as a sum over a count "
                "(tf.reduce_sum(x) / tf.cast(tf.size(x), x.dtype), as Keras's and "
                "tf.compat.v1.losses' means are), which is exact")
    elif once and not summed:
        note = (f"the loss {once[0][0]!r} sums over the batch and adds a term that does not "
                f"depend on the data ({once[0][1]!r}: a regularizer?), and other losses "
                "average; the replicas' gradients are averaged, which makes its data's part "
                "1/N of one device's. Make the sum a mean over the replica's batch "
                "(tf.nn.compute_average_loss without global_batch_size, tf.reduce_mean) and "
                "add the term to it")
    elif unsure:
        note = (f"the loss {unsure[0]!r} sums over the batch and scales the sum by a number "
                "the graph does not show to be a replica's batch size; the replicas' "
                "gradients are averaged, which equals one device if it divides by that "
                "size. If not, set config average_dense and average_sparse: false (summed)")
    elif sums and not summed:
        note = (f"the losses {sums} sum over the batch and others average; the replicas' "
                "gradients are averaged (set average_dense/average_sparse to choose)")
    elif unread and (drawn := drawn_rows(graph.get_tensor_by_name(unread[0]),
                                         set(sources(graph)))):
        note = (f"the loss {unread[0]!r} reads no data but {drawn[1]} rows that "
                f"{drawn[0]!r} draws, a number the graph fixes (tf.random.normal([BATCH_SIZE, "
                "...]) of a GAN's generator): every replica draws them all, N times one "
                "device's rows together, and the replicas' gradients are averaged. Draw "
                "tf.shape(batch)[0] rows for each replica's part of the global batch")
    elif unread:
        note = (f"the graph does not show whether the loss {unread[0]!r} is a mean or a sum "
                "over the batch (an op between it and the data hides the batch's rows); the "
                "replicas' gradients are averaged, which equals one device for a mean. For a "
                "sum, set config average_dense and average_sparse: false (summed)")
    dense, sparse = (not summed if w == "auto" else w for w in wanted)
    if sites is not None and dense:     # and scalars beside the losses: a fetched accuracy
        sites.extend(_beside(graph, data, losses))
    for x in dict.fromkeys(tracker_products(graph, data).values()) if sites is not None \
            else ():        # a loss a tracker adds (`evaluate`'s, without gradients): as one
        kind, guessed, _ = read.get(x.name) or scalar_form(x, data)
        done = {site.op for site in sites}
        sites.extend(s for s in (scaled_sums(x, data) if guessed or kind is None else [])
                     if s.op not in done)
    if not note and (dense or sparse) and (bent := bent_gradient(graph)):
        note = (f"a custom gradient is not linear in the gradient it receives ({bent[0]!r}: "
                f"{bent[1]}); the loss is a mean, so each replica's incoming "
                "gradient is N times one device's per example and the replicas' mean of "
                "its results differs from one device. Divide a sum over the batch by the "
                "global batch size and set config average_dense and average_sparse: false "
                "(the replicas' gradients summed), or make the custom gradient linear")
    return dense, sparse, note


@dataclass(frozen=True)
class ScaledSum:
    """Where a TF1 loss multiplies (`multiplies`) or divides a sum over the
    batch by a number, input `at` of `op`, that the graph does not show to
    be a batch size: `count`, the number as a count of rows (0 where it is
    not a whole number, -1 where it is fed: read each step), `per_row`, the
    elements the sum adds per row (1 where the graph does not show it), and
    `rows`, a tensor of the batch's rows the sum reads (its first dimension
    is the rows fed)."""
    op: str
    at: int
    multiplies: bool
    count: int
    per_row: int
    rows: str


def scaled_sums(loss: tf.Tensor, data) -> list[ScaledSum]:
    """Each place where `loss`, a TF1 loss read as a sum over the batch
    scaled by a number (`scalar_form`'s guess), scales a sum by constants
    (`/ 2 / 4`: the outer one) or once by a fed scalar; [] where one of its
    terms is another form (a sum not scaled, a form the graph hides), which
    the warning of `averages` names instead. Terms without data (a regularizer) and
    means beside the scaled sums are averaged as they are. `data`: the
    graph's reading of the batch's axes."""
    found, inputs = [], set(data.sources)

    def terms(t) -> bool:           # whether every term of t is one of the above
        op = t.op
        if not _reads(t, inputs):
            return True
        if past(t) is not t:        # (Keras 3's sum of an added loss)
            return terms(past(t))
        if op.type == "Neg":
            return terms(op.inputs[0])
        if (added := added_terms(op)) is not None:
            return all([terms(x) for x in added.inputs])
        if (at := _number(op, inputs)) is not None and scaled(op, at):
            return True         # (or a mean times a number: as the mean)
        return loss_form(t, data, None, strict=False).kind == "mean"

    def scaled(op, at) -> bool:     # op scales a sum over the batch, by input `at`
        site, n, scales, fed = (op, at), 1.0, 0, False  # (n: what the sum is divided by)
        while True:
            number, x = op.inputs[at], op.inputs[1 - at]
            value = None if _reads(number, inputs) else constant_value(number)
            fed, scales = fed or fed_scalar(number, inputs), scales + 1
            if not fed and (value is None or np.ndim(value) or not np.isfinite(value) or
                            value == 0):
                return False
            n *= 1.0 if fed else float(value) if op.type != "Mul" else 1.0 / float(value)
            while x.op.type in ("Identity", "Snapshot", "Cast", "Neg"):
                x = x.op.inputs[0]
            op, at = x.op, _number(x.op, inputs)
            if at is None:
                break               # x: the sum, or not one
        form, rows = loss_form(x, data, None, strict=False), _rows(x, data)
        if form.kind != "sum" or form.scaled or form.widened or rows is None or \
                _looped(site[0]) or counts_rows(x.op, data) or fed and scales > 1:
            return False            # (rows counted: a rate's; a fed number: the one scale)
        n = abs(n)
        count = -1 if fed else round(n) if abs(n - round(n)) <= 1e-4 * n else 0
        found.append(ScaledSum(site[0].name, site[1], site[0].type == "Mul", count,
                               _per_row(x, data), rows))
        return True
    return found if terms(loss) and found else []


def _number(op: tf.Operation, inputs: set) -> int | None:
    """The input of a scalar product or quotient `op` that reads no data
    (of `inputs`) or is a fed scalar: a quotient's divisor, either factor
    of a product; None."""
    if op.type not in ("Mul", "RealDiv", "Div") or op.outputs[0].shape.rank != 0:
        return None
    return next((at for at in ((1, 0) if op.type == "Mul" else (1,))
                 if fed_scalar(op.inputs[at], inputs) or not _reads(op.inputs[at], inputs)), None)


def fed_scalar(t: tf.Tensor, inputs) -> bool:
    """Whether `t` is (a cast or reciprocal of) a scalar placeholder of
    `inputs`, fed whole to every replica (a script's `batch_size` fed
    beside the batch)."""
    while t.op.type in ("Identity", "Cast", "Reciprocal", "Inv"):
        t = t.op.inputs[0]
    return t.shape.rank == 0 and t.op.name in inputs and \
        t.op.type in FED


def _fed_count(form, data) -> bool:
    """Whether a mean's form divides a sum by a fed scalar (its "count")."""
    graph, inputs = data.graph, set(data.sources)
    return any(fed_scalar(graph.get_operation_by_name(op).inputs[1], inputs)
               for op in form.by_count)


def _beside(graph: tf.Graph, data, losses) -> list[ScaledSum]:
    """The scaled sums of scalars no loss reads that flow into scalars only
    (a hand-written accuracy, `tf.reduce_sum(correct) / BATCH_SIZE`, fetched
    or added up by a metric), outside while loops: each replica's value is
    then one whose replicas' mean is one device's, as a loss's."""
    read, stack, found, updates = set(), [t.op for t in losses], [], None
    inputs = set(data.sources)
    while stack:
        op = stack.pop()
        if op.name not in read:
            read.add(op.name)
            stack.extend(t.op for t in op.inputs)
    for op in graph.get_operations():
        t = op.outputs[0] if len(op.outputs) == 1 else None
        if t is None or op.type not in ("Mul", "RealDiv", "Div") or t.shape.rank != 0 or \
                not t.dtype.is_floating or op.name in read or is_autodiff(op.name) or \
                all(tf.get_static_value(x) is None and not fed_scalar(x, inputs)
                    for x in op.inputs) or _looped(op):
            continue
        updates = from_autodiff(graph) if updates is None else updates
        if reaches(op, updates):
            continue            # a learning rate's (transforms/extremes.py reads the job's)
        _, guessed, form = scalar_form(t, data)
        if (guessed or _fed_count(form, data)) and not used_per_row(op, data) and \
                (sites := scaled_sums(t, data)):
            found.extend(sites)
            read |= {site.op for site in sites}
    return found


def _looped(op: tf.Operation) -> bool:
    """Whether `op` sits in a TF1 while loop's frame."""
    context = op._get_control_flow_context()     # noqa: SLF001 (TensorFlow's own record)
    while context is not None and not context.IsWhileContext():
        context = context.outer_context
    return context is not None


def _reads(t: tf.Tensor, names: set) -> bool:
    """Whether `t` depends on an op named in `names` (not through the fixed
    size of a later axis of its tensors: a feature count)."""
    seen, stack = set(), [t.op]
    while stack:
        op = stack.pop()
        if op.name in names:
            return True
        if op.name not in seen and static_size(op) is None:
            seen.add(op.name)
            stack.extend(x.op for x in op.inputs)
    return False


def _rows(x: tf.Tensor, data) -> str | None:
    """A dense data source's tensor that `x` reads whose first dimension
    holds the batch's rows; None if there is none (a sparse batch)."""
    seen, stack, found = set(), [x.op], []
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in data.sources:
            found += [t for t in op.outputs if t.shape.rank and batch_axis(t, data) == 0]
        stack.extend(t.op for t in op.inputs)
    return min(found, key=lambda t: t.name).name if found else None


def _per_row(x: tf.Tensor, data) -> int:
    """The elements a sum over every axis of a tensor of the batch's rows
    adds per row, where its static shape shows them; else 1."""
    op = past(x).op
    inner = op.inputs[0] if op.type == "Sum" else None
    axis = batch_axis(inner, data) if inner is not None and inner.shape.rank else None
    axes = constant_value(op.inputs[1]) if axis is not None else None
    if axes is None or len({int(a) % inner.shape.rank for a in np.ravel(axes)}) != \
            inner.shape.rank:
        return 1
    dims = [compat.dim(inner.shape, i) for i in range(inner.shape.rank) if i != axis]
    return int(np.prod(dims, dtype=np.int64)) if None not in dims else 1


def data_free(graph: tf.Graph) -> list[str]:
    """The losses the graph differentiates that read no data and draw no
    random numbers (a weight penalty under a tape or tf.gradients of its
    own): the same on every replica, neither a mean nor a sum over the batch."""
    data, out = set(sources(graph)), []
    for loss in autodiff_losses(graph):
        seen, stack, varies = set(), [loss.op], False
        while stack and not varies:
            op = stack.pop()
            if op.name not in seen:
                seen.add(op.name)
                varies = op.name in data or is_random(op.node_def)
                stack.extend(t.op for t in op.inputs)
        if not varies:
            out.append(loss.name)
    return out


def drawn_rows(loss: tf.Tensor, data) -> tuple[str, int] | None:
    """(random op, rows) where `loss` reads no data source (in `data`) but a
    random draw whose first dimension the graph fixes; else None."""
    seen, stack, drawn = set(), [loss.op], None
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in data:
            return None
        shape = op.outputs[0].shape if op.outputs else None
        if (is_random(op.node_def) or seed_input(op.node_def) is not None) and \
                shape is not None and shape.rank and compat.dim(shape, 0) is not None:
            drawn = drawn or (op.name, compat.dim(shape, 0))
        stack.extend(t.op for t in op.inputs)
    return drawn


def added_once(graph: tf.Graph, form=None) -> list[tuple[str, int]]:
    """(op, input index) where a loss the graph differentiates, a sum over
    the batch, adds a term without data (a regularizer beside a
    `tf.reduce_sum`; `compute_average_loss(..., global_batch_size=B)` plus
    `scale_regularization_loss`): one device adds it once, so replicas whose
    gradients are summed each add 1/N of it. `form(loss)`: the loss's
    `loss_form` without a batch, not strict, where the caller has read it."""
    if form is None:
        data = sources(graph)
        form = lambda loss: loss_form(loss, data, None, strict=False)  # noqa: E731
    return [where for loss in autodiff_losses(graph) for where in form(loss).once]


_PAST = frozenset({"Identity", "Snapshot", "Cast", "BroadcastTo", "Reshape", "Squeeze",
                   "ExpandDims"})


def past(t: tf.Tensor) -> tf.Tensor:
    """`t` past ops that keep its value (and sums or means of one element)."""
    while t.op.type in _PAST or (t.op.type in ("Sum", "Mean")
                                 and t.op.inputs[0].shape.num_elements() == 1):
        t = t.op.inputs[0]
    return t


def tracker_products(graph: tf.Graph, sources) -> dict:
    """{Mul op: x} of the scalars that are a scalar x times the replica's
    row count (Keras's loss tracker adds `loss x batch size` to its
    total). Where x is summed (a sum over the batch, or a mean over a
    widened count), one device adds the global x times the global count,
    N times the replicas' sum of theirs (transforms/state_sync.py)."""
    found = {}
    for op in graph.get_operations():
        if op.type != "Mul" or op.outputs[0].shape.num_elements() != 1:
            continue
        a, b = (past(x) for x in op.inputs)
        x = next((x for count, x in ((a, b), (b, a)) if counts_rows(count.op, sources)
                  and x.shape.num_elements() == 1), None)
        if x is not None:
            found[op.name] = x
    return found
