"""The counts losses divide a sum over the batch by, as the state-sync pass
shares them among replicas (transforms/state_sync.py): which divisions
(a masked mean's, `tf.compat.v1.losses`' with weights, a mean added to a
sum over the batch), whether the data's values set a count (a mask's sum)
or only its shape (equal on every replica), and where a count is floored
or smoothed before the division (`tf.maximum(count, 1)`, `count + eps`).
Also the scalars a program reads beside its loss (`beside`: a masked
accuracy, an RMSE, fetched, returned or added up by a metric), whose
counts are shared and whose means, and the means they centre the batch on
(`centres`), the replicas exchange as a loss's, so the replicas' mean of
each is one device's.

Requires: the user's TrainingGraph (`tg`: its IR and tf.Graph) and the
names of its data sources. Guarantees: reads the graph only, but
`read_everywhere`, which records rewires for a pass to make.
"""
from __future__ import annotations

from parallax_ng.graph import (averaging, batch_sums, branches, forms, mixing, rows, rules,
                                selections)
from parallax_ng.graph.ir import parse_tensor


class Forms:
    """Each loss's form as the planner reads it (`forms.scalar_form`: with
    a replica's batch size where the graph shows it, not strict), read
    once per pass: `form(loss)`."""

    def __init__(self, sources):
        self.sources, self.read = sources, {}

    def __call__(self, loss):
        if loss.name not in self.read:
            self.read[loss.name] = forms.scalar_form(loss, self.sources)[2]
        return self.read[loss.name]

    def over_widened(self, t, widened) -> bool:
        """forms.over_widened, from the form read."""
        return bool(widened) and forms.widened_in(self(t), widened)


def shared(tg, sources, form, widened: dict, products: dict, read=()) -> list:
    """(count, widened) of the counts that losses (and the losses Keras's
    trackers add: `evaluate`'s) and the scalars `read` beside them (a masked
    accuracy a metric adds up or a program fetches) divide a sum over the
    batch by. Where the
    count depends on the data's values (a mask's sum, weights' nonzero
    count), not only on its shape (equal on every replica), one device
    divides by the global batch's count: each replica divides by the
    replicas' mean count instead of its own, so the mean of the replicas'
    gradients (and losses) is one device's. `widened` divisions' counts
    are N times that (1, or -1 for a product by 1 / the size: the power of
    N they take). A scalar fed whole (a script's `batch_size`) is every
    replica's alike: transforms/scaled_sums.py decides a sum over it."""
    out = {}
    for loss in forms.autodiff_losses(tg.graph) + list(products.values()) + list(read):
        for op in form(loss).by_count:
            count = tg.ir.data_inputs(op)[1]
            if by_job(tg, count, set(sources)) and not averaging.fed_scalar(
                    tg.tensor(count), set(sources)):    # (fed whole: transforms/scaled_sums.py)
                out.setdefault(count, False)
    out.update({c[0]: c[1] for c in widened.values() if c is not None})
    return list(out.items())


def widened(tg, form, products: dict, summing: bool) -> dict:
    """{division: (its count, the power of N it takes)} of the means a loss
    adds to a sum over the batch (forms.LossForm.widened; a Mean's is None:
    transforms/selected_means.py divides it): where the replicas' gradients
    are summed, or a graph without gradients (`evaluate`'s) has a tracker
    add the loss, each replica divides the mean by N times its count, so
    the replicas' sum of it is one device's mean."""
    losses = forms.autodiff_losses(tg.graph)
    trained = tg.ir.ancestors({t.op.name for t in losses}, data_only=True) if losses else set()
    return {op: _widened_count(tg, op)
            for loss in (losses if summing else []) + list(products.values())
            for op in form(loss).widened if summing or op not in trained}


def _widened_count(tg, op: str):
    """(count, power of N) of a widened mean's op: a division's divisor (N
    times it), a product's count under a reciprocal (`sum * (1 / rows)`:
    N times it), or a product's 1 / size (a static batch's: 1/N times it);
    None for a Mean."""
    kind = tg.ir.node(op).op
    if kind != "Mul":
        return None if kind == "Mean" else (tg.ir.data_inputs(op)[1], 1)
    for x in tg.graph.get_operation_by_name(op).inputs:
        if forms.reciprocal_of(x) is not None:      # (its count: the last input)
            return tg.ir.data_inputs(x.op.name)[-1], 1
    return tg.ir.data_inputs(op)[1], -1


MIXED = ("state adds up or is assigned numbers each replica computes over its own rows "
         "that mix the batch's examples or take its largest or smallest value ((variable, "
         "why): {}): no sum or mean of the replicas' is one device's over the global batch; "
         "they are averaged (rows added at indices: summed)")

UNTRAINED = (
    "variables {} are written by the step from each replica's data (trainable ones, or "
    "others from the autodiff's output, as an optimizer's slots), but no gradient of a "
    "variable was found there (an optimizer's update reading the autodiff's output, or a "
    "slot it writes that way): their writes are synced as state, the replicas' values "
    "averaged (rows added at indices summed), which equals one device only where the write "
    "is linear in the data (plain SGD, a moving average); mark trainable ones "
    "trainable=False if they are state")


def mixed(tg, ref, sources, products) -> str | None:
    """Why a scalar of floats from the data's values that state adds up (a
    metric's) is not one device's as the replicas' sum: it mixes the
    batch's examples (its top k, a softmax across it: graph/mixing.py) or
    is its largest or smallest value; None otherwise (a loss tracker's
    product and counts of shapes too)."""
    t = tg.tensor(ref)
    if t.shape.rank != 0 or not t.dtype.is_floating or \
            averaging.past(t).op.name in products or not from_values(tg, ref, set(sources)):
        return None
    if found := mixing.mixing(t, sources):
        return f"{found[0]}: {found[1]}"
    while (op := forms.through(t.op)).type in ("Sum", "Mean") and op.inputs[0].shape.rank == 0:
        t = op.inputs[0]            # Keras's metrics add up a sum of the scalar they take
    if largest := mixing.extreme(t, sources):
        return f"{forms.through(t.op).name}: the batch's {largest}imum"
    return None


_DIVISIONS = frozenset({"RealDiv", "Div", "DivNoNan"})


def beside(tg, sources) -> list:
    """The scalars of floats outside branches and loops that a program reads
    beside its loss and that flow into scalars only: ratios of a Sum over a
    count the data's values set (a masked accuracy a TF1 script fetches
    and prints) or over other Sums (a Dice coefficient), and scalar functions
    of means (a fetched RMSE's `tf.sqrt(tf.reduce_mean(...))`, or of a sum
    over its count, maybe scaled or shifted: `+ 1e-6`); so per feature,
    of no batch axis (a masked accuracy's sums over the batch's axis, a
    standard deviation's means); and means over the batch of rows centred
    on a mean over it (tf.math.reduce_variance, not trained). Candidates:
    their forms say which counts `shared` shares and which means and sums
    the replicas exchange."""
    out, above, found = [], {}, set(sources)
    data = rows.reading(list(sources), tg.graph)
    trained = None
    for op in tg.graph.get_operations():
        if op.type == "Mean" and _batch_mean(op, data) and not rules.is_autodiff(op.name):
            trained = _trained(tg) if trained is None else trained
            if op.name not in trained and _centred(tg, op, data) and \
                    not branches.switches_above(tg.ir, op.name, above) and \
                    not selections.used_per_row(op, data):
                out.append(op.outputs[0])       # (a variance: the job's mean of its squares)
            continue
        if op.type not in forms.SCALAR_FUNCTIONS or not op.outputs[0].dtype.is_floating or \
                rules.is_autodiff(op.name):
            continue
        vector = op.outputs[0].shape.rank != 0      # per feature: of no batch axis
        if vector and (op.outputs[0].shape.rank is None or
                       data.guarded(lambda r: r.axis(op.outputs[0])) is not None):
            continue
        if op.type in _DIVISIONS and (_batch_sum(op.inputs[0], data) if vector
                                      else _scaled_sum(op.inputs[0])):
            if not from_values(tg, tg.ir.data_inputs(op.name)[1], found):
                continue        # (a masked accuracy, or one per feature)
        elif not any(_batch_mean(_past_constants(x.op), data) if vector else
                     x.shape.rank == 0 and _a_mean(_past_constants(x.op)) for x in op.inputs):
            continue            # (an RMSE, or a standard deviation per feature)
        if not branches.switches_above(tg.ir, op.name, above) and \
                not selections.used_per_row(op, data):
            out.append(op.outputs[0])
    return out


def _trained(tg) -> set[str]:
    """The ops the losses are computed from."""
    losses = forms.autodiff_losses(tg.graph)
    return tg.ir.ancestors({t.op.name for t in losses}, data_only=True) if losses else set()


def _centred(tg, op, data) -> bool:
    """Whether Mean `op` over the batch takes rows centred on a mean over
    the batch (tf.math.reduce_variance's, a mean absolute deviation's):
    what `centres` gives the job's."""
    return any(x != op.name and (m := tg.graph.get_operation_by_name(x)).type == "Mean" and
               _batch_mean(m, data) and selections.used_per_row(m, data)
               for x in tg.ir.ancestors({op.name}, data_only=True))


def exchanged(tg, sources, form, read, tracked) -> list[tuple[str, bool]]:
    """(tensor name, mean) of what the replicas exchange, forward and in the
    gradient: of the losses, the scalars `read` beside them and those
    Keras's trackers add up (`tracked`), the means a function not linear in
    them takes (an RMSE's: the job's mean) and the sums over the batch (a
    Dice loss's, with their incoming gradients: the job's sums), and the
    means the values read centre on (`centres`)."""
    losses = forms.autodiff_losses(tg.graph) + read + tracked
    return [(n, True) for loss in losses for n in form(loss).exchanged] + \
        [(n, False) for loss in losses for n in form(loss).summed] + \
        [(n, True) for n in centres(tg, sources, read)]


def _batch_sum(t, data) -> bool:
    """Whether `t` is a Sum over the batch's axis (of a vector too) or its
    rows summed per class (`batch_sums.per_segment`), maybe scaled or
    shifted by constants."""
    total = _past_constants(t.op)
    return total.type == "Sum" and data.guarded(lambda r: r.axis(total.inputs[0])) is not None \
        or bool(data.guarded(lambda r: batch_sums.per_segment(total, r)))


def _batch_mean(op, data) -> bool:
    """Whether `op` is a Mean over the batch's axis (of a vector too)."""
    return op.type == "Mean" and data.guarded(lambda r: r.axis(op.outputs[0])) is None and \
        data.guarded(lambda r: r.axis(op.inputs[0])) is not None


def _a_mean(op) -> bool:
    """Whether `op` makes a mean: a Mean, or a division of a Sum (Keras's
    and tf.compat.v1.losses' means divide a sum by its count)."""
    return op.type == "Mean" or op.type in _DIVISIONS and _scaled_sum(op.inputs[0])


def job_points(tg, points, form, widened: dict) -> list[tuple]:
    """(tensor, mean, share) of each of `points` ((name, mean): `exchanged`
    and the plan's): a widened mean's (each replica's value a share of one
    device's: `share`) is the replicas' sum, not their mean, unless it is
    computed from another such (which every replica then reads whole)."""
    refs = [(parse_tensor(name), mean) for name, mean in points]
    shares = {ref.node for ref, mean in refs if mean and form.over_widened(tg.tensor(ref),
                                                                          widened)}
    out = []
    for ref, mean in refs:
        share = ref.node in shares and not shares & (
            tg.ir.ancestors({ref.node}, data_only=True) - {ref.node})
        out.append((ref, mean and not share, share))
    return out


def _scaled_sum(t) -> bool:
    """Whether `t` is a Sum, maybe scaled or shifted by constants (a Dice
    coefficient's `2 * sum(y * p) + smooth`)."""
    return _past_constants(t.op).type == "Sum"


def _past_constants(op):
    """The op `op` scales, shifts or negates by constants (`mean + 1e-6`
    under an RMSE's root, `2 * sum`, `-mean`), past ops that keep a value."""
    op = forms.through(op)
    while op.type in ("Mul", "AddV2", "Add", "Sub", "RealDiv", "Div", "Neg"):
        constant = [x.op.type == "Const" for x in op.inputs]    # (a divisor's, or either)
        if constant != [False] and constant != [False, True] and (
                constant != [True, False] or op.type in _DIVISIONS):
            break
        op = forms.through(op.inputs[constant.index(False)].op)
    return op


def centres(tg, sources, read) -> list[str]:
    """The means over the batch (scalars, or vectors: per feature) that the
    values `read` beside the loss take back into rows (a per-batch
    R-squared's or Pearson correlation's `y - mean(y)`, a standard
    deviation's): each replica would centre its rows on its
    own mean, one device centres the global batch on the global one, so
    the replicas exchange them (tensor names). Means the loss reads too
    are left alone: training stays as it was."""
    if not read:
        return []
    trained, out, data = _trained(tg), [], rows.reading(list(sources), tg.graph)
    for name in sorted(tg.ir.ancestors({t.op.name for t in read}, data_only=True) - trained):
        op = tg.graph.get_operation_by_name(name)
        if op.type == "Mean" and op.outputs[0].dtype.is_floating and \
                not rules.is_autodiff(name) and (
                    op.outputs[0].shape.num_elements() == 1 and
                    forms.scalar_kind(op.outputs[0], sources) == "mean" or
                    _batch_mean(op, data)) and selections.used_per_row(op, data):
            out.append(op.outputs[0].name)      # (a vector's: a std per feature)
    return out


_SHAPES = frozenset({"Shape", "ShapeN", "Size", "Rank", "OnesLike", "ZerosLike"})


def from_values(tg, ref, sources: set) -> bool:
    """Whether `ref` depends on a data source's values (data edges not through
    ops that read only a shape, but for the shape of rows a mask picks)."""
    return bool(sources & tg.ir.ancestors({ref.node}, stop=lambda name: tg.ir.node(
        name).op in _SHAPES and not selections.picked(tg.graph.get_operation_by_name(
            name).inputs[0], list(sources)), data_only=True))


_FLOORS = frozenset({"Maximum", "AddV2", "Add", "Sub", "Sqrt", "Square", "Pow"})


def by_job(tg, count, sources: set) -> bool:
    """Whether each replica divides by the job's `count` (`shared`): a count
    the data's values set, or a count of rows floored or shifted (`n - 1`:
    a covariance's, which no mean of the replicas' quotients equals)."""
    if from_values(tg, count, sources):
        return True
    at, inner = floored(tg, count, sources)
    op = tg.graph.get_operation_by_name(inner.node)
    while op.type == "Cast":
        op = op.inputs[0].op
    return at is not None and rows.counts_rows(op, list(sources))


def floored(tg, count, sources: set):
    """((op, input position), the count inside) where a count enters ops
    that floor or smooth it with values the data does not set
    (`tf.maximum(count, 1)`, `count + eps`, `n - 1`, maybe cast after), or
    bend it (`tf.sqrt(n)`, `n ** 2`): one device floors the global count,
    so the job's sum goes in there and each replica divides by 1/N of the
    result; (None, count) for a bare count."""
    found, ref, inner = None, count, count
    while ref.index == 0 and tg.ir.node(ref.node).op in _FLOORS | forms.KEEPING:
        ins = tg.ir.data_inputs(ref.node)
        data = [i for i, r in enumerate(ins) if from_values(tg, r, sources)] or \
            [i for i, r in enumerate(ins) if sources & tg.ir.ancestors({r.node}, data_only=True)]
        if len(data) != 1 or data[0] and tg.ir.node(ref.node).op == "Sub":
            break
        if tg.ir.node(ref.node).op not in forms.KEEPING:     # (tf.norm squeezes its root)
            found, inner = (ref.node, data[0]), ins[data[0]]
        ref = ins[data[0]]
    return found, inner


def read_as_job(tg, ref, replaced: set) -> bool:
    """Whether every use of `ref` reads a job's value already (`replaced`:
    extremes' exchange of a state write's standard deviation, say)."""
    used = uses(tg, ref)
    return bool(used) and all(u in replaced for u in used)


def read_everywhere(ctx, ref, outs, rewires: dict, replaced: set, apart_from=None,
                    losses_apart: bool = False) -> None:
    """Every use of `ref` in replica k reads outs[k] instead (a synced write
    of it stays so); with `apart_from` (widened means), only the uses
    `apart` from them; with `losses_apart`, not those of the losses' nodes
    (`in_losses`)."""
    but = in_losses(ctx.tg) if losses_apart else ()
    only = apart(ctx.tg, apart_from) if apart_from else None
    for node, at in uses(ctx.tg, ref):
        if node in but or only is not None and not only(node):
            continue
        replaced.add((node, at))
        for k, out in enumerate(outs):
            rewires.setdefault((ctx.replica_name(k, node), at), out)


def apart(tg, widened) -> callable:
    """Whether a node is apart from the `widened` means (none of their ops,
    the ops they are made of, or the autodiff's): a value that divides by
    a widened mean's count too (an accuracy over the same rows) reads the
    count unwidened."""
    made = tg.ir.ancestors(set(widened), data_only=True) | set(widened)
    return lambda node: node not in made and not rules.is_autodiff(node)


def in_losses(tg) -> set[str]:
    """The nodes the losses the autodiff differentiates are made of: a
    widened mean's share is theirs, the job's value (the shares' sum) the
    functions' of it beside them (a fetched RMSE's)."""
    return tg.ir.ancestors({t.op.name for t in forms.autodiff_losses(tg.graph)}, data_only=True)


def uses(tg, ref) -> list[tuple[str, int]]:
    """(node, input position) of every data use of `ref`: the division, and
    the gradient's ops that divide by the count too."""
    return [(name, at) for name in sorted(tg.ir.node_consumers.get(ref.node, ()))
            for at, r in enumerate(tg.ir.data_inputs(name)) if r == ref]
