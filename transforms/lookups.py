"""Lookups of a server's variable: where the gather runs, and how many rows
cross.

LookupsOnServersPass (Parallax 5.3.2, a boundary move; the plan's
`rewrites.lookups_on_servers`). Requires: `place`. Guarantees: a gather of
a whole read of a shared variable (a reference variable's lookup is built
so: GatherV2 of its `read`; also tf.gather(var.read_value(), ids)), the
reads in between and the ops only it uses run on the variable's server,
every replica's copy alike, so the rows cross the network and not the
table. (A ResourceGather takes the handle: `place` puts it there already.)

DistinctLookupsPass: a worker fetches each distinct row of a server's
variable once per step, however many of its replicas' ids name it.

Requires: `place` (lookups of shared variables run with the variable,
parallax_ng/planning/coalescing.py `lookups`); a job with parameter servers; runs
before `shard_variables`, which cuts the one gather that is left by row
range.
Guarantees: for every lookup of a variable on the servers, the ids of all
the worker's replicas are flattened and made distinct on the worker's host
(Unique); one gather on the server (the host for a sharded variable, whose
parts are then gathered on their servers) reads each distinct row once;
one copy of those rows comes to the host, and replica k's lookup, under its
own name and on its own device, gathers its rows from that copy at the
positions Unique gave, shaped like its ids. The values are exactly the
lookup's; the gradient, built from the ids, is untouched. Control inputs of
every replica's lookup go to the one gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.graph import emit
from parallax_ng.graph.ir import GraphIR, format_input
from parallax_ng.planning.coalescing import lookups
from parallax_ng.planning.placement import Sharded
from transforms.place import move, server_side

SCOPE = "parallax/lookups"


@dataclass(frozen=True)
class LookupsOnServersPass:
    name: str = "lookups_on_servers"
    requires: tuple = ("place",)
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        out, moved = move(ir, ctx, server_side(ctx, lookups_too=True, updates=False))
        return out, {"moved": moved}


@dataclass(frozen=True)
class DistinctLookupsPass:
    name: str = "distinct_lookups"
    requires: tuple = ("place",)
    after: tuple = ("server_sync", "lookups_on_servers")

    def run(self, ir: GraphIR, ctx):
        added, changed, rows = [], {}, 0
        for var in sorted(ctx.plan.shared_state()):
            for lookup in lookups(ctx.tg, var):
                nodes, replaced = _distinct(ir, ctx, var, lookup.op)
                added += nodes
                changed.update(replaced)
                rows += 1
        return (ir.replace(changed, added) if rows else ir), {"lookups": rows}


def _distinct(ir: GraphIR, ctx, var: str, op: str):
    """(new nodes, replaced replica lookups) for user lookup `op` of `var`."""
    plan = ctx.plan
    n, host, scope = plan.num_replicas, plan.host, f"{SCOPE}/{op}"
    copies = [ir.node(ctx.replica_name(k, op)) for k in range(n)]
    first = copies[0]
    ids_type = tf.as_dtype(first.attr["Tindices"].type)
    dtype = tf.as_dtype(first.attr["dtype" if first.op == "ResourceGather" else "Tparams"].type)
    ids, controls = [], []
    for nd in copies:
        parsed = ir.parsed_inputs(nd)
        ids.append(format_input(*[(s, i) for s, i, c in parsed if not c][1]))
        controls += [format_input(s, -1) for s, _, c in parsed if c]
    shape_of = lambda k: f"{scope}/ids_shape_{k}"   # noqa: E731
    flat = emit.const(f"{scope}/flat", [-1], tf.int32, host)
    nodes = [flat]
    for k, t in enumerate(ids):
        nodes += [emit.node_def(f"{scope}/ids_{k}", "Reshape", [t, flat.name], host,
                                T=ids_type, Tshape=tf.int32),
                  emit.node_def(shape_of(k), "Shape", [t], host, T=ids_type,
                                out_type=tf.int32)]
    every = f"{scope}/ids_0"
    if n > 1:
        axis = emit.const(f"{scope}/axis", 0, tf.int32, host)
        nodes += [axis, emit.node_def(f"{scope}/ids", "ConcatV2",
                                      [f"{scope}/ids_{k}" for k in range(n)] + [axis.name],
                                      host, T=ids_type, N=n, Tidx=tf.int32)]
        nodes += [emit.node_def(f"{scope}/size_{k}", "Size", [f"{scope}/ids_{k}"], host,
                                T=ids_type, out_type=tf.int32) for k in range(n)]
        nodes.append(emit.node_def(f"{scope}/sizes", "Pack",
                                   [f"{scope}/size_{k}" for k in range(n)], host,
                                   T=tf.int32, N=n, axis=0))
        every = f"{scope}/ids"
    nodes.append(emit.node_def(f"{scope}/unique", "Unique", [every], host, T=ids_type,
                               out_idx=tf.int32))
    gather = emit.like(first, f"{scope}/rows",
                       host if isinstance(plan.placement[var], Sharded) else first.device)
    gather.input.extend([first.input[0], f"{scope}/unique", *first.input[2:]])
    gather.input[:] = [i for i in gather.input if not i.startswith("^")]
    gather.input.extend(sorted(set(controls)))
    nodes += [gather, emit.node_def(f"{scope}/local", "Identity", [gather.name], host, T=dtype)]
    positions = [f"{scope}/unique:1"]
    if n > 1:
        nodes.append(emit.node_def(f"{scope}/positions", "SplitV",
                                   [f"{scope}/unique:1", f"{scope}/sizes", f"{scope}/axis"],
                                   host, T=tf.int32, Tlen=tf.int32, num_split=n))
        positions = [format_input(f"{scope}/positions", k) for k in range(n)]
    zero = emit.const(f"{scope}/zero", 0, tf.int32, host)
    nodes.append(zero)
    replaced = {}
    for k, nd in enumerate(copies):
        nodes.append(emit.node_def(f"{scope}/at_{k}", "Reshape", [positions[k], shape_of(k)],
                                   host, T=tf.int32, Tshape=tf.int32))
        replaced[nd.name] = emit.node_def(
            nd.name, "GatherV2", [f"{scope}/local", f"{scope}/at_{k}", zero.name],
            plan.devices[k], Tparams=dtype, Tindices=tf.int32, Taxis=tf.int32, batch_dims=0)
    return nodes, replaced
