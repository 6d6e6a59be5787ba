"""The fused batch normalization kernel in training, lowered to the form
of `tf.nn.moments` (graph/normalization.py), so that `batch_norm:
synchronized` can make its statistics the global batch's.

`FusedBatchNormV3` (and V1, V2) with `is_training` computes the batch's
mean and variance, normalizes, and reports the unbiased variance for the
moving statistics (moved inside the op with an `exponential_avg_factor`
other than 1), all in one kernel; its gradient op reads what it kept
(its reserve spaces). `edit` replaces the pair, in the copy
graph/cond_lowering.py makes, by

    <op>/parallax_bn/mean        Mean(x, axes)                 (kept dims)
    <op>/parallax_bn/variance    Mean(SquaredDifference(x, StopGradient(mean)))
    <op>/parallax_bn/y           (x - mean) * rsqrt(variance + eps) * scale + offset
    <op>/parallax_bn/count       the rows per channel (the job's: summed)
    <op>                         IdentityN(y, batch mean, unbiased variance, ...)
    <grad>/parallax_bn/mean_grad, variance_grad
                                 the incoming gradients of the two Means
    <grad>                       IdentityN(dx, dscale, doffset, ...)

the gradient written out as the autodiff of the forward ops gives it
(`dx = dy * scale * r + mean_grad / n + variance_grad * 2 (x - mean) / n`,
r the reciprocal deviation, n the replica's rows per channel), so the
exchanges normalization.py asks for (each Mean and each incoming gradient
the job's mean, the count the job's sum) make it one device's with the
global batch. The Means carry the names of their incoming gradients
(`normalization.LOWERED`). Any layout (NHWC, NCHW, 5-D), float16 values
with float32 statistics.

A kernel in a v1 tf.cond's branch is lowered in place (its exchanges run
in the branch); one in an If's branch (tf_keras's layer under a
`training` tensor, with TF2 behavior) once cond_lowering lowers the If and
its gradient's If (`training_ifs`), whose reserve spaces reach the
gradient op through the Ifs' outputs and cond_v2's Optionals (followed
branch by branch: `_side`).

Requires: a tf.Graph. Guarantees: None where no fused op in training is
at the top level or in an If's branch; else an edit of a copy. A fused
op that two gradient ops read, whose reserve spaces another op reads (a
gradient in a function), or that runs in a while loop stays fused.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import branches, emit, randomness
from .cond_lowering import LOWERED as LOWERED_IFS
from .ir import GraphIR
from .normalization import FUSED, LOWERED

# data format: the statistics' axes, the shape the [C] parameters take to broadcast
_LAYOUTS = {"NHWC": ([0, 1, 2], [-1]), "NCHW": ([0, 2, 3], [1, -1, 1, 1]),
            "NDHWC": ([0, 1, 2, 3], [-1]), "NCDHW": ([0, 2, 3, 4], [1, -1, 1, 1, 1])}


def edit(graph: tf.Graph):
    """The edit of a meta graph that lowers each fused batch normalization
    in training, and its gradient, to the form of `tf.nn.moments` whose
    statistics and their incoming gradients normalization.found names
    (cond_lowering.lowered makes it in its copy, after the Ifs
    `training_ifs` names are lowered: their kernels are lowered too), or
    None where the graph has none. The fused op keeps its name (an
    IdentityN of its outputs), so does its gradient's; one in a while loop,
    with more than one gradient op (two tf.gradients calls), or whose
    reserve spaces another op reads (a gradient in a function), stays
    fused."""
    ops = [op for op in graph.get_operations() if op.type in FUSED and op.get_attr("is_training")]
    graph_def = graph.as_graph_def()        # read once: loops and Ifs
    looped = {op.name for op in ops} & _loops(graph_def) if ops else set()
    if len(ops) == len(looped) and not training_ifs(graph_def):
        return None
    return lambda meta: _lower(meta.graph_def, looped)


def training_ifs(graph_def) -> list[str]:
    """The If ops a branch of which runs a fused batch normalization in
    training or its gradient (tf_keras's layer under a `training` tensor,
    in a graph of TF2 behavior): lowered to Switch/Merge, their kernels are
    at the top level, where `edit` lowers them."""
    library = {f.signature.name: f for f in graph_def.library.function}
    return [n.name for n in graph_def.node if n.op in LOWERED_IFS and any(
        _trains(d) for f in branches.functions(n.attr) if f in library
        for d in library[f].node_def)]


def _trains(node) -> bool:
    return (node.op in FUSED or node.op.startswith("FusedBatchNormGrad")) and \
        node.attr["is_training"].b


def _loops(graph_def) -> set[str]:
    """The ops that run in a v1 while loop, whose body cannot take the
    lowering's constants (they would need its frame's Enter), and whose
    statistics normalization.planned would not exchange anyway: found from
    the frames' Enters, as a graph imported from a GraphDef (a traced step
    lowered) has no loop contexts. (In a v1 tf.cond it is lowered: the
    exchanges run in the branch, which every replica takes alike or the
    plan names the layer.)"""
    if not any(n.op in ("Enter", "RefEnter") for n in graph_def.node):
        return set()
    return randomness.in_loops(GraphIR(graph_def))


# ops that pass a tensor on unchanged (a lowered If's outputs, cond_v2's wrapping
# of the intermediates its gradient reads): input -> the output ports it reaches
_PASSING = {"Identity": lambda at: [0], "IdentityN": lambda at: [at],
            "OptionalFromValue": lambda at: [0], "OptionalGetValue": lambda at: [0],
            "Switch": lambda at: [0, 1] if at == 0 else [], "Merge": lambda at: [0]}


def _lower(graph_def, looped: set[str]) -> None:
    nodes = {n.name: n for n in graph_def.node}
    forward = {n.name: n for n in graph_def.node if n.op in FUSED and n.attr["is_training"].b
               and n.name not in looped and _layout(n) in _LAYOUTS}
    readers = {}                            # tensor -> (reader, its input position)
    for n in graph_def.node:
        for at, i in enumerate(i for i in n.input if not i.startswith("^")):
            name, _, port = i.partition(":")
            readers.setdefault((name, int(port or 0)), []).append((n, at))

    def reached(name: str, port: int) -> set[str]:
        """The ops other than pass-through ones that read the tensor. Out of
        a lowered If's branch by its Merge, it enters a Switch on the same
        predicate (the gradient If's) on that branch's side only."""
        out, todo, seen = set(), [(name, port, None)], set()
        while todo:
            ref, side = todo[-1][:2], todo.pop()[2]
            for n, at in readers.get(ref, ()) if (*ref, side) not in seen else ():
                ports, on = _PASSING.get(n.op, lambda _: None)(at), side
                if n.op == "Switch" and side is not None and _ref(n.input[1]) == side[0]:
                    ports, on = [side[1]], None
                if ports is None or not any((n.name, p) in readers for p in ports):
                    if n.op != "ZerosLike" and not _wrapped(n):  # (tf.gradients' zeros: a
                        out.add(n.name)     # shape; a pass-through none reads: a fetch may)
                    continue
                todo += [(n.name, p, _side(nodes, n, at) or on) for p in ports]
            seen.add((*ref, side))
        return out
    lowered = {}
    for name in forward:
        read = set().union(*(reached(name, port) for port in (3, 4, 5)))
        grads = [nodes[r] for r in read if nodes[r].op.startswith("FusedBatchNormGrad")]
        if len(read) <= 1 and len(grads) == len(read) and \
                all(g.attr["is_training"].b for g in grads):
            lowered[name] = grads[0] if grads else None
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


def _side(nodes: dict, merge, at: int) -> tuple[str, int] | None:
    """(the predicate, the side) of a value entering input `at` of Merge
    `merge` of an If graph/cond_lowering.py lowered (else 0, then 1)."""
    base, _, output = merge.name.rpartition("/")
    pred = nodes.get(f"{base}/pred")
    if merge.op == "Merge" and base.endswith("/lowered") and output.startswith("output_") \
            and pred is not None and pred.op == "Switch":
        return _ref(pred.input[1]), at
    return None


def _wrapped(node) -> bool:
    """An Identity of an Optional (cond_v2's Identity of each of its If's
    outputs, the wrapped intermediates too): nothing a program fetches."""
    return node.op == "Identity" and node.attr["T"].type == tf.variant.as_datatype_enum


def _ref(name: str) -> str:
    return name if ":" in name else name + ":0"


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
