"""Extremes: state written from the batch's largest or smallest values is
one device's.

A variable written from a maximum or minimum over the batch (a running
maximum of activations, as a quantizer's calibration keeps it; a moving
average of each batch's minimum) holds, on one device, the extremes of the
global batch. The replicas' writes averaged do not give them: the mean of
the replicas' maxima is below the job's maximum. So each such reduction
(graph/mixing.py `extreme`: a Max or Min whose axes hold the batch's) that
state reads, and the gradients do not, is exchanged: every replica puts
its value in its own row of an [N, ...] tensor of zeros, the rows are
summed over the job (any backend's sum; exact, a value plus zeros), and
the largest or smallest row is read in place of the replica's value. A
write that differs between replicas only through such values is then the
same on every replica, and state_sync leaves it alone.
"""
from __future__ import annotations

import tensorflow as tf

from parallax_ng.graph import emit, mixing

_REDUCTIONS = {"max": tf.reduce_max, "min": tf.reduce_min}


def explained(tg, ref, varies, sources, trained: set) -> dict | None:
    """{Max or Min output: "max" or "min"}: the reductions over the batch
    through which alone tensor `ref` differs between replicas (`varies`),
    none among `trained` (the nodes the gradients are computed from: a
    reduction the loss reads keeps its own gradient); None where `ref`
    differs otherwise too, or through none."""
    found, seen, todo = {}, set(), [ref]
    while todo:
        r = todo.pop()
        if r in seen:
            continue
        seen.add(r)
        if tg.ir.node(r.node).op in ("Max", "Min") and tg.tensor(r).shape.rank is not None \
                and (kind := mixing.extreme(tg.tensor(r), sources)) is not None:
            if r.node in trained:
                return None
            found[r] = kind
            continue
        ins = [i for i in tg.ir.data_inputs(r.node) if varies(i)]
        if not ins:                 # an input or a draw: differs on its own
            return None
        todo.extend(ins)
    return found or None


def job_extreme(ctx, ir, reduce, ref, kind: str, index: int) -> tuple[list, list[str]]:
    """(nodes, replica k's job extreme of tensor `ref`): its value in row
    g (the replica's place in the job) of zeros, summed by `reduce` (as
    state_sync's: all_reduce or on_a_server), the largest or smallest row."""
    tg, plan = ctx.tg, ctx.plan
    t, n = tg.tensor(ref), plan.group_size
    scope = f"parallax/extremes/{ref.node}"
    rows, nodes = [], []
    for k in range(plan.num_replicas):
        g = plan.replica_offset + k
        made, (row,) = _traced(
            lambda x, g=g: tf.pad(tf.expand_dims(x, 0),
                                  [[g, n - 1 - g]] + [[0, 0]] * x.shape.rank),
            ctx, ir, ref, t, f"{scope}/row_{k}", k)
        nodes, rows = nodes + made, rows + [row]
    more, sums = reduce(ctx, f"{scope}/rows", rows, t.dtype, False, index)
    nodes += more
    outs = []
    for k, total in enumerate(sums):
        made, (out,) = _traced(lambda x: _REDUCTIONS[kind](x, 0), ctx, ir, ref, t,
                               f"{scope}/{kind}_{k}", k, total, [n] + t.shape.as_list())
        nodes, outs = nodes + made, outs + [out]
    return nodes, outs


def _traced(fn, ctx, ir, ref, t, scope: str, k: int, name: str | None = None, shape=None):
    """`fn` of replica k's `ref` (or of tensor `name`) on its copy's device."""
    device = ir.node(ctx.replica_name(k, ref.node)).device
    return emit.emit_traced(fn, [(name or ctx.replica_tensor(k, ref), t.dtype,
                                  t.shape if shape is None else shape)], scope, device)
