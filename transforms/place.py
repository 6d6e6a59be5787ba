"""Place: put every user op and every copy of it on a device.

Requires: replicas made by `replicate`; aggregation nodes already placed.
Guarantees:
- replica k's ops run on the plan's device k;
- shared variables, every op that takes their handle, and the update math
  that feeds only their writers run on the parameter-server device that
  holds the variable (the Parallax paper's placement of aggregation/update
  ops with the parameter), and so do gathers of its rows (also through a
  whole read, as reference variables' lookups are built), so rows cross
  the network rather than the table; update math feeding variables on several
  servers runs on the worker's host CPU;
- in multi-worker jobs with servers, colocation groups that contradict these
  devices are dropped (the device decides);
- ops that need a host (input pipelines, checkpoint I/O, ops the user pinned
  to a CPU) run on the host CPU when the replica's device is a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng import rules
from parallax_ng.duplicates import lookups
from parallax_ng.ir import GraphIR, copy_node
from parallax_ng.passes import replica_of


@dataclass(frozen=True)
class PlacePass:
    name: str = "place"
    requires: tuple = ("replicate",)
    after: tuple = ("aggregate", "state_sync", "shard_inputs")

    def run(self, ir: GraphIR, ctx):
        plan, tg = ctx.plan, ctx.tg
        on_host = _server_side(ctx)
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
    """User ops that belong with shared variables, and the server of each."""
    tg, plan = ctx.tg, ctx.plan
    shared = plan.shared_state()
    out = {}
    for var in sorted(shared):
        out[var] = plan.server(var)
        for op in list(tg.writers.get(var, ())) + list(tg.readers.get(var, ())):
            out.setdefault(op, plan.server(var))
        for lookup in lookups(tg, var):     # rows cross, not the whole table
            for op in (*lookup.via, lookup.op):
                out.setdefault(op, plan.server(var))
    writers = {w for var in shared for w in tg.writers.get(var, ())}
    variant = ctx.variant
    for name in reversed(tg.ir.topo_order):   # consumers before producers
        if name in out or rules.is_autodiff(name) or name in variant:
            continue
        users = tg.ir.node_consumers.get(name)
        if users and all(u in writers or (u in out and u not in shared) for u in users):
            devices = {out[u] for u in users}
            out[name] = devices.pop() if len(devices) == 1 else plan.host
    return out
