"""Batch normalization's statistics: found, and made the global batch's.

In training, batch normalization (Keras 3's and tf_keras's
BatchNormalization, `tf.compat.v1.layers.batch_normalization`, a script's
own `tf.nn.moments` over the batch) normalizes by the mean and variance of
the batch it is given. On N replicas each is given its own rows, so by
default (config `batch_norm: per_replica`) the step trains close to one
device's with the global batch, not equal to it: `found` names such layers,
and other means over the batch that the step applies to its rows (a
normalization of the program's own), for the lines the plan prints.

`batch_norm: synchronized` makes the statistics the global batch's, forward
and backward, where the graph computes them with `tf.nn.moments` over the
batch's axis (`Mean` of x; `Mean` of the squared difference of x and that
mean, through a StopGradient): each replica's mean is replaced by the job's
mean of the replicas' means, and so is its variance of x around that mean
(equal row counts make those the global batch's, as one device computes
them: two passes, no cancellation), and in the gradient the incoming
gradient of each `Mean` likewise (the autodiff divides it by the replica's
rows; the job's mean of it, so divided, is what one device gives each row).
`points` names those tensors; transforms/state_sync.py exchanges them.
So are, under `synchronized`, the other Means over the batch the step
applies to its rows (a standardization by hand, Barlow Twins'), with the
incoming gradients graph/mean_gradients.py finds for them, and Sums (the
job's sum both ways: Keras 3's BatchNormalization given a mask, an
l2_normalize over the batch), with the row counts that divide them where
nothing else reads those (`sum / n`, a variance's `/ (n - 1)`).
A `Mean`'s gradient is found under the autodiff's name for it
(`gradients/<op>_grad/`, tf.gradients) or in a traced step's GradientTape
by its form (`Reshape`, `Tile` or `BroadcastTo`, `RealDiv`) under the
layer's scope, the variance's being the one whose result is multiplied by
x minus the mean; for a layer in a nested tf.function, inlined, under its
name past the call's scope in the gradient whose ops read its x (another
call of the layer has a gradient of the same names). The fused kernel
(`FusedBatchNormV3` in training, which tf_keras and tf.compat.v1 pick for
4-D inputs) computes its statistics
inside one op: graph/fused_norm.py lowers it to that form, its Means
marked with the names of their incoming gradients (`LOWERED`) and its
row count summed (`count`: the unbiased variance of the moving
statistics). Statistics in a tf.cond's branch every replica takes alike
are exchanged there; one the exchange cannot reach (in a while loop, a
function, a branch each replica decides by its own data) stays per
replica, and the plan's line says so.

Requires: a TrainingGraph (its tf.Graph) and the names of its data
sources. Guarantees: reads the graph only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import tensorflow as tf

from .. import compat
from . import branches, randomness
from .applied import alone, applied, axes_of, carried, of_data
from .forms import autodiff_losses, sources
from .rows import reading
from .mean_gradients import Autodiff, chains, incoming, incoming_sum
from .rules import from_autodiff, is_autodiff, past_identities

FUSED = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
# on a lowered fused op's Means (graph/fused_norm.py): their incoming gradient's name
LOWERED = "_parallax_lowered"


@dataclass(frozen=True)
class Moments:
    """A `tf.nn.moments` over the batch: its two Means, and the incoming
    gradients of each, one in each gradient that reaches it (None: no
    gradient reaches it, or not every one was found)."""
    mean: tf.Operation
    variance: tf.Operation
    mean_grad: tuple[tf.Tensor, ...] | None
    variance_grad: tuple[tf.Tensor, ...] | None
    differentiated: bool        # the autodiff has ops for the statistics' layer
    count: tf.Tensor | None = None   # a lowered fused op's rows, summed (its unbiased variance)
    branched: bool = False      # in a v1 tf.cond or while loop: not exchanged

    @property
    def layer(self) -> str:
        """The layer's scope: the ops' names without `moments/...`."""
        return self.mean.name.rsplit("/", 2)[0] if self.mean.name.count("/") > 1 else \
            self.mean.name.rsplit("/", 1)[0]

    def trained(self) -> bool:
        """Whether the gradients reach the statistics."""
        return self.mean_grad is not None or self.variance_grad is not None

    def complete(self) -> bool:
        """Whether every gradient the statistics get was found: both, or
        none where the autodiff has no op for them (no gradient reaches x
        through them: the forward's exchange is all)."""
        return (self.mean_grad is not None and self.variance_grad is not None) or \
            (not self.trained() and not self.differentiated)


def planned(tg, batch_norm: str) -> tuple[tuple[str, ...], tuple]:
    """(the plan's lines, the `points` to exchange) for config `batch_norm`
    of TrainingGraph `tg`. Statistics in a tf.cond's branch every replica
    takes alike (a fed `training` flag) are exchanged there; in a loop, or
    under a predicate from each replica's data, they are not: a replica
    that skips the branch would leave the others waiting for its part.
    Moments of the data alone (no variable's value upstream: a script's
    inputs standardized by tf.nn.moments) are exchanged with any
    `batch_norm`: that is exact and cheap."""
    moments, fused, other = found(tg.graph, sources(tg.graph))
    memo, looped = {}, randomness.in_loops(tg.ir)     # a traced step's lowered loops too
    moments = [replace(m, branched=m.mean.name in looped or _apart(tg, m.mean.name, memo))
               for m in moments]
    synchronized, own = batch_norm == "synchronized", []
    if not synchronized:        # the data's own moments (inputs standardized): exchanged
        data = [m for m in moments if not m.branched and of_data(m.mean) and of_data(m.variance)]
        moments = [m for m in moments if m not in data]
    else:                       # a normalization of the program's own: its means too
        own, other = _own_means(tg, other, lambda n: n in looped or _apart(tg, n, memo))
    return tuple(lines(moments, fused, synchronized, other, looped)), \
        tuple(points(moments if synchronized else data) + own)


def _own_means(tg, other: list[str], apart) -> tuple[list, list[str]]:
    """(points, the rest of `other`): each Mean and Sum among `other`
    (statistics of what the variables compute, applied to the batch's
    rows) with its incoming gradient, where that is found and the
    statistic runs in no loop or branch `apart` from other replicas': a
    Mean as tf.nn.moments' are exchanged (the job's mean forward and of
    the incoming gradient), which makes the rows one device's; a Sum by
    the job's sum both ways, where nothing of the replica's own scales it
    on its way to the rows (applied.py `alone`): the data's sums that do,
    a masked mean's count, and the batch's row counts that only these
    Sums' ways read, exchanged with it (the job's sums of them)."""
    index, found = Autodiff(tg.graph), {}
    for name in other:
        op = tg.graph.get_operation_by_name(name)
        grads = None if apart(name) else incoming(index, op) if op.type == "Mean" else \
            incoming_sum(index, op) if op.type == "Sum" else None
        if grads is not None:
            found[name] = (op, grads)
    rows, scales = reading(sources(tg.graph), tg.graph), {}
    while True:             # a Sum scaled by one that stays the replica's stays too
        sums = [op for op, _ in found.values() if op.type == "Sum"]
        path = rows.guarded(lambda r: frozenset().union(*(carried(op, r)[0] for op in sums)))
        scales = {op.name: rows.guarded(lambda r: alone(op, r, frozenset(found), path or ()))
                  for op in sums}
        if not (dropped := [n for n, s in scales.items() if s is None]):
            break
        for n in dropped:
            del found[n]
    out = [(s.outputs[0].name, s.type == "Mean") for ss in scales.values() for s in ss]
    for op, grads in found.values():
        out += [(x.name, op.type == "Mean") for x in (op.outputs[0], *grads)]
    return out, [n for n in other if n not in found]


def _apart(tg, name: str, memo: dict) -> bool:
    """Whether op `name` runs in a while loop, or in a branch whose predicate
    differs between replicas (beyond their batches' shapes)."""
    return any(tg.ir.node(tg.ir.data_inputs(s)[1].node).op == "LoopCond" or
               branches.decided_apart(tg, s, lambda ref: ref.node in tg.variant)
               for s in branches.switches_above(tg.ir, name, memo))


def found(graph: tf.Graph, sources) -> tuple[list[Moments], list[str], list[str]]:
    """(the `tf.nn.moments` over the batch's axis of data, the fused batch
    normalizations in training: their op names, those in functions as
    `function:op`, and other statistics over the batch's axis of what
    the variables compute that the step applies to the batch's rows: a
    normalization of the script's own)."""
    rows, index = reading(sources, graph), Autodiff(graph)
    moments = rows.guarded(lambda r: [m for op in graph.get_operations()
                                      if (m := _moments(op, r, index)) is not None])
    fused = rows.guarded(lambda r: [op.name for op in graph.get_operations()
                                    if _training(op) and _over_examples(op, r)]) or []
    fused += [f"{name}:{n.name}" for name, f in _called(graph.as_graph_def()).items()
              for n in f.node_def if n.op in FUSED and n.attr["is_training"].b]
    known = {o.name for m in moments or () for o in (m.mean, m.variance)}
    known |= from_autodiff(graph)       # an update's math reads the job's gradient
    trained = _read_by(autodiff_losses(graph))   # (state alone: transforms/extremes.py)
    other = rows.guarded(lambda r: [op.name for op in graph.get_operations()
                                    if op.name not in known and applied(op, r) and
                                    (trained is None or op.name in trained) and
                                    not of_data(op)])
    return moments or [], fused, other or []


def data_statistics(graph: tf.Graph, sources) -> list[tf.Operation]:
    """The means, sums, maxima and minima over the batch's axis of the data
    alone (no variable's value; `of_data`) that the step applies to the
    batch's rows: a program's own scaling of its inputs
    by the batch's statistics (`(x - mean) / std`, `x / max`, a reward's
    baseline); and maxima and minima read anywhere (a loss divided by the
    batch's largest target: no loss form reads them). The replicas
    exchange them (transforms/extremes.py), so they are the global
    batch's, exactly. Not a sum that scales a statistic of what the
    variables compute (a weighted mean's total weight): it is the job's
    with that statistic or the replica's with it (`_own_means`)."""
    def ask(r):
        found = [op for op in graph.get_operations() if applied(op, r) or op.type in (
            "Max", "Min") and applied(op, r, anywhere=True)]
        scaling = {s.name for op in found if op.type in ("Sum", "Mean") and not of_data(op)
                   for s in alone(op, r) or ()}
        return [op for op in found if of_data(op) and op.name not in scaling]
    return reading(sources, graph).guarded(ask) or []


def _read_by(losses: list) -> set | None:
    """The names of the ops the losses are computed from (None without a
    loss: every op counts, a normalized output is each replica's)."""
    seen, stack = set(), [t.op for t in losses]
    while stack:
        if (op := stack.pop()).name not in seen:
            seen.add(op.name)
            stack.extend(x.op for x in op.inputs)
    return seen or None


def points(moments: list[Moments]) -> list[tuple[str, bool]]:
    """(tensor name, True: the job's mean) of every statistic and incoming
    gradient the replicas exchange, for those whose gradients are all
    found."""
    out = []
    for m in moments:
        if m.complete() and not m.branched:
            out += [(m.mean.outputs[0].name, True), (m.variance.outputs[0].name, True)]
            out += [(g.name, True) for gs in (m.mean_grad, m.variance_grad) for g in gs or ()]
            out += [(m.count.name, False)] if m.count is not None else []
    return out


def lines(moments: list[Moments], fused: list[str], synchronized: bool,
          other=(), looped=frozenset()) -> list[str]:
    """The plan's lines on batch normalization that is not the global
    batch's (one device's): all of it by default, what `synchronized`
    cannot reach with it (by default too: in a loop, `looped`, or a
    function); and `other` means over the batch applied to its rows, which
    neither exchanges."""
    said = "normalizes each replica's rows by their own mean and variance"
    out = [f"statistics over the batch's axis {_named(other)} are applied to the batch's "
           "rows (a normalization of the program's own): each replica takes its own rows', "
           "so training is close to one device's with the global batch, not equal; " + (
               "batch_norm: synchronized exchanges a Mean or a Sum over the batch (not a "
               "maximum or minimum, nor a Sum divided by a row count the program reads "
               "elsewhere too, as its loss's) where it finds the "
               "autodiff's gradient of it, outside while loops and branches the replicas "
               "decide apart" if synchronized else
               "batch_norm: synchronized makes means and sums over the batch the global batch's, "
               "forward and backward")] * bool(other)
    branched = [f"batch normalization {_named({m.layer for m in moments if m.branched})} "
                f"{said}, batch_norm: synchronized notwithstanding: its statistics are "
                "computed inside a while loop or a tf.cond whose predicate each replica "
                "computes from its own data, whose exchange would wait on replicas that skip "
                "it"] * any(m.branched for m in moments)
    kept = [f for f in fused if synchronized or f in looped or ":" in f]
    branched += [f"fused batch normalization {_named(kept)} {said}, batch_norm: synchronized "
                 "notwithstanding: it runs inside a while loop or a function other than a "
                 "tf.cond's branch, or ops other than its one gradient read what it keeps for "
                 "it (fused=False makes it the global batch's)"] * bool(kept)
    if not synchronized:        # (the branched and kept: synchronized does not reach them)
        layers = _named({m.layer for m in moments if not m.branched} | set(fused) - set(kept))
        return [f"batch normalization {layers} {said} (batch_norm: per_replica, the default): "
                "training is close to one device's with the global batch, not equal; "
                "batch_norm: synchronized makes the statistics the global batch's"] * bool(
                    layers) + branched + out
    if unknown := _named({m.layer for m in moments if not m.complete() and not m.branched}):
        out.append(f"batch normalization {unknown} {said}, batch_norm: synchronized "
                   "notwithstanding: the gradient of its statistics is not one the autodiff "
                   "makes of tf.nn.moments' ops")
    return out + branched


def _called(graph_def) -> dict:
    """The library's functions the graph's ops call, directly or in turn
    (not the branches of an If graph/cond_lowering.py lowered)."""
    library = {f.signature.name: f for f in graph_def.library.function}
    out, todo = {}, list(graph_def.node)
    while todo:
        node = todo.pop()
        for name in branches.functions(node.attr) + [node.op]:
            if name in library and name not in out:
                out[name] = library[name]
                todo += list(library[name].node_def)
    return out


def _named(layers, most: int = 6) -> str:
    """The first `most` of `layers` in order, and how many more."""
    names = sorted(layers)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{names[:most]}{more}" if names else ""


def _training(op) -> bool:
    return op.type in FUSED and op.get_attr("is_training")


def _over_examples(op, rows) -> bool:
    """Whether fused op `op` takes its statistics over the batch's examples:
    its rows on an axis it reduces (not C), or unknown where N is not 1
    (tf_keras's LayerNormalization reshapes its input to [1, rows,
    features, 1], NCHW: a statistic per row, whatever the replicas hold)."""
    x, axis = op.inputs[0], rows.axis(op.inputs[0])
    if axis is not None:
        channels = 1 if op.get_attr("data_format").startswith(b"NC") else \
            (x.shape.rank or 4) - 1
        return axis != channels
    return x.shape.rank is None or compat.dim(x.shape, 0) != 1     # (a v1 Dimension too)


def _moments(op, rows, index) -> Moments | None:
    """The Moments whose variance `op` is, or None: op is a Mean of a
    SquaredDifference of x and the StopGradient of a Mean of x, over the
    same axes, which hold x's batch axis."""
    if op.type != "Mean" or is_autodiff(op.name):
        return None
    diff = op.inputs[0].op
    if diff.type != "SquaredDifference" or diff.inputs[1].op.type != "StopGradient":
        return None
    mean, x = diff.inputs[1].op.inputs[0].op, diff.inputs[0]
    if mean.type != "Mean" or mean.inputs[0] is not x:
        return None
    axes = [axes_of(o) for o in (op, mean)]
    rank = x.shape.rank
    if axes[0] is None or axes[0] != axes[1] or rank is None:
        return None
    axis = rows.axis(x)
    if axis is None or axis not in {a % rank for a in axes[0]}:
        return None
    if LOWERED in mean.node_def.attr:       # a fused op's, lowered (`edit`)
        grads = [_lowered_gradient(m) for m in (mean, op)]
        return Moments(mean, op, *grads, grads[0] is not None,
                       op.graph.get_tensor_by_name(mean.name.rsplit("/", 1)[0] + "/count:0"))
    return Moments(mean, op, _incoming(index, mean, op, x), _incoming(index, op, op, x),
                   bool(index.of(mean, x) or index.of(op, x)))


def _lowered_gradient(mean) -> tuple[tf.Tensor] | None:
    name = mean.node_def.attr[LOWERED].s.decode()
    return (mean.graph.get_tensor_by_name(name),) if name else None


def _incoming(index, mean, variance, x) -> tuple[tf.Tensor, ...] | None:
    """The gradients the autodiff gives `mean`'s output, one in each
    gradient that reaches it (a GAN's discriminator on the generated rows
    is differentiated in its loss and the generator's), where it finds
    one form of it in each: the input of its Mean gradient's Reshape."""
    found = [[c for c in chains(ops) if _of_variance(c[2], variance, x) == (mean is variance)]
             for ops in index.each(mean, x)]
    if found and all(len(f) == 1 for f in found):
        return tuple(f[0][0].inputs[0] for f in found)
    return None


def _of_variance(div, variance, x) -> bool:
    """Whether the Mean gradient `div` is the variance's: its result
    multiplied (after the 2 of the square's gradient) by x minus the
    mean (each read directly or through Identities)."""
    x, mean = past_identities(x), past_identities(variance.inputs[0].op.inputs[1])
    for first in div.outputs[0].consumers():
        if first.type != "Mul":
            continue
        for second in first.outputs[0].consumers():
            if second.type == "Mul" and any(
                    i.op.type == "Sub" and past_identities(i.op.inputs[0]) is x and
                    past_identities(i.op.inputs[1]) is mean for i in second.inputs):
                return True
    return False
