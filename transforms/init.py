"""Init: all replicas start from the same values.

Requires: replicas made by `replicate`.
Guarantees: replica k's initializer of every mirrored variable assigns
replica 0's initial-value tensor, so random initializers are drawn once and
every copy starts equal (the user's `global_variables_initializer()` runs all
replicas' initializers in one step). Shared variables are initialized once.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng.ir import GraphIR
from transforms.aggregate import apply_rewires


@dataclass(frozen=True)
class InitPass:
    name: str = "init"

    def run(self, ir: GraphIR, ctx):
        rewires = {}
        for var in ctx.tg.variables.values():
            if ctx.plan.placement[var.name] != "mirrored" or not var.initializer:
                continue
            init = ctx.tg.ir.node(var.initializer)
            if init.op not in ("AssignVariableOp", "Assign"):
                continue
            for k in range(1, ctx.plan.num_replicas):
                rewires[(ctx.replica_name(k, init.name), 1)] = init.input[1]
        return apply_rewires(ir, [], rewires), {"initializers": len(rewires)}
