"""Split rows: a large sparse variable as row ranges on several servers.

Requires: the plan's `row_split` (parallax_ng/plan.py `balance`: variables
bigger than a server's share whose every use `splittable` accepts); runs
after `server_sync`, so a non-chief worker's writers are already no-ops.
Guarantees: each split variable (and each same-shape slot) becomes one
variable per range, `<name>/part_<k>` on the range's server, and every op
that took its handle does the same on the ranges:
- ReadVariableOp: the ranges' values concatenated (the op's name is kept);
- ResourceGather: indices bucketed by range, one gather per server, results
  stitched back in order (only the rows asked for leave each server);
- AssignVariableOp / AssignAdd / AssignSub: the value split by rows;
- ResourceScatter* and ResourceSparseApply*: indices and rows bucketed by
  range, one op per range on its server (slots split the same way);
- VariableShape: the whole shape; VarIsInitializedOp: range 0's.
A writer's name becomes a no-op after its per-range ops, so control edges
to it still order the step. Results are exactly those of the whole variable.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng import emit
from parallax_ng.errors import GraphError
from parallax_ng.ir import GraphIR, TensorRef


@dataclass(frozen=True)
class SplitRowsPass:
    name: str = "split_rows"

    def run(self, ir: GraphIR, ctx):
        split = ctx.plan.row_split
        if not split:
            return ir, {}
        tg = ctx.tg
        added, changed = [], {}
        for var, ranges in sorted(split.items()):
            v = tg.variables[var]
            for k, (server, _, rows) in enumerate(ranges):
                added.append(emit.node_def(
                    part(var, k), "VarHandleOp", [], server, dtype=v.dtype.base_dtype,
                    shape=tf.compat.v1.AttrValue(
                        shape=tf.TensorShape([rows, *v.shape[1:]]).as_proto()),
                    container="", shared_name=part(var, k)))
        users = sorted({c for var in split for c, _ in ir.consumers.get(TensorRef(var, 0), ())})
        for name in users:
            nodes, replacement = _rewrite(ir, ir.node(name), split, ctx)
            added.extend(nodes)
            changed[name] = replacement
        return ir.replace(changed, added), {"split": len(split), "rewritten": len(users)}


def part(var: str, k: int) -> str:
    return f"{var}/part_{k}"


def _rewrite(ir: GraphIR, node, split: dict, ctx):
    """(new nodes, the node that takes `node`'s name) for one use."""
    parsed = ir.parsed_inputs(node)
    data = [(src, idx) for src, idx, control in parsed if not control]
    controls = [f"^{src}" for src, _, control in parsed if control]
    handles = [src for src, _ in data if src in split]
    ranges = split[handles[0]]
    if any(split[h] != ranges for h in handles):
        raise GraphError(f"{node.name!r} ({node.op}) takes variables split differently")
    dtype = ctx.tg.variables[handles[0]].dtype.base_dtype
    scope = f"parallax/split_rows/{node.name}"
    op = node.op
    if op == "ReadVariableOp":
        reads = [emit.node_def(f"{scope}/read_{k}", "ReadVariableOp",
                               [part(handles[0], k)] + controls, server, dtype=dtype)
                 for k, (server, _, _) in enumerate(ranges)]
        axis = emit.const(f"{scope}/axis", 0, tf.int32, node.device)
        return reads + [axis], emit.node_def(
            node.name, "ConcatV2", [r.name for r in reads] + [axis.name], node.device,
            T=dtype, N=len(reads), Tidx=tf.int32)
    if op == "VariableShape":
        full = [ranges[-1][1] + ranges[-1][2]] + list(ctx.tg.variables[handles[0]].shape[1:])
        out_type = node.attr["out_type"].type if "out_type" in node.attr else tf.int32
        return [], emit.const(node.name, full, tf.as_dtype(out_type), node.device)
    if op == "VarIsInitializedOp":
        return [], emit.node_def(node.name, op, [part(handles[0], 0)] + controls, node.device)
    if op == "ResourceGather":
        return _gather(node, data, controls, ranges, handles[0], dtype, scope)
    if op in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
        value = _tensor(data[1])
        sizes = emit.const(f"{scope}/sizes", [r for _, _, r in ranges], tf.int64, node.device)
        axis = emit.const(f"{scope}/axis", 0, tf.int32, node.device)
        cut = emit.node_def(f"{scope}/split", "SplitV", [value, sizes.name, axis.name],
                            node.device, T=dtype, Tlen=tf.int64, num_split=len(ranges))
        writes = []
        for k, (server, _, _) in enumerate(ranges):
            nd = _like(node, f"{scope}/part_{k}", server)
            nd.input.extend([part(handles[0], k), f"{cut.name}:{k}"] + controls)
            writes.append(nd)
        return [sizes, axis, cut] + writes, _after(node, writes)
    if op.startswith(("ResourceScatter", "ResourceSparseApply")):
        return _sparse_write(node, data, controls, ranges, split, scope)
    raise GraphError(f"{node.name!r} ({op}) takes the handle of a variable split by rows; "
                     "split_rows cannot cut it")


def _tensor(ref) -> str:
    src, idx = ref
    return src if idx == 0 else f"{src}:{idx}"


def _like(node, name: str, device: str):
    nd = tf.compat.v1.NodeDef(name=name, op=node.op, device=device)
    for key, value in node.attr.items():
        if key != "_class":
            nd.attr[key].CopyFrom(value)
    return nd


def _after(node, ops) -> object:
    return emit.node_def(node.name, "NoOp", [f"^{o.name}" for o in ops], node.device)


def _bucket(indices, ranges):
    """(range of each index, index within its range), exact for any int."""
    starts = tf.constant([s for _, s, _ in ranges], indices.dtype)
    which = tf.reduce_sum(tf.cast(indices[:, None] >= starts[None, 1:], tf.int32), 1)
    return which, indices - tf.gather(starts, which)


def _gather(node, data, controls, ranges, var, dtype, scope):
    ids_ref = _tensor(data[1])
    ids_type = tf.as_dtype(node.attr["Tindices"].type)
    n = len(ranges)

    def lookup(ids, *handles):
        flat = tf.reshape(ids, [-1])
        which, local = _bucket(flat, ranges)
        positions = tf.dynamic_partition(tf.range(tf.size(flat)), which, n)
        wanted = tf.dynamic_partition(local, which, n)
        rows = []
        for k, (server, _, _) in enumerate(ranges):
            with tf.device(server):
                rows.append(tf.raw_ops.ResourceGather(resource=handles[k], indices=wanted[k],
                                                      dtype=dtype))
        got = tf.dynamic_stitch(positions, rows)
        return tf.reshape(got, tf.concat([tf.shape(ids), tf.shape(got)[1:]], 0))

    inputs = [(ids_ref, ids_type, None)] + [(part(var, k), tf.resource, [])
                                            for k in range(n)]
    nodes, (out,) = emit.emit_traced(lookup, inputs, scope, node.device)
    return _with_controls(nodes, controls), emit.node_def(
        node.name, "Identity", [out], node.device, T=dtype)


def _sparse_write(node, data, controls, ranges, split, scope):
    """ResourceScatter*(var, indices, updates) or ResourceSparseApply*(var,
    slots..., scalars..., grad, indices, ...): one op per range."""
    from tensorflow.python.framework import op_def_registry
    args = [a.name for a in op_def_registry.get(node.op).input_arg]
    if len(args) != len(data):
        raise GraphError(f"{node.name!r} ({node.op}) has list inputs; split_rows cannot cut it")
    pos = {a: i for i, a in enumerate(args)}
    rows_arg = "updates" if "updates" in pos else "grad"
    rows_ref, idx_ref = _tensor(data[pos[rows_arg]]), _tensor(data[pos["indices"]])
    rows_type = tf.as_dtype(node.attr["dtype" if rows_arg == "updates" else "T"].type)
    idx_type = tf.as_dtype(node.attr["Tindices"].type)
    n = len(ranges)

    def bucket(rows, indices):
        which, local = _bucket(indices, ranges)
        return (tf.dynamic_partition(rows, which, n) + tf.dynamic_partition(local, which, n))

    nodes, outs = emit.emit_traced(bucket, [(rows_ref, rows_type, None),
                                            (idx_ref, idx_type, [None])], scope, node.device)
    writes = []
    for k, (server, _, _) in enumerate(ranges):
        nd = _like(node, f"{scope}/part_{k}", server)
        for i, (src, idx) in enumerate(data):
            if src in split:
                nd.input.append(part(src, k))
            elif i == pos[rows_arg]:
                nd.input.append(outs[k])
            elif i == pos["indices"]:
                nd.input.append(outs[n + k])
            else:
                nd.input.append(_tensor((src, idx)))
        nd.input.extend(controls)
        writes.append(nd)
    return _with_controls(nodes, controls) + writes, _after(node, writes)


def _with_controls(nodes, controls):
    """The original op's control inputs, on the traced ops that have no inputs."""
    if controls:
        for nd in nodes:
            if not nd.input:
                nd.input.extend(controls)
    return nodes


__all__ = ["SplitRowsPass", "part"]
