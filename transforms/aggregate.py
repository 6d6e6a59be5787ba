"""Aggregate: every use of a gradient sees the gradient of the global batch.

Requires: replicas made by `replicate`; the plan's method per variable.
Guarantees: for each trained variable, the autodiff output of every replica
is combined across replicas before anything else reads it (clipping, global
norms, summaries, update ops), by the plan's method:
- allreduce: CollectiveReduce on each replica's device (mean or sum);
- ps: sum on the parameter-server device (host CPU in-process); IndexedSlices
  are concatenated there (local aggregation), scaled by 1/N for a mean;
- allgather: IndexedSlices gathered to every replica with collective gathers
  (sizes first, padded to the largest, padding dropped).
With `communication.backend: horovod`, allreduce and allgather use Horovod's
ops instead (parallax_ng/horovod.py).
New nodes live under `parallax/<method>/<variable>/`.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng import emit, horovod, rules
from parallax_ng.ir import GraphIR

GROUP_KEY = 1   # the group of all replicas


@dataclass(frozen=True)
class AggregatePass:
    name: str = "aggregate"

    def run(self, ir: GraphIR, ctx):
        keys = ctx.instance_keys
        new_nodes, rewires = [], {}
        counts = {"allreduce": 0, "ps": 0, "allgather": 0}
        for var, vp in sorted(ctx.plan.variables.items()):
            grad = ctx.tg.gradients[var]
            build = {"allreduce": _allreduce, "ps": _ps, "allgather": _allgather}[vp.method]
            nodes, outputs = build(ctx, var, grad, keys)
            new_nodes.extend(nodes)
            for ref, per_replica in outputs.items():
                _rewire(ctx, ref, per_replica, rewires)
            counts[vp.method] += 1
        return ir.rewire(rewires, new_nodes), counts


def _allreduce(ctx, var, grad, keys):
    plan, dtype = ctx.plan, ctx.tg.tensor(grad.values).dtype
    if plan.backend == "horovod":
        nodes, outs = horovod.all_reduce(
            plan, f"parallax/allreduce/{var}",
            [ctx.replica_tensor(k, grad.values) for k in range(plan.num_replicas)],
            dtype, plan.average_dense)
        return nodes, {grad.values: outs}
    key = keys.take()
    nodes, outs = [], []
    for k, device in enumerate(plan.devices):
        name = f"parallax/allreduce/{var}/replica_{k}"
        nodes.append(emit.collective_reduce(
            name, ctx.replica_tensor(k, grad.values), dtype, device,
            group_size=plan.group_size, group_key=GROUP_KEY, instance_key=key,
            mean=plan.average_dense, timeout=plan.timeout_seconds))
        outs.append(name)
    return nodes, {grad.values: outs}


def _ps(ctx, var, grad, keys):
    plan, n = ctx.plan, ctx.plan.num_replicas
    scope = f"parallax/ps/{var}"
    dtype = ctx.tg.tensor(grad.values).dtype
    values = [ctx.replica_tensor(k, grad.values) for k in range(n)]
    out_values, out_indices = ps_outputs(plan, var, grad.sparse)
    if grad.sparse:
        idx_dtype = ctx.tg.tensor(grad.indices).dtype
        indices = [ctx.replica_tensor(k, grad.indices) for k in range(n)]
        nodes = [emit.const(f"{scope}/axis", 0, tf.int32, plan.host),
                 _concat(f"{scope}/values", values, f"{scope}/axis", dtype, plan.host),
                 _concat(f"{scope}/indices", indices, f"{scope}/axis", idx_dtype, plan.host)]
        outputs = {grad.indices: [out_indices] * n}
    else:
        nodes = [emit.node_def(f"{scope}/sum", "AddN", values, plan.host, T=dtype, N=n)]
        outputs = {}
    if out_values.endswith("/mean"):
        total = f"{scope}/values" if grad.sparse else f"{scope}/sum"
        nodes += [emit.const(f"{scope}/scale", 1.0 / plan.group_size, dtype, plan.host),
                  emit.node_def(out_values, "Mul", [total, f"{scope}/scale"],
                                plan.host, T=dtype)]
    outputs[grad.values] = [out_values] * n
    return nodes, outputs


def ps_outputs(plan, var: str, sparse: bool) -> tuple[str, str | None]:
    """Names of the worker-local aggregate of `var`'s gradient made by `_ps`:
    (values or dense sum, indices or None); scaled by 1/group_size for a mean."""
    scope = f"parallax/ps/{var}"
    mean = plan.average_sparse if sparse else plan.average_dense
    if mean and plan.group_size > 1:
        values = f"{scope}/mean"
    else:
        values = f"{scope}/values" if sparse else f"{scope}/sum"
    return values, (f"{scope}/indices" if sparse else None)


def _concat(name, inputs, axis, dtype, device):
    if len(inputs) == 1:   # ConcatV2 needs two inputs or more
        return emit.node_def(name, "Identity", inputs, device, T=dtype)
    return emit.node_def(name, "ConcatV2", inputs + [axis], device,
                         T=dtype, N=len(inputs), Tidx=tf.int32)


def _allgather(ctx, var, grad, keys):
    plan = ctx.plan
    tg = ctx.tg
    vt, it = tg.tensor(grad.values), tg.tensor(grad.indices)
    if plan.backend == "horovod":
        n = plan.num_replicas
        nodes, v, i = horovod.all_gather(
            plan, f"parallax/allgather/{var}",
            [ctx.replica_tensor(k, grad.values) for k in range(n)],
            [ctx.replica_tensor(k, grad.indices) for k in range(n)],
            vt.dtype, it.dtype, vt.shape, plan.average_sparse)
        return nodes, {grad.values: [v] * n, grad.indices: [i] * n}
    key_sizes, key_values, key_indices = keys.take(), keys.take(), keys.take()
    nodes, out_v, out_i = [], [], []
    for k, device in enumerate(plan.devices):
        def gather(values, indices):
            return _gather_slices(values, indices, plan, (key_sizes, key_values, key_indices))
        made, (v, i) = emit.emit_traced(
            gather, [(ctx.replica_tensor(k, grad.values), vt.dtype, vt.shape),
                     (ctx.replica_tensor(k, grad.indices), it.dtype, it.shape)],
            f"parallax/allgather/{var}/replica_{k}", device)
        nodes.extend(made)
        out_v.append(v)
        out_i.append(i)
    return nodes, {grad.values: out_v, grad.indices: out_i}


def _gather_slices(values, indices, plan, keys):
    n, timeout = plan.group_size, plan.timeout_seconds

    def all_gather(t, key):
        return tf.raw_ops.CollectiveGatherV2(
            input=t, group_size=n, group_key=GROUP_KEY, instance_key=key,
            ordering_token=[], communication_hint="auto", timeout_seconds=timeout)

    size = tf.shape(indices, out_type=tf.int32)[:1]
    sizes = all_gather(size, keys[0])
    longest = tf.reduce_max(sizes)
    pad = longest - size[0]
    rest = tf.zeros(tf.stack([tf.rank(values) - 1, 2]), tf.int32)
    padded_v = tf.pad(values, tf.concat([[[0, pad]], rest], 0))
    padded_i = tf.pad(indices, [[0, pad]])
    mask = tf.reshape(tf.sequence_mask(sizes, longest), [-1])
    gathered_v = tf.boolean_mask(all_gather(padded_v, keys[1]), mask)
    gathered_i = tf.boolean_mask(all_gather(padded_i, keys[2]), mask)
    if plan.average_sparse:
        gathered_v = gathered_v * tf.cast(1.0 / n, values.dtype)
    return tf.identity(gathered_v, "values"), tf.identity(gathered_i, "indices")


def _rewire(ctx, ref, per_replica: list[str], rewires: dict) -> None:
    """Point every non-autodiff consumer of `ref`, in every replica, at the aggregate."""
    for consumer, pos in ctx.tg.ir.consumers.get(ref, ()):
        if rules.is_autodiff(consumer):
            continue
        for k in range(ctx.plan.num_replicas):
            target = ctx.replica_name(k, consumer)
            rewires.setdefault((target, pos), per_replica[k])
            if target == consumer and k > 0:
                break   # an op that exists once reads replica 0's aggregate
