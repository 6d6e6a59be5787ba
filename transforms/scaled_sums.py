"""Scaled sums: a TF1 loss that sums over the batch and multiplies or
divides the sum by a number the graph does not show to be a batch size
(`tf.reduce_sum(x) / BATCH_SIZE` over a placeholder's rows, or over a
batch size fed beside them, whole to every replica) is decided each step
from the rows fed; so is such a scalar read beside the loss (a
hand-written accuracy fetched or added up by a metric).

The plan averages the replicas' gradients of such a loss, and their values
of such a scalar (graph/averaging.py takes it for a mean). That equals one
device only where the number is a replica's rows. Each step this pass
compares the number with the rows this process's replicas were fed, R
(and with R times the elements the sum adds per row, where the shape
shows them):
- number x local replicas = R: a sum over a replica's batch size, a mean:
  averaged, as before (a constant's; a fed number is the feed's or other);
- number = R: a sum over the batch the process was fed, that batch's mean:
  each replica's loss takes the number over its local replica count, so
  the average over the job is the mean of the workers' losses (in-process,
  the sum over the replicas: one device's with the same feed);
- any other number: a sum times a number, as one device computes it with
  the global batch: each replica's loss takes the number over N (the job's
  replicas), so the average is the replicas' sum.
The forward op and the autodiff's ops that read the number read the
scaled number instead, so the loss, its fetched value (averaged) and the
gradients agree.

Requires: replicas made by `replicate`; the plan's `scaled_sums` (planning
finds them where the config leaves averaging to the graph: `auto`).
Guarantees: a few scalar ops per site under `parallax/scaled_sums/`, on
replica 0's device; no exchange between tasks (each worker counts its own
feed, as every worker is fed the same number of rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.graph import emit, rules
from parallax_ng.graph.ir import parse_tensor


@dataclass(frozen=True)
class ScaledSumsPass:
    name: str = "scaled_sums"
    requires: tuple = ("replicate",)
    after: tuple = ("shard_inputs", "state_sync")

    def run(self, ir, ctx):
        tg, plan, added, rewires = ctx.tg, ctx.plan, [], {}
        autodiff = rules.from_autodiff(tg.graph)
        for site in plan.scaled_sums:
            op = tg.graph.get_operation_by_name(site.op)
            number = op.inputs[site.at]
            scope, device = f"parallax/scaled_sums/{site.op}", ir.node(site.op).device
            mine = ctx.replica_tensor(0, parse_tensor(number.name))
            nodes, share = _share(ctx, ir, site, mine, scope, number.dtype, device)
            scaled = emit.node_def(f"{scope}/number", "RealDiv" if site.multiplies else "Mul",
                                   [mine, share], device, T=number.dtype)
            added += nodes + [scaled]
            for reader in number.consumers():
                if reader.name != site.op and reader.name not in autodiff:
                    continue
                for pos, x in enumerate(reader.inputs):
                    if x.name == number.name:
                        rewires.update({(ctx.replica_name(k, reader.name), pos): scaled.name
                                        for k in range(plan.num_replicas)})
        return ir.rewire(rewires, added), {"scaled_sums": len(plan.scaled_sums)}


def _share(ctx, ir, site, number: str, scope: str, dtype, device: str) -> tuple[list, str]:
    """(nodes, g): the factor g each replica's number is multiplied by (a
    divisor) or divided by (a multiplier): 1 where the number is a replica's
    rows, workers / N where it is the process's, else 1 / N. `number`:
    replica 0's copy of it (a fed one is read each step, and is taken for
    the process's rows or another number, not for a replica's: a loss
    weight of 1 / 4 is not a mean over 4 rows)."""
    plan = ctx.plan
    n, workers, local = plan.group_size, plan.num_workers, plan.num_replicas
    if not site.count:
        return [emit.const(f"{scope}/share", 1.0 / n, dtype, device)], f"{scope}/share"
    ref, nodes, rows = parse_tensor(site.rows), [], []
    source = ctx.tg.tensor(ref)
    for k in range(local):
        at, device_k = f"{scope}/replica_{k}", ir.node(ctx.replica_name(k, ref.node)).device
        nodes += [emit.node_def(f"{at}/shape", "Shape", [ctx.replica_tensor(k, ref)], device_k,
                                T=source.dtype, out_type=tf.int32),
                  emit.node_def(f"{at}/dims", "Unpack", [f"{at}/shape"], device_k,
                                T=tf.int32, num=source.shape.rank, axis=0)]
        rows.append(f"{at}/dims")
    nodes += [emit.node_def(f"{scope}/rows", "AddN", rows, device, T=tf.int32, N=local)
              if local > 1 else emit.node_def(f"{scope}/rows", "Identity", rows, device,
                                              T=tf.int32),
              emit.node_def(f"{scope}/fed", "Cast", [f"{scope}/rows"], device,
                            SrcT=tf.int32, DstT=dtype)]
    counts = [f"{scope}/fed"]
    if site.per_row > 1:            # the number may count elements: rows x elements per row
        nodes += [emit.const(f"{scope}/per_row", float(site.per_row), dtype, device),
                  emit.node_def(f"{scope}/elements", "Mul", [counts[0], f"{scope}/per_row"],
                                device, T=dtype)]
        counts.append(f"{scope}/elements")
    if site.count > 0:
        nodes.append(emit.const(f"{scope}/count", float(site.count), dtype, device))
    else:                           # fed: the number (a divisor, or 1 / a multiplier), rounded
        inverse = [emit.node_def(f"{scope}/inverse", "Reciprocal", [number], device, T=dtype)]
        nodes += inverse * site.multiplies + [emit.node_def(
            f"{scope}/count", "Round", [inverse[0].name if site.multiplies else number],
            device, T=dtype)]
    tests = []          # (a fed number is the feed's: a replica's rows only by chance)
    for label, factor in (("feed", 1),) + (("replica", local),) * (site.count > 0):
        nodes += [emit.const(f"{scope}/{label}_factor", float(factor), dtype, device),
                  emit.node_def(f"{scope}/{label}_count", "Mul",
                                [f"{scope}/count", f"{scope}/{label}_factor"], device, T=dtype)]
        equal = [emit.node_def(f"{scope}/{label}_{i}", "Equal", [c, f"{scope}/{label}_count"],
                               device, T=dtype) for i, c in enumerate(counts)]
        nodes += equal
        if len(equal) > 1:
            nodes.append(emit.node_def(f"{scope}/{label}", "LogicalOr",
                                       [e.name for e in equal], device))
        tests.append(nodes[-1].name)
    for name, value in (("mean", 1.0), ("feed_share", workers / n), ("sum", 1.0 / n)):
        nodes.append(emit.const(f"{scope}/{name}", value, dtype, device))
    nodes.append(emit.node_def(f"{scope}/by_feed", "SelectV2",
                               [tests[0], f"{scope}/feed_share", f"{scope}/sum"], device,
                               T=dtype))
    if len(tests) > 1:
        nodes.append(emit.node_def(f"{scope}/share", "SelectV2",
                                   [tests[1], f"{scope}/mean", f"{scope}/by_feed"], device,
                                   T=dtype))
    return nodes, nodes[-1].name
