"""Micro-batches: where the user's graph holds a replica's batch size as a
number, the number a micro-batch needs instead.

Requires: a TrainingGraph, its Layering, the micro-batches per replica and
the host device. Guarantees: `batch_size` is a replica's batch as the graph
was built (the data iterators' static first dimension, or None); `split` cuts a
batch into micro-batches (`whole_feeds` are the feeds each gets whole); `constants(seg,
by_batch)` gives, per op of a layer, the inputs to replace with a
micro-batch's constant (the patterns are listed there), made once per layer
on the host; `apart` says why a loss's micro-batches do not make one
device's step.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import compat
from ..errors import GraphError
from ..graph import mixing, normalization
from .layers import STATELESS

# ops that broadcast their inputs against each other (element by element)
# ops whose inputs line up row by row with data of first dimension B, so a
# constant of B equal rows among them is a micro-batch's m rows: elementwise
# (broadcasting or not), and joins beside the batch (Pack on any axis, a
# concatenation on an axis other than 0)
BROADCASTING = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "Select", "SelectV2", "Equal", "NotEqual", "Less", "LessEqual",
    "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "Pack"})


class MicroBatches:
    def __init__(self, tg, layering, micro_batches: int, host: str, scope: str):
        self.tg, self.lay, self.u, self.host, self.scope = tg, layering, micro_batches, host, scope
        self._rewires: dict[str, dict] = {}        # layer -> constants
        self._data_ops: set[str] | None = None

    def batch_size(self) -> int | None:
        """A replica's batch as the graph was built: the static first
        dimension of the data iterators' outputs (None if unknown)."""
        sizes = {compat.dim(t.shape, 0) for name in self.lay.sources
                 for t in self.tg.graph.get_operation_by_name(name).outputs
                 if t.op.type != "Placeholder" and t.shape.rank}
        return sizes.pop() if len(sizes) == 1 else None

    def from_data(self) -> set[str]:
        """The user's ops that depend on a data source."""
        if self._data_ops is None:
            self._data_ops = set(self.lay.sources)
            for op in self.tg.graph.get_operations():
                if any(t.op.name in self._data_ops for t in op.inputs):
                    self._data_ops.add(op.name)
        return self._data_ops

    def whole_feeds(self) -> list[tf.Tensor]:
        """The data placeholders every micro-batch gets whole (`split`)."""
        return [t for name in self.lay.sources
                for t in self.tg.graph.get_operation_by_name(name).outputs
                if t.op.type == "Placeholder" and t.shape.rank and
                compat.dim(t.shape, 0) is not None]

    def split(self, t: tf.Tensor, ways: int, replicas: int):
        """t split in `ways` along its first dimension; None if t has no
        batch dimension (a scalar, a fixed-size feed), so every part uses it."""
        if t.shape.rank == 0:
            return None
        if t.op.type == "Placeholder" and (t.shape.rank is not None and
                                           compat.dim(t.shape, 0) is not None):
            return None
        size = compat.dim(t.shape, 0) if t.shape.rank is not None else None
        if ways == 1:
            return [t]
        if size is not None and size % ways:
            raise GraphError(f"layer-by-layer execution splits {t.name!r} (batch {size}) in "
                             f"{ways} parts ({replicas} replicas x {self.u} micro-batches); "
                             "make the batch a multiple of that")
        return tf.split(t, ways, axis=0)

    def constants(self, seg, by_batch) -> dict[str, dict[int, tf.Tensor]]:
        """Constants holding a replica's batch size B that a micro-batch of
        m = B / micro_batches needs as m: op -> {input index: new constant}.
        The patterns, each where the graph shows the number is the batch
        ("data": a tensor that depends on a data source, with a first
        dimension that is a multiple of B: [B, ...] or [B x seq, ...]):
        - a random op's constant shape starting with a multiple of B
          (dropout on data of static shape: TensorFlow folds the shape);
        - a reshape of data to a constant shape whose first entry is a
          multiple of B (BERT's [B x seq, width] and back to [B, seq, ...]);
        - a constant of one value repeated, of first dimension B (tf.ones,
          tf.zeros, tf.fill with B, a folded zeros_like), that an op lining
          rows up combines with data of first dimension B (BERT's attention
          mask, tf.compat.v1.where against zeros, a column of ones
          concatenated to the data);
        - the loss as a sum over data divided by B (or times 1/B), B being
          a constant or computed from constants (`by_batch` of
          graph/forms.py loss_form).
        """
        if seg.name in self._rewires:
            return self._rewires[seg.name]
        out = self._rewires[seg.name] = {}
        batch = self.batch_size()
        if batch is None or self.u == 1:
            return out
        micro = batch // self.u
        g = self.tg.graph

        def const(t):       # the value of a constant-only tensor, or None
            if t.op.type == "Const":
                return tf.make_ndarray(t.op.get_attr("value"))
            if t.op.type == "Fill" and all(x.op.type == "Const" for x in t.op.inputs):
                return np.full(const(t.op.inputs[0]), const(t.op.inputs[1]))
            return None

        def data(t, exact=False):
            if t.op.name not in self.from_data() or not t.shape.rank:
                return False
            first = compat.dim(t.shape, 0)
            return first is not None and (first == batch if exact else first % batch == 0)

        def first_over_u(shape):
            shape = shape.copy()
            shape[0] //= self.u
            return tf.constant(shape)

        with tf.device(self.host), tf.name_scope(f"{self.scope}/micro_batch_constants/"):
            for name in seg.ops:
                op = g.get_operation_by_name(name)
                if op.type in STATELESS or (op.type == "Reshape" and data(op.inputs[0])):
                    at = 0 if op.type in STATELESS else 1
                    shape = const(op.inputs[at])
                    if shape is not None and shape.ndim == 1 and len(shape) and \
                            shape[0] > 0 and shape[0] % batch == 0:
                        out[name] = {at: first_over_u(shape)}
                elif (op.type in BROADCASTING or _beside_batch(op)) and \
                        any(data(t, exact=True) for t in op.inputs):
                    for at, t in enumerate(op.inputs):
                        value = const(t)
                        if value is not None and value.ndim and value.shape[0] == batch and \
                                (value == value.flat[0]).all():
                            out.setdefault(name, {})[at] = tf.constant(np.full(
                                (micro,) + value.shape[1:], value.flat[0], value.dtype))
            for name, at, multiplies in by_batch:
                if name in seg.ops:
                    dtype = g.get_operation_by_name(name).inputs[at].dtype
                    out.setdefault(name, {})[at] = tf.constant(
                        1.0 / micro if multiplies else micro, dtype)
        return out


def _beside_batch(op) -> bool:
    """A concatenation on an axis other than the batch's (0)."""
    if op.type != "ConcatV2":
        return False
    axis = op.inputs[-1]
    return axis.op.type == "Const" and int(tf.make_ndarray(axis.op.get_attr("value"))) != 0


def apart(tg, layering, form, u: int) -> str | None:
    """Why the `u` micro-batches of a replica, each computing the loss over
    its own rows, do not make one device's step, for the warning the build
    gives; None where they do. The loss's `form` (graph/forms.py) is not a
    mean or a sum, or is a function of means or sums over the batch, or a
    mean over rows a mask picks; or the loss mixes the batch's examples
    (graph/mixing.py), or the step applies statistics over the batch to
    its rows (a class's count in the batch, inputs standardized:
    graph/normalization.py): each micro-batch takes its own, where data
    parallelism exchanges the data's."""
    loss = tg.graph.get_tensor_by_name(layering.loss)
    said = f"layer-by-layer execution runs the {u} micro-batches of a replica's batch apart"
    if form.kind is None or form.exchanged or form.summed or form.selected:
        return (f"{said} and averages their losses, right for a mean over the batch, but the "
                f"loss {layering.loss!r} " + (
                    "is not shown to be a mean or a sum" if not form.kind else
                    "takes a function of such a mean or of sums (an RMSE, a Dice loss?)"
                    if form.exchanged or form.summed else
                    "is a mean over rows a mask picks, each micro-batch's over its own count")
                + ", not one device's step")
    if found := mixing.mixing(loss, layering.sources):
        return (f"{said}, and the loss {layering.loss!r} mixes the batch's examples "
                f"({found[0]!r}: {found[1]}): each micro-batch's over its own rows, not one "
                "device's step")
    stats = [op.name for op in normalization.data_statistics(tg.graph, layering.sources)] + \
        normalization.found(tg.graph, layering.sources)[2]
    if stats:
        return (f"{said}, and the step applies statistics over the batch to its rows "
                f"({stats[:3]}: a class's count in the batch, a normalization by its mean or "
                "largest value): each "
                "micro-batch takes its own rows', not one device's step")
    return None
