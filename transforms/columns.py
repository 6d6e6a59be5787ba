"""Columns: each replica holds its columns of a table the plan cuts by columns.

Requires: replicas made by `replicate`, placed; the plan's `Columns`
placements (method alltoall and its slots; the planner checked every use
with parallax_ng/planning/column_cut.py); runs after `init`, so an initializer writes
the value every replica agreed on.
Guarantees, for every replica k (job index j) and every use the analysis
found (`Facts.column_uses`):
- replica k's copy of the table and of each slot of its shape is a
  variable of the replica's columns only ([rows, width of part j]);
- a lookup whose rows the model reads gives full rows, by the backend's
  exchange (`comm.columns_lookup`: the replicas' ids gathered, each replica
  looks up its columns for all of them, one AlltoAll; with the plan's
  `distinct_lookups`, each distinct id of a replica once);
- a read of the whole value (a fetch, a tied layer) reads every replica's
  part, on other workers too, and puts them side by side (the backend's
  `join_columns`: an all-gather where other processes' parts are out of
  the graph's reach);
- a write of a whole-width value (an initializer, a restore) writes the
  replica's columns of it; VariableShape gives the whole shape.
The update ops and the reads feeding them stay as they are: they act on
the replica's columns element by element or row by row; a write among them
that would run before the step's first collective (Adam's decay of its
moments) waits for the data of the write it precedes, so no worker's parts
change before all have entered the step. The pass publishes
`ColumnParts`: the handle of every part of every such variable in this
worker's graph (its own replicas', and the other workers' by shared name).
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.comm.collectives import join_parts
from parallax_ng.errors import GraphError
from parallax_ng.graph import emit, rules
from parallax_ng.graph.ir import GraphIR, copy_node
from parallax_ng.methods import method
from parallax_ng.pipeline.results import ColumnParts, ExchangedLookups


@dataclass(frozen=True)
class ColumnsPass:
    name: str = "columns"
    requires: tuple = ("replicate", "aggregate")
    after: tuple = ("place", "init")

    def run(self, ir: GraphIR, ctx):
        plan, tg = ctx.plan, ctx.tg
        parts = plan.columns()
        cut = sorted(v for v, vp in plan.variables.items() if method(vp.method).columns)
        changed, added, handles = {}, [], {}
        for state, part in sorted(parts.items()):
            handles[state] = _handles(ir, ctx, state, part, added)
        counts = {"lookups": 0, "whole_reads": 0, "cut_writes": 0}
        for var in cut:
            uses = ctx.facts.column_uses(var)
            part = parts[var]
            for k in range(plan.num_replicas):
                me = plan.replica_offset + k
                for s in uses.state:
                    nd = changed[ctx.replica_name(k, s)] = copy_node(
                        ir.node(ctx.replica_name(k, s)))
                    shape = [tg.variables[s].shape[0], part.shards[me].size]
                    nd.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
                for op in uses.whole_reads:
                    name = ctx.replica_name(k, op)
                    state = tg.variable_of_handle(tg.ir.data_inputs(op)[0])
                    old = ir.node(name)
                    *made, changed[name] = ctx.comm.join_columns(
                        name, handles[state], parts[state], tg.variables[state].dtype.base_dtype,
                        old.device, [i for i in old.input if i.startswith("^")])
                    added.extend(made)
                for op, branches in uses.selects.items():
                    name = ctx.replica_name(k, op)
                    changed[name] = _select(ir, ctx, ir.node(name), op, branches, handles, parts,
                                            None if op in uses.whole_selects else
                                            part.shards[me], added)
                for w, pos in uses.cut:
                    name = ctx.replica_name(k, w)
                    nd = changed.get(name) or copy_node(ir.node(name))
                    changed[name] = _cut_input(nd, pos, part.shards[me], tg, added)
                for op in uses.shapes:
                    name = ctx.replica_name(k, op)
                    old = ir.node(name)
                    out_type = old.attr["out_type"].type if "out_type" in old.attr else tf.int32
                    changed[name] = emit.const(name, list(tg.variables[var].shape),
                                               tf.as_dtype(out_type), old.device)
            for op in uses.lookups:
                _lookup(ir, ctx, op, part, changed, added)
            counts["lookups"] += len(uses.lookups)
            counts["whole_reads"] += len(uses.whole_reads)
            counts["cut_writes"] += len(uses.cut)
        counts["writes_held"] = _writes_after_exchange(ir, ctx, cut, changed)
        ctx.publish(ColumnParts({s: tuple(h) for s, h in handles.items()},
                                gather=not ctx.comm.reaches_parts))
        return ir.replace(changed, added), counts


def _writes_after_exchange(ir, ctx, cut: list[str], changed: dict) -> int:
    """A write to a replica's columns that waits for no collective of the
    step (Adam's m <- beta1 * m, which precedes its scatter-add of the
    gradient rows by a control edge) waits for the input of the write it
    precedes that does: no worker's columns then change before every worker
    has entered the step, so while worker 0 is between steps the other
    workers' parts hold the last step's values (its checkpoints, a Saver
    and whole reads read them there). Returns how many writes it held."""
    collective = [n.name for n in ir.nodes if n.op.startswith(ctx.comm.op_types)]
    after = ir.descendants(collective)
    held = 0
    for k in range(ctx.plan.num_replicas):
        handles = {ctx.replica_name(k, s) for var in cut
                   for s in ctx.facts.column_uses(var).state}
        for node in ir.nodes:
            if node.name in after or not rules.is_writer(node.op):
                continue
            inputs = ir.data_inputs(node.name)
            if not inputs or inputs[0].node not in handles:
                continue
            mine = ir.descendants([node.name])
            waits = sorted({ref.node for later in ir.node_consumers.get(node.name, ())
                            if later in after and rules.is_writer(ir.node(later).op)
                            for ref in ir.data_inputs(later)
                            if ref.node in after and ref.node not in mine})
            if waits:
                nd = changed.get(node.name) or copy_node(node)
                nd.input.extend("^" + w for w in waits if "^" + w not in nd.input)
                changed[node.name] = nd
                held += 1
    return held


def _handles(ir, ctx, state: str, part, added: list) -> list[str]:
    """A handle of every job replica's part of `state`: this worker's copies,
    and for another worker's replica a VarHandleOp on its device with the
    shared name its copy has there (only this worker's copies when the
    backend reaches other processes by collectives alone)."""
    plan = ctx.plan
    user = ctx.tg.ir.node(state)
    out = []
    for j, shard in enumerate(part.shards):
        worker, k = divmod(j, plan.num_replicas)
        if worker == plan.worker:
            out.append(ctx.replica_name(k, state))
            continue
        if not ctx.comm.reaches_parts:
            continue
        name = f"parallax/columns/{state}/part_{j}"
        nd = emit.like(user, name, shard.device)
        nd.attr["shape"].shape.CopyFrom(
            tf.TensorShape([ctx.tg.variables[state].shape[0], shard.size]).as_proto())
        own = user.attr["shared_name"].s.decode() or state
        nd.attr["shared_name"].s = (own if k == 0 else ctx.replica_name(k, state)).encode()
        added.append(nd)
        out.append(name)
    return out


def _select(ir, ctx, old, op: str, branches, handles: dict, parts: dict, mine, added: list):
    """If `old` (replica k's copy of `op`, see columns.Branch) as Switch and
    Merge. With `mine` (the replica's shard: only its columns are used) a
    branch that reads the handle reads the replica's part and one that
    passes a value passes its columns; else the read reads every part and
    joins them, only when its branch is taken."""
    data = [i for i in old.input if not i.startswith("^")]
    controls = [i for i in old.input if i.startswith("^")]
    pred, args = data[0], data[1:]
    scope = f"parallax/columns/{old.name}"
    values = []
    for side, branch in zip((1, 0), branches):       # Switch: output 1 when pred holds
        at = f"{scope}/{'then' if side else 'else'}"
        if branch.kind == "pass":
            dtype = tf.as_dtype(old.attr["Tin"].list.type[branch.arg])
            value = args[branch.arg] if mine is None else _agreed(
                ir, ctx, ctx.tg.ir.data_inputs(op)[1 + branch.arg])
            added.append(emit.node_def(f"{at}/switch", "Switch", [value, pred], old.device,
                                       T=dtype))
            values.append(f"{at}/switch:{side}")
            if mine is not None:
                made, (out,) = emit.emit_traced(
                    lambda t: t[..., mine.start:mine.start + mine.size],
                    [(values[-1], dtype, None)], f"{at}/columns", old.device)
                added.extend(made)
                values[-1] = out
            continue
        state = ctx.tg.variable_of_handle(ctx.tg.ir.data_inputs(op)[1 + branch.arg])
        var = ctx.tg.variables[state]
        if mine is not None:
            added += [emit.node_def(f"{at}/switch", "Switch", [args[branch.arg], pred],
                                    old.device, T=tf.resource),
                      emit.node_def(f"{at}/read", "ReadVariableOp", [f"{at}/switch:{side}"],
                                    old.device, dtype=var.dtype.base_dtype)]
            values.append(f"{at}/read")
            continue
        gates = []
        for j, (h, s) in enumerate(zip(handles[state], parts[state].shards)):
            added.append(emit.node_def(f"{at}/switch_{j}", "Switch", [h, pred], s.device,
                                       T=tf.resource))
            gates.append(f"{at}/switch_{j}:{side}")
        if not ctx.comm.reaches_parts:
            raise GraphError(f"{op!r} reads the whole of {state!r}, whose parts live in other "
                             "processes this backend reaches only by collectives, which an "
                             f"If's branch cannot run; use ps or allgather for {state!r}")
        added.extend(join_parts(f"{at}/joined", gates, parts[state], var.dtype.base_dtype,
                                old.device))
        values.append(f"{at}/joined")
    dtype = tf.as_dtype(old.attr["Tout"].list.type[0])
    return emit.node_def(old.name, "Merge", [values[1], values[0]] + controls, old.device,
                         T=dtype, N=2)


def _agreed(ir, ctx, ref) -> str:
    """The value every replica agrees on for user tensor `ref`: a variable's
    initial value as its initializer now assigns it (replica 0's, or worker
    0's broadcast: the init pass), else replica 0's copy."""
    for var in ctx.tg.variables.values():
        init = var.initializer and ctx.tg.ir.node(var.initializer)
        if init is not None and init.op == "AssignVariableOp" and \
                ctx.tg.ir.data_inputs(var.initializer)[1] == ref:
            return [i for i in ir.node(var.initializer).input
                    if not i.startswith("^")][1]
    return ctx.replica_tensor(0, ref)


def _cut_input(nd, pos: int, shard, tg, added: list):
    """`nd` with data input `pos` replaced by its columns of `shard`."""
    scope = f"parallax/columns/{nd.name}/input_{pos}"
    data = [i for i in nd.input if not i.startswith("^")]
    value = data[pos]
    dtype = tf.as_dtype(nd.attr["T"].type if "T" in nd.attr else nd.attr["dtype"].type)
    made, (out,) = emit.emit_traced(lambda t: t[..., shard.start:shard.start + shard.size],
                                    [(value, dtype, None)], scope, nd.device)
    added.extend(made)
    nd.input[pos] = out
    return nd


def _lookup(ir, ctx, op: str, part, changed: dict, added: list) -> None:
    """Every replica's copy of gather `op` as rows from the exchange (the
    one `aggregate` built with the gradient's, else a new one)."""
    made = ctx.result(ExchangedLookups)
    if made is not None and op in made.rows:
        outs = made.rows[op]
    else:
        nodes, outs, _ = lookup_exchange(ctx, op, part)
        added.extend(nodes)
    dtype = tf.as_dtype(ctx.tg.ir.node(op).attr["dtype"].type)
    for k in range(ctx.plan.num_replicas):
        name = ctx.replica_name(k, op)
        old = ir.node(name)
        controls = [i for i in old.input if i.startswith("^")]
        changed[name] = emit.node_def(name, "Identity", [outs[k]] + controls, old.device,
                                      T=dtype)


def lookup_exchange(ctx, op: str, part):
    """(nodes, rows per replica, (sizes, ids) gathered per replica): the
    backend's exchange for every replica's copy of gather `op` of a table
    cut by columns (`part`)."""
    plan, tg = ctx.plan, ctx.tg
    handle, ids = tg.ir.data_inputs(op)[:2]
    node = tg.ir.node(op)
    return ctx.comm.columns_lookup(
        f"parallax/columns/{op}", [ctx.replica_tensor(k, ids) for k in range(plan.num_replicas)],
        [ctx.replica_tensor(k, handle) for k in range(plan.num_replicas)], part,
        tf.as_dtype(node.attr["dtype"].type), tf.as_dtype(node.attr["Tindices"].type),
        plan.distinct_lookups)
