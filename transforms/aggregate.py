"""Aggregate: every use of a gradient sees the gradient of the global batch.

Requires: replicas made by `replicate`; the plan's method per variable.
Guarantees: for each trained variable, the autodiff output of every replica
is combined across replicas before anything else reads it (clipping, global
norms, summaries, update ops), by the plan's method:
- allreduce: the backend's all-reduce (mean or sum; parallax_ng/comm/collectives.py),
  one per bucket of the plan's (packed flat on each replica's device,
  reduced, split back: transforms/flat_buffers.py), one per variable left
  out of buckets (a bucket of one included); a sparse gradient as a dense one
  (its rows summed by index, with their counts), then the touched rows;
- ps: sum of the worker's replicas on the variable's server (host CPU
  in-process; transforms/local_aggregation.py moves it to the worker's
  host); IndexedSlices are concatenated there, scaled by 1/N for a mean;
- allgather: the backend's all-gather of the IndexedSlices (with
  TensorFlow's collectives the row counts of every all-gathered variable
  a train op updates in one gather, then each variable's rows and ids in
  one; a global norm's shares of all of them in one all-reduce:
  transforms/replica_rows.py);
- factors: a dense gradient MatMul(a, b, transpose_a=True) by its two
  factors: every replica's [a | b] all-gathered, the product taken on
  every replica (the sum of the replicas' products);
- a sparse gradient that holds each id once on one device (its ids went
  through a Unique, as embedding_lookup_sparse's: TrainingGraph.rows_unique)
  has the job's rows summed by id (in the order the ids first appear, one
  device's order) before any use reads them: where the gathered, exchanged
  or concatenated rows arrive (on the server, after every worker's,
  transforms/server_sync.py), so a global norm or an update that squares
  rows sees one device's rows;
- a sparse gradient whose indices are the same on every replica (a lookup
  of positions: TrainingGraph.rows_alike) has its values summed row for
  row instead (all-reduced, or AddN on the server), its indices kept, so
  the update sees one device's rows (under allreduce, allgather and ps);
- alltoall (EmbRace): every replica's rows, each replica receiving its own
  columns of them (the table is cut by columns, parallax_ng/planning/column_cut.py),
  by the backend's exchange; a global norm's L2Loss of the rows is each
  replica's share, summed over the replicas;
- bfb (balanced fusion buffers, Herring): the replicas' sum on the host,
  packed into the plan's buffers, each buffer's shards summed over the
  workers on their servers (transforms/flat_buffers.py). Every worker
  applies the update to its own copy.
Gradients a script accumulates in variables of its own are aggregated where
the update reads them (graph/accumulation.py), after the adds the update
follows where a run adds and applies (`adds_before`); the accumulators' other reads
(a global norm of them logged) read the replicas' mean, exchanged as the
state-sync pass exchanges a mean (on the servers in a job that sums there).
New nodes live under `parallax/<method>/<variable>/` (bfb: `parallax/bfb/`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import tensorflow as tf

from parallax_ng import compat
from parallax_ng.errors import GraphError
from parallax_ng.graph import accumulation, branches, emit, rules
from parallax_ng.graph.ir import GraphIR, TensorRef, parse_input
from parallax_ng.methods import ALLREDUCE, BFB, METHODS
from parallax_ng.pipeline.results import CoalescedRows, ExchangedLookups, LocalAggregates
from parallax_ng.planning import analysis, deferral
from transforms.columns import lookup_exchange
from transforms.extremes import all_reduce, on_a_server
from transforms.flat_buffers import bucket, concat, elements, fusion_buffers
from transforms.replica_rows import by_id, coalesce, norm_shares, replica_rows, summed_norms


@dataclass(frozen=True)
class AggregatePass:
    name: str = "aggregate"
    requires: tuple = ("replicate",)
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        new_nodes, rewires, local, exchanged, gathered = [], {}, {}, {}, {}
        on_server, coalesced, reads = {}, {}, {}
        counts = dict.fromkeys(METHODS, 0)
        if ctx.plan.buffers:
            nodes, outputs = fusion_buffers(ctx)
            new_nodes.extend(nodes)
            _rewire(ctx, outputs, rewires)
            counts[BFB.name] = len(outputs)
        # a bucket of one variable is its own all-reduce, not packed
        merged = [(b, bucket_) for b, bucket_ in enumerate(ctx.plan.buckets)
                  if len(bucket_.variables) > 1]
        bucketed = {v for _, bucket_ in merged for v in bucket_.variables}
        for b, bucket_ in merged:
            nodes, outputs = bucket(ctx, b, bucket_.variables)
            new_nodes.extend(nodes)
            _rewire(ctx, outputs, rewires)
            counts[ALLREDUCE.name] += len(outputs)
        made, rows = _gathered_together(ctx)
        new_nodes.extend(made)
        new_nodes.extend(_accumulator_reads(ctx, rewires))
        for var, vp in sorted(ctx.plan.variables.items()):
            if METHODS[vp.method].fused or var in bucketed:
                continue
            grad = ctx.tg.gradients[var]
            build = {"allreduce": _allreduce, "ps": _ps,
                     "allgather": lambda c, v, g: _allgather(c, v, g, rows.get(v)),
                     "factors": _factors,
                     "alltoall": lambda c, v, g: _alltoall(c, v, g, exchanged, gathered,
                                                           coalesced, reads)}[vp.method]
            nodes, outputs = build(ctx, var, grad)
            new_nodes.extend(nodes)
            _rewire(ctx, outputs, rewires)
            counts[vp.method] += 1
            if vp.shared:
                local[var] = _ps_outputs(ctx.plan, var, grad.sparse)
                on_server[var] = tuple(n.name for n in nodes)
        norms = {v: f"parallax/ps/{v}/norm" for v, vp in ctx.plan.variables.items()
                 if vp.coalesce and vp.shared}
        ctx.publish(LocalAggregates(local, norms, on_server))
        if exchanged:
            ctx.publish(ExchangedLookups(exchanged, gathered, reads))
        if coalesced:
            ctx.publish(CoalescedRows(coalesced))
        for var, adds in accumulation.adds_before(ctx.tg).items():  # (a reference snapshot's)
            for k in range(ctx.plan.num_replicas):
                read = ctx.replica_tensor(k, ctx.tg.gradients[var].values)
                for nd in (nd for nd in new_nodes if read in nd.input):
                    nd.input.extend(f"^{ctx.replica_name(k, w)}" for w in adds)
        return ir.rewire(rewires, new_nodes), counts


def _allreduce(ctx, var, grad, method: str = "allreduce"):
    """A dense gradient all-reduced; a sparse one as dense rows, or its
    values alone where its rows are alike on every replica (each replica
    keeps its own indices, the same as the others')."""
    if grad.sparse and var not in ctx.tg.rows_alike:
        return _dense_rows(ctx, var, grad)
    plan, dtype = ctx.plan, ctx.tg.tensor(grad.values).dtype
    nodes, outs = ctx.comm.all_reduce(
        f"parallax/{method}/{var}",
        [ctx.replica_tensor(k, grad.values) for k in range(plan.num_replicas)],
        dtype, plan.average_sparse if grad.sparse else plan.average_dense, gradient=True)
    return nodes, {grad.values: outs}


def _factors(ctx, var, grad):
    """A dense gradient MatMul(a, b, transpose_a=True) from its factors:
    each replica's [a | b] gathered from every replica (one all-gather of
    rows, in replica order), and on every replica the product of the
    gathered a and b, which is the sum of every replica's product (times
    1/N for a mean)."""
    plan, tg = ctx.plan, ctx.tg
    a, b = tg.ir.data_inputs(analysis.product(tg, grad).name)[:2]
    m, dtype = compat.dim(tg.tensor(a).shape, 1), tg.tensor(grad.values).dtype
    scope = f"parallax/factors/{var}"
    nodes, joined, rows = [], [], []
    for k, device in enumerate(plan.devices):
        made, (both, ids) = emit.emit_traced(
            lambda x, y: (tf.concat([x, y], 1), tf.range(tf.shape(x)[0])),
            [(ctx.replica_tensor(k, a), dtype, tg.tensor(a).shape),
             (ctx.replica_tensor(k, b), dtype, tg.tensor(b).shape)],
            f"{scope}/replica_{k}/join", device)
        nodes += made
        joined.append(both)
        rows.append(ids)
    width = m + compat.dim(tg.tensor(b).shape, 1)
    made, gathered, _ = ctx.comm.all_gather(f"{scope}/gather", joined, rows, dtype, tf.int32,
                                            [None, width], mean=False)
    nodes += made
    scale = 1.0 / plan.group_size if plan.average_dense else 1.0
    outs = []
    for k, device in enumerate(plan.devices):
        made, (product,) = emit.emit_traced(
            lambda g: tf.matmul(g[:, :m], g[:, m:], transpose_a=True) * tf.cast(scale, dtype),
            [(gathered[k], dtype, [None, width])], f"{scope}/replica_{k}/product", device)
        nodes += made
        outs.append(product)
    return nodes, {grad.values: outs}


def _dense_rows(ctx, var, grad):
    """A sparse gradient all-reduced as a dense one: each replica's rows
    summed into a [rows, columns + 1] tensor whose last column counts the
    row's occurrences, one all-reduce, then the rows any replica touched
    (their sums; every occurrence's share of a global norm's L2Loss summed
    over the replicas). The planner allows it only where each row once,
    duplicates summed, is what the gradient's uses see (`coalescing`)."""
    plan, tg = ctx.plan, ctx.tg
    vt, it = tg.tensor(grad.values), tg.tensor(grad.indices)
    rows, width = tg.variables[var].shape[0], elements(tg, var) // tg.variables[var].shape[0]
    scope = f"parallax/allreduce/{var}"
    nodes, outputs = [], {}
    mean = plan.average_sparse and plan.group_size > 1
    sums = []

    def dense(v, i):
        flat = tf.reshape(v, [-1, width])
        return tf.math.unsorted_segment_sum(
            tf.concat([flat, tf.ones_like(flat[:, :1])], 1), i, rows)

    for k, device in enumerate(plan.devices):
        made, (total,) = emit.emit_traced(
            dense, [(ctx.replica_tensor(k, grad.values), vt.dtype, None),
                    (ctx.replica_tensor(k, grad.indices), it.dtype, [None])],
            f"{scope}/replica_{k}/dense", device)
        nodes += made
        sums.append(total)
    made, reduced = ctx.comm.all_reduce(f"{scope}/reduce", sums, vt.dtype, False,
                                        gradient=True)
    nodes += made
    values, indices = [], []
    for k, device in enumerate(plan.devices):
        def touched(total):
            where = tf.cast(tf.reshape(tf.where(total[:, -1] > 0), [-1]), it.dtype)
            got = tf.gather(total[:, :-1], where)
            if mean:
                got = got * tf.cast(1.0 / plan.group_size, vt.dtype)
            return tf.reshape(got, tf.concat([[-1], vt.shape[1:]], 0)), where
        made, (v, i) = emit.emit_traced(touched, [(reduced[k], vt.dtype, [rows, width + 1])],
                                        f"{scope}/replica_{k}/rows", device)
        nodes += made
        values.append(v)
        indices.append(i)
    outputs.update({grad.values: values, grad.indices: indices})
    if plan.variables[var].unique_rows:    # the touched rows are one device's rows
        return nodes, outputs
    made, norms = norm_shares(ctx, var, scope, [ctx.replica_tensor(k, grad.values)
                                                  for k in range(plan.num_replicas)])
    outputs.update(norms)
    return nodes + made, outputs


def _ps(ctx, var, grad):
    plan, n = ctx.plan, ctx.plan.num_replicas
    device = plan.server(var)    # transforms/local_aggregation.py: the worker's host
    scope = f"parallax/ps/{var}"
    dtype = ctx.tg.tensor(grad.values).dtype
    values = [ctx.replica_tensor(k, grad.values) for k in range(n)]
    out_values, out_indices = _ps_outputs(plan, var, grad.sparse)
    alike = var in ctx.tg.rows_alike     # rows summed row for row, replica 0's indices
    if grad.sparse:
        idx_dtype = ctx.tg.tensor(grad.indices).dtype
        indices = [ctx.replica_tensor(k, grad.indices) for k in range(n)]
        nodes = [emit.const(f"{scope}/axis", 0, tf.int32, device),
                 emit.node_def(f"{scope}/values", "AddN", values, device, T=dtype, N=n)
                 if alike else concat(f"{scope}/values", values, f"{scope}/axis", dtype, device),
                 emit.node_def(f"{scope}/indices", "Identity", indices[:1], device, T=idx_dtype)
                 if alike else concat(f"{scope}/indices", indices, f"{scope}/axis", idx_dtype,
                                       device)]
        outputs = {grad.indices: [out_indices] * n}
    else:
        nodes = [emit.node_def(f"{scope}/sum", "AddN", values, device, T=dtype, N=n)]
        outputs = {}
    rows = _rows(plan, var, grad.sparse)
    total = f"{scope}/values" if grad.sparse else f"{scope}/sum"
    if rows != total:
        nodes += [emit.const(f"{scope}/scale", 1.0 / plan.group_size, dtype, device),
                  emit.node_def(rows, "Mul", [total, f"{scope}/scale"], device, T=dtype)]
    vp = plan.variables[var]
    if grad.sparse and (vp.coalesce or vp.unique_rows):   # (server_sync sums the workers')
        nodes += coalesce(scope, rows, f"{scope}/indices", dtype, idx_dtype, device)
    if vp.coalesce:        # never with unique_rows: its norm is of the rows summed by id
        nodes.append(emit.node_def(f"{scope}/norm", "L2Loss", [rows], device, T=dtype))
        for norm in ctx.facts.coalescing(var):
            outputs[TensorRef(norm, 0)] = [f"{scope}/norm"] * n
    outputs[grad.values] = [out_values] * n
    return nodes, outputs


def _rows(plan, var: str, sparse: bool) -> str:
    """The worker's sum (dense) or concatenation (sparse) of its replicas'
    gradients of `var`, scaled by 1/group_size for a mean."""
    scope = f"parallax/ps/{var}"
    mean = plan.average_sparse if sparse else plan.average_dense
    if mean and plan.group_size > 1:
        return f"{scope}/mean"
    return f"{scope}/values" if sparse else f"{scope}/sum"


def _ps_outputs(plan, var: str, sparse: bool) -> tuple[str, str | None]:
    """Names of the worker-local aggregate of `var`'s gradient made by `_ps`:
    (values or dense sum, indices or None); scaled by 1/group_size for a
    mean; each distinct row once when the plan coalesces it."""
    scope = f"parallax/ps/{var}"
    vp = plan.variables[var]
    if sparse and (vp.coalesce or vp.unique_rows):
        return f"{scope}/coalesced", f"{scope}/distinct"
    return _rows(plan, var, sparse), (f"{scope}/indices" if sparse else None)


def _gathered_together(ctx):
    """(nodes, {variable: (its `replica_rows`, its row counts or None)}) of
    several all-gathered variables of one run (planning/packing.py `runs`: a train op's):
    their global norm's shares summed in one all-reduce (per dtype), not
    one each; where the backend gathers row counts apart from rows
    (TensorFlow's collectives), their row counts in one gather."""
    tg = ctx.tg
    gathered = [v for v, vp in sorted(ctx.plan.variables.items())
                if vp.method == "allgather" and v not in tg.rows_alike]
    run = ctx.facts.runs() if len(gathered) > 1 else dict.fromkeys(gathered, 0)
    nodes, out = [], {}
    for k in sorted({run[v] for v in gathered}):
        made, rows = _gathered_run(ctx, [v for v in gathered if run[v] == k],
                                   f"_{k}" if k else "")
        nodes, out = nodes + made, {**out, **rows}
    return nodes, out


def _gathered_run(ctx, gathered: list[str], run: str):
    if len(gathered) < 2:
        return [], {}
    tg, shares, nodes = ctx.tg, {}, []
    rows = {v: replica_rows(ctx, v, tg.gradients[v], f"parallax/allgather/{v}", shares)
            for v in gathered}
    for dtype in sorted({d.name for _, d, _ in shares.values()}):
        made, outputs = summed_norms(ctx, f"parallax/allgather/norms{run}_{dtype}", {
            v: s for v, s in shares.items() if s[1].name == dtype})
        nodes += made
        rows[min(shares)][3].update(outputs)
    counts = [None] * len(gathered)
    if hasattr(ctx.comm, "gather_counts"):
        made, counts = ctx.comm.gather_counts(
            f"parallax/allgather/counts{run}", [rows[v][2] for v in gathered],
            [tg.tensor(tg.gradients[v].indices).dtype for v in gathered])
        nodes += made
    return nodes, {v: (rows[v], c) for v, c in zip(gathered, counts)}


def _allgather(ctx, var, grad, counted=None):
    """The replicas' IndexedSlices gathered; with coalescing, each replica's
    distinct rows only, and a global norm's L2Loss summed over the replicas'
    shares (as one device squares every row). `counted`: the variable's
    rows and their counts (or None), from `_gathered_together`."""
    plan, tg = ctx.plan, ctx.tg
    if var in tg.rows_alike:
        return _allreduce(ctx, var, grad, "allgather")
    vt, it = tg.tensor(grad.values), tg.tensor(grad.indices)
    scope = f"parallax/allgather/{var}"
    rows, counts = counted or (replica_rows(ctx, var, grad, scope), None)
    nodes, values, indices, outputs = rows
    made, v, i = ctx.comm.all_gather(scope, values, indices, vt.dtype, it.dtype, vt.shape,
                                     plan.average_sparse, counts=counts)
    nodes += made
    if plan.variables[var].unique_rows:
        made, v, i = by_id(ctx, f"{scope}/replica_{{}}/by_id", v, i, vt.dtype, it.dtype)
        nodes += made
    outputs.update({grad.values: v, grad.indices: i})
    return nodes, outputs


def _part_reads(ctx, lookup: str, made: list) -> list[str]:
    """Per replica, the ResourceGather of the exchange `made` for `lookup`
    that reads the replica's own part (by its handle input)."""
    handle = ctx.tg.ir.data_inputs(lookup)[0]
    out = []
    for k in range(ctx.plan.num_replicas):
        mine = parse_input(ctx.replica_tensor(k, handle))[:2]
        out += [n.name for n in made if n.op == "ResourceGather" and
                parse_input(n.input[0])[:2] == mine][:1]
    if len(out) != ctx.plan.num_replicas:
        raise GraphError(f"the exchange of lookup {lookup!r} reads no part by its handle")
    return out


def _alltoall(ctx, var, grad, exchanged: dict, ids: dict, coalesced: dict, reads: dict):
    """Each replica's rows (each distinct row once when coalesced) exchanged,
    each replica receiving its columns of all of them; a global norm's
    L2Loss of the rows summed over the replicas (their rows' shares when
    coalesced, else their columns' shares). When the gradient's rows are a
    lookup's distinct ids, that lookup's exchange is built here too and the
    gradient reuses its gathered sizes and ids (`exchanged`: gather -> rows
    per replica, for the columns pass; `ids`: gather -> those sizes and ids
    per replica; `coalesced`: var -> each replica's coalesced rows and ids)."""
    plan, tg = ctx.plan, ctx.tg
    vt, it = tg.tensor(grad.values), tg.tensor(grad.indices)
    n, scope = plan.num_replicas, f"parallax/alltoall/{var}"
    nodes, values, indices, outputs = replica_rows(ctx, var, grad, scope)
    if plan.variables[var].coalesce:
        coalesced[var] = tuple(zip(values, indices))
    lookup = deferral.same_ids(ctx.facts, var, plan.distinct_lookups,
                               plan.variables[var].coalesce)
    gathered = None
    if lookup is not None:       # the forward's gathered ids serve the gradient too
        made, rows, gathered = lookup_exchange(ctx, lookup, plan.placement[var])
        reads[lookup] = _part_reads(ctx, lookup, made)
        nodes += made
        exchanged[lookup], ids[lookup] = rows, gathered
    made, v, i = ctx.comm.columns_gradient(scope, values, indices, plan.placement[var],
                                           vt.dtype, it.dtype, plan.average_sparse, gathered)
    nodes += made
    if plan.variables[var].unique_rows:      # each replica's columns of the job's rows
        made, v, i = by_id(ctx, f"{scope}/replica_{{}}/by_id", v, i, vt.dtype, it.dtype)
        nodes += made
    outputs.update({grad.values: v, grad.indices: i})
    if plan.variables[var].coalesce:
        return nodes, outputs
    for norm in ctx.facts.column_uses(var).norms:     # each replica squared its columns
        made, summed = ctx.comm.all_reduce(
            f"{scope}/norm/{norm}", [ctx.replica_tensor(k, TensorRef(norm, 0))
                                     for k in range(n)], vt.dtype, False)
        nodes += made
        outputs[TensorRef(norm, 0)] = summed
    return nodes, outputs


def _accumulator_reads(ctx, rewires: dict) -> list:
    """An accumulator's reads besides its gradient's (accumulation.other_reads:
    a global norm of the accumulated gradients logged, a resource
    variable's second `acc / k`) read the replicas' mean, one device's
    value, exchanged as the state-sync pass exchanges a mean (before, each
    replica's own sum: a norm fetched 0.2 off one device's)."""
    tg, plan, made = ctx.tg, ctx.plan, []
    reduce = on_a_server if plan.reduces_on_servers else all_reduce
    branched = partial(on_a_server, branched=True) if plan.uses_servers else reduce
    memo: dict = {}
    reads = [r for _, g in sorted(tg.gradients.items())
             for r in accumulation.other_reads(tg, g.values)]
    for index, read in enumerate(reads):
        how = branched if plan.num_workers > 1 and \
            branches.switches_above(tg.ir, read.node, memo) else reduce
        nodes, outs = how(ctx, f"parallax/accumulated/{read.node}",
                          [ctx.replica_tensor(k, read) for k in range(plan.num_replicas)],
                          tg.tensor(read).dtype, True, index)
        made.extend(nodes)
        for consumer, pos in tg.ir.consumers.get(read, ()):
            for k in range(plan.num_replicas):
                rewires.setdefault((ctx.replica_name(k, consumer), pos), outs[k])
    return made


def _rewire(ctx, outputs: dict, rewires: dict) -> None:
    """Point every non-autodiff consumer of a gradient tensor of `outputs`,
    in every replica, at its aggregate (`outputs`: ref -> one per replica)."""
    for ref, per_replica in outputs.items():
        for consumer, pos in ctx.tg.ir.consumers.get(ref, ()):
            if rules.is_autodiff_use(ctx.tg.ir.node(consumer)):
                continue
            for k in range(ctx.plan.num_replicas):
                target = ctx.replica_name(k, consumer)
                rewires.setdefault((target, pos), per_replica[k])
                if target == consumer and k > 0:
                    break   # an op that exists once reads replica 0's aggregate
