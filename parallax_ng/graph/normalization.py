"""Batch normalization's statistics: found, and made the global batch's.

In training, batch normalization (Keras 3's and tf_keras's
BatchNormalization, `tf.compat.v1.layers.batch_normalization`, a script's
own `tf.nn.moments` over the batch) normalizes by the mean and variance of
the batch it is given. On N replicas each is given its own rows, so by
default (config `batch_norm: per_replica`) the step trains close to one
device's with the global batch, not equal to it: `found` names such layers,
for the line the plan prints.

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
A `Mean`'s gradient is found under the autodiff's name for it
(`gradients/<op>_grad/`, tf.gradients) or in a traced step's GradientTape
by its form (`Reshape`, `Tile` or `BroadcastTo`, `RealDiv`) under the
layer's scope, the variance's being the one whose result is multiplied by
x minus the mean. The fused kernel (`FusedBatchNormV3` in training, which
tf_keras and tf.compat.v1 pick for 4-D inputs) computes its statistics
inside one op: it stays per replica, and the plan's line says so.

Requires: a tf.Graph and the names of its data sources. Guarantees: reads
the graph only.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from .forms import sources
from .rows import reading
from .rules import AUTODIFF_SCOPE, is_autodiff

FUSED = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
_SPREADS = ("Tile", "BroadcastTo")


@dataclass(frozen=True)
class Moments:
    """A `tf.nn.moments` over the batch: its two Means, and the incoming
    gradient of each (None: no gradient reaches it, or none was found)."""
    mean: tf.Operation
    variance: tf.Operation
    mean_grad: tf.Tensor | None
    variance_grad: tf.Tensor | None
    differentiated: bool        # the autodiff has ops for the statistics' layer

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


def planned(graph: tf.Graph, batch_norm: str) -> tuple[tuple[str, ...], tuple]:
    """(the plan's lines, the `points` to exchange) for config `batch_norm`."""
    moments, fused = found(graph, sources(graph))
    synchronized = batch_norm == "synchronized"
    return tuple(lines(moments, fused, synchronized)), \
        tuple(points(moments)) if synchronized else ()


def found(graph: tf.Graph, sources) -> tuple[list[Moments], list[str]]:
    """(the `tf.nn.moments` over the batch's axis of data, the fused batch
    normalizations in training: their op names, those in functions as
    `function:op`)."""
    rows = reading(sources, graph)
    moments = rows.guarded(lambda r: [m for op in graph.get_operations()
                                      if (m := _moments(op, r)) is not None])
    fused = [op.name for op in graph.get_operations() if _training(op)]
    fused += [f"{f.signature.name}:{n.name}" for f in graph.as_graph_def().library.function
              for n in f.node_def if n.op in FUSED and n.attr["is_training"].b]
    return moments or [], fused


def points(moments: list[Moments]) -> list[tuple[str, bool]]:
    """(tensor name, True: the job's mean) of every statistic and incoming
    gradient the replicas exchange, for those whose gradients are all
    found."""
    out = []
    for m in moments:
        if m.complete():
            out += [(m.mean.outputs[0].name, True), (m.variance.outputs[0].name, True)]
            out += [(g.name, True) for g in (m.mean_grad, m.variance_grad) if g is not None]
    return out


def lines(moments: list[Moments], fused: list[str], synchronized: bool) -> list[str]:
    """The plan's lines on batch normalization that is not the global
    batch's (one device's): all of it by default, what `synchronized`
    cannot reach with it."""
    per_replica = sorted({m.layer for m in moments if not synchronized or not m.complete()})
    out = []
    if per_replica:
        out.append(
            f"batch normalization {per_replica} normalizes each replica's rows by their own "
            "mean and variance " + (
                "(batch_norm: per_replica, the default): training is close to one device's "
                "with the global batch, not equal; batch_norm: synchronized makes the "
                "statistics the global batch's" if not synchronized else
                "(batch_norm: synchronized: the gradient of its statistics is not one the "
                "autodiff makes by tf.nn.moments' ops)"))
    if fused:
        out.append(
            f"fused batch normalization {sorted(fused)[:8]} in training normalizes each "
            "replica's rows by their own mean and variance (computed inside the op): training "
            "is close to one device's with the global batch, not equal" + (
                "; batch_norm: synchronized applies to unfused batch normalization (fused=False "
                "in tf.compat.v1.layers and tf_keras)" if synchronized else
                "; batch_norm: synchronized with fused=False (tf.compat.v1.layers, tf_keras) "
                "makes the statistics the global batch's"))
    return out


def _training(op) -> bool:
    return op.type in FUSED and op.get_attr("is_training")


def _moments(op, rows) -> Moments | None:
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
    axes = [_axes(o) for o in (op, mean)]
    rank = x.shape.rank
    if axes[0] is None or axes[0] != axes[1] or rank is None:
        return None
    axis = rows.axis(x)
    if axis is None or axis not in {a % rank for a in axes[0]}:
        return None
    return Moments(mean, op, _incoming(mean, op, x), _incoming(op, op, x),
                   bool(_autodiff(mean) or _autodiff(op)))


def _axes(op) -> set[int] | None:
    value = tf.get_static_value(op.inputs[1])
    return None if value is None else {int(a) for a in value.reshape(-1)}


def _incoming(mean, variance, x) -> tf.Tensor | None:
    """The gradient the autodiff gives `mean`'s output, where it finds one
    form of it: the input of its Mean gradient's Reshape."""
    chains = [c for c in _chains(mean) if _of_variance(c[2], variance, x) == (mean is variance)]
    return chains[0][0].inputs[0] if len(chains) == 1 else None


def _autodiff(mean) -> list:
    """The autodiff's ops under `mean`'s names for its gradient:
    tf.gradients' `gradients/<op>_grad/`, else a tape's `gradient_tape/<op's
    scope>/` (the layer's other statistic's too)."""
    scope = mean.name.rsplit("/", 1)[0] + "/" if "/" in mean.name else ""
    named, taped = [], []
    for op in mean.graph.get_operations():
        if (found := AUTODIFF_SCOPE.search(op.name)) is None:
            continue
        rest = op.name[found.end():]
        if rest.startswith(f"{mean.name}_grad/"):
            named.append(op)
        elif found.group(2) == "gradient_tape" and rest.startswith(scope) and \
                "/" not in rest[len(scope):]:
            taped.append(op)
    return named or taped


def _chains(mean) -> list[tuple]:
    """(Reshape, spread, RealDiv) of the Mean gradients among `mean`'s
    autodiff ops."""
    out = []
    for op in _autodiff(mean):
        if op.type != "RealDiv" or op.inputs[0].op.type not in _SPREADS:
            continue
        reshape = op.inputs[0].op.inputs[0].op
        if reshape.type == "Reshape":
            out.append((reshape, op.inputs[0].op, op))
    return out


def _of_variance(div, variance, x) -> bool:
    """Whether the Mean gradient `div` is the variance's: its result
    multiplied (after the 2 of the square's gradient) by x minus the
    mean."""
    for first in div.outputs[0].consumers():
        if first.type != "Mul":
            continue
        for second in first.outputs[0].consumers():
            if second.type == "Mul" and any(
                    i.op.type == "Sub" and i.op.inputs[0] is x and
                    i.op.inputs[1] is variance.inputs[0].op.inputs[1] for i in second.inputs):
                return True
    return False
