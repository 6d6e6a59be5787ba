"""Server sync: shared variables updated once per step by a multi-worker job.

Requires: a multi-worker plan with shared state on parameter servers
(`plan.cross_worker_servers`); `aggregate` has summed each shared variable's
gradient over this worker's replicas (local aggregation); `place` has put
shared variables, their readers, writers and update math on their servers.
Guarantees (the synchronous parameter-server protocol of the Parallax paper):
- every worker but the chief (worker 0) pushes its local aggregates, one
  queue element per server and step (`parallax/server_sync/push_<j>`; a
  train op's of a graph with several, run apart, one of their own, after
  the reads its gradients depend on alone (packing.runs); those
  computed in a tf.cond's branch, an update applied under a condition, one
  of their own, `push_<j>b<g>`, in the steps that take it), after its
  replicas' reads of shared variables; its own writers of shared state
  become no-ops (their training writers wait for the pushes), so each update
  is applied exactly once;
- the chief takes every other worker's element from each server's queues, in
  worker order, and adds it to its own local aggregate on that server
  (dense: AddN; sparse: values and indices concatenated, then summed by id
  where one device's gradient holds each id once, `VariablePlan.unique_rows`,
  transforms/aggregate.py). Whatever read the
  local aggregate (clipping, update ops) reads the job's aggregate, and the
  chief's writers apply it; each of the chief's training writers of shared
  state, and a write they wait on that reads no gradient (a decoupled
  weight decay), runs after every take (`_after_pushes`);
- where writers of mirrored state need a job aggregate (a global norm that
  clips every gradient), the chief queues it back and the other workers
  take it after their push; reductions of it (L2Loss, Sum, ...) run on the
  server, so a scalar leaves the server instead of the aggregate;
- a barrier after each step (transforms/step_barrier.py; and after
  initialisation or a restore): the
  chief runs `parallax/server_sync/release` once its writes are done, every
  other worker runs `parallax/server_sync/wait` before it goes on, so no
  worker reads a shared variable before the step's update. The runner runs
  both; each wait is bounded by the run's timeout. A training run holds its
  own barrier (`Barrier.folded`): the chief puts a token after each shared
  writer, the others' silenced writers take it. (A step whose collectives
  run beside it, transforms/split_step.py, takes the tokens in its server
  run while the collective run goes on, so no worker waits for itself.)
Queues live on the servers under fixed shared names (a process's later
graph, a tuned size's or plan's, under its own: InstanceKeys.shared), so a
job needs fresh server processes (the launcher starts them).
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng import compat
from parallax_ng.comm import compression
from parallax_ng.errors import GraphError
from parallax_ng.graph import branches, emit
from parallax_ng.graph.ir import GraphIR, TensorRef, copy_node
from parallax_ng.graph.randomness import in_loops
from parallax_ng.pipeline.passes import replica_of
from parallax_ng.pipeline.results import Barrier, LocalAggregates
from transforms import step_barrier
from transforms.replica_rows import coalesce
from transforms.step_barrier import RELEASE, SCOPE, WAIT, queue


@dataclass(frozen=True)
class ServerSyncPass:
    name: str = "server_sync"
    requires: tuple = ("aggregate", "place")
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        plan = ctx.plan
        if not plan.cross_worker_servers:
            return ir, {}
        by_server: dict[str, list[str]] = {}
        for var in sorted(plan.variables):
            if plan.variables[var].shared:
                by_server.setdefault(plan.server(var), []).append(var)
        added, rewires, changed = [], {}, {}
        pushes, shared_back = {}, _needed_by_every_worker(ctx)
        reads = _forward_reads(ctx) if plan.worker > 0 else {}
        queued, takes, runs = 0, {}, ctx.facts.runs()
        for j, server in enumerate(plan.servers):
            if server not in by_server:
                continue
            each = [(v, p) for v in by_server[server] for p in _components(ctx, [v])]
            for j, switches, run, parts in _by_branches(
                    ir, j, [p for _, p in each], {p[0]: runs[v] for v, p in each}):
                queued += len(parts)
                back = [p for p in parts if p[0] in shared_back]
                if plan.worker == 0:
                    added += _take(ctx, ir, j, server, parts, rewires, _wires(ctx, parts),
                                   bool(switches))
                    takes.setdefault(run, []).extend(
                        [] if switches else [f"{SCOPE}/take_{j}_{w}"
                                             for w in range(1, plan.num_workers)])
                    added += _give_back(ctx, ir, j, server, back, rewires)
                    continue
                pushes.setdefault(server, []).extend(
                    (name, switches, run) for name in [f"{SCOPE}/push_{j}"] +
                    [f"{SCOPE}/result_{j}/take"] * bool(back))
                added += _push(ctx, ir, j, server, parts, reads.get(run, []),
                               _wires(ctx, parts))
                added += _take_back(ctx, ir, j, server, back, rewires)
        added += step_barrier.between_steps(ctx)
        step = step_barrier.writers(ctx)
        folded = step is not None
        ctx.publish(Barrier(release=RELEASE, folded=folded) if plan.worker == 0 else
                    Barrier(wait=WAIT, folded=folded))
        if plan.worker > 0:
            waits = step_barrier.waits(ctx, step or [], pushes, ctx.facts.reached_runs())
            added += waits
            changed = _silence_writers(ctx, ir, pushes, {w: f"^{n.name}" for w, n in
                                                         zip(step or [], waits[1::2])})
        elif folded:
            puts, changed = step_barrier.releases(ctx, ir, step)
            added += puts
        if plan.worker == 0:
            _after_pushes(ctx, ir, takes, changed)
        out = ir.replace(changed, added) if changed or added else ir
        if plan.worker > 0:   # a silenced writer is a NoOp: it no longer reads the aggregates
            rewires = {key: t for key, t in rewires.items() if key[0] not in changed}
        if rewires:
            out = out.rewire(rewires)
            out, moved = _reduce_on_server(out, rewires)
        else:
            moved = 0
        return out, {"servers": len(by_server), "queued_tensors": queued,
                     "silenced_writers": len(changed), "reductions_on_servers": moved}


def _after_pushes(ctx, ir: GraphIR, takes: dict[int, list[str]], changed: dict) -> None:
    """The chief's training writers of shared state wait for the other
    workers' pushes (`takes`, by run: a train op's writer for its own),
    which follow their reads of shared
    variables: a write that reads no gradient (Keras 3's decoupled weight
    decay, `variable.assign_sub(variable * wd * lr)` before the update)
    ran at the step's start, before another worker's forward pass had read
    the variable, which then trained on decayed weights."""
    if not any(takes.values()):
        return
    tg, reached = ctx.tg, ctx.facts.reached_runs()
    shared = {w for var in ctx.plan.shared_state() for w in tg.writers.get(var, ())
              if w in ir and ir.node(w).op not in branches.FUNCTIONAL}
    trained = {w for w in shared if w in tg.after_gradients}
    before = ir.ancestors(trained)          # a write the updates wait on is the step's
    for w in sorted(shared):
        if w in trained or w in before:
            runs = reached.get(w) or {r for u in trained & ir.descendants([w])
                                      for r in reached.get(u, ())} or set(takes)
            nd = changed.get(w) or copy_node(ir.node(w))
            nd.input.extend(f"^{t}" for r in sorted(runs) for t in takes.get(r, ())
                            if f"^{t}" not in nd.input)
            changed[w] = nd


def _components(ctx, variables: list[str]) -> list[tuple[str, tf.DType, bool]]:
    """(local aggregate tensor, dtype, sparse) of every shared variable on one
    server: a dense sum, or the values and indices of an IndexedSlices."""
    out, local = [], ctx.result(LocalAggregates)
    for var in variables:
        grad = ctx.tg.gradients[var]
        values, indices = local.of[var]
        dtype = ctx.tg.tensor(grad.values).dtype
        alike = var in ctx.tg.rows_alike      # summed row for row; the chief's indices
        out.append((values, dtype, grad.sparse and not alike))
        if indices and not alike:
            out.append((indices, ctx.tg.tensor(grad.indices).dtype, True))
        if var in local.norms:     # the rows' squared norm, summed over the workers
            out.append((local.norms[var], dtype, False))
    return out


def _by_branches(ir: GraphIR, j: int, parts: list,
                 run_of: dict) -> list[tuple[str, frozenset, int, list]]:
    """(queue key, Switch ops, run, components) of one server's components
    by the tf.cond branches they are computed in (an update applied under
    a condition) and by their `run_of` (packing.runs: the train op that
    applies them): each group moves through queues of its own, so a
    branch every worker skips, or a train op not run, moves none of its
    elements and the others' still move. The first group outside every
    branch keeps the server's index."""
    memo, groups = {}, {}
    for part in parts:
        above = frozenset(branches.switches_above(ir, part[0].split(":")[0], memo))
        groups.setdefault((above, run_of[part[0]]), []).append(part)
    ordered = sorted(groups.items(), key=lambda kv: (bool(kv[0][0]), sorted(kv[0][0]), kv[0][1]))
    return [(str(j) if not above and not g else f"{j}b{g}", above, run, group)
            for g, ((above, run), group) in enumerate(ordered)]


def _wires(ctx, parts) -> list:
    """Per component, the dtype it is pushed in: 16 bits for a gradient's
    values (not indices, not norms) under compression, else its own."""
    values = {v for v, _ in ctx.result(LocalAggregates).of.values()}
    return [compression.wire_for(ctx.plan, d) or d if t in values else d
            for t, d, _ in parts]


def _cast(name: str, tensor: str, src, dst, device: str):
    return emit.node_def(name, "Cast", [tensor], device, SrcT=src, DstT=dst, Truncate=False)


def _push(ctx, ir: GraphIR, j: str, server: str, parts, reads: list[str], wires: list):
    plan = ctx.plan
    q = f"{SCOPE}/queue_{j}"
    nodes, pushed = [], []
    for c, ((t, dtype, _), wire) in enumerate(zip(parts, wires)):
        if wire != dtype:        # narrowed where the aggregate is, before it leaves
            nodes.append(_cast(f"{SCOPE}/push_{j}/narrow_{c}", t, dtype, wire,
                               ir.node(t.split(":")[0]).device))
            t = nodes[-1].name
        pushed.append(t)
    return nodes + [queue(ctx, q, f"parallax_ng/grads/{j}/{plan.worker}", wires, server),
                    emit.node_def(f"{SCOPE}/push_{j}", "QueueEnqueueV2",
                                  [q] + pushed + ["^" + r for r in reads], server,
                                  Tcomponents=wires, timeout_ms=-1)]


def _take(ctx, ir: GraphIR, j: str, server: str, parts, rewires: dict, wires: list,
          branched: bool = False):
    """The chief's side: dequeue the other workers' elements and add each to
    the chief's own local aggregate, in worker order (16-bit components
    widened first, the chief's own narrowed and widened alike)."""
    plan = ctx.plan
    axis = f"{SCOPE}/axis_{j}"
    nodes, taken = [emit.const(axis, 0, tf.int32, server)], []
    local, tensors = ctx.result(LocalAggregates), {t for t, _, _ in parts}
    by_id = {local.of[v][0]: local.of[v][1] for v, vp in plan.variables.items()
             if vp.unique_rows and local.of.get(v, (None,))[0] in tensors}
    own = ["^" + t.split(":")[0] for t, _, _ in parts] * branched  # a branch not taken: no take
    for w in range(1, plan.num_workers):
        q, deq = f"{SCOPE}/queue_{j}_{w}", f"{SCOPE}/take_{j}_{w}"
        nodes += [queue(ctx, q, f"parallax_ng/grads/{j}/{w}", wires, server),
                  emit.node_def(deq, "QueueDequeueV2", [q] + own, server,
                                component_types=wires, timeout_ms=-1)]
        taken.append(deq)
    for c, ((tensor, dtype, sparse), wire) in enumerate(zip(parts, wires)):
        inputs = [tensor] + [f"{d}:{c}" for d in taken]
        if wire != dtype:
            own = f"{SCOPE}/take_{j}/narrow_{c}"
            nodes.append(_cast(own, tensor, dtype, wire, ir.node(tensor.split(":")[0]).device))
            inputs[0] = own
            for i, t in enumerate(inputs):
                nodes.append(_cast(f"{SCOPE}/take_{j}/wide_{c}_{i}", t, wire, dtype, server))
                inputs[i] = nodes[-1].name
        name = f"{tensor}/job"
        if sparse:
            summed = tensor in by_id or tensor in by_id.values()
            nodes.append(emit.node_def(name + ("_all" if summed else ""), "ConcatV2",
                                       inputs + [axis], server, T=dtype, N=len(inputs),
                                       Tidx=tf.int32))
        else:
            nodes.append(emit.node_def(name, "AddN", inputs, server, T=dtype, N=len(inputs)))
        for consumer, pos in ir.consumers.get(TensorRef(tensor, 0), ()):
            rewires[(consumer, pos)] = name
    dtypes = {t: d for t, d, _ in parts}
    for values, indices in by_id.items():      # the job's rows summed by id
        rows = f"{values}/job_rows"
        nodes += coalesce(rows, f"{values}/job_all", f"{indices}/job_all", dtypes[values],
                           dtypes[indices], server)
        nodes += [emit.node_def(f"{values}/job", "Identity", [f"{rows}/coalesced"], server,
                                T=dtypes[values]),
                  emit.node_def(f"{indices}/job", "Identity", [f"{rows}/distinct"], server,
                                T=dtypes[indices])]
    return nodes


REDUCTIONS = frozenset({"L2Loss", "Sum", "Max", "Min", "Mean", "Prod", "EuclideanNorm"})


def _reduce_on_server(ir: GraphIR, rewires: dict):
    """Reductions of the job's aggregates (e.g. the squared norms of a global
    norm) run on the server that holds them: a scalar leaves the server
    instead of the whole aggregate."""
    changed = {}
    for (consumer, _), tensor in rewires.items():
        node = ir.node(consumer)
        source = ir.node(tensor.split(":")[0])
        if node.op in REDUCTIONS and node.device != source.device:
            nd = changed.get(consumer) or copy_node(node)
            nd.device = source.device
            if "_class" in nd.attr:   # e.g. colocated with the gradient on a worker
                del nd.attr["_class"]
            changed[consumer] = nd
    return (ir.replace(changed) if changed else ir), len(changed)


def _needed_by_every_worker(ctx) -> set[str]:
    """Local aggregates (tensor names) whose job-wide value a non-chief worker
    needs: those that feed writers of state every worker writes itself
    (mirrored, or its replicas' columns of a table cut by columns), e.g.
    through a global norm used to clip every gradient."""
    tg, plan = ctx.tg, ctx.plan
    local = ctx.result(LocalAggregates)
    shared = plan.shared_state()
    own_writers = [w for v in plan.placement if v not in shared
                   for w in tg.writers.get(v, ())]
    # the user's L2Loss of coalesced values is replaced by the summed norms
    replaced = {n for v in local.norms for n in ctx.facts.coalescing(v)}
    feeding = tg.ir.ancestors(own_writers, stop=replaced.__contains__, data_only=True)
    out = set()
    for var, vp in plan.variables.items():
        grad = tg.gradients[var]
        if not vp.shared:
            continue
        # a global norm reads an IndexedSlices' values, not its indices
        for tensor, ref in zip(local.of[var], (grad.values, grad.indices)):
            if tensor and ref.node in feeding - replaced:
                out.add(tensor)
        if var in local.norms and feeding & set(ctx.facts.coalescing(var)):
            out.add(local.norms[var])
    return out


def _give_back(ctx, ir: GraphIR, j: str, server: str, back, rewires: dict):
    """The chief hands the job's aggregates in `back` to every other worker:
    whatever reads them on the chief waits until they are queued."""
    if not back:
        return []
    plan, dtypes = ctx.plan, [d for _, d, _ in back]
    nodes, puts = [], []
    for w in range(1, plan.num_workers):
        q = f"{SCOPE}/result_{j}_{w}"
        nodes += [queue(ctx, q, f"parallax_ng/result/{j}/{w}", dtypes, server),
                  emit.node_def(f"{q}/put", "QueueEnqueueV2",
                                [q] + [f"{t}/job" for t, _, _ in back], server,
                                Tcomponents=dtypes, timeout_ms=-1)]
        puts.append(f"^{q}/put")
    for tensor, dtype, _ in back:
        name = f"{tensor}/job_given"
        nodes.append(emit.node_def(name, "Identity", [f"{tensor}/job"] + puts, server, T=dtype))
        for key, value in list(rewires.items()):
            if value == f"{tensor}/job":
                rewires[key] = name
    return nodes


def _take_back(ctx, ir: GraphIR, j: str, server: str, back, rewires: dict):
    """A non-chief worker reads the job's aggregates in `back` after its push."""
    if not back:
        return []
    plan, dtypes = ctx.plan, [d for _, d, _ in back]
    q, deq = f"{SCOPE}/result_{j}", f"{SCOPE}/result_{j}/take"
    nodes = [queue(ctx, q, f"parallax_ng/result/{j}/{plan.worker}", dtypes, server),
             emit.node_def(deq, "QueueDequeueV2", [q, f"^{SCOPE}/push_{j}"], server,
                           component_types=dtypes, timeout_ms=-1)]
    for c, (tensor, _, _) in enumerate(back):
        for consumer, pos in ir.consumers.get(TensorRef(tensor, 0), ()):
            rewires[(consumer, pos)] = f"{deq}:{c}"
    return nodes


def _forward_reads(ctx) -> dict[int, list[str]]:
    """By run (packing.runs: a train op's), every replica's reads of shared
    variables that its gradients depend on: its push waits for them, so
    the chief's update cannot overtake them (not for another train op's,
    which its run does not compute). A
    read inside a tf.compat.v1 while loop (a recurrent layer's kernel, each
    step) is waited for by its outermost loop's exits: a control edge
    cannot leave a loop's frame; one inside a v1 tf.cond's branch by the
    Merges where its conds end (the branch not taken would leave the push
    dead: tf_keras's fused batch normalization reads its moving statistics
    in a branch, trained or not)."""
    runs = ctx.facts.runs()
    return {run: _reads_for(ctx, {r.node for v, g in ctx.tg.gradients.items() if runs[v] == run
                                  for r in (g.values, g.indices) if r is not None})
            for run in sorted(set(runs.values()))}


def _reads_for(ctx, gradients: set[str]) -> list[str]:
    tg = ctx.tg
    shared = ctx.plan.shared_state()
    grads = tg.ir.ancestors(gradients)
    reads = {r for var in shared for r in tg.reads(var)
             if r in grads and r not in ctx.unreplicated}
    inner = in_loops(tg.ir)
    if looped := inner & reads:     # their loops' exits out of every frame, before the gradients
        exits = {d for d in tg.ir.descendants(looped) & grads
                 if tg.ir.node(d).op in ("Exit", "RefExit")}
        outer = {e for e in exits if set(tg.ir.node_consumers.get(e, ())) - inner}
        reads = (reads - looped) | outer
    reads = branches.after_branches(tg.ir, reads, grads) - inner   # a read in a v1 tf.cond
    return [ctx.replica_name(k, r) for r in sorted(reads) for k in range(ctx.plan.num_replicas)]


def _silence_writers(ctx, ir: GraphIR, pushes: dict[str, list[tuple[str, frozenset, int]]],
                     waits: dict[str, str]) -> dict:
    """A non-chief worker's writers of shared state, as no-ops; training
    writers (those after the gradients) wait for this worker's push of
    their run and for the job's aggregates it takes back (and, in `waits`,
    for the chief's token that it has written), so every training step
    moves one element through each queue of its run, as the chief's does.

    A reference variable's writer returns the variable, and optimizers chain
    on it (Adam's sparse update scales `m` after its ScatterAdd). When that
    output only feeds other silenced writers, the chain is dead on this worker
    and the writer becomes an Identity of the variable, so the graph stays
    well formed; when it reaches anything else it is an error."""
    tg, plan, reached = ctx.tg, ctx.plan, ctx.facts.reached_runs()
    after_grads = tg.after_gradients
    writers = {w: var for var in sorted(plan.shared_state()) for w in tg.writers.get(var, ())}
    changed, memo = {}, {}
    for w, var in writers.items():
        if w in changed:
            continue
        above = set(branches.switches_above(ir, w, memo))    # its branch's pushes, or none
        runs = reached.get(w, ())
        deps = ["^" + p for p, s, r in pushes[plan.server(var)] if s <= above and
                (not runs or r in runs)] if w in after_grads else []
        deps += [waits[w]] if w in waits else []
        deps += [c for c in ir.node(w).input if c.startswith("^parallax/extremes/")]  # (its tie)
        if not _data_consumers(ir, w):
            changed[w] = emit.node_def(w, "NoOp", deps, plan.host)
            continue
        used = _live_uses(ir, w, set(writers)) if var in ir else [w]
        if used:
            raise GraphError(
                f"op {w!r} ({ir.node(w).op}) writes shared variable {var!r} and "
                f"{used[:3]} use its output; only the chief applies updates to "
                "parameter-server variables, so read the variable instead")
        dtype, _ = compat.output_dtypes(ir.node(w), ir.library)[0]
        changed[w] = emit.node_def(w, "Identity", [var, *deps], plan.host, T=dtype)
    return changed


def _live_uses(ir: GraphIR, name: str, silenced: set[str]) -> list[str]:
    """Ops through which a silenced writer's output would still be used on
    this worker: among its transitive data consumers (silenced writers aside),
    those with a consumer outside the chain, and those nothing consumes (a
    script may fetch them; not the other replicas' copies of the update
    math, which only replica 0's copy feeds a shared writer)."""
    chain, todo = set(), [name]
    while todo:
        for c, _ in _data_consumers(ir, todo.pop()):
            if c not in silenced and c not in chain:
                chain.add(c)
                todo.append(c)
    live = []
    for c in sorted(chain):
        users = ir.node_consumers.get(c, set())
        if users - chain - silenced or not users and replica_of(c)[0] == 0:
            live.append(c)
    return live


def _data_consumers(ir: GraphIR, name: str) -> list[tuple[str, int]]:
    outputs = len(compat.output_dtypes(ir.node(name), ir.library) or [None])
    return [u for i in range(outputs) for u in ir.consumers.get(TensorRef(name, i), ())]


__all__ = ["ServerSyncPass"]
