"""A queue of the batch's rows kept in a variable, as one device keeps it.

MoCo keeps the keys of recent batches in a variable: each step the batch's
keys go in front and the oldest rows drop off the end,
`queue.assign(tf.concat([k, queue[:-n]], 0))` with `n = tf.shape(k)[0]`.
One device queues the global batch's keys; a replica has its own rows
only, and no sum or mean of the replicas' queues is one device's. Here
every replica's concatenation reads the job's rows instead, in replica
order (the global batch's order, as runtime/fetches.py splits a feed and
pn.shard a dataset), and every count of rows among its other inputs
(`queue[:-n]`'s n) is the job's count: so every replica assigns one
device's value, and the write needs no exchange of its own.

The job's rows come by the plan's all-gather of rows (comm `all_gather`,
which carries a count that changes from step to step, a last short batch's)
or, in a job that reduces on its servers (no collective op in its step),
by two sums on a server: the replicas' counts, then each replica's rows
padded with zeros to its place among the job's (x + 0 is x, exactly).

Requires: replicas made by `replicate`; state_sync calls `joined` for an
Assign of a mirrored variable from data that differs between replicas.
Guarantees: None where the assigned value is not such a concatenation
along the batch's first axis (graph/mixing.py `queued`), or its rows are
of a dtype the exchange does not carry; else (nodes, rewires).
"""
from __future__ import annotations

import tensorflow as tf

from parallax_ng.graph import branches, emit, mixing
from parallax_ng.graph.ir import TensorRef
from transforms.extremes import on_a_server

_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32)
_COUNTS_READ = ("Shape", "Size")    # a count of rows reads no further


def joined(ctx, write: str, ref, rows, index: int, above: dict):
    """(nodes, rewires) that make every replica's `write` (an Assign) of
    value `ref` (a TensorRef) one device's, or None (also where it runs in
    a tf.cond's branch or a loop's body). `rows`: a graph/rows.py reading
    of the data sources; `index`: the exchange's number (its server);
    `above`: branches.switches_above's memo."""
    if ctx.tg.ir.node(write).op not in ("Assign", "AssignVariableOp") or \
            branches.switches_above(ctx.tg.ir, write, above):
        return None
    op = ctx.tg.tensor(ref).op
    while op.type == "Identity":
        op = op.inputs[0].op
    if op.type != "ConcatV2" or not mixing.queued(op, rows) or \
            int(tf.get_static_value(op.inputs[-1])) % op.outputs[0].shape.rank != 0:
        return None
    inputs = op.inputs[:-1]
    parts = [j for j, x in enumerate(inputs) if rows.axis(x) == 0]
    others = [x for x in inputs if rows.axis(x) is None]
    if len(parts) + len(others) != len(inputs) or \
            not all(mixing.data_free(x, rows) for x in others) or \
            any(inputs[j].dtype not in _DTYPES or inputs[j].shape.rank is None for j in parts):
        return None
    plan, scope = ctx.plan, f"parallax/queued_rows/{op.name}"
    nodes, rewires, first = [], {}, None
    for j in parts:
        x = inputs[j]
        tensors = [ctx.replica_tensor(k, TensorRef(x.op.name, x.value_index))
                   for k in range(plan.num_replicas)]
        gather = _on_servers if plan.reduces_on_servers else _all_gather
        made, outs = gather(ctx, f"{scope}/input_{j}", tensors, x.dtype, x.shape, index)
        nodes += made
        first = first or (outs, x.dtype, x.shape)
        rewires.update({(ctx.replica_name(k, op.name), j): out for k, out in enumerate(outs)})
    made, counted = _counts(ctx, scope, others, rows, *first)
    return nodes + made, {**rewires, **counted}


def _all_gather(ctx, scope, tensors, dtype, shape, _):
    """Every replica's rows, in replica order, by the plan's all-gather."""
    nodes, ids = [], []
    for k, (t, device) in enumerate(zip(tensors, ctx.plan.devices)):
        made, (rows,) = emit.emit_traced(lambda x: tf.range(tf.shape(x)[0]),
                                         [(t, dtype, shape)], f"{scope}/replica_{k}/ids", device)
        nodes += made
        ids.append(rows)
    made, values, _ = ctx.comm.all_gather(scope, tensors, ids, dtype, tf.int32,
                                          shape.as_list(), mean=False)
    return nodes + made, values


def _on_servers(ctx, scope, tensors, dtype, shape, index):
    """Every replica's rows, in replica order, by two sums on a server:
    each replica's count at its place, then its rows padded to theirs."""
    plan = ctx.plan
    n, nodes, counts = plan.group_size, [], []
    for k, (t, device) in enumerate(zip(tensors, plan.devices)):
        made, (mine,) = emit.emit_traced(
            lambda x, at=plan.replica_offset + k: tf.one_hot(at, n) * tf.cast(
                tf.shape(x)[0], tf.float32), [(t, dtype, shape)],
            f"{scope}/replica_{k}/count", device)
        nodes += made
        counts.append(mine)
    made, every = on_a_server(ctx, f"{scope}/counts", counts, tf.float32, False, index)
    nodes += made
    padded = []
    for k, (t, device) in enumerate(zip(tensors, plan.devices)):
        made, (out,) = emit.emit_traced(
            lambda x, c, at=plan.replica_offset + k: _padded(x, c, at),
            [(t, dtype, shape), (every[k], tf.float32, [n])],
            f"{scope}/replica_{k}/padded", device)
        nodes += made
        padded.append(out)
    made, outs = on_a_server(ctx, f"{scope}/rows", padded, dtype, False, index)
    return nodes + made, outs


def _padded(x, counts, at: int):
    """x's rows at their place among every replica's (`counts`, in replica
    order), zeros elsewhere."""
    c = tf.cast(tf.round(counts), tf.int32)
    before, total = tf.reduce_sum(c[:at]), tf.reduce_sum(c)
    rest = tf.zeros(tf.stack([tf.rank(x) - 1, 2]), tf.int32)
    return tf.pad(x, tf.concat([[[before, total - before - tf.shape(x)[0]]], rest], 0))


def _counts(ctx, scope, others, rows, joined_rows, dtype, shape):
    """(nodes, rewires) by which every count of the batch's rows that the
    concatenation's other inputs read (`queue[:-n]`) is the job's: the
    count of the joined rows."""
    found, seen, stack = {}, set(), [x.op for x in others]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        for at, x in enumerate(op.inputs):
            if x.shape.rank == 0 and rows.counts_rows(x.op):
                found.setdefault(x.name, (x, []))[1].append((op.name, at))
            elif op.type not in _COUNTS_READ:
                stack.append(x.op)
    nodes, rewires = [], {}
    for name, (x, uses) in found.items():
        for k, (t, device) in enumerate(zip(joined_rows, ctx.plan.devices)):
            made, (count,) = emit.emit_traced(
                lambda g, kind=x.dtype: tf.shape(g, out_type=kind)[0] if kind.is_integer
                else tf.cast(tf.shape(g)[0], kind), [(t, dtype, shape)],
                f"{scope}/{x.op.name}/replica_{k}", device)
            nodes += made
            rewires.update({(ctx.replica_name(k, user), at): count for user, at in uses})
    return nodes, rewires
