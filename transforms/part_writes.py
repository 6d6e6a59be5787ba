"""Part writes: in a job, every replica counts its writes to its parts of
tables cut by columns, so a worker can wait for the others' before it
reads their parts.

Requires: `columns` (every replica's part of such a table), after every
pass that adds writers of the parts (`prefetch`); a multi-worker job whose
backend reads other workers' parts directly (`reaches_parts`: TensorFlow's
collectives; a backend that reaches other processes only by collectives
all-gathers the parts in every worker's run
instead, which orders itself).
Why: each worker writes its own replicas' parts, and a worker's run ends
when its own writes are done. A worker that finished first could then read
another worker's part before that worker's write landed: a fetch of the
whole table or a checkpoint worker 0 writes alone would see the part one
step old (or uninitialized after the initializers' run). A training step
needs no wait: it reads only its replicas' own parts, and no worker writes
a part before every worker has entered the step (`columns`).
Guarantees, on every local replica, for each write to the replica's parts
that no other write to them follows (a step's last one: the update of the
table after its slots; each initializer; a restore of a user Saver): the
write is renamed `<name>/write`, and `<name>` becomes a NoOp that waits for
it and for `<name>/counted`, which adds 1 to the replica's count (an int64
variable on its device, `parallax/part_writes/count_<job replica>`, under
a shared name of this graph's, so other workers' graphs read it). Whatever
ran `<name>` has counted the write; the write waits for nothing more, so
a step costs one local add per such write. The pass publishes
`PartsWritten` (every job replica's count, read on its device, and the
variables cut so); the runtime waits on them
(parallax_ng/runtime/executor.py). Writes made outside the graph (the
checkpoint's restore) meet at `PartsWritten.meet`: an all-reduce every
worker runs, as a run of its own, after them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.errors import GraphError
from parallax_ng.graph import emit, rules
from parallax_ng.graph.ir import GraphIR, copy_node
from parallax_ng.pipeline.passes import replica_of
from parallax_ng.pipeline.results import ColumnParts, PartsWritten

SCOPE = "parallax/part_writes"
MEET = f"{SCOPE}/meet"
START = f"{SCOPE}/start"
_REPLICA = re.compile(r"(?<=/)replica_\d+(?=/)")


@dataclass(frozen=True)
class PartWritesPass:
    name: str = "part_writes"
    requires: tuple = ("columns",)
    after: tuple = ("prefetch", "horizontal")

    def run(self, ir: GraphIR, ctx):
        plan, parts = ctx.plan, ctx.result(ColumnParts)
        if plan.num_workers < 2 or parts is None or parts.gather:
            return ir, {"writes_counted": 0}
        devices = [s.device for s in next(iter(plan.columns().values())).shards]
        added, counts = [], []
        for j, device in enumerate(devices):
            handle = emit.node_def(f"{SCOPE}/count_{j}", "VarHandleOp", [], device,
                                   dtype=tf.int64, container="",
                                   shared_name=ctx.instance_keys.shared(f"{SCOPE}/count_{j}"))
            handle.attr["shape"].shape.CopyFrom(tf.TensorShape([]).as_proto())
            read = emit.node_def(f"{SCOPE}/read_{j}", "ReadVariableOp", [handle.name], device,
                                 dtype=tf.int64)
            added += [handle, read]
            counts.append(read.name)
        mine = plan.replica_offset
        starts = []
        for k in range(plan.num_replicas):
            zero = emit.const(f"{SCOPE}/zero_{k}", 0, tf.int64, plan.devices[k])
            added += [zero, emit.node_def(f"{SCOPE}/start_{k}", "AssignVariableOp",
                                          [f"{SCOPE}/count_{mine + k}", zero.name],
                                          plan.devices[k], dtype=tf.int64),
                      emit.const(f"{SCOPE}/one_{k}", 1, tf.int64, plan.devices[k])]
            starts.append(f"^{SCOPE}/start_{k}")
        added.append(emit.node_def(START, "NoOp", starts, plan.devices[0]))
        changed = {}
        for what, writes in sorted(last_writes(ir, ctx, parts).items()):
            for k, w in enumerate(writes):
                old = ir.node(w)
                if any(not x.startswith("^") and x.split(":")[0] == w
                       for c in ir.node_consumers.get(w, ()) for x in ir.node(c).input):
                    raise GraphError(f"{what!r} writes a part of a table cut by columns and "
                                     "its output is read; use ps or allgather for the table")
                write = copy_node(old)
                write.name = f"{w}/write"
                counted = emit.node_def(f"{w}/counted", "AssignAddVariableOp",
                                        [f"{SCOPE}/count_{mine + k}", f"{SCOPE}/one_{k}",
                                         f"^{write.name}"], old.device, dtype=tf.int64)
                added += [write, counted]
                changed[w] = emit.node_def(w, "NoOp", [f"^{write.name}", f"^{counted.name}"],
                                           old.device)
        ones = [emit.const(f"{MEET}/one_{k}", 1.0, tf.float32, d)
                for k, d in enumerate(plan.devices)]
        made, met = ctx.comm.all_reduce(MEET, [o.name for o in ones], tf.float32, mean=False)
        added += ones + made + [emit.node_def(MEET, "NoOp", [f"^{m}" for m in met],
                                              plan.devices[0])]
        ctx.publish(PartsWritten(tuple(counts), mine, START, frozenset(parts.handles), MEET))
        return ir.replace(changed, added), {"writes_counted": len(changed)}


def last_writes(ir: GraphIR, ctx, parts: ColumnParts) -> dict[str, list[str]]:
    """{a write's name with the replica left out: its node on each local
    replica} for the writes to a replica's parts that no other write to
    them follows."""
    out: dict[str, list] = {}
    for k in range(ctx.plan.num_replicas):
        mine = {ctx.replica_name(k, state) for state in parts.handles}
        writes = [n.name for n in ir.nodes if rules.is_writer(n.op) and ir.data_inputs(n.name)
                  and ir.data_inputs(n.name)[0].node in mine]
        for w in writes:
            later = ir.descendants([w]) - {w}
            if not any(o in later for o in writes):
                out.setdefault(_REPLICA.sub("replica", replica_of(w)[1]), []).append(w)
    uneven = sorted(w for w, nodes in out.items() if len(nodes) != ctx.plan.num_replicas)
    if uneven:
        raise GraphError(f"the replicas write parts of tables cut by columns unlike each "
                         f"other: {uneven[:3]} is not on every replica")
    return out
