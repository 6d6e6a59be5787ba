"""Loss scales: a dynamic loss scale (mixed precision's: Keras 3's and
tf_keras's LossScaleOptimizer, tf.compat.v1's
MixedPrecisionLossScaleOptimizer) overflows on the replicas where one
device overflows, not N times sooner.

One device differentiates the mean over the global batch's G rows, a
replica the mean over its own G/N, so each row's gradient in a replica's
backward pass is N times one device's until the replicas' gradients are
averaged. In float16 that backward overflows at a loss scale N times
lower: a step one device applies, the replicas would skip (halving the
scale), and the two trainings part. This pass divides the scale by N in
each replica wherever the step reads it to scale the loss or to unscale
the gradients (every read that reaches the loss, a gradient or a write of
another variable), not where the scale updates itself (doubled after a run
of finite steps, halved after an overflow). So each replica's backward
pass holds one device's values per row, the average of the replicas'
gradients is one device's times S/N, and unscaling by S/N gives one
device's gradient; the scale variable keeps one device's value.

A scale is a scalar floating variable that is not trained, whose read
is a factor of a differentiated loss (through Mul, Cast and Identity)
and divides or multiplies a gradient after the backward pass (the
unscale). A variable that only weighs the loss is no scale: its reads are
left.

A replica sums a weight's float16 gradient over its own rows only, which
overflows later than one device's sum over the global batch; so where a
scale is found, each dense gradient that is a Cast of float16 reads
infinity wherever its aggregate (the replicas' mean) times N reaches
float16's limit, and the scale's finite check skips the step one device
skips.

Requires: replicas made by `replicate`, gradients aggregated by
`aggregate`, ops placed (`place`, and the placement rewrites after it:
each added op runs on its reader's device); the plan averages the
replicas' gradients (dense and sparse alike: where they are summed, a
replica's values per row are one device's already). Guarantees: per
replica and read, one Mul by 1/N on the reader's device, and per
aggregate of a float16 sum and device that reads it, a few elementwise
ops there; reads inside a while loop's body are left (named in a warning
and the report).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from parallax_ng.graph import emit, forms, randomness, rules
from parallax_ng.graph.ir import TensorRef

_FLOAT16_INF = 65520.0          # the least magnitude float16 rounds to infinity
_FACTORS = ("Mul", "Cast", "Identity")                 # loss = mean * scale
_UNSCALES = ("Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan")


@dataclass(frozen=True)
class LossScalesPass:
    name: str = "loss_scales"
    requires: tuple = ("replicate", "aggregate", "place")
    after: tuple = ("lookups_on_servers", "colocate_updates")

    def run(self, ir, ctx):
        tg, plan = ctx.tg, ctx.plan
        scales = scale_reads(tg) if plan.average_dense and plan.average_sparse else {}
        if not scales:
            return ir, {"scales": []}
        looped, rewires, added = randomness.in_loops(tg.ir), {}, []
        for var, uses in scales.items():
            dtype = tg.variables[var].dtype
            for read, (consumer, pos) in uses:
                if consumer in looped:
                    continue
                for k in range(plan.num_replicas):
                    node = ctx.replica_name(k, consumer)
                    if (node, pos) in rewires or node not in ir:    # one for every replica
                        continue
                    at = f"parallax/loss_scales/{node}/input_{pos}"
                    device = ir.node(node).device
                    share = emit.const(f"{at}/share", 1.0 / plan.group_size, dtype, device)
                    added += [share, emit.node_def(at, "Mul", [
                        ctx.replica_tensor(k, TensorRef(read, 0)), share.name], device, T=dtype)]
                    rewires[(node, pos)] = at
        totals, made, summed = _totals(ir, ctx)
        left = sorted({c for uses in scales.values() for _, (c, _) in uses if c in looped})
        if left:
            warnings.warn(
                f"the step reads the loss scale {sorted(scales)} inside a tf.while_loop's body "
                f"({left}): those reads are left whole, so there each replica's float16 values "
                "per row are N times one device's and may overflow where one device's do not "
                "(read the scale outside the loop)", stacklevel=3)
        return ir.rewire(rewires, added).rewire(totals, made), \
            {"scales": sorted(scales), "in_loops": left, "totals": summed}


def _totals(ir, ctx):
    """(rewires, nodes, variables): each dense gradient a float16 backward
    pass sums over the batch (a Cast of float16 to a wider float: a
    weight's or a bias's sum over the rows) reads, wherever the step reads its aggregate,
    infinity where one device's float16 sum over the global batch would
    have overflowed: the replicas' mean times N at or beyond 65520, which
    float16 rounds to infinity. A replica sums only its own rows, which
    overflow later; one device's overflow makes the scale's finite check
    skip the step, so the replicas skip it too. The uses of one aggregate
    on one device read one check."""
    tg, n, rewires, added, summed = ctx.tg, ctx.plan.group_size, {}, [], []
    made = {}           # (aggregate, device) -> its check: one for the uses there
    for var, grad in sorted(tg.gradients.items()):
        cast = tg.ir.node(grad.values.node)
        if grad.sparse or cast.op != "Cast" or \
                cast.attr["SrcT"].type != tf.float16.as_datatype_enum:
            continue
        dtype = tf.as_dtype(cast.attr["DstT"].type)
        summed.append(var)
        for consumer, pos in tg.ir.consumers.get(grad.values, ()):
            if rules.is_autodiff_use(tg.ir.node(consumer)):
                continue
            for k in range(ctx.plan.num_replicas):
                node = ctx.replica_name(k, consumer)
                if (node, pos) in rewires or node not in ir:
                    continue
                mean, device = ir.node(node).input[pos], ir.node(node).device
                if (at := made.get((mean, device))) is None:
                    at = made[(mean, device)] = f"parallax/loss_scales/{node}/total_{pos}"
                    limit = emit.const(f"{at}/limit", _FLOAT16_INF / n, dtype, device)
                    inf = emit.const(f"{at}/inf", np.inf, dtype, device)
                    size = emit.node_def(f"{at}/abs", "Abs", [mean], device, T=dtype)
                    over = emit.node_def(f"{at}/over", "GreaterEqual", [size.name, limit.name],
                                         device, T=dtype)
                    added += [limit, inf, size, over, emit.node_def(
                        at, "SelectV2", [over.name, inf.name, mean], device, T=dtype)]
                rewires[(node, pos)] = at
    return rewires, added, summed


def scale_reads(tg) -> dict[str, list[tuple[str, tuple[str, int]]]]:
    """{loss scale variable: [(read, (consumer, input position))]}: the
    reads' data uses that reach a differentiated loss, a gradient or a
    write of another variable (not the scale's own update)."""
    losses = forms.autodiff_losses(tg.graph)
    if not (factors := _factors(tg, [t.op for t in losses])):
        return {}
    gradients = {r.node for r in tg.gradient_tensors}
    after = tg.ir.descendants(gradients, data_only=True)
    out = {}
    for var in factors:
        others = {w for v, ws in tg.writers.items() if v != var for w in ws}
        stops = gradients | {t.op.name for t in losses}
        uses = [(read, use) for read in tg.readers.get(var, ())
                if read in tg.ir and tg.ir.node(read).op in ("ReadVariableOp", "Identity")
                for use in tg.ir.consumers.get(TensorRef(read, 0), ())]
        # the unscale: an op after the backward pass that the read reaches
        # without going through the loss or the gradients
        if any(tg.ir.node(n).op in _UNSCALES for _, use in uses
               for n in tg.ir.descendants({use[0]}, stops.__contains__, True) & after):
            out[var] = [(read, use) for read, use in uses
                        if tg.ir.descendants({use[0]}, data_only=True) & (others | stops)]
    return {var: uses for var, uses in out.items() if uses}


def _factors(tg, ops: list) -> list[str]:
    """The variables, not trained, scalar and floating, read as a factor
    of one of `ops` (through Mul, Cast and Identity)."""
    readers = {r: var for var, rs in tg.readers.items() for r in rs}
    found, seen, todo = [], set(), list(ops)
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        var = readers.get(op.name)
        v = tg.variables.get(var)
        if v is not None and not v.trainable and var not in tg.gradients and v.shape == () and \
                v.dtype.is_floating and var not in found:
            found.append(var)
        elif op.type in _FACTORS:
            todo.extend(t.op for t in op.inputs)
    return found
