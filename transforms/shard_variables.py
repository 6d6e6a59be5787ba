"""Shard variables: a variable the plan shards lives as parts on several devices.

Requires: the plan's `Sharded` placements (parallax_ng/planning/placement.py; the
planner shards only variables `planner.shardable` accepts, a hand-made plan
must do the same); runs after `place` and `server_sync` (a non-chief
worker's writers are already no-ops).
Guarantees: each sharded variable becomes one variable per shard,
`part_name(var, k)` on the shard's device (rows [start, start+size) along
axis 0, or, flattened, elements [start, start+size) as a 1-D variable), and
every op that took its handle does the same on the parts:
- ReadVariableOp: the parts put together (the op's name is kept);
- AssignVariableOp / AssignAdd / AssignSub: the value cut the same way;
- VariableShape: the whole shape; VarIsInitializedOp: part 0's;
- rows only: ResourceGather (indices bucketed by range, one gather per
  part, rows stitched back in order) and ResourceScatter* /
  ResourceSparseApply* (indices and rows bucketed, one op per part);
- elements only: dense ResourceApply* (element-wise updates: the variable,
  its slots and the gradient cut alike, scalars shared).
A writer's name becomes a no-op after its per-part ops, so control edges to
it still order the step. Results are exactly those of the whole variable.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.errors import GraphError
from parallax_ng.graph import emit
from parallax_ng.graph.ir import GraphIR, TensorRef
from parallax_ng.planning.placement import part_name as part


@dataclass(frozen=True)
class ShardVariablesPass:
    name: str = "shard_variables"
    requires: tuple = ("place",)
    after: tuple = ("server_sync",)

    def run(self, ir: GraphIR, ctx):
        sharded = ctx.plan.sharded()
        if not sharded:
            return ir, {}
        tg = ctx.tg
        added, changed = [], {}
        for var, p in sorted(sharded.items()):
            v = tg.variables[var]
            for k, s in enumerate(p.shards):
                shape = [s.size, *v.shape[1:]] if p.axis == 0 else [s.size]
                added.append(emit.node_def(
                    part(var, k), "VarHandleOp", [], s.device, dtype=v.dtype.base_dtype,
                    shape=tf.compat.v1.AttrValue(shape=tf.TensorShape(shape).as_proto()),
                    container="", shared_name=part(var, k)))
        users = sorted({c for var in sharded for c, _ in ir.consumers.get(TensorRef(var, 0), ())})
        for name in users:
            nodes, replacement = _rewrite(ir, ir.node(name), sharded, ctx)
            added.extend(nodes)
            changed[name] = replacement
        return ir.replace(changed, added), {"sharded": len(sharded), "rewritten": len(users)}


def _rewrite(ir: GraphIR, node, sharded: dict, ctx):
    """(new nodes, the node that takes `node`'s name) for one use."""
    parsed = ir.parsed_inputs(node)
    data = [(src, idx) for src, idx, control in parsed if not control]
    controls = [f"^{src}" for src, _, control in parsed if control]
    handles = [src for src, _ in data if src in sharded]
    p = sharded[handles[0]]
    if any(sharded[h] != p for h in handles):
        raise GraphError(f"{node.name!r} ({node.op}) takes variables sharded differently")
    var = ctx.tg.variables[handles[0]]
    dtype = var.dtype.base_dtype
    scope = f"parallax/shard_variables/{node.name}"
    op = node.op
    if op == "ReadVariableOp":
        reads = [emit.node_def(f"{scope}/read_{k}", "ReadVariableOp",
                               [part(var.name, k)] + controls, s.device, dtype=dtype)
                 for k, s in enumerate(p.shards)]
        axis = emit.const(f"{scope}/axis", 0, tf.int32, node.device)
        joined = emit.node_def(f"{scope}/concat" if p.axis is None else node.name, "ConcatV2",
                               [r.name for r in reads] + [axis.name], node.device,
                               T=dtype, N=len(reads), Tidx=tf.int32)
        if p.axis == 0:
            return reads + [axis], joined
        shape = emit.const(f"{scope}/shape", list(var.shape), tf.int32, node.device)
        return reads + [axis, joined, shape], emit.node_def(
            node.name, "Reshape", [joined.name, shape.name], node.device, T=dtype,
            Tshape=tf.int32)
    if op == "VariableShape":
        out_type = node.attr["out_type"].type if "out_type" in node.attr else tf.int32
        return [], emit.const(node.name, list(var.shape), tf.as_dtype(out_type), node.device)
    if op == "VarIsInitializedOp":
        return [], emit.node_def(node.name, op, [part(var.name, 0)] + controls, node.device)
    if op in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
        cut, pieces = _cut(_tensor(data[1]), p, dtype, node.device, scope)
        writes = []
        for k, s in enumerate(p.shards):
            nd = emit.like(node, f"{scope}/part_{k}", s.device)
            nd.input.extend([part(var.name, k), pieces[k]] + controls)
            writes.append(nd)
        return cut + writes, _after(node, writes)
    if p.axis == 0 and op == "ResourceGather":
        return _gather(node, data, controls, p, var.name, dtype, scope)
    if p.axis == 0 and op.startswith(("ResourceScatter", "ResourceSparseApply")):
        return _sparse_write(node, data, controls, p, sharded, scope)
    if p.axis is None and op.startswith("ResourceApply"):
        return _dense_apply(node, data, controls, p, sharded, var, scope)
    raise GraphError(f"{node.name!r} ({op}) takes the handle of variable {var.name!r}, "
                     f"which the plan shards by {'rows' if p.axis == 0 else 'elements'}; "
                     "shard_variables cannot cut that op")


def _cut(value: str, p, dtype, device: str, scope: str):
    """(nodes, one tensor per shard): `value` cut like the variable."""
    nodes = []
    if p.axis is None:
        flat = emit.const(f"{scope}/flat", [-1], tf.int32, device)
        nodes += [flat, emit.node_def(f"{scope}/flatten", "Reshape", [value, flat.name],
                                      device, T=dtype, Tshape=tf.int32)]
        value = f"{scope}/flatten"
    sizes = emit.const(f"{scope}/sizes", [s.size for s in p.shards], tf.int64, device)
    axis = emit.const(f"{scope}/axis", 0, tf.int32, device)
    cut = emit.node_def(f"{scope}/split", "SplitV", [value, sizes.name, axis.name], device,
                        T=dtype, Tlen=tf.int64, num_split=len(p.shards))
    return nodes + [sizes, axis, cut], [f"{cut.name}:{k}" for k in range(len(p.shards))]


def _tensor(ref) -> str:
    src, idx = ref
    return src if idx == 0 else f"{src}:{idx}"


def _after(node, ops) -> object:
    return emit.node_def(node.name, "NoOp", [f"^{o.name}" for o in ops], node.device)


def _bucket(indices, p):
    """(range of each index, index within its range), exact for any int."""
    starts = tf.constant([s.start for s in p.shards], indices.dtype)
    which = tf.reduce_sum(tf.cast(indices[:, None] >= starts[None, 1:], tf.int32), 1)
    return which, indices - tf.gather(starts, which)


def _gather(node, data, controls, p, var, dtype, scope):
    ids_ref = _tensor(data[1])
    ids_type = tf.as_dtype(node.attr["Tindices"].type)
    n = len(p.shards)

    def lookup(ids, *handles):
        flat = tf.reshape(ids, [-1])
        which, local = _bucket(flat, p)
        positions = tf.dynamic_partition(tf.range(tf.size(flat)), which, n)
        wanted = tf.dynamic_partition(local, which, n)
        rows = []
        for k, s in enumerate(p.shards):
            with tf.device(s.device):
                rows.append(tf.raw_ops.ResourceGather(resource=handles[k], indices=wanted[k],
                                                      dtype=dtype))
        got = tf.dynamic_stitch(positions, rows)
        return tf.reshape(got, tf.concat([tf.shape(ids), tf.shape(got)[1:]], 0))

    inputs = [(ids_ref, ids_type, None)] + [(part(var, k), tf.resource, [])
                                            for k in range(n)]
    nodes, (out,) = emit.emit_traced(lookup, inputs, scope, node.device)
    return _with_controls(nodes, controls), emit.node_def(
        node.name, "Identity", [out], node.device, T=dtype)


def _arg_positions(node, data) -> dict[str, int]:
    from tensorflow.python.framework import op_def_registry
    args = [a.name for a in op_def_registry.get(node.op).input_arg]
    if len(args) != len(data):
        raise GraphError(f"{node.name!r} ({node.op}) has list inputs; shard_variables "
                         "cannot cut it")
    return {a: i for i, a in enumerate(args)}


def _sparse_write(node, data, controls, p, sharded, scope):
    """ResourceScatter*(var, indices, updates) or ResourceSparseApply*(var,
    slots..., scalars..., grad, indices, ...): one op per row range."""
    pos = _arg_positions(node, data)
    rows_arg = "updates" if "updates" in pos else "grad"
    rows_ref, idx_ref = _tensor(data[pos[rows_arg]]), _tensor(data[pos["indices"]])
    rows_type = tf.as_dtype(node.attr["dtype" if rows_arg == "updates" else "T"].type)
    idx_type = tf.as_dtype(node.attr["Tindices"].type)
    n = len(p.shards)

    def bucket(rows, indices):
        which, local = _bucket(indices, p)
        return (tf.dynamic_partition(rows, which, n) + tf.dynamic_partition(local, which, n))

    nodes, outs = emit.emit_traced(bucket, [(rows_ref, rows_type, None),
                                            (idx_ref, idx_type, [None])], scope, node.device)
    cut = {pos[rows_arg]: outs[:n], pos["indices"]: outs[n:]}
    writes = _per_part(node, data, controls, p, sharded, cut, scope)
    return _with_controls(nodes, controls) + writes, _after(node, writes)


# The argument of a dense ResourceApply* that carries the gradient; every
# other non-resource argument is a scalar (learning rate, decay, beta powers).
GRADIENT_ARGS = ("grad", "delta")


def _dense_apply(node, data, controls, p, sharded, var, scope):
    """ResourceApply*(var, slots..., scalars..., grad): element-wise, so each
    part applies to its elements of the variable, slots and gradient."""
    pos = _arg_positions(node, data)
    grads = [i for a, i in pos.items() if a in GRADIENT_ARGS]
    if len(grads) != 1:
        raise GraphError(f"{node.name!r} ({node.op}) has no single gradient argument "
                         f"({'/'.join(GRADIENT_ARGS)}); shard_variables cannot cut it")
    nodes, pieces = _cut(_tensor(data[grads[0]]), p, var.dtype.base_dtype, node.device,
                         f"{scope}/grad")
    writes = _per_part(node, data, controls, p, sharded, {grads[0]: pieces}, scope)
    return nodes + writes, _after(node, writes)


def _per_part(node, data, controls, p, sharded, cut: dict, scope: str):
    """One copy of `node` per shard on its device: sharded handles by their
    part k, inputs in `cut` by their piece k, the rest as they are; then the
    caller adds the NoOp that keeps `node`'s name."""
    writes = []
    for k, s in enumerate(p.shards):
        nd = emit.like(node, f"{scope}/part_{k}", s.device)
        for i, (src, idx) in enumerate(data):
            if src in sharded:
                nd.input.append(part(src, k))
            elif i in cut:
                nd.input.append(cut[i][k])
            else:
                nd.input.append(_tensor((src, idx)))
        nd.input.extend(controls)
        writes.append(nd)
    return writes


def _with_controls(nodes, controls):
    """The original op's control inputs, on the traced ops that have no inputs."""
    if controls:
        for nd in nodes:
            if not nd.input:
                nd.input.extend(controls)
    return nodes
