"""State sync: mirrored state written from per-replica data stays equal.

Requires: replicas made by `replicate`.
Guarantees: when a mirrored variable is written with a value computed from a
replica's own batch (batch-norm moving statistics, streaming metric totals),
that value is all-reduced across replicas first, by the rule table in
`parallax_ng.rules` (AssignAdd: sum; AssignSub and Assign: mean), so every
replica writes the same value and the replicas never drift apart.
Initializers are left to the `init` pass.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng import rules
from parallax_ng.ir import GraphIR


@dataclass(frozen=True)
class StateSyncPass:
    name: str = "state_sync"
    requires: tuple = ("replicate",)
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        tg, plan = ctx.tg, ctx.plan
        if plan.group_size == 1:
            return ir, {"synced": 0}
        initializers = {v.initializer for v in tg.variables.values()}
        synced = 0
        new_nodes, rewires = [], {}
        for var, writers in sorted(tg.writers.items()):
            if not plan.mirrored(var):
                continue
            for w in writers:
                if w in initializers:
                    continue
                for pos, ref in enumerate(tg.ir.data_inputs(w)):
                    if pos == 0 or not ctx.varies(ref):
                        continue
                    how = rules.state_sync_reduction(tg.ir.node(w).op, w)
                    synced += 1
                    nodes, outs = ctx.comm.all_reduce(
                        f"parallax/state_sync/{w}/input_{pos}",
                        [ctx.replica_tensor(k, ref) for k in range(plan.num_replicas)],
                        tg.tensor(ref).dtype, how == "mean")
                    new_nodes.extend(nodes)
                    for k, out in enumerate(outs):
                        rewires[(ctx.replica_name(k, w), pos)] = out
        return ir.rewire(rewires, new_nodes), {"synced": synced}
