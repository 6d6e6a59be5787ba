"""Place: put every user op and every copy of it on a device.

Requires: replicas made by `replicate`; aggregation nodes already placed.
Guarantees:
- replica k's ops run on the plan's device k;
- shared variables and every op that takes their handle run on the
  parameter-server device that holds the variable (the host CPU in-process);
- in multi-worker jobs with servers, colocation groups that contradict these
  devices are dropped (the device decides);
- ops that need a host (input pipelines, checkpoint I/O, ops the user pinned
  to a CPU) run on the host CPU when the replica's device is a GPU.
The placement rewrites that follow move more ops to the servers
(transforms/colocate.py: update math; transforms/lookups.py: gathers);
`move` is how they do it.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng.graph import rules
from parallax_ng.graph.ir import GraphIR, copy_node
from parallax_ng.pipeline.passes import replica_of
from parallax_ng.planning.coalescing import lookups


@dataclass(frozen=True)
class PlacePass:
    name: str = "place"
    requires: tuple = ("replicate",)
    after: tuple = ("aggregate", "state_sync", "shard_inputs")

    def run(self, ir: GraphIR, ctx):
        plan, tg = ctx.plan, ctx.tg
        on_host = server_side(ctx, lookups_too=False, updates=False)
        counts = {"replica": 0, "server": 0, "host": 0}
        changed = {}
        for nd in ir.nodes:
            k, user = replica_of(nd.name)
            if user not in tg.ir:
                continue   # added by an earlier pass, placed there
            device = plan.devices[k]
            if user in on_host:
                target, where = on_host[user], "server"
            elif "GPU" in device.upper() and (rules.is_host_only(nd.op) or
                                              "CPU" in tg.ir.node(user).device.upper()):
                target, where = host_cpu_of(device), "host"
            else:
                target, where = device, "replica"
            counts[where] += 1
            if nd.device != target:
                changed[nd.name] = copy_node(nd)
                changed[nd.name].device = target
        out = ir.replace(changed)
        if plan.cross_worker_servers:
            out, counts["colocations_dropped"] = drop_stale_colocation(out)
        return out, counts


def drop_stale_colocation(ir: GraphIR) -> tuple[GraphIR, int]:
    """Drop `_class` colocation groups that name a node on another device.

    TensorFlow puts a node with the nodes it is colocated with, whatever its
    device says (the user's graph colocates clipping math with gradients);
    across processes that would move a server's update math to a worker.
    """
    changed = {}
    for nd in ir.nodes:
        if "_class" not in nd.attr:
            continue
        for loc in nd.attr["_class"].list.s:
            target = ir.get(loc.decode().removeprefix("loc:@"))
            if target is not None and target.device != nd.device:
                changed[nd.name] = copy_node(nd)
                del changed[nd.name].attr["_class"]
                break
    return (ir.replace(changed) if changed else ir), len(changed)


def host_cpu_of(device: str) -> str:
    """The CPU of the machine that owns `device`."""
    prefix = device.rsplit("/device:", 1)[0]
    return f"{prefix}/device:CPU:0"


def _server_side(ctx) -> dict[str, str]:
    """User ops that must run with shared variables (they take the handle),
    and the server of each."""
    tg, plan = ctx.tg, ctx.plan
    out = {}
    for var in sorted(plan.shared_state()):
        out[var] = plan.server(var)
        for op in list(tg.writers.get(var, ())) + list(tg.readers.get(var, ())):
            out.setdefault(op, plan.server(var))
    return out


def server_side(ctx, lookups_too: bool, updates: bool) -> dict[str, str]:
    """User ops that run on a server: those that take a shared variable's
    handle; with `lookups_too`, a gather of a whole read of the variable and
    the reads in between; with `updates`, update math whose every consumer
    is a writer there (the host when those are on several servers); and the
    ops whose every consumer is one of these (not writers) but a gradient
    or a replica's own data."""
    tg, plan = ctx.tg, ctx.plan
    shared = plan.shared_state()
    out = _server_side(ctx)
    if lookups_too:
        for var in sorted(shared):
            for lookup in lookups(tg, var):     # rows cross, not the whole table
                for op in (*lookup.via, lookup.op):
                    out.setdefault(op, plan.server(var))
    writers = {w for var in shared for w in tg.writers.get(var, ())}
    variant = ctx.variant
    for name in reversed(tg.ir.topo_order):   # consumers before producers
        if name in out or rules.is_autodiff(name) or name in variant:
            continue
        users = tg.ir.node_consumers.get(name)
        if not users or not all(u in writers and updates or
                                u in out and u not in shared and u not in writers
                                for u in users):
            continue
        devices = {out[u] for u in users}
        out[name] = devices.pop() if len(devices) == 1 else plan.host
    return out


def move(ir: GraphIR, ctx, targets: dict[str, str]) -> tuple[GraphIR, int]:
    """Every replica's copy of the user ops in `targets` to that device;
    then, in a job with servers, colocation groups the moves contradict are
    dropped. Returns the graph and how many nodes moved."""
    changed = {}
    for nd in ir.nodes:
        k, user = replica_of(nd.name)
        target = targets.get(user)
        if target is not None and user in ctx.tg.ir and nd.device != target:
            changed[nd.name] = copy_node(nd)
            changed[nd.name].device = target
    out = ir.replace(changed) if changed else ir
    if changed and ctx.plan.cross_worker_servers:
        out, _ = drop_stale_colocation(out)
    return out, len(changed)
