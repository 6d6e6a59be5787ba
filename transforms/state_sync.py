"""State sync: mirrored state written from per-replica data stays equal.

Requires: replicas made by `replicate`.
Guarantees: when a mirrored variable is written with a value computed from a
replica's own batch (batch-norm moving statistics, streaming metric totals),
that value is all-reduced across replicas first, by the rule table in
`parallax_ng.rules` (AssignAdd: sum; AssignSub and Assign: mean; those of one
dtype and rule with static shapes as one tensor: one exchange a step for a
metric's total and count), so the replicas never drift apart. Two forms are
told apart from what the value computes: an Assign of `var + increment` whose
increment does not read `var` is an accumulation (Keras 3's metrics: totals and
counts), so the replicas' increments are summed, as AssignAdd's are, and the
total equals one device's with the global batch; an AssignAdd whose increment
reads `var` is a moving average written as an add, so it is averaged; so is an
increment that is a mean over the replica's batch (tf.compat.v1.metrics.mean of
a mean loss: one device adds the global batch's mean, the mean of the
replicas'). An increment that is the same on every replica and counts the
batch's rows (a multiple of the replica batch made of constants:
tf.compat.v1.metrics' count over a batch of static shape, folded by TensorFlow)
is multiplied by the replica count, as one device adds the global batch's. A
loss that divides a sum over the batch by a count of the data's values (a
masked mean, `tf.compat.v1.losses` with per-example weights) divides by the
replicas' mean count in every replica, forward and gradient, so the mean of the
replicas' gradients is one device's (the global sum over the global count); a
count floored or smoothed first (`tf.maximum(count, 1)`, `count + eps`) is
floored from the job's sum and divided by N (transforms/counts.py reads the
counts). Scalars read beside the loss (a masked accuracy or an RMSE a metric
adds up, a script fetches or a step returns; counts.beside) take the job's
counts and means too, centred on the job's means (counts.centres). A function
of sums over the batch (a Dice loss's ratio; graph/batch_sums.py) takes the
job's sums, and their incoming gradients' sums, so the mean of the replicas'
gradients is one device's; also in the losses Keras's trackers add. A loss that
sums over the batch and adds a term without data (a regularizer) where the
replicas' gradients are summed: every replica adds 1/N of the term, to the loss
and to the variables' gradients (the parts of a gradient's sum that do not
depend on the data's values), so the replicas' sums are one device's. A mean
over a count added to a sum over the batch (graph/forms.py `widened`) divides
by N times the count in every replica, forward and gradient, where the
gradients are summed or in a graph without gradients; a tracker's increment of
a summed scalar times the replica's row count (Keras's loss tracker) is taken N
times, so totals and logs are one device's. In a job that sums dense gradients
on the servers (fusion buffers) these sums go there too, so the step keeps no
collective op; so do those in a tf.cond's branch in any job with servers (a
collective would put the branch in both of a split step's runs). A write from
the batch's largest or smallest values (a running maximum), or assigned from
its sums or row count (a learning rate scaled by the rows: an update's too),
reads the job's (transforms/extremes.py). A write whose value holds rows of the
replica's examples (an RNN's state kept from step to step) is not synced: each
replica keeps its own examples' rows, as one device's holds them
(`PerExampleState`). A queue of the batch's rows in a variable (MoCo's) or a
memory bank written at its examples' ids takes the job's rows
(transforms/job_rows.py). Batch normalization's statistics and incoming
gradients the plan names (graph/normalization.py) are the job's means.
Initializers: the `init` pass.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import numpy as np

from parallax_ng.graph import (averaging, branches, emit, forms, randomness, replica_sums,
                               rules)
from parallax_ng.graph.ir import GraphIR, parse_tensor
from parallax_ng.graph.rows import batch_axis
from parallax_ng.graph.rows import reading as read_rows
from parallax_ng.pipeline.results import PerExampleState, SyncedInputs, WidenedMeans
from transforms import counts, extremes, job_rows
from transforms.extremes import all_reduce, on_a_server


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
        new_nodes, rewires, tracked, untrained, above = [], {}, [], set(), {}
        syncs = []                              # (scope, tensors, tensor, mean, node, at)
        means = []          # increments averaged as means over the batch: their counts shared
        unshown = []        # state added scalars that mix the batch's examples
        replaced = set()            # (node, input) now the replicas' reduction: SyncedInputs
        sources = forms.sources(tg.graph)          # what _a_mean counts as data
        batch = forms.replica_batch(tg.graph, sources)
        summing = not plan.average_dense and not plan.average_sparse
        form = counts.Forms(sources)                    # each loss's form, read once
        products = averaging.tracker_products(tg.graph, sources)
        widened = counts.widened(tg, form, products, summing)
        examples, per_example, extreme = read_rows(sources, tg.graph), {}, {}
        trained = tg.ir.ancestors({g.values.node for g in tg.gradients.values()}, data_only=True)
        from_autodiff = rules.from_autodiff(tg.graph)     # (by data edges)
        branches.warn_out_of_reach(tg, ctx.varies)
        looped, in_loops = [], {n for n in randomness.in_loops(tg.ir)    # (an Exit's value is
                                if tg.ir.node(n).op not in ("Exit", "RefExit")}   # the loop's)
        for var, writers in sorted(tg.writers.items()):
            if not plan.mirrored(var) or var in tg.accumulators:    # replica-local sums
                continue
            for w in writers:
                if w in initializers:
                    continue
                branches.check_one_branch(tg, ctx.varies, var, w, above)
                for pos, ref in enumerate(tg.ir.data_inputs(w)):
                    if pos and not ctx.varies(ref) and \
                            (rows := _rows_counted(tg, var, w, pos, batch)) is not None:
                        nodes, outs = _times_replicas(ctx, ir, *rows, ctx.plan.group_size)
                        new_nodes.extend(nodes)
                        rewires.update(outs)
                    if pos == 0 or not ctx.varies(ref):
                        continue
                    if tg.ir.node(w).op in _WHOLE_WRITES and \
                            (axis := examples.axis(tg.tensor(ref))) is not None:
                        per_example[var] = axis   # rows of examples: each replica its own
                        continue
                    if w in in_loops:       # a sync would run each turn: an exchange runs
                        looped.append((var, w))     # once a step (a second would wait)
                        continue
                    if made := job_rows.joined(ctx, w, ref, examples, synced, above):
                        new_nodes.extend(made[0])       # a queue of the job's rows
                        rewires.update(made[1])
                        continue
                    if var not in tg.gradients and tg.variables[var].dtype.is_floating and (
                            tg.variables[var].trainable or ref.node in from_autodiff):
                        untrained.add(var)      # (an optimizer's slot whose owner is unknown)
                    if (w, 2) in replaced:      # a scatter's indices and rows: synced once
                        continue
                    if tg.ir.node(w).op in _SCATTERS and \
                            (dense := _scatter_dense(ctx, ir, var, w)) is not None:
                        nodes, tensors, rows = dense    # rows added at indices: the job's
                        new_nodes.extend(nodes)         # rows summed at every index
                        if why := extremes.mixed(tg, tg.ir.data_inputs(w)[2], sources):
                            unshown.append((var, why))      # warned: summed
                        replaced.update({(w, 1), (w, 2)})
                        rewires.update({(ctx.replica_name(k, w), 1): rows
                                        for k in range(plan.num_replicas)})
                        syncs.append((f"{nodes[0].name}/sum", tensors,
                                      tg.tensor(tg.ir.data_inputs(w)[2]), False, w, 2))
                        continue
                    how = rules.STATE_SYNC_REDUCTION.get(tg.ir.node(w).op)   # (None: an update's)
                    node, at = w, pos
                    if how == "sum" and _reads(tg, var, ref.node):
                        how = "mean"              # a moving average written as an add
                    elif tg.ir.node(w).op in _ASSIGNS and (
                            delta := _accumulated(tg, var, ref)) is not None:
                        node, at, how = ref.node, delta, "sum"
                        ref = tg.ir.data_inputs(node)[delta]
                    if (cut := extremes.explained(tg, ref, ctx.varies, sources, trained,
                                                  how or "update")):
                        extreme.update(cut)     # the job's reductions: one device's write
                        continue
                    rules.state_sync_reduction(tg.ir.node(w).op, w, var, ref)  # (or refused)
                    if how == "mean" and (why := extremes.mixed(tg, ref, sources)):
                        unshown.append((var, why))      # warned: averaged
                    if how == "sum" and _a_mean(tg, ref, sources) and \
                            not form.over_widened(tg.tensor(ref), widened):
                        how = "mean"              # one device adds the global batch's mean
                        means.append(tg.tensor(ref))
                    elif how == "sum" and (why := counts.mixed(tg, ref, sources, products)):
                        how = "mean"              # warned: no rule makes it one device's
                        unshown.append((var, why))
                    scope = f"parallax/state_sync/{node}/input_{at}"
                    nodes, tensors = [], [ctx.replica_tensor(k, ref)
                                          for k in range(plan.num_replicas)]
                    loss = products.get(averaging.past(tg.tensor(ref)).op.name) \
                        if how == "sum" else None
                    if loss is not None and (forms.scalar_kind(loss, sources) == "sum"
                                             or form.over_widened(loss, widened)):
                        tracked.append(loss)
                        nodes, tensors = _times(ctx, ir, f"{scope}/sum_times_rows", tensors,
                                                node, tg.tensor(ref).dtype, plan.group_size)
                    new_nodes.extend(nodes)
                    syncs.append((scope, tensors, tg.tensor(ref), how == "mean", node, at))
        shared, read_once = extremes.in_shared_updates(ctx, sources, trained)
        extreme.update(shared)
        reduce = on_a_server if plan.reduces_on_servers else all_reduce
        branched = partial(on_a_server, branched=True) if plan.uses_servers else reduce
        in_branch = lambda node: branched if plan.num_workers > 1 and \
            branches.switches_above(tg.ir, node, above) else reduce     # noqa: E731
        on_servers = {r.node for r in shared} if plan.uses_servers else set()  # a shared
        nodes, synced = extremes.exchanged(     # update's by its servers' queues; and the
            ctx, ir, lambda n: on_a_server if n in on_servers else in_branch(n),   # data's
            extreme, sources, in_loops, synced, rewires, replaced)      # statistics
        new_nodes.extend(nodes)
        for together in _together(ir, ctx, syncs, set(sources), above):
            nodes, outs = _reduced(ctx, in_branch(together[0][4]), together, synced)
            synced += len(together)
            new_nodes.extend(nodes)
            for (*_, node, at), mine in zip(together, outs):
                replaced.add((node, at))
                for k, out in enumerate(mine):
                    rewires[(ctx.replica_name(k, node), at)] = out
        if widened:
            ctx.publish(WidenedMeans(frozenset(widened)))
        if per_example:
            ctx.publish(PerExampleState(tuple(sorted(per_example.items()))))
        if untrained:
            warnings.warn(counts.UNTRAINED.format(sorted(untrained)), stacklevel=2)
        branches.warn_in_loops(looped)
        if unshown:     # each variable's first
            warnings.warn(counts.MIXED.format(sorted(dict(unshown[::-1]).items())), stacklevel=2)
        read = means + counts.beside(tg, sources)      # scalars beside the loss: metrics'
        for count, widen in counts.shared(tg, sources, form, widened, products, read):
            dtype = tg.tensor(count).dtype
            outs = [ctx.replica_tensor(k, count) for k in range(plan.num_replicas)]
            if counts.by_job(tg, count, set(sources)):   # a masked mean's, n - 1: the job's
                nodes, outs, widen = _job_count(ctx, ir, reduce, count, set(sources), widen,
                                                synced, rewires, replaced)
                synced += 1
                new_nodes.extend(nodes)
            if widen:           # a mean added to a sum: over the job's count (times 1 / it)
                counts.read_everywhere(ctx, count, outs, rewires, replaced, widened)  # (others)
                nodes, outs = _times(ctx, ir, f"parallax/state_sync/{count.node}/widened", outs,
                                     count.node, dtype, plan.group_size ** widen)
                new_nodes.extend(nodes)
            counts.read_everywhere(ctx, count, outs, rewires, replaced)
        points = counts.exchanged(tg, sources, form, read, list(products.values())) + \
            replica_sums.points(tg.graph, {g.values.name for g in tg.gradients.values()})
        points = list(dict.fromkeys(points + list(plan.norm_points)))     # batch norm's too
        branches.warn_in_loops(means=[n for n, _ in points if parse_tensor(n).node in in_loops])
        for ref, mean, wide in counts.job_points(tg, points, form, widened):
            if ref.node in in_loops or counts.read_as_job(tg, ref, replaced):
                continue
            outs = [ctx.replica_tensor(k, ref) for k in range(plan.num_replicas)]
            nodes, outs = in_branch(ref.node)(ctx, f"parallax/state_sync/{ref.node}/"
                                              f"{ref.index}/job", outs, tg.tensor(ref).dtype,
                                              mean, synced)
            synced += 1
            new_nodes.extend(nodes)
            counts.read_everywhere(ctx, ref, outs, rewires, replaced, losses_apart=wide)
        parts = []      # a regularizer in or beside a summed loss: 1/N of it per replica
        if summing:
            parts = averaging.added_once(tg.graph, form)
            if parts or averaging.data_free(tg.graph):
                parts += [p for grad in tg.gradients.values()
                          for p in _data_free_parts(tg, grad, set(sources))]
        parts += [p for loss in tracked     # the loss a tracker adds (an evaluation's too)
                  for p in form(loss).once]
        for node, at in dict.fromkeys(parts):
            nodes, outs = _times_replicas(ctx, ir, node, at, 1.0 / plan.group_size, "once")
            new_nodes.extend(nodes)
            rewires.update(outs)
        ctx.publish(SyncedInputs(frozenset(replaced)))
        ir = ir.rewire(rewires, new_nodes)
        ties, writers = extremes.tie(ctx, ir, read_once)
        return ir.replace(writers, ties), {"synced": synced}


def _data_free_parts(tg, grad, sources: set) -> list[tuple[str, int]]:
    """(node, input position) of the terms of a dense gradient's sum (the
    autodiff's AddN over a variable's uses) that do not depend on the data's
    values: a regularizer's part."""
    if grad.sparse:
        return []
    ref = tg.ir.past_identities(grad.values)
    if tg.ir.node(ref.node).op not in ("AddN", "AddV2", "Add") or ref.index != 0:
        return []
    return [(ref.node, at) for at, r in enumerate(tg.ir.data_inputs(ref.node))
            if not counts.from_values(tg, r, sources)]


_SCATTERS = frozenset({"ScatterAdd", "ResourceScatterAdd", "ScatterSub", "ResourceScatterSub"})


def _scatter_dense(ctx, ir, var: str, w: str):
    """(nodes, each replica's rows summed by index into a tensor of `var`'s
    shape, every index) for a scatter-add of rows from the replica's batch
    (mean_per_class_accuracy's counts per class): summed over the replicas and
    added at every index, as one device adds. None if `var`'s rows are unknown."""
    shape, (_, indices, updates) = ctx.tg.variables[var].shape, ctx.tg.ir.data_inputs(w)
    if not shape or shape[0] is None:       # (VariableInfo.shape: ints, None where unknown)
        return None
    n = ctx.plan.num_replicas
    return emit.segment_sums(
        f"parallax/state_sync/{w}/dense", [ctx.replica_tensor(k, updates) for k in range(n)],
        [ctx.replica_tensor(k, indices) for k in range(n)], int(shape[0]),
        ctx.tg.tensor(indices).dtype, ctx.tg.tensor(updates).dtype,
        [ir.node(ctx.replica_name(k, w)).device for k in range(n)], ctx.plan.host)


_ASSIGNS = frozenset({"AssignVariableOp", "Assign"})
_WHOLE_WRITES = _ASSIGNS | {"AssignAdd", "AssignAddVariableOp", "AssignSub", "AssignSubVariableOp"}


def _accumulated(tg, var: str, ref) -> int | None:
    """Input position of the increment when `ref` is `var + increment` (an
    Add of a read of `var` itself and an increment that does not read it:
    Keras 3's metrics accumulate so), else None."""
    node = tg.ir.node(ref.node)
    if node.op not in ("AddV2", "Add") or ref.index != 0:
        return None
    ins = tg.ir.data_inputs(ref.node)
    for at, other in ((1, ins[0]), (0, ins[1])):
        if _is_read_of(tg, var, other) and not _reads(tg, var, ins[at].node):
            return at
    return None


def _rows_counted(tg, var: str, w: str, pos: int, batch: int | None):
    """(node, input position of the increment) when writer `w` adds to `var`, at
    input `pos`, an increment that is the same on every replica and counts
    the batch's rows: a value of constants alone that is a multiple of the
    replica batch B >= 2 (tf.compat.v1.metrics counts a batch of static
    shape so, its size folded by TensorFlow), where one device adds N times
    as many; None otherwise."""
    if batch is None or batch < 2:
        return None
    ref, op = tg.ir.data_inputs(w)[pos], tg.ir.node(w).op
    if op in _ASSIGNS and (delta := _accumulated(tg, var, ref)) is not None:
        node, at = ref.node, delta
    elif op in ("AssignAdd", "AssignAddVariableOp") and pos == 1:
        node, at = w, pos
    else:
        return None
    inc = tg.ir.data_inputs(node)[at]
    value = forms.constant_value(tg.tensor(inc))
    if value is None or np.ndim(value) or not value > 0 or value % batch:
        return None
    return node, at


def _job_count(ctx, ir, reduce, count, sources: set, widen: bool, index: int,
               rewires: dict, replaced: set):
    """(nodes, each replica's count, whether it is still to be widened) for
    a count the data's values set: the replicas' mean count; or, where the
    count is floored first (counts.floored), the floor of the replicas' sum
    (summed as the count's dtype where an integer is floored, then cast)
    over N, or whole where the mean is widened."""
    tg, n, scope = ctx.tg, ctx.plan.num_replicas, f"parallax/state_sync/{count.node}"
    dtype = tg.tensor(count).dtype
    at, inner = counts.floored(tg, count, sources)
    tensors, kind, nodes = [ctx.replica_tensor(k, inner) for k in range(n)], \
        tg.tensor(inner).dtype, []
    if kind != dtype:
        nodes, tensors = _cast(ctx, ir, f"{scope}/as_count", tensors, count.node, kind, dtype)
    more, sums = reduce(ctx, f"{scope}/count", tensors, dtype, at is None, index)
    nodes += more
    if at is None:
        return nodes, sums, widen
    if kind != dtype:
        more, sums = _cast(ctx, ir, f"{scope}/sum", sums, count.node, dtype, kind)
        nodes += more
    replaced.add(at)            # the floor of the job's count
    rewires.update({(ctx.replica_name(k, at[0]), at[1]): total for k, total in enumerate(sums)})
    more, outs = _times(ctx, ir, f"{scope}/floored", [ctx.replica_tensor(k, count)
                                                      for k in range(n)], count.node, dtype,
                        1.0 if widen else 1.0 / ctx.plan.group_size)
    return nodes + more, outs, False


def _cast(ctx, ir, scope: str, tensors: list, node: str, src, dst):
    """(nodes, names): replica k's tensor cast from `src` to `dst` on the
    device of its copy of `node`."""
    nodes = [emit.node_def(f"{scope}/{k}", "Cast", [t], ir.node(ctx.replica_name(
        k, node)).device, SrcT=src, DstT=dst) for k, t in enumerate(tensors)]
    return nodes, [nd.name for nd in nodes]


def _times_replicas(ctx, ir, node: str, at: int, factor, what: str = "rows"):
    """Every replica's `node` takes its input `at` times `factor` (the
    job's replica count, or its inverse)."""
    inc = ctx.tg.ir.data_inputs(node)[at]
    nodes, outs = _times(ctx, ir, f"parallax/state_sync/{node}/input_{at}/{what}",
                         [ctx.replica_tensor(k, inc) for k in range(ctx.plan.num_replicas)],
                         node, ctx.tg.tensor(inc).dtype, factor)
    return nodes, {(ctx.replica_name(k, node), at): out for k, out in enumerate(outs)}


def _times(ctx, ir, scope: str, tensors: list, node: str, dtype, factor):
    """(nodes, names): replica k's tensor times `factor`, on the device of
    its copy of `node`."""
    count = emit.const(f"{scope}/replicas", factor, dtype, ctx.plan.host)
    nodes = [count] + [emit.node_def(f"{scope}/{k}", "Mul", [t, count.name],
                                     ir.node(ctx.replica_name(k, node)).device, T=dtype)
                       for k, t in enumerate(tensors)]
    return nodes, [n.name for n in nodes[1:]]


def _a_mean(tg, ref, sources: list[str]) -> bool:
    """Whether `ref` is a mean over the replica's batch, or a tensor of such
    means (tf.compat.v1.metrics.mean of a mean loss, mean_tensor of a mean
    over the batch's axis): one device adds the global batch's, the
    replicas' mean. Placeholders and iterators count as data (a value scaled
    by a fed number is no mean); a sum scaled by a number not shown to be
    the batch size is one, as the gradients take it (forms.scalar_kind). A
    sum over the batch, or a value whose form is not shown, is summed."""
    t = tg.graph.get_tensor_by_name(f"{ref.node}:{ref.index}")
    if t.shape.rank is None or t.shape.rank and batch_axis(t, sources) is not None:
        return False
    return forms.scalar_kind(t, sources) == "mean"


def _is_read_of(tg, var: str, ref) -> bool:
    """A read of `var`'s value (a resource's ReadVariableOp, a reference's
    `read` Identity)."""
    return (tg.ir.node(ref.node).op in ("ReadVariableOp", "Identity", "Snapshot")
            and ref.node in tg.readers.get(var, ()))


def _reads(tg, var: str, name: str) -> bool:
    """True if node `name` depends on `var`'s value (data edges)."""
    readers = set(tg.readers.get(var, ()))
    return bool(readers & tg.ir.ancestors({name}, data_only=True))


def _together(ir, ctx, syncs: list, sources: set, above: dict) -> list[list]:
    """Syncs in groups reduced as one tensor (each exchange costs a message
    per worker): those of one dtype, sum or mean, static shape and data
    sources (a run that needs one can compute all), outside branches and
    loops, none reading what another's sum feeds (a cycle); others alone."""
    groups: dict = {}
    tg = ctx.tg
    for sync in syncs:
        _, _, t, mean, node, _ = sync
        alone = not t.shape.is_fully_defined() or branches.switches_above(tg.ir, node, above) \
            or tg.ir.node(node).op in _SCATTERS         # (t: the rows, not their sum)
        groups.setdefault(id(sync) if alone else (t.dtype, mean, frozenset(
            sources & tg.ir.ancestors([t.op.name]))), []).append(sync)
    out = []
    for group in groups.values():
        fed = {ctx.replica_name(0, node) for *_, node, _ in group}
        free = [s for s in group if len(group) > 1 and not fed & ir.ancestors(
            [ctx.replica_name(0, s[2].op.name)])]       # s[2]: the synced tensor
        out += ([free] if free else []) + [[s] for s in group if all(s is not f for f in free)]
    return out


def _reduced(ctx, reduce, together: list, index: int) -> tuple[list, list[list[str]]]:
    """(nodes, each sync's reduced tensors per replica): several as one vector."""
    if len(together) == 1:
        scope, tensors, t, mean, *_ = together[0]
        nodes, outs = reduce(ctx, scope, tensors, t.dtype, mean, index)
        return nodes, [outs]
    (_, _, t, mean, *_), shapes = together[0], [s[2].shape.as_list() for s in together]
    scope, nodes, packed, mine = f"parallax/state_sync/together_{index}", [], [], []
    for k, device in enumerate(ctx.plan.devices[:len(together[0][1])]):
        made, out = emit.flattened(f"{scope}/pack_{k}", [s[1][k] for s in together], t.dtype,
                                   shapes, device)
        nodes, packed = nodes + made, packed + [out]
    more, sums = reduce(ctx, scope, packed, t.dtype, mean, index)
    for k, (device, total) in enumerate(zip(ctx.plan.devices, sums)):
        made, outs = emit.unflattened(f"{scope}/unpack_{k}", total, t.dtype, shapes, device)
        nodes, mine = nodes + made, mine + [outs]
    return nodes + more, [list(each) for each in zip(*mine)]
