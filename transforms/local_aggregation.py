"""Local aggregation: a worker sums its replicas' gradients of a
parameter-server variable before they leave it (Parallax 5.3.2, "LA").

Requires: `aggregate` (it builds each `ps` variable's sum of the worker's
replicas, `parallax/ps/<var>/...`, on the variable's server, where a plain
parameter server adds what every replica sends). Runs in jobs with servers
when the plan's `rewrites.local_aggregation` is on (in-process the server is
the host already).
Guarantees: those nodes (sum or concatenation, mean scale, coalesced rows,
partial norm) run on the worker's host CPU, so one aggregate per worker
crosses the network instead of one gradient per replica. Values are
unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng.graph.ir import GraphIR, copy_node

SCOPE = "parallax/ps/"


@dataclass(frozen=True)
class LocalAggregationPass:
    name: str = "local_aggregation"
    requires: tuple = ("aggregate",)
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        plan = ctx.plan
        shared = {v for v, vp in plan.variables.items() if vp.method == "ps"}
        changed = {}
        for nd in ir.nodes:
            if not nd.name.startswith(SCOPE) or nd.device == plan.host:
                continue
            if nd.name[len(SCOPE):].rsplit("/", 1)[0] in shared:
                changed[nd.name] = copy_node(nd)
                changed[nd.name].device = plan.host
        return (ir.replace(changed) if changed else ir), {"moved": len(changed)}
