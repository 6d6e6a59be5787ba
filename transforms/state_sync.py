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

from parallax_ng import emit, horovod, rules
from parallax_ng.ir import GraphIR
from transforms.aggregate import GROUP_KEY


@dataclass(frozen=True)
class StateSyncPass:
    name: str = "state_sync"

    def run(self, ir: GraphIR, ctx):
        tg, plan = ctx.tg, ctx.plan
        if plan.group_size == 1:
            return ir, {"synced": 0}
        initializers = {v.initializer for v in tg.variables.values()}
        synced = 0
        new_nodes, rewires = [], {}
        for var, writers in sorted(tg.writers.items()):
            if plan.placement[var] != "mirrored":
                continue
            for w in writers:
                if w in initializers:
                    continue
                for pos, ref in enumerate(tg.ir.data_inputs(w)):
                    if pos == 0 or not ctx.varies(ref):
                        continue
                    how = rules.state_sync_reduction(tg.ir.node(w).op, w)
                    dtype = tg.tensor(ref).dtype
                    synced += 1
                    if plan.backend == "horovod":
                        scope = f"parallax/state_sync/{w}/input_{pos}"
                        nodes, outs = horovod.all_reduce(
                            plan, scope, [ctx.replica_tensor(k, ref)
                                          for k in range(plan.num_replicas)],
                            dtype, how == "mean")
                        new_nodes.extend(nodes)
                        for k, out in enumerate(outs):
                            rewires[(ctx.replica_name(k, w), pos)] = out
                        continue
                    key = ctx.instance_keys.take()
                    for k, device in enumerate(plan.devices):
                        name = f"parallax/state_sync/{w}/input_{pos}/replica_{k}"
                        new_nodes.append(emit.collective_reduce(
                            name, ctx.replica_tensor(k, ref), dtype, device,
                            group_size=plan.group_size, group_key=GROUP_KEY,
                            instance_key=key, mean=how == "mean",
                            timeout=plan.timeout_seconds))
                        rewires[(ctx.replica_name(k, w), pos)] = name
        return ir.rewire(rewires, new_nodes), {"synced": synced}
