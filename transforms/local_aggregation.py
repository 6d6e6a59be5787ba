"""Local aggregation: a worker sums its replicas' gradients of a
parameter-server variable before they leave it (Parallax 5.3.2, "LA").

Requires: `aggregate` (it builds each `ps` variable's sum of the worker's
replicas on the variable's server, where a plain parameter server adds what
every replica sends, and publishes those nodes: LocalAggregates.nodes).
Runs in jobs with servers when the plan's `rewrites.local_aggregation` is
on (in-process the server is the host already).
Guarantees: those nodes (sum or concatenation, mean scale, coalesced rows,
partial norm) run on the worker's host CPU, so one aggregate per worker
crosses the network instead of one gradient per replica. Values are
unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng.graph.ir import GraphIR, copy_node
from parallax_ng.pipeline.results import LocalAggregates


@dataclass(frozen=True)
class LocalAggregationPass:
    name: str = "local_aggregation"
    requires: tuple = ("aggregate",)
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        host = ctx.plan.host
        changed = {}
        for names in ctx.result(LocalAggregates).nodes.values():
            for name in names:
                if ir.node(name).device != host:
                    changed[name] = copy_node(ir.node(name))
                    changed[name].device = host
        return (ir.replace(changed) if changed else ir), {"moved": len(changed)}
