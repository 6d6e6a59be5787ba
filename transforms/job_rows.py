"""Writes of the batch's rows into state that take the job's rows, as one
device's writes take the global batch's.

- A queue: MoCo keeps the keys of recent batches in a variable, each step
  the batch's keys in front and the oldest rows dropped off the end,
  `queue.assign(tf.concat([k, queue[:-n]], 0))` with `n = tf.shape(k)[0]`.
  Every replica's concatenation reads the job's rows instead of its own,
  and every count of rows among its other inputs (`queue[:-n]`'s n) is
  the job's count.
- A memory bank: a variable of a row per example of the data set, each
  step the batch's rows written at its examples' ids (instance
  discrimination's `tf.compat.v1.scatter_update(memory, ids, rows)`; a
  ScatterNd's at `ids[:, None]`, or an assign of a TensorScatter of the
  variable). Every replica writes the job's ids and rows.

A replica alone has its own rows, and no sum or mean of the replicas'
writes is one device's; with the job's rows, in replica order (the global
batch's, as runtime/fetches.py splits a feed and pn.shard a dataset), every
replica writes one device's value, and the write needs no exchange of its
own. The job's rows come by the plan's all-gather of rows (comm
`all_gather`, which carries a count that changes from step to step, a last
short batch's) or, in a job that reduces on its servers (no collective op
in its step), by sums on a server: the replicas' counts, then each
replica's rows padded with zeros to its place among the job's (x + 0 is x,
exactly).

Requires: replicas made by `replicate`; state_sync calls `joined` for each
write of a mirrored variable from data that differs between replicas.
Guarantees: None where the write is neither form (the queue's
concatenation along the batch's first axis, graph/mixing.py `queued`; a
scatter of rows of the batch at ids of its examples), runs in a tf.cond's
branch, or its rows are of a dtype the exchange does not carry; else
(nodes, rewires).
"""
from __future__ import annotations

import tensorflow as tf

from parallax_ng import compat
from parallax_ng.graph import branches, emit, mixing
from parallax_ng.graph.ir import TensorRef
from transforms.extremes import on_a_server

_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32)
_COUNTS_READ = ("Shape", "Size")    # a count of rows reads no further
_ASSIGNS = ("Assign", "AssignVariableOp")
_SCATTERS = ("ScatterUpdate", "ResourceScatterUpdate", "ScatterNdUpdate",
             "ResourceScatterNdUpdate", "ScatterNdAdd", "ResourceScatterNdAdd")
_TENSOR_SCATTERS = ("TensorScatterUpdate", "TensorScatterAdd", "TensorScatterSub")
_SLICE_ASSIGNS = ("StridedSliceAssign", "ResourceStridedSliceAssign")   # buf[p:p + n]


def joined(ctx, write: str, ref, rows, index: int, above: dict):
    """(nodes, rewires) that make every replica's `write` (of `ref`, a
    TensorRef among its inputs) one device's, or None. `rows`: a
    graph/rows.py reading of the data sources; `index`: the exchange's
    number (its server); `above`: branches.switches_above's memo. A
    scatter's rows and ids are made the job's once, where `ref` is the
    ids: ([], {}) for its rows."""
    kind = ctx.tg.ir.node(write).op
    if kind not in _ASSIGNS + _SCATTERS + _SLICE_ASSIGNS or \
            branches.switches_above(ctx.tg.ir, write, above):
        return None
    if kind in _SCATTERS:
        return _scattered(ctx, write, ref, rows, index)
    if kind in _SLICE_ASSIGNS:      # (ref, begin, end, strides, value)
        places = [ctx.tg.tensor(r) for r in ctx.tg.ir.data_inputs(write)[1:4]]
        value = ctx.tg.tensor(ctx.tg.ir.data_inputs(write)[4])
        if rows.axis(value) != 0 or value.dtype not in _DTYPES or \
                value.shape.rank is None or not all(mixing.data_free(p, rows) for p in places):
            return None
        return _placed(ctx, write, ref, rows, index, places, value, 4)
    op = ctx.tg.tensor(ref).op
    while op.type == "Identity":
        op = op.inputs[0].op
    if op.type in _TENSOR_SCATTERS and mixing.data_free(op.inputs[0], rows):
        return _scattered(ctx, op.name, None, rows, index)     # bank.assign(scatter(bank...))
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
    scope = f"parallax/job_rows/{op.name}"
    nodes, rewires, first = [], {}, None
    for j in parts:
        made, outs = _gathered(ctx, f"{scope}/input_{j}", _of(ctx, inputs[j]), None, index)
        nodes += made
        first = first or (outs, inputs[j].dtype, inputs[j].shape)
        rewires.update({(ctx.replica_name(k, op.name), j): out for k, out in enumerate(outs)})
    made, counted = _counts(ctx, scope, others, rows, *first)
    return nodes + made, {**rewires, **counted}


def _scattered(ctx, node, ref, rows, index):
    """A scatter (`node`) of the batch's rows at its examples' ids (a
    vector, or a column for ScatterNd's [n, 1], computed from the data's
    values): the job's ids and rows, gathered where `ref` is the ids or
    None. At places counted from the rows' count (a ring buffer's `(ptr +
    tf.range(n)) % size`, no data's values read): the job's rows, where
    `ref` is the rows or None, at places counted from the job's count."""
    tg = ctx.tg
    ids, values = (tg.tensor(r) for r in tg.ir.data_inputs(node)[1:3])
    column = ids.shape.rank == 2 and compat.dim(ids.shape, 1) == 1
    if not (ids.shape.rank == 1 or column) or rows.axis(values) != 0 or \
            values.dtype not in _DTYPES or ids.dtype not in (tf.int32, tf.int64) or \
            values.shape.rank is None:
        return None
    if mixing.data_free(ids, rows):
        return _placed(ctx, node, ref, rows, index, [ids], values, 2)
    if rows.axis(ids) != 0:
        return None
    if ref is not None and tg.tensor(ref) is not ids:
        return [], {}
    scope, (names, dtype, _) = f"parallax/job_rows/{node}", _of(ctx, ids)
    nodes, shape = [], [None]
    if column:      # gathered as a vector, a column again after
        nodes, names = _each(ctx, f"{scope}/vector", names, dtype, [None, 1],
                             lambda i: tf.reshape(i, [-1]))
    made, (joined_ids, joined_values) = _gathered(ctx, scope, _of(ctx, values),
                                                  (names, dtype, shape), index)
    nodes += made
    if column:
        made, joined_ids = _each(ctx, f"{scope}/column", joined_ids, dtype, shape,
                                 lambda i: tf.reshape(i, [-1, 1]))
        nodes += made
    return nodes, {(ctx.replica_name(k, node), at): out[at - 1]
                   for k, out in enumerate(zip(joined_ids, joined_values)) for at in (1, 2)}


def _placed(ctx, node, ref, rows, index, places: list, values, at: int):
    """A write (`node`) of the batch's rows (`values`, its input `at`) at
    places (`places`: a scatter's ids, a slice's bounds) counted from the
    batch's count: the job's rows, where `ref` is the rows or None, at
    places counted from the job's count. None where the places read no
    count of its rows (fixed places: one device writes other rows there)."""
    uses = _count_uses(places, rows)
    if not uses:
        return None
    if ref is not None and ctx.tg.tensor(ref) is not values:
        return [], {}
    made, joined_rows = _gathered(ctx, f"parallax/job_rows/{node}", _of(ctx, values),
                                  None, index)
    more, counted = _counted(ctx, f"parallax/job_rows/{node}", uses, joined_rows,
                             values.dtype, values.shape)
    return made + more, {**{(ctx.replica_name(k, node), at): out
                            for k, out in enumerate(joined_rows)}, **counted}


def _of(ctx, t):
    """(each replica's copy of user tensor `t`, its dtype, its shape)."""
    return ([ctx.replica_tensor(k, TensorRef(t.op.name, t.value_index))
             for k in range(ctx.plan.num_replicas)], t.dtype, t.shape)


def _each(ctx, scope, names, dtype, shape, fn):
    """(nodes, fn of each replica's tensor of `names`, on its device)."""
    nodes, outs = [], []
    for k, (t, device) in enumerate(zip(names, ctx.plan.devices)):
        made, (out,) = emit.emit_traced(fn, [(t, dtype, shape)], f"{scope}/replica_{k}", device)
        nodes += made
        outs.append(out)
    return nodes, outs


def _gathered(ctx, scope, values, ids, index):
    """(nodes, per replica the job's rows of `values` ((names, dtype,
    shape): `_of`), and with `ids` (rows alike, a vector) theirs: (ids,
    rows) lists)."""
    if ctx.plan.reduces_on_servers:
        made, joined_values = _on_servers(ctx, scope, *values, index)
        if ids is None:
            return made, joined_values
        more, joined_ids = _on_servers(ctx, f"{scope}/ids", *ids, index)
        return made + more, (joined_ids, joined_values)
    return _all_gather(ctx, scope, *values, ids)


def _all_gather(ctx, scope, tensors, dtype, shape, ids=None):
    """Every replica's rows, in replica order, by the plan's all-gather
    (with `ids`, (names, dtype, shape) of each replica's, theirs too: (ids,
    rows))."""
    nodes, kind = [], tf.int32 if ids is None else ids[1]
    if ids is None:
        nodes, numbers = _each(ctx, f"{scope}/ids", tensors, dtype, shape,
                               lambda x: tf.range(tf.shape(x)[0]))
    made, values, indices = ctx.comm.all_gather(scope, tensors, numbers if ids is None
                                                else ids[0], dtype, kind,
                                                tf.TensorShape(shape).as_list(), mean=False)
    return nodes + made, values if ids is None else (indices, values)


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
    return _counted(ctx, scope, _count_uses(others, rows), joined_rows, dtype, shape)


def _count_uses(tensors, rows) -> dict:
    """{name: (a count of the batch's rows that `tensors` read, its
    [(user, input position)])}."""
    found, seen, stack = {}, set(), [x.op for x in tensors]
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
    return found


def _counted(ctx, scope, found: dict, joined_rows, dtype, shape):
    """(nodes, rewires): every use in `found` (`_count_uses`) reads the
    count of the joined rows."""
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
