"""Each replica's sparse gradient rows as they leave it, for the methods that
send rows (all-gather, alltoall, servers).

- `coalesce`: each distinct row once, duplicates summed (first-appearance
  order), on one device;
- `by_id`: that on every replica;
- `replica_rows`: a variable's rows on every replica, coalesced where the
  plan says so, with a global norm's L2Loss of the rows (taken before the
  sums, as one device squares every row) as each replica's share summed
  over the replicas (`norm_shares`);
- `summed_norms`: the shares of several variables summed in one all-reduce,
  not one each.

Requires: a PassContext after `replicate`. Guarantees: new nodes under the
scope each caller gives; the same graph on every worker.
"""
from __future__ import annotations

import tensorflow as tf

from parallax_ng.graph import emit
from parallax_ng.graph.ir import TensorRef, format_input


def coalesce(scope: str, values: str, indices: str, dtype, idx_dtype, device: str):
    """Each distinct row once: duplicate indices' values summed, in the order
    the indices first appear."""
    return [emit.node_def(f"{scope}/unique", "Unique", [indices], device, T=idx_dtype,
                          out_idx=tf.int32),
            emit.node_def(f"{scope}/rows", "Size", [f"{scope}/unique"], device, T=idx_dtype,
                          out_type=tf.int32),
            emit.node_def(f"{scope}/coalesced", "UnsortedSegmentSum",
                          [values, f"{scope}/unique:1", f"{scope}/rows"], device, T=dtype,
                          Tindices=tf.int32, Tnumsegments=tf.int32),
            # what later passes re-point (the job's rows), apart from the above
            emit.node_def(f"{scope}/distinct", "Identity", [f"{scope}/unique"], device,
                          T=idx_dtype)]


def by_id(ctx, scopes: str, values: list, indices: list, dtype, idx_dtype):
    """Each replica's rows (`values`, `indices`: one per replica) summed by
    id, on the replica's device, under `scopes`.format(replica): (nodes,
    values, indices)."""
    nodes, out_values, out_indices = [], [], []
    for k, device in enumerate(ctx.plan.devices):
        part = scopes.format(k)
        nodes += coalesce(part, values[k], indices[k], dtype, idx_dtype, device)
        out_values.append(f"{part}/coalesced")
        out_indices.append(f"{part}/distinct")
    return nodes, out_values, out_indices


def replica_rows(ctx, var, grad, scope, shares: dict | None = None):
    """Each replica's gradient rows as they leave it: (nodes, values,
    indices, outputs). Coalesced when the plan says so: each distinct row
    once, duplicates summed, and a global norm's L2Loss of the rows (the
    outputs) the sum over the replicas of their rows' shares, squared
    before the sum, as one device squares every row (`shares`: left in it
    to be summed with other variables', `summed_norms`)."""
    plan, tg = ctx.plan, ctx.tg
    vt, it = tg.tensor(grad.values), tg.tensor(grad.indices)
    n = plan.num_replicas
    values = [ctx.replica_tensor(k, grad.values) for k in range(n)]
    indices = [ctx.replica_tensor(k, grad.indices) for k in range(n)]
    nodes, outputs = [], {}
    if not plan.variables[var].coalesce:
        return nodes, values, indices, outputs
    made, outputs = norm_shares(ctx, var, scope, values, shares)   # rows before the sums
    nodes += made
    made, values, indices = by_id(ctx, f"{scope}/replica_{{}}/rows", values, indices,
                                  vt.dtype, it.dtype)
    return nodes + made, values, indices, outputs


def norm_shares(ctx, var, scope: str, values: list[str], shares: dict | None = None):
    """(nodes, outputs): a global norm's L2Loss of `var`'s gradient rows (the
    uses `coalescing` lists) as each replica's rows, scaled for a mean,
    squared, and summed over the replicas, as one device squares every row.
    With `shares`, the replicas' shares are put there (var: (the L2Loss
    ops, dtype, shares)) for `summed_norms`, and no outputs made."""
    plan, tg = ctx.plan, ctx.tg
    norms = ctx.facts.coalescing(var)
    if not norms:
        return [], {}
    dtype = tg.tensor(tg.gradients[var].values).dtype
    scale = 1.0 / plan.group_size if plan.average_sparse else 1.0
    nodes, parts = [], []
    for k, device in enumerate(plan.devices):
        part = f"{scope}/replica_{k}/norm"
        nodes += [emit.const(f"{part}/scale", scale, dtype, device),
                  emit.node_def(f"{part}/scaled", "Mul", [values[k], f"{part}/scale"], device,
                                T=dtype),
                  emit.node_def(part, "L2Loss", [f"{part}/scaled"], device, T=dtype)]
        parts.append(part)
    if shares is not None:
        shares[var] = (norms, dtype, parts)
        return nodes, {}
    made, summed = ctx.comm.all_reduce(f"{scope}/norm", parts, dtype, False)
    return nodes + made, {TensorRef(norm, 0): summed for norm in norms}


def summed_norms(ctx, scope: str, shares: dict):
    """(nodes, outputs): the norm shares `norm_shares` left in `shares`,
    of one dtype, summed over the replicas in one all-reduce of their
    vector per replica, each variable's L2Loss ops reading their entry."""
    variables = sorted(shares)
    dtype = shares[variables[0]][1]
    nodes, packed = [], []
    for k, device in enumerate(ctx.plan.devices):
        at = f"{scope}/replica_{k}"
        nodes.append(emit.node_def(f"{at}/shares", "Pack", [shares[v][2][k] for v in variables],
                                   device, T=dtype, N=len(variables), axis=0))
        packed.append(f"{at}/shares")
    made, summed = ctx.comm.all_reduce(f"{scope}/sum", packed, dtype, False)
    nodes += made
    outputs = {}
    for k, device in enumerate(ctx.plan.devices):
        at = f"{scope}/replica_{k}/summed"
        nodes.append(emit.node_def(at, "Unpack", [summed[k]], device, T=dtype,
                                   num=len(variables), axis=0))
        for j, var in enumerate(variables):
            for norm in shares[var][0]:
                outputs.setdefault(TensorRef(norm, 0), []).append(format_input(at, j))
    return nodes, outputs
