"""Part writes: in a job, a run that writes a table cut by columns ends
only once every worker has made that write.

Requires: `columns` (every replica's part of such a table), after every
pass that adds writers of the parts (`prefetch`); a multi-worker job whose
backend reads other workers' parts directly (`reaches_parts`: TensorFlow's
collectives; Horovod's backend all-gathers the parts in every worker's run
instead, which orders itself).
Why: each worker writes its own replicas' parts, and a worker's run
otherwise ends when its own writes are done. A worker that finished first
could then read another worker's part before that worker's write landed: a
fetch of the whole table, a checkpoint worker 0 writes alone, the next
step's read of the whole table (a tied layer) would see the part one
step old, or uninitialized after the initializer's run.
Guarantees, on every local replica, for each write to the replica's parts
that no other write to them follows (a step's last one: the update of the
table after its slots; each initializer; a restore of a user Saver): the
write is renamed `<name>/write`, and `<name>` becomes a NoOp that waits
for it and for a scalar all-reduce over the job's replicas that waits for
it too (`parallax/part_writes/<i>/replica_<k>`). Whatever ran `<name>` (the
user's train op, the initializer's group) has then waited for that write
on every worker; the write itself waits for nothing more. Each write's
all-reduce has its own instance key, taken in the order of the writes'
names with the replica left out, so every worker's graph pairs the same
writes (every worker runs the same runs, as a synchronous job must).
Writes made outside the graph (the runner's checkpoint restore) meet at
`ColumnParts.meet`: an all-reduce every worker runs, as a run of its own,
after them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import tensorflow as tf

from parallax_ng.errors import GraphError
from parallax_ng.graph import emit, rules
from parallax_ng.graph.ir import GraphIR, copy_node
from parallax_ng.pipeline.passes import replica_of
from parallax_ng.pipeline.results import ColumnParts

SCOPE = "parallax/part_writes"
MEET = f"{SCOPE}/meet"
_REPLICA = re.compile(r"(?<=/)replica_\d+(?=/)")


@dataclass(frozen=True)
class PartWritesPass:
    name: str = "part_writes"
    requires: tuple = ("columns",)
    after: tuple = ("prefetch", "horizontal")

    def run(self, ir: GraphIR, ctx):
        parts = ctx.result(ColumnParts)
        if ctx.plan.num_workers < 2 or parts is None or parts.gather:
            return ir, {"writes_met": 0}
        changed, added = {}, []
        for i, (what, writes) in enumerate(sorted(last_writes(ir, ctx, parts).items())):
            scope = f"{SCOPE}/{i}"
            made, met = _all_reduce(ctx, scope, [[f"^{w}/write"] for w in writes])
            added += made
            for w, done in zip(writes, met):
                old = ir.node(w)
                if any(not x.startswith("^") and x.split(":")[0] == w
                       for c in ir.node_consumers.get(w, ()) for x in ir.node(c).input):
                    raise GraphError(f"{what!r} writes a part of a table cut by columns and "
                                     "its output is read; use ps or allgather for the table")
                write = copy_node(old)
                write.name = f"{w}/write"
                added.append(write)
                changed[w] = emit.node_def(w, "NoOp", [f"^{write.name}", f"^{done}"],
                                           old.device)
        made, met = _all_reduce(ctx, MEET, [[] for _ in range(ctx.plan.num_replicas)])
        added += made + [emit.node_def(MEET, "NoOp", [f"^{m}" for m in met],
                                       ctx.plan.devices[0])]
        ctx.publish(replace(parts, meet=MEET))
        return ir.replace(changed, added), {"writes_met": len(changed)}


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


def _all_reduce(ctx, scope: str, controls: list[list[str]]):
    """(nodes, one name per local replica): a scalar all-reduce over the
    job's replicas, replica k's input waiting for `controls[k]`."""
    ones = []
    for k, (before, device) in enumerate(zip(controls, ctx.plan.devices)):
        one = emit.const(f"{scope}/one_{k}", 1.0, tf.float32, device)
        one.input.extend(before)
        ones.append(one)
    made, met = ctx.comm.all_reduce(scope, [o.name for o in ones], tf.float32, mean=False)
    return ones + made, met
