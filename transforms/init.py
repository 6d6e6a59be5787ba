"""Init: all replicas start from the same values.

Requires: replicas made by `replicate`.
Guarantees: replica k's initializer of every mirrored variable assigns
replica 0's initial-value tensor, so random initializers are drawn once and
every copy starts equal (the user's `global_variables_initializer()` runs all
replicas' initializers in one step). In a multi-worker job, worker 0's
replica 0 broadcasts each initial value (CollectiveBcastSend) and the other
workers assign what they receive, so every worker starts equal too (with
the Horovod backend: HorovodBroadcast from worker 0, on every worker).
Shared variables are initialized once.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng import emit, horovod
from parallax_ng.errors import GraphError
from parallax_ng.ir import GraphIR, copy_node

BROADCAST_GROUP_KEY = 2   # replica 0 of every worker


@dataclass(frozen=True)
class InitPass:
    name: str = "init"

    def run(self, ir: GraphIR, ctx):
        plan = ctx.plan
        rewires, added, controls = {}, [], {}
        for var in ctx.tg.variables.values():
            if plan.placement[var.name] != "mirrored" or not var.initializer:
                continue
            init = ctx.tg.ir.node(var.initializer)
            if init.op not in ("AssignVariableOp", "Assign"):
                continue
            value = init.input[1]
            if plan.num_workers > 1:
                value = self._broadcast(ctx, var, value, added, controls)
                if plan.worker > 0 or plan.backend == "horovod":
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
        plan = ctx.plan
        if any(d is None for d in var.shape):
            raise GraphError(f"variable {var.name!r} has shape {var.shape}; a multi-worker "
                             "job broadcasts initial values and needs a full shape")
        if plan.backend == "horovod":
            nodes, out = horovod.broadcast(plan, f"parallax/broadcast/{var.name}", value,
                                           var.dtype.base_dtype, list(var.shape))
            added.extend(nodes)
            return out   # every rank takes part, worker 0 included
        key = ctx.instance_keys.take()
        common = dict(T=var.dtype.base_dtype, group_size=plan.num_workers,
                      group_key=BROADCAST_GROUP_KEY, instance_key=key,
                      shape=_shape_attr(var.shape), communication_hint="auto",
                      timeout_seconds=float(plan.timeout_seconds))
        name = f"parallax/broadcast/{var.name}"
        if plan.worker == 0:
            added.append(emit.node_def(name + "/send", "CollectiveBcastSend", [value],
                                       plan.devices[0], **common))
            controls.setdefault(var.initializer, []).append("^" + name + "/send")
            return value
        added.append(emit.node_def(name + "/recv", "CollectiveBcastRecv", [],
                                   plan.devices[0], **common))
        return name + "/recv"


def _shape_attr(shape):
    import tensorflow as tf
    return tf.compat.v1.AttrValue(shape=tf.TensorShape(list(shape)).as_proto())
