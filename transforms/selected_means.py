"""Selected means: a mean over rows a mask picks from the batch
(tf.reduce_mean(tf.boolean_mask(x, mask)), a mean of tf.gather at
tf.where's indices) divides by the job's count of picked rows.

Each replica picks its own number of rows, maybe none: the mean of the
replicas' means is not one device's mean over the global batch (a replica
picking none makes NaN). One device's is the replicas' sums over the sum
of their counts.

Requires: replicas made by `replicate`; `state_sync` first, when it runs
(a function of such a mean, an RMSE's square root, reads the replicas'
mean of it: the value this pass gives each replica's mean).
Guarantees: every replica's copy of each such scalar mean of floats
(picked rows: graph/selections.py) that flows into scalars only (a loss,
a metric; not a normalization of rows by it) and sits outside branches
and loops (which not every replica may run; those two are warned, naming
them) becomes, under its own name, the replica's Sum of the same rows
over the replicas' mean count of them (a job-wide reduction of Size per
step, on a server where the plan sums there); the autodiff's division of
the mean's gradient by the count takes that count too. So the mean of
the replicas' gradients, losses and fetched values (a masked metric's) is
one device's, and a replica that picks no row adds 0. Added to a sum over
the batch (graph/forms.py `widened`: the gradients summed), such a mean
divides by the job's count of picked rows, the replicas' sum.

A Mean over the batch that a loss adds to a sum over it (graph/forms.py
`widened`, where the state-sync pass has the replicas' gradients summed)
divides by N times its count in every replica, forward (its value over N)
and in the autodiff's division of its gradient, so the replicas' sum is
one device's, as a widened count's mean is (transforms/state_sync.py).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.graph import branches, emit, forms, mean_gradients, selections
from parallax_ng.graph.rows import reading
from parallax_ng.pipeline.results import WidenedMeans
from transforms.extremes import all_reduce, on_a_server


@dataclass(frozen=True)
class SelectedMeansPass:
    name: str = "selected_means"
    requires: tuple = ("replicate",)
    after: tuple = ("state_sync",)

    def run(self, ir, ctx):
        tg, plan, wide = ctx.tg, ctx.plan, ctx.result(WidenedMeans)
        means, widened = _means(tg), wide.divisions if wide else frozenset()
        reduce = on_a_server if plan.reduces_on_servers else all_reduce
        changed, added, rewires = {}, [], {}
        for i, mean in enumerate(means):
            scope, op = f"parallax/selected_means/{mean}", tg.graph.get_operation_by_name(mean)
            dtype, copies = op.outputs[0].dtype, [ir.node(ctx.replica_name(k, mean))
                                                  for k in range(plan.num_replicas)]
            counts = []
            for k, node in enumerate(copies):
                at = f"{scope}/replica_{k}"
                size = emit.node_def(f"{at}/size", "Size", node.input[:1], node.device,
                                     T=node.attr["T"], out_type=tf.int32)
                cast = emit.node_def(f"{at}/count", "Cast", [size.name], node.device,
                                     SrcT=tf.int32, DstT=dtype)
                added += [size, cast]
                counts.append(cast.name)
            nodes, jobs = reduce(ctx, f"{scope}/job_count", counts, dtype,
                                 mean not in widened, i)    # (widened: the sum of them)
            added += nodes
            for node, job in zip(copies, jobs):
                total = emit.like(node, f"{node.name}/parallax_sum", node.device)
                total.op = "Sum"
                total.input.extend(node.input)
                added.append(total)
                changed[node.name] = emit.node_def(node.name, "RealDiv", [total.name, job],
                                                   node.device, T=dtype)
            for division in selections.gradient_divisions(op):
                rewires.update({(ctx.replica_name(k, division.name), 1): job
                                for k, job in enumerate(jobs)})
        wide = _widened(ir, ctx, set(means), changed, added, rewires)
        return ir.replace(changed, added).rewire(rewires), {"selected": len(means),
                                                            "widened": wide}


def _widened(ir, ctx, selected: set, changed: dict, added: list, rewires: dict) -> int:
    """Every replica's copy of each widened Mean (`WidenedMeans`) not over
    `selected` rows becomes its value over N, and its gradient's division
    takes N times the count; a trained one whose gradient is not found is
    warned. The Means' count."""
    tg, plan, wide = ctx.tg, ctx.plan, ctx.result(WidenedMeans)
    means = sorted(n for n in (wide.divisions if wide else ()) if tg.ir.node(n).op == "Mean"
                   and n not in selected)
    index = mean_gradients.Autodiff(tg.graph) if means else None
    trained = tg.ir.ancestors({t.op.name for t in forms.autodiff_losses(tg.graph)},
                              data_only=True) if means else set()
    for mean in means:
        op, scope = tg.graph.get_operation_by_name(mean), f"parallax/selected_means/{mean}"
        dtype, divisions = op.outputs[0].dtype, mean_gradients.division(index, op)
        if divisions is None and mean in trained:
            warnings.warn(f"the Mean {mean!r} is added to a sum over the batch, but its "
                          "gradient was not found: its part of the replicas' summed "
                          "gradients is N times one device's", stacklevel=3)
        share = emit.const(f"{scope}/share", 1.0 / plan.group_size, dtype, plan.host)
        times = emit.const(f"{scope}/replicas", plan.group_size, dtype, plan.host)
        added += [share, times]
        for k in range(plan.num_replicas):
            node = ir.node(ctx.replica_name(k, mean))
            inner = emit.like(node, f"{node.name}/parallax_mean", node.device)
            inner.input.extend(node.input)
            added.append(inner)
            changed[node.name] = emit.node_def(node.name, "Mul", [inner.name, share.name],
                                               node.device, T=dtype)
            for j, division in enumerate(divisions or ()):
                count, at = tg.ir.data_inputs(division.name)[1], \
                    ctx.replica_name(k, division.name)
                added.append(emit.node_def(f"{scope}/replica_{k}/count_{j}", "Mul", [
                    ctx.replica_tensor(k, count), times.name], ir.node(at).device, T=dtype))
                rewires[(at, 1)] = added[-1].name
    return len(means)


def _means(tg) -> list[str]:
    """The scalar means of floats over picked rows that this pass divides
    by the job's count; those it cannot (in a branch or a loop, or taken
    into rows) are warned."""
    rows, above, means, inside, per_row = reading(forms.sources(tg.graph), tg.graph), \
        {}, [], [], []
    for op in tg.graph.get_operations():
        if op.type != "Mean" or op.outputs[0].shape.rank != 0 or \
                not op.outputs[0].dtype.is_floating or \
                not selections.picked(op.inputs[0], rows):
            continue
        if branches.switches_above(tg.ir, op.name, above):
            inside.append(op.name)
        elif use := selections.used_per_row(op, rows):
            per_row.append((op.name, use))
        else:
            means.append(op.name)
    if inside:
        warnings.warn(f"means over rows a mask picks {inside} sit in a branch or a loop, "
                      "which not every replica may run: each replica's divides by its "
                      "own count, not one device's (compute them outside)", stacklevel=3)
    if per_row:
        warnings.warn(f"means over rows a mask picks, taken into rows (mean, op): {per_row}: "
                      "each replica's is of its own rows, not of the global batch's as on "
                      "one device", stacklevel=3)
    return means
