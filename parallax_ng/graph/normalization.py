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
inside one op: `edit` lowers it and its gradient op to that form (in the
copy graph/cond_lowering.py makes), the gradient written out as the
autodiff of those ops gives it, the unbiased variance of its moving
statistics from the job's row count (`count`, summed). One the exchange
cannot reach (in a v1 cond or while loop, in a function) stays per
replica, and the plan's line says so.

Requires: a tf.Graph and the names of its data sources. Guarantees:
`found` and `points` read the graph only; `edit` changes a copy.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import tensorflow as tf

from . import branches, emit
from .forms import sources
from .rows import reading
from .rules import AUTODIFF_SCOPE, is_autodiff

FUSED = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
_SPREADS = ("Tile", "BroadcastTo")
_LEADING = re.compile(r"(gradients(_\d+)?|gradient_tape)/")
LOWERED = "_parallax_lowered"      # a lowered fused op's Means: their incoming gradient
# data format: the statistics' axes, the shape the [C] parameters take to broadcast
_LAYOUTS = {"NHWC": ([0, 1, 2], [-1]), "NCHW": ([0, 2, 3], [1, -1, 1, 1]),
            "NDHWC": ([0, 1, 2, 3], [-1]), "NCDHW": ([0, 2, 3, 4], [1, -1, 1, 1, 1])}


@dataclass(frozen=True)
class Moments:
    """A `tf.nn.moments` over the batch: its two Means, and the incoming
    gradient of each (None: no gradient reaches it, or none was found)."""
    mean: tf.Operation
    variance: tf.Operation
    mean_grad: tf.Tensor | None
    variance_grad: tf.Tensor | None
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
    of TrainingGraph `tg`. Statistics in a branch or a loop (Switch/Merge)
    are not exchanged: a replica (a worker) that skips the branch would
    leave the others, or a server's sum, waiting for its part."""
    moments, fused, other = found(tg.graph, sources(tg.graph))
    memo = {}
    moments = [replace(m, branched=bool(branches.switches_above(tg.ir, m.mean.name, memo)))
               for m in moments]
    synchronized = batch_norm == "synchronized"
    return tuple(lines(moments, fused, synchronized, other)), \
        tuple(points(moments)) if synchronized else ()


def found(graph: tf.Graph, sources) -> tuple[list[Moments], list[str], list[str]]:
    """(the `tf.nn.moments` over the batch's axis of data, the fused batch
    normalizations in training: their op names, those in functions as
    `function:op`, and other means over the batch's axis that the step
    applies to the batch's rows: a normalization of the script's own)."""
    rows, index = reading(sources, graph), _Autodiff(graph)
    moments = rows.guarded(lambda r: [m for op in graph.get_operations()
                                      if (m := _moments(op, r, index)) is not None])
    fused = [op.name for op in graph.get_operations() if _training(op)]
    fused += [f"{f.signature.name}:{n.name}" for f in graph.as_graph_def().library.function
              for n in f.node_def if n.op in FUSED and n.attr["is_training"].b]
    known = {o.name for m in moments or () for o in (m.mean, m.variance)}
    other = rows.guarded(lambda r: [op.name for op in graph.get_operations()
                                    if op.name not in known and _applied(op, r)])
    return moments or [], fused, other or []


def points(moments: list[Moments]) -> list[tuple[str, bool]]:
    """(tensor name, True: the job's mean) of every statistic and incoming
    gradient the replicas exchange, for those whose gradients are all
    found."""
    out = []
    for m in moments:
        if m.complete() and not m.branched:
            out += [(m.mean.outputs[0].name, True), (m.variance.outputs[0].name, True)]
            out += [(g.name, True) for g in (m.mean_grad, m.variance_grad) if g is not None]
            out += [(m.count.name, False)] if m.count is not None else []
    return out


def lines(moments: list[Moments], fused: list[str], synchronized: bool,
          other=()) -> list[str]:
    """The plan's lines on batch normalization that is not the global
    batch's (one device's): all of it by default, what `synchronized`
    cannot reach with it; and `other` means over the batch applied to its
    rows, which neither exchanges."""
    said = "normalizes each replica's rows by their own mean and variance"
    out = [f"means over the batch's axis {_named(other)} are applied to the batch's rows (a "
           "normalization of the program's own): each replica takes the mean of its own rows, "
           "so training is close to one device's with the global batch, not equal; "
           "tf.nn.moments (with batch_norm: synchronized) makes such statistics the global "
           "batch's"] * bool(other)
    if not synchronized:
        layers = _named({m.layer for m in moments} | set(fused))
        return [f"batch normalization {layers} {said} (batch_norm: per_replica, the default): "
                "training is close to one device's with the global batch, not equal; "
                "batch_norm: synchronized makes the statistics the global batch's"] * bool(
                    layers) + out
    if unknown := _named({m.layer for m in moments if not m.complete() and not m.branched}):
        out.append(f"batch normalization {unknown} {said}, batch_norm: synchronized "
                   "notwithstanding: the gradient of its statistics is not one the autodiff "
                   "makes of tf.nn.moments' ops")
    if branched := _named({m.layer for m in moments if m.branched}):
        out.append(f"batch normalization {branched} {said}, batch_norm: synchronized "
                   "notwithstanding: its statistics are computed inside a tf.cond or a while "
                   "loop, whose exchange would wait on replicas that skip it")
    if fused:
        out.append(f"fused batch normalization {_named(fused)} {said}, batch_norm: "
                   "synchronized notwithstanding: it runs inside a tf.cond, a while loop or a "
                   "function, or ops other than its one gradient read what it keeps for it "
                   "(fused=False makes it the global batch's)")
    return out


def _named(layers, most: int = 6) -> str:
    """The first `most` of `layers` in order, and how many more."""
    names = sorted(layers)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{names[:most]}{more}" if names else ""


def _training(op) -> bool:
    return op.type in FUSED and op.get_attr("is_training")


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
    axes = [_axes(o) for o in (op, mean)]
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
                   bool(index.of(mean) or index.of(op)))


# ops a batch statistic passes through to where it meets the rows
_CARRIES = frozenset({"Squeeze", "Reshape", "ExpandDims", "Identity", "StopGradient", "Cast",
                      "Sqrt", "Rsqrt", "AddV2", "Add", "Sub", "Mul", "RealDiv", "Maximum",
                      "Neg", "Square", "Reciprocal"})
_MEETS = frozenset({"Sub", "AddV2", "Add", "Mul", "RealDiv", "SquaredDifference", "Maximum",
                    "Minimum"})


def _applied(op, rows) -> bool:
    """Whether `op` is a Mean (forward, not the autodiff's) over the batch's
    axis of the batch's rows whose result an element-wise op meets with
    the rows (through a few ops that keep it a statistic)."""
    if op.type != "Mean" or is_autodiff(op.name):
        return False
    x, axes = op.inputs[0], _axes(op)
    rank = x.shape.rank
    if axes is None or rank is None or (axis := rows.axis(x)) is None or \
            axis not in {a % rank for a in axes}:
        return False
    seen, stack = set(), [op.outputs[0]]
    while stack and len(seen) < 64:
        t = stack.pop()
        for c in t.consumers():
            if c.name in seen or is_autodiff(c.name):
                continue
            seen.add(c.name)
            if c.type in _MEETS and any(i is not t and rows.axis(i) is not None
                                        for i in c.inputs):
                return True
            if c.type in _CARRIES:
                stack.extend(c.outputs)
    return False


def _lowered_gradient(mean) -> tf.Tensor | None:
    name = mean.node_def.attr[LOWERED].s.decode()
    return mean.graph.get_tensor_by_name(name) if name else None


def _axes(op) -> set[int] | None:
    value = tf.get_static_value(op.inputs[1])
    return None if value is None else {int(a) for a in value.reshape(-1)}


def _incoming(index, mean, variance, x) -> tf.Tensor | None:
    """The gradient the autodiff gives `mean`'s output, where it finds one
    form of it: the input of its Mean gradient's Reshape."""
    chains = [c for c in _chains(index.of(mean))
              if _of_variance(c[2], variance, x) == (mean is variance)]
    return chains[0][0].inputs[0] if len(chains) == 1 else None


class _Autodiff:
    """The autodiff's ops by the forward op their names are for:
    tf.gradients' `gradients/<op>_grad/...`, and a tape's
    `gradient_tape/<op's scope>/...` (every op of the scope's)."""

    def __init__(self, graph: tf.Graph):
        self.named, self.taped = {}, {}
        for op in graph.get_operations():
            if (found := AUTODIFF_SCOPE.search(op.name)) is None:
                continue
            rest = op.name[found.end():]
            while (inner := _LEADING.match(rest)) is not None:    # Adam/gradients/gradients/
                rest = rest[inner.end():]
            if "_grad/" in rest:
                self.named.setdefault(rest.split("_grad/", 1)[0], []).append(op)
            if found.group(2) == "gradient_tape":
                self.taped.setdefault(rest.rsplit("/", 1)[0] if "/" in rest else "",
                                      []).append(op)

    def of(self, mean) -> list:
        """`mean`'s gradient ops by tf.gradients' names, else its scope's
        in a tape (the layer's other statistic's too)."""
        scope = mean.name.rsplit("/", 1)[0] if "/" in mean.name else ""
        return self.named.get(mean.name) or self.taped.get(scope, [])


def _chains(ops) -> list[tuple]:
    """(Reshape, spread, RealDiv) of the Mean gradients among `ops`."""
    out = []
    for op in ops:
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


def edit(graph: tf.Graph):
    """The edit of a meta graph that lowers each top-level fused batch
    normalization in training, and its gradient, to the form of
    `tf.nn.moments` whose statistics and their incoming gradients `found`
    names (cond_lowering.lowered makes it in its copy), or None where the
    graph has none. The fused op keeps its name (an IdentityN of its
    outputs), so does its gradient's; an op with more than one gradient op
    (two tf.gradients calls) or whose reserve spaces another op reads (a
    gradient in a function), or in a v1 tf.cond or while loop, stays
    fused."""
    ops = [op for op in graph.get_operations() if _training(op) and not _in_control_flow(op)]
    if not ops:
        return None
    names = {op.name for op in ops}
    return lambda meta: _lower(meta.graph_def, names)


def _in_control_flow(op) -> bool:
    """Whether `op` runs in a v1 tf.cond or while loop (where the
    statistics' exchange would wait on replicas that skip it)."""
    return op._get_control_flow_context() is not None or any(   # noqa: SLF001
        i.op.type in ("Switch", "RefSwitch", "Enter", "RefEnter") for i in op.inputs)


def _lower(graph_def, names: set[str]) -> None:
    forward = {n.name: n for n in graph_def.node if n.name in names and
               _layout(n) in _LAYOUTS}
    grads = {}
    for n in graph_def.node:
        if n.op.startswith("FusedBatchNormGrad") and n.attr["is_training"].b and \
                (source := n.input[3].split(":")[0]) in forward:
            grads.setdefault(source, []).append(n)
    reserves = {}           # forward op -> the ops that read its reserve spaces
    for n in graph_def.node:
        for i in n.input:
            name, _, port = i.partition(":")
            if name in forward and port in ("3", "4", "5") and n.op != "ZerosLike":
                reserves.setdefault(name, set()).add(n.name)    # (tf.gradients' zeros: shape)
    lowered = {name: (g or [None])[0] for name, g in
               ((name, grads.get(name, [])) for name in forward)
               if len(g) <= 1 and reserves.get(name, set()) <= {d.name for d in g}}
    by_grad = {g.name: name for name, g in lowered.items() if g is not None}
    out = []
    for n in graph_def.node:
        if n.name in lowered:
            out.extend(_Lowering(n, lowered[n.name]).forward())
        elif n.name in by_grad:
            out.extend(_Lowering(forward[by_grad[n.name]], n).backward())
        else:
            out.append(n)
    del graph_def.node[:]
    graph_def.node.extend(out)


def _layout(node) -> str:
    return node.attr["data_format"].s.decode() or "NHWC"


class _Lowering:
    """The ops of one fused batch normalization in training (`node`) and
    of its gradient (`grad`, or None): the statistics as tf.nn.moments
    makes them, under `<node>/parallax_bn/`, and the gradient as the
    autodiff of those ops gives it, with the incoming gradients of the two
    Means under `<grad>/parallax_bn/` (`mean_grad`, `variance_grad`)."""

    def __init__(self, node, grad):
        self.node, self.grad = node, grad
        self.t = tf.as_dtype(node.attr["T"].type)
        self.u = tf.as_dtype(node.attr["U"].type) if "U" in node.attr else self.t
        self.axes, self.shape = _LAYOUTS[_layout(node)]
        self.at, self.device, self.made = f"{node.name}/parallax_bn", node.device, set()

    def forward(self) -> list:
        n, at, u = self.node, self.at, self.u
        x, scale, offset, mean_in, var_in = ("=" + i for i in n.input[:5])
        controls = [i for i in n.input if i.startswith("^")]
        grad = self.grad.name + "/parallax_bn" if self.grad is not None else None
        nodes = [self._cast("x", [x] + controls, self.t, u),
                 self._const("axes", np.int32(self.axes), tf.int32),
                 self._const("shape", np.int32(self.shape), tf.int32),
                 self._op("mean", "Mean", ["x", "axes"], keep_dims=True, Tidx=tf.int32),
                 self._op("StopGradient", "StopGradient", ["mean"]),
                 self._op("SquaredDifference", "SquaredDifference", ["x", "StopGradient"]),
                 self._op("variance", "Mean", ["SquaredDifference", "axes"], keep_dims=True,
                          Tidx=tf.int32),
                 self._op("centred", "Sub", ["x", "mean"]),
                 self._const("epsilon", n.attr["epsilon"].f, u),
                 self._op("plus_epsilon", "AddV2", ["variance", "epsilon"]),
                 self._op("rsqrt", "Rsqrt", ["plus_epsilon"]),
                 self._reshape("scale", scale), self._reshape("offset", offset),
                 self._op("normalized", "Mul", ["centred", "rsqrt"]),
                 self._op("scaled", "Mul", ["normalized", "scale"]),
                 self._op("shifted", "AddV2", ["scaled", "offset"]),
                 self._cast("y", [f"{at}/shifted"], u, self.t),
                 # the replica's rows per channel; the job's (`count`) make the unbiased variance
                 self._op("size", "Size", ["x"], out_type=tf.int32),
                 self._op("channels", "Size", [scale], out_type=tf.int32, T=u),
                 self._cast("size_u", ["size"], tf.int32, u),
                 self._cast("channels_u", ["channels"], tf.int32, u),
                 self._op("rows", "RealDiv", ["size_u", "channels_u"]),
                 self._op("count", "Identity", ["rows"]),
                 self._const("one", 1.0, u),
                 self._op("count_less_one", "Sub", ["count", "one"]),
                 self._op("at_least_one", "Maximum", ["count_less_one", "one"]),
                 self._op("bessel", "RealDiv", ["count", "at_least_one"]),
                 self._op("unbiased", "Mul", ["variance", "bessel"]),
                 self._const("flat", np.int32([-1]), tf.int32),
                 self._op("batch_mean", "Reshape", ["mean", "flat"], Tshape=tf.int32),
                 self._op("batch_variance", "Reshape", ["unbiased", "flat"], Tshape=tf.int32)]
        for node, what in ((nodes[3], "mean"), (nodes[6], "variance")):
            node.attr[LOWERED].s = f"{grad}/{what}_grad:0".encode() if grad else b""
        outs = [f"{at}/y", f"{at}/batch_mean", f"{at}/batch_variance"]
        factor = n.attr["exponential_avg_factor"].f if "exponential_avg_factor" in n.attr \
            else 1.0
        if factor != 1.0:           # the running statistics moved inside the op
            nodes += [self._const("factor", factor, u),
                      self._const("keep", 1.0 - factor, u)]
            for k, (stat, old) in enumerate((("batch_mean", mean_in),
                                             ("batch_variance", var_in)), 1):
                nodes += [self._op(f"{stat}_new", "Mul", [stat, "factor"]),
                          self._op(f"{stat}_old", "Mul", [old, "keep"]),
                          self._op(f"{stat}_moved", "AddV2", [f"{stat}_new", f"{stat}_old"])]
                outs[k] = f"{at}/{stat}_moved"
        outs += [outs[1]] * (3 if n.op == "FusedBatchNormV3" else 2)    # reserve spaces
        nodes.append(emit.node_def(n.name, "IdentityN", outs, n.device,
                                   T=[self.t] + [u] * (len(outs) - 1)))
        return nodes

    def backward(self) -> list:
        g, at, u = self.grad, self.at, self.u
        fwd = lambda name: f"{at}/{name}"                # noqa: E731
        self.at, self.device = f"{g.name}/parallax_bn", g.device
        controls = [i for i in g.input if i.startswith("^")]
        nodes = [self._cast("dy", ["=" + g.input[0]] + controls, self.t, u),
                 self._op("scale_rsqrt", "Mul", [fwd("scale"), fwd("rsqrt")]),
                 self._op("sum_dy", "Sum", ["dy", fwd("axes")], keep_dims=True, Tidx=tf.int32),
                 self._op("sum_dy_scaled", "Mul", ["sum_dy", "scale_rsqrt"]),
                 self._op("mean_grad", "Neg", ["sum_dy_scaled"]),
                 self._op("dy_centred", "Mul", ["dy", fwd("centred")]),
                 self._op("sum_dy_centred", "Sum", ["dy_centred", fwd("axes")], keep_dims=True,
                          Tidx=tf.int32),
                 self._op("rsqrt_2", "Mul", [fwd("rsqrt"), fwd("rsqrt")]),
                 self._op("rsqrt_3", "Mul", ["rsqrt_2", fwd("rsqrt")]),
                 self._const("minus_half", -0.5, u),
                 self._op("dv_dr", "Mul", ["rsqrt_3", "minus_half"]),
                 self._op("sum_scaled", "Mul", ["sum_dy_centred", fwd("scale")]),
                 self._op("variance_grad", "Mul", ["sum_scaled", "dv_dr"]),
                 self._op("direct", "Mul", ["dy", "scale_rsqrt"]),
                 self._op("from_mean", "RealDiv", ["mean_grad", fwd("rows")]),
                 self._const("two", 2.0, u),
                 self._op("variance_grad_2", "Mul", ["variance_grad", "two"]),
                 self._op("variance_per_row", "RealDiv", ["variance_grad_2", fwd("rows")]),
                 self._op("from_variance", "Mul", ["variance_per_row", fwd("centred")]),
                 self._op("direct_and_variance", "AddV2", ["direct", "from_variance"]),
                 self._op("dx_u", "AddV2", ["direct_and_variance", "from_mean"]),
                 self._cast("dx", [f"{self.at}/dx_u"], u, self.t),
                 self._op("dy_normalized", "Mul", ["dy_centred", fwd("rsqrt")]),
                 self._op("scale_grad", "Sum", ["dy_normalized", fwd("axes")],
                          keep_dims=False, Tidx=tf.int32),
                 self._op("offset_grad", "Sum", ["dy", fwd("axes")], keep_dims=False,
                          Tidx=tf.int32)]
        outs = [f"{self.at}/dx", f"{self.at}/scale_grad"] + [f"{self.at}/offset_grad"] * 3
        nodes.append(emit.node_def(g.name, "IdentityN", outs, g.device,
                                   T=[self.t] + [u] * 4))
        return nodes

    def _op(self, name: str, op: str, inputs: list[str], T="u", **attrs):
        """`op` named `name` in this lowering's scope; an input that names
        one of its ops made before is that op, one that starts with '='
        the graph's tensor of the name that follows."""
        refs = [i[1:] if i.startswith("=") else f"{self.at}/{i}" if i in self.made else i
                for i in inputs]
        if T is not None:
            attrs["T"] = self.u if T == "u" else T
        self.made.add(name)
        return emit.node_def(f"{self.at}/{name}", op, refs, self.device, **attrs)

    def _const(self, name: str, value, dtype):
        self.made.add(name)
        return emit.const(f"{self.at}/{name}", value, dtype, self.device)

    def _cast(self, name: str, inputs: list[str], src, dst):
        if src == dst:
            return self._op(name, "Identity", inputs, T=src)
        return self._op(name, "Cast", inputs, T=None, SrcT=src, DstT=dst)

    def _reshape(self, name: str, tensor: str):
        return self._op(name, "Reshape", [tensor, "shape"], Tshape=tf.int32)
