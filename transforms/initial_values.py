"""Initial values: all replicas start from the same values.

Requires: replicas made by `replicate`.
Guarantees: replica k's initializer of every mirrored variable assigns
replica 0's initial-value tensor, so random initializers are drawn once and
every copy starts equal (the user's `global_variables_initializer()` runs all
replicas' initializers in one step). In a multi-worker job every worker
assigns worker 0's initial values, by the backend's broadcast
(parallax_ng/comm/collectives.py), so every worker starts equal too.
Shared variables are initialized once. A variable cut by columns
(placement.Columns) is initialized like a mirrored one; the `columns` pass
then cuts each replica's value to its columns.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng.errors import GraphError
from parallax_ng.graph.ir import GraphIR, copy_node
from parallax_ng.methods import method


@dataclass(frozen=True)
class InitPass:
    name: str = "init"
    requires: tuple = ("replicate",)
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        plan = ctx.plan
        rewires, added, controls = {}, [], {}
        own = _own_columns(ctx)
        for var in ctx.tg.variables.values():
            if var.name in plan.shared_state() or not var.initializer or var.name in own:
                continue
            init = ctx.tg.ir.node(var.initializer)
            if init.op not in ("AssignVariableOp", "Assign"):
                continue
            value = init.input[1]
            if plan.num_workers > 1:
                value = self._broadcast(ctx, var, value, added, controls)
                if value != init.input[1]:
                    rewires[(init.name, 1)] = value
            for k in range(1, plan.num_replicas):
                rewires[(ctx.replica_name(k, init.name), 1)] = value
        out = ir.rewire(rewires, added)
        if controls:
            changed = {}
            for name, deps in controls.items():
                nd = changed[name] = copy_node(out.node(name))
                nd.input.extend(deps)
            out = out.replace(changed)
        return out, {"initializers": len(rewires), "broadcasts": len(added)}

    def _broadcast(self, ctx, var, value: str, added: list, controls: dict) -> str:
        """The value this worker's copies assign: worker 0's, by the backend's
        broadcast; its own use waits for what the broadcast needs."""
        if any(d is None for d in var.shape):
            raise GraphError(f"variable {var.name!r} has shape {var.shape}; a multi-worker "
                             "job broadcasts initial values and needs a full shape")
        b = ctx.comm.broadcast(f"parallax/broadcast/{var.name}", value,
                               var.dtype.base_dtype, list(var.shape))
        added.extend(b.nodes)
        if b.before:
            controls.setdefault(var.initializer, []).extend(b.before)
        return b.value


def _own_columns(ctx) -> set[str]:
    """Variables cut by columns whose initializer assigns each replica its
    own columns already (parallax_ng/planning/column_cut.py: its value is not cut later)."""
    out = set()
    for var, vp in ctx.plan.variables.items():
        if not method(vp.method).columns:
            continue
        uses = ctx.facts.column_uses(var)
        cut = {w for w, _ in uses.cut}
        out.update(s for s in uses.state if ctx.tg.variables[s].initializer not in cut)
    return out
