"""Extremes and sums: state written from reductions over the batch, and
data scaled by the batch's own statistics, are one device's.

A variable written from a maximum or minimum over the batch (a running
maximum of activations, as a quantizer's calibration keeps it; a moving
average of each batch's minimum) holds, on one device, the extremes of the
global batch; one assigned a sum over the batch (a decayed total, a moving
average of a sum of squares), or a function of a reduction of reductions
(a standard deviation: a mean of squares about the batch's mean), holds
the global batch's; one assigned from the batch's row count
(`tf.shape(x)[0]`, `tf.size(x)`: the same on every replica, and 1/N of
one device's) holds the global batch's count. The replicas' writes averaged give none of these: the
mean of the replicas' maxima is below the job's, the mean of their sums
1/N of the job's. So each such reduction over the batch's axis that state
reads, and the gradients do not, is exchanged where the write varies
between replicas through such reductions alone: a sum or a mean by the
job's all-reduce, a count by the job's all-reduce in float64 (exact),
a maximum or a minimum as rows (every replica puts its
value in its own row of an [N, ...] tensor of zeros, the rows are summed
over the job, exactly: a value plus zeros, and the largest or smallest row
is taken). Each replica reads the job's value in place of its own, so the
write is the same on every replica, and state_sync leaves it alone.
Writes that add a sum or a mean of the batch (metrics' totals, moving
averages of means) keep state_sync's rules, which are exact for them. The
same exchange makes the batch's statistics of the data alone that a step
scales its rows by (inputs standardized or divided by their largest value,
examples' weights over their sum: graph/normalization.py
`data_statistics`) the global batch's.
`all_reduce` and `on_a_server` are the two forms of a pass's exchange of
per-replica values (state_sync's, selected_means'): collectives, or sums
through a server where a job's gradients go there.
"""
from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from parallax_ng.graph import applied, batch_sums, branches, emit, mixing, normalization, rules
from parallax_ng.graph.applied import alone, carried
from parallax_ng.graph.ir import copy_node, parse_tensor
from parallax_ng.graph.rows import batch_axis, counts_rows, reading
from transforms import counts

_KINDS = {"Max": "max", "Min": "min", "Sum": "sum", "Mean": "mean"}
_REDUCTIONS = {"max": tf.reduce_max, "min": tf.reduce_min}
_COUNTS = frozenset({"Shape", "ShapeN", "Size"})


def explained(tg, ref, varies, sources, trained: set, how: str) -> dict | None:
    """{Max, Min, Sum or Mean output: "max", "min", "sum" or "mean"; a
    count of the batch's rows: "count"}: the reductions over the batch's
    axis (and counts) through which alone tensor `ref` differs between
    replicas (`varies`) or from one device, with those they read, none among
    `trained` (the nodes the gradients are computed from: a reduction the
    loss reads keeps its own gradient) and none reading an op that mixes
    the batch's examples; where a write state_sync would combine by `how`
    ("sum" or "mean") is one device's only with them exchanged: extremes in
    any; in a mean, a sum, a count or a reduction of reductions (a mean of
    means is averaged exactly as it is); every one in an optimizer's update
    (`how` "update": its hyperparameters are not averaged). None otherwise."""
    found, nested, seen, todo = {}, False, set(), [(ref, False)]
    while todo:
        r, under = todo.pop()
        if (r, under) in seen:
            continue
        seen.add((r, under))
        if (kind := _over_the_batch(tg, r, sources)) is not None:
            if r.node in trained or mixing.mixing(tg.tensor(r).op.inputs[0], sources):
                return None
            nested, under, found[r] = nested or under, True, kind
        elif not under and not tg.tensor(r).shape.rank and counts_rows(tg.tensor(r).op, sources):
            if r.node in trained:       # a count of the batch's rows: the job's is their sum
                return None
            found[r] = "count"
            continue
        elif under and (tg.ir.node(r.node).op in _COUNTS or tg.tensor(r).dtype.is_floating
                        and batch_axis(tg.tensor(r), sources) is None):
            return None     # beneath a reduction: rows alone (not the replica's row count)
        ins = [i for i in tg.ir.data_inputs(r.node) if varies(i)]
        if not ins and not under:       # an input or a draw: differs on its own
            return None
        todo.extend((i, under) for i in ins)
    kinds = set(found.values())
    needed = kinds & {"max", "min"} or how == "mean" and (kinds & {"sum", "count"} or nested)
    return found if needed or how == "update" else None


def in_shared_updates(ctx, sources, trained: set) -> tuple[dict, list]:
    """(`explained`'s reductions and counts, the (writer, input) pairs that
    read them) for the optimizers' updates of variables held once (on a
    server, sharded, cut by columns) that read a hyperparameter computed
    from the batch (a learning rate scaled by its row count): such an
    update runs once, on replica 0's value, so it reads the job's (`tie`).
    A hyperparameter computed from the batch otherwise is refused by name
    (rules.state_sync_reduction)."""
    tg, found, updates, read = ctx.tg, {}, set(rules.STATE_SYNC_REDUCTION), []
    initializers = {v.initializer for v in tg.variables.values()}
    for var, writers in sorted(tg.writers.items()):
        if ctx.plan.mirrored(var) or var in tg.accumulators:
            continue        # (mirrored: state_sync reads each replica's updates)
        for w in sorted(set(writers) - initializers):
            if tg.ir.node(w).op in updates:
                continue        # (an assignment: no hyperparameter)
            for ref in tg.ir.data_inputs(w)[1:]:
                if tg.tensor(ref).shape.rank != 0 or not ctx.varies(ref):
                    continue
                if (cut := explained(tg, ref, ctx.varies, sources, trained, "update")) is None:
                    rules.state_sync_reduction(tg.ir.node(w).op, w, var, ref)
                found.update(cut)
                read.append((w, ref))
    return found, read


def tie(ctx, ir, read: list):
    """(nodes, changed writers): each update of `in_shared_updates` that
    runs once waits on every replica's value of what it reads (a NoOp
    `parallax/extremes/<writer>/tie`, which a silenced writer of another
    worker keeps: transforms/server_sync.py), so every replica's exchange
    runs, not replica 0's alone."""
    nodes, changed, each = [], {}, {}
    for w, ref in read:
        if w in ctx.unreplicated:       # (an update per replica reads its own)
            each.setdefault(w, []).extend(
                "^" + ctx.replica_name(k, ref.node) for k in range(ctx.plan.num_replicas))
    for w, deps in each.items():
        nodes.append(emit.node_def(f"parallax/extremes/{w}/tie", "NoOp", deps, ctx.plan.host))
        changed[w] = copy_node(ir.node(w))
        changed[w].input.append("^" + nodes[-1].name)
    return nodes, changed


def statistics(tg, sources) -> dict:
    """{statistic: kind} of graph/normalization.py's `data_statistics`: the
    batch's statistics of the data alone that the step scales its rows by,
    and the row counts and data's sums that scale such a Sum on its way
    to the rows (a fraction of positive labels, `sum(y) / tf.size(y)`, as
    a class-balanced loss weighs its rows: the job's sum over the job's
    count; before, over the replica's). A Sum scaled by a statistic of what
    the variables compute stays the replica's as that does (the plan's
    line names it; `batch_norm: synchronized` exchanges both); by another
    value the exchange does not read, with a warning naming it."""
    found, rows = {}, reading(sources, tg.graph)
    for op in normalization.data_statistics(tg.graph, sources):
        ref = parse_tensor(op.outputs[0].name)
        if (kind := _over_the_batch(tg, ref, sources)) is None:
            continue
        scales = rows.guarded(lambda r: alone(op, r, path=carried(op, r)[0])) \
            if kind == "sum" else ()
        if scales is None and rows.guarded(lambda r: alone(op, r, _model_statistics(
                tg.graph, r), carried(op, r)[0])) is not None:
            continue    # scaled by what the variables compute: as that, normalization's
        if scales is None:      # the job's sum over the replica's count: worse than its own
            warnings.warn(f"the batch's sum {op.name!r} of the data scales its rows with a "
                          "count or value the exchange does not read (a product of shapes?), "
                          "so it stays each replica's and the step differs from one device "
                          "with the global batch: divide by tf.cast(tf.size(x), ...) or "
                          "tf.cast(tf.shape(x)[0], ...), or take tf.reduce_mean", stacklevel=2)
            continue
        found[ref] = kind if kind != "sum" or op.outputs[0].dtype.is_floating else "count"
        for s in scales:
            at = parse_tensor(s.outputs[0].name)
            found[at] = _over_the_batch(tg, at, sources) or "count"
    for op in rows.guarded(lambda r: applied.counts_applied(tg.graph, r)) or ():
        found[parse_tensor(op.outputs[0].name)] = "count"       # (l / n per row: the job's n)
    return found


def _model_statistics(graph, rows) -> frozenset:
    """The names of the Sums and Means over the batch of what the variables
    compute (graph/normalization.py exchanges them or names them)."""
    return frozenset(op.name for op in graph.get_operations() if op.type in ("Sum", "Mean")
                     and not rules.is_autodiff(op.name) and applied.over_the_batch(op, rows)
                     and not applied.of_data(op))


def mixed(tg, ref, sources) -> str | None:
    """Why a value state is assigned, which no exchange makes one device's,
    is not one device's as the replicas' mean: the first op that mixes the
    batch's examples (graph/mixing.py: its top k, a softmax across it)."""
    t = tg.tensor(ref)
    if not t.dtype.is_floating or not (found := mixing.mixing(t, sources)):
        return None
    return f"{found[0]}: {found[1]}"


def _over_the_batch(tg, ref, sources) -> str | None:
    """The kind of a Max, Min, Sum or Mean whose axes hold the batch's
    (or a largest of largest values: mixing.extreme), else None."""
    kind = _KINDS.get(tg.ir.node(ref.node).op)
    t = tg.tensor(ref)
    if per_class := batch_sums.per_class(t.op, sources):
        return per_class        # (a running largest value per class)
    if reading(sources, tg.graph).guarded(lambda r: applied.fixed_bincount(t.op, r)):
        return "sum"
    if kind is None or t.shape.rank is None:
        return None
    if kind in ("max", "min"):
        return mixing.extreme(t, sources)
    x, axes = t.op.inputs[0], tf.get_static_value(t.op.inputs[1])
    a = batch_axis(x, sources) if x.shape.rank else None
    return kind if a is not None and axes is not None and \
        a in {int(v) % x.shape.rank for v in np.atleast_1d(axes)} else None


def exchanged(ctx, ir, reduce_at, found: dict, sources, in_loops: set, index: int,
              rewires: dict, replaced: set):
    """(nodes, the next exchange's index): every replica's uses of each
    reduction in `found`, and of each statistic of the data alone the step
    scales its rows by (`statistics`), read the job's value
    (`reduce_at(node)`: the reduction state_sync uses there); none in a
    while loop's body (an exchange runs once a step: a second would wait)."""
    nodes, looped = [], []
    for ref, kind in sorted({**statistics(ctx.tg, sources), **found}.items()):
        if ref.node in in_loops:
            looped.append(ref.name)     # (named: each replica's)
            continue
        made, outs = job_value(ctx, ir, reduce_at(ref.node), ref, kind, index)
        nodes, index = nodes + made, index + 1
        counts.read_everywhere(ctx, ref, outs, rewires, replaced)
    branches.warn_in_loops(means=looped)
    return nodes, index


def job_value(ctx, ir, reduce, ref, kind: str, index: int) -> tuple[list, list[str]]:
    """(nodes, replica k's job value of reduction `ref`): a sum or mean
    by `reduce` (state_sync's: all_reduce or on_a_server); an extreme as
    its value in row g (the replica's place in the job) of zeros, summed,
    the largest or smallest row."""
    tg, plan = ctx.tg, ctx.plan
    t, n = tg.tensor(ref), plan.group_size
    scope = f"parallax/extremes/{ref.node}"
    if kind in ("sum", "mean"):
        return reduce(ctx, scope, [ctx.replica_tensor(k, ref) for k in range(plan.num_replicas)],
                      t.dtype, kind == "mean", index)
    if kind == "count":         # summed in float64: exact for any count of rows
        nodes, wide = [], []
        for k in range(plan.num_replicas):
            made, (out,) = _traced(lambda x: tf.cast(x, tf.float64), ctx, ir, ref, t,
                                   f"{scope}/wide_{k}", k)
            nodes, wide = nodes + made, wide + [out]
        more, sums = reduce(ctx, scope, wide, tf.float64, False, index)
        nodes, outs = nodes + more, []
        for k, total in enumerate(sums):
            made, (out,) = _traced(lambda x: tf.cast(x, t.dtype), ctx, ir, ref, t,
                                   f"{scope}/count_{k}", k, total, dtype=tf.float64)
            nodes, outs = nodes + made, outs + [out]
        return nodes, outs
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


def _traced(fn, ctx, ir, ref, t, scope: str, k: int, name: str | None = None, shape=None,
            dtype=None):
    """`fn` of replica k's `ref` (or of tensor `name`, of `shape` and
    `dtype` where they are not `ref`'s) on its copy's device."""
    device = ir.node(ctx.replica_name(k, ref.node)).device
    return emit.emit_traced(fn, [(name or ctx.replica_tensor(k, ref), dtype or t.dtype,
                                  t.shape if shape is None else shape)], scope, device)


def all_reduce(ctx, scope, tensors, dtype, mean: bool, _):
    return ctx.comm.all_reduce(scope, tensors, dtype, mean)


def on_a_server(ctx, scope, tensors, dtype, mean: bool, k: int, branched: bool = False):
    """The workers' sums of their replicas' on server k mod S, read by all."""
    plan = ctx.plan
    op, more = ("AddN", {"N": len(tensors)}) if len(tensors) > 1 else ("Identity", {})
    local = emit.node_def(f"{scope}/local", op, tensors, plan.host, T=dtype, **more)
    nodes, out = ctx.comm.server_sum(scope, local.name, dtype,
                                     plan.servers[k % len(plan.servers)],
                                     1.0 / plan.group_size if mean else 1.0, branched=branched)
    return [local, *nodes], [out] * len(tensors)
