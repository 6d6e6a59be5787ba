"""Which replicas' copies of a user op a run must run, and the copies of ops
the user makes after get_runner.

A fetch whose value is the same on every replica is read from replica 0's
copy, except where running it writes state the replicas hold apart: an
assign to a learning-rate variable each replica keeps (PTB's
`sess.run(lr_update, {new_lr: v})`), a counter's `assign_add`. Then every
replica's copy runs, or the others would train on with the old value,
silently.

Requires: the ReplicaFetchMap (parallax_ng/runtime/fetches.py): the user's
graph, the step graph and `copy_name(k, node)`, replica k's copy of a user
node.
Guarantees: `writes_apart(fmap, node)` says whether running user node
`node` writes a variable (resource or reference) through an op that has
a copy per replica. `adopt(fmap, new)` copies the new user ops `new` (made
after get_runner: a later initializer, a `tf.assign(lr, ...)` built in the
training loop) into the step graph: once per replica where an op reads
something the replicas hold apart (their placeholders, replicated
variables, per-replica values), else once, so that an op on state that
exists once (a variable on a server) runs once, and so does an op that
writes a file (a Saver made late saves replica 0's); an op colocated with a
variable goes to the device of that variable's copy. A new op on a
variable the plan cuts into parts (columns over the replicas, rows over
servers) reads it whole (the parts side by side; a gather, rows of that),
writes a whole value as each part's piece, or gives its shape or whether
it is initialized; any other such op is refused, naming it. It returns each new op's copies by
replica, and the new ops whose values differ across the replicas.
"""
from __future__ import annotations

import itertools

import tensorflow as tf

from .. import compat
from ..errors import FetchError
from ..graph import emit, rules
from ..graph.ir import format_input, parse_input
from ..pipeline.passes import REPLICA_PREFIX
from ..pipeline.results import ColumnParts
from ..planning.placement import Columns, Sharded, part_name

_IMPORTS = itertools.count()


def apart(fmap, node: str) -> bool:
    """Whether the replicas run copies of user node `node` of their own."""
    n = fmap.plan.num_replicas
    return len({fmap.copy_name(k, node) for k in range(n)}) > 1


def writes(op: tf.Operation) -> bool:
    """Whether op writes a variable: a resource writer, or an op that takes
    a reference variable by reference (not one that passes it on)."""
    if rules.is_writer(op.type):
        return True
    if op.type in rules.REF_PASSTHROUGH or op.type in rules.REF_READERS:
        return False
    return any(compat.ref_input_positions(op.type) or ())


def writes_apart(fmap, node: str) -> bool:
    """Whether running user node `node` runs a write (it, or an op it needs)
    that has a copy on each replica."""
    seen, todo = set(), [fmap.user_graph.get_operation_by_name(node)]
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if writes(op) and apart(fmap, op.name):
            return True
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return False


def adopt(fmap, new: dict) -> tuple[dict, set]:
    """Copy the new user ops `new` (name -> op) into fmap's step graph:
    ({name: its copies, one per replica}, names whose values vary)."""
    order = [o for o in fmap.user_graph.get_operations() if o.name in new]
    own, variant = set(), set()       # new ops copied per replica; varying ones
    for o in order:
        ins = [t.op.name for t in o.inputs]
        if any(i in variant if i in new else fmap.varies(i) for i in ins):
            variant.add(o.name)
        if o.type not in rules.EXTERNAL_EFFECT_OPS and \
                any(i in own if i in new else apart(fmap, i)
                    for i in ins + [c.name for c in o.control_inputs]):
            own.add(o.name)          # (a file written, as a Saver's, is written once)
    copies: dict[str, list[str]] = {}
    for k, device in enumerate(fmap.plan.devices):
        _import(fmap, order if k == 0 else [o for o in order if o.name in own],
                new, copies, k, device)
    n = fmap.plan.num_replicas
    return {name: names * n if len(names) == 1 else names
            for name, names in copies.items()}, variant


def _import(fmap, ops: list, new: dict, copies: dict, k: int, device: str) -> None:
    """Replica k's copies of `ops` (in the order they were made); a new op
    not among them is read from the copy made for replica 0."""
    scope = f"parallax/late_{next(_IMPORTS)}"
    here = {o.name for o in ops}
    gd, input_map, controls = tf.compat.v1.GraphDef(), {}, {}

    def there(src: str) -> str:      # an op's copy the import reads, by its step-graph name
        return copies[src][0] if src in new else fmap.copy_name(k, src)

    for o in ops:
        nd = gd.node.add()
        nd.CopyFrom(o.node_def)
        nd.name = _late_name(k, o.name)
        nd.device = _device(fmap, o, k, device, new)
        if "_class" in nd.attr:     # colocation: kept by the device above
            del nd.attr["_class"]
        del nd.input[:]
        for text in o.node_def.input:
            src, idx, control = parse_input(text)
            if src in here:
                nd.input.append(format_input(_late_name(k, src), idx))
            elif control:
                controls.setdefault(nd.name, []).append(there(src))
            else:
                input_map[f"{src}:{idx}"] = fmap.graph.get_tensor_by_name(
                    f"{there(src)}:{idx}")
                nd.input.append(f"{src}:{idx}")
        _on_parts(fmap, o, nd, k, gd, input_map, controls)
    used = {f"{src}:{idx}" for n in gd.node for src, idx, control in map(parse_input, n.input)
            if not control}
    with fmap.graph.as_default():       # (a handle _on_parts read through parts is unused)
        tf.graph_util.import_graph_def(
            gd, input_map={t: v for t, v in input_map.items() if t in used}, name=scope)
    for name, deps in controls.items():
        compat.add_control_inputs(fmap.graph.get_operation_by_name(f"{scope}/{name}"),
                                  [fmap.graph.get_operation_by_name(d) for d in deps])
    for o in ops:
        copies.setdefault(o.name, []).append(f"{scope}/{_late_name(k, o.name)}")


# reads of a resource variable: its whole value, or rows of it (input 1 the ids)
_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})
# writes of a whole value to a resource variable (input 0 its handle, 1 the value)
_WHOLE_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})


def _on_parts(fmap, op: tf.Operation, nd, k: int, gd, input_map: dict,
              controls: dict) -> None:
    """A late op on a variable the plan cuts into parts (by columns over the
    replicas: alltoall; by rows or elements over servers): a read of the
    whole value reads every part, side by side (a gather, its rows of
    that); a write of a whole value writes each part its piece (replica
    k's copy its columns); any other use is refused, naming it. (Before,
    such an op reached replica 0's columns or a handle no step uses, and
    gave or kept a part silently.)"""
    var = op.inputs[0].op.name if op.inputs and op.inputs[0].dtype == tf.resource else None
    placement = fmap.plan.placement.get(var)
    if not isinstance(placement, (Columns, Sharded)):
        return
    dtype, whole = op.inputs[0].op.get_attr("dtype"), op.inputs[0].op.get_attr("shape")
    if isinstance(placement, Columns):
        parts = fmap.ctx.result(ColumnParts)
        handles = None if parts is None or parts.gather else parts.handles[var]
        axis = 1
    else:
        handles = [part_name(var, j) for j in range(len(placement.shards))]
        axis = 0
    scope = f"{nd.name}/parts"
    if handles is not None:     # the parts' handles, by names of the import's own
        keys = [f"{scope}/handle_{j}:0" for j in range(len(handles))]
        input_map.update({key: fmap.graph.get_tensor_by_name(h + ":0")
                          for key, h in zip(keys, handles)})
        handles = [key[:-2] for key in keys]
    if op.type in _READS and handles is not None:
        def joined(*hs):
            value = tf.concat([tf.raw_ops.ReadVariableOp(resource=h, dtype=dtype)
                               for h in hs], axis)
            return tf.reshape(value, whole) if getattr(placement, "axis", 0) is None \
                else value

        def read(*args):        # the whole value, or its rows the gather asks for
            if op.type == "ReadVariableOp":
                return joined(*args)
            if op.type == "ResourceGatherNd":
                return tf.gather_nd(joined(*args[1:]), args[0])
            return tf.gather(joined(*args[1:]), args[0], batch_dims=op.get_attr("batch_dims"))
        ids = [] if op.type == "ReadVariableOp" else [(nd.input[1], op.inputs[1].dtype, None)]
        made, (out,) = emit.emit_traced(read, ids + [(h + ":0", tf.resource, None)
                                                     for h in handles], scope, nd.device)
    elif op.type in _WHOLE_WRITES and isinstance(placement, Columns):
        shard = placement.shards[fmap.plan.replica_offset + k]
        made, (out,) = emit.emit_traced(
            lambda t: t[..., shard.start:shard.start + shard.size],
            [(nd.input[1], dtype, None)], scope, nd.device)
        gd.node.extend(made)
        nd.input[1] = out
        return
    elif op.type in ("VariableShape", "VarIsInitializedOp") and handles is not None:
        def asked(*hs):
            if op.type == "VariableShape":
                return tf.constant(whole.as_list(), op.get_attr("out_type"))
            return tf.reduce_all(tf.stack([tf.raw_ops.VarIsInitializedOp(resource=h)
                                           for h in hs]))
        made, (out,) = emit.emit_traced(asked, [(h + ":0", tf.resource, None)
                                                for h in handles], scope, nd.device)
    elif op.type in _WHOLE_WRITES:
        def pieces(value, *hs):
            flat = value if placement.axis == 0 else tf.reshape(value, [-1])
            split = tf.split(flat, [s.size for s in placement.shards], 0)
            return [tf.group(*[getattr(tf.raw_ops, op.type)(resource=h, value=piece)
                               for h, piece in zip(hs, split)])]
        made, (out,) = emit.emit_traced(pieces, [(nd.input[1], dtype, None)] + [
            (h + ":0", tf.resource, None) for h in handles], scope, nd.device)
    else:
        raise FetchError(
            f"{op.name!r} ({op.type}) was made after get_runner and uses variable {var!r}, "
            f"which the plan cuts into parts ({placement.describe()}); an op made after "
            "get_runner may read such a variable whole (read_value) or its rows (tf.gather, "
            "embedding_lookup), assign it whole "
            "(tf.assign, assign_add, assign_sub), or ask its shape or whether it is "
            "initialized; make this op before get_runner, where the plan sees it")
    waits = [t for t in nd.input if t.startswith("^")]     # the op's control inputs
    for m in made:              # hold for the parts' reads and writes too
        if m.op in ("ReadVariableOp", "VarIsInitializedOp") or m.op in _WHOLE_WRITES:
            m.input.extend(waits)
            if nd.name in controls:
                controls[m.name] = list(controls[nd.name])
    gd.node.extend(made)
    nd.attr.clear()
    if op.type not in _WHOLE_WRITES:    # its value, by its name
        nd.op, nd.input[:] = "Identity", [out] + waits
        nd.attr["T"].type = op.outputs[0].dtype.as_datatype_enum
    else:
        nd.op, nd.input[:] = "NoOp", ["^" + out.split(":")[0]] + waits


def _device(fmap, op: tf.Operation, k: int, device: str, new: dict) -> str:
    """Replica k's device, or that of the variable copy `op` is colocated
    with (an assign to a variable on a server runs there)."""
    for loc in op.colocation_groups():
        target = loc.decode().removeprefix("loc:@")
        if target not in new and target != op.name:
            try:
                return fmap.graph.get_operation_by_name(fmap.copy_name(k, target)).device
            except KeyError:
                break
    return device


def _late_name(k: int, name: str) -> str:
    return name if k == 0 else REPLICA_PREFIX.format(k) + name
