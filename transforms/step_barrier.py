"""The step barrier of a job whose shared variables live on parameter
servers (transforms/server_sync.py's): no worker reads a shared variable
before the chief has applied the step's update to it.

Between runs (`between_steps`): the chief runs `parallax/server_sync/release`
once its writes are done, every other worker `parallax/server_sync/wait`
before it goes on (after initialisation, a restore, or a step the barrier
is not folded into). Inside a training run (`writers`, `releases`,
`waits`): the chief puts a token after each shared writer the run has,
the other workers' silenced writers take it. A writer inside a tf.cond's
branch (an update applied under a condition) has its token put where its
conds end (`ends`), so a step that skips the update still puts it and the
others, which take one every step, do not wait for it.

Requires: the PassContext of server_sync (its plan, TrainingGraph and
instance keys). Guarantees: node definitions; no rewiring but the chief's
writers' consumers waiting for the tokens (`releases`).
"""
from __future__ import annotations

import tensorflow as tf

from parallax_ng.graph import branches, emit
from parallax_ng.graph.ir import GraphIR, copy_node

SCOPE = "parallax/server_sync"
RELEASE = f"{SCOPE}/release"
WAIT = f"{SCOPE}/wait"


def queue(ctx, name: str, shared_name: str, dtypes, device: str):
    """A queue on a server under `shared_name` (this graph's: InstanceKeys.shared)."""
    return emit.fifo_queue(name, ctx.instance_keys.shared(shared_name), dtypes, device)


def between_steps(ctx):
    """Release (chief) or wait (other workers) tokens on the first server."""
    plan = ctx.plan
    device, nodes = plan.servers[0], []
    if plan.worker == 0:
        deps = []
        for w in range(1, plan.num_workers):
            q = f"{SCOPE}/done_{w}"
            nodes += [queue(ctx, q, f"parallax_ng/done/{w}", [tf.int32], device),
                      emit.const(f"{q}/token", 0, tf.int32, device),
                      emit.node_def(f"{q}/put", "QueueEnqueueV2", [q, f"{q}/token"], device,
                                    Tcomponents=[tf.int32], timeout_ms=-1)]
            deps.append(f"^{q}/put")
        nodes.append(emit.node_def(RELEASE, "NoOp", deps, device))
    else:
        q = f"{SCOPE}/done"
        nodes += [queue(ctx, q, f"parallax_ng/done/{plan.worker}", [tf.int32], device),
                  emit.node_def(WAIT, "QueueDequeueV2", [q], device,
                                component_types=[tf.int32], timeout_ms=-1)]
    return nodes


def writers(ctx) -> list[str] | None:
    """The chief's writers of shared state that training runs (those after the
    gradients), in a fixed order; None if one of them has no consumer to
    hang the step's release on (the barrier then stays a run of its own)."""
    tg, plan = ctx.tg, ctx.plan
    after_grads = tg.after_gradients
    found = sorted({w for var in plan.shared_state() for w in tg.writers.get(var, ())
                    if w in after_grads})
    ends_of = ends(ctx, found)
    if any(not ends_of[w] or any(not tg.ir.node_consumers.get(e) for e in ends_of[w])
           for w in found):
        return None
    return found


def ends(ctx, writers: list[str]) -> dict[str, list[str]]:
    """Per writer, what the chief's token for it waits on: the writer, or
    where it is inside a tf.cond's branch (an update applied under a
    condition), the Merges where its conds end, which run whether it ran
    or not (a token after a writer the step skipped would never be put)."""
    above = {}
    return {w: sorted(branches.after_branches(ctx.tg.ir, [w], memo=above)) for w in writers}


def releases(ctx, ir: GraphIR, writers: list[str]):
    """The barrier inside the training run, chief's side: after each shared
    writer (or where its branch ends: `ends`), one token per other worker,
    put before anything that follows (so every run that trains puts them)."""
    plan, device = ctx.plan, ctx.plan.servers[0]
    nodes, changed, ends_of = [], {}, ends(ctx, writers)
    for i, writer in enumerate(writers):
        for w in range(1, plan.num_workers):
            q = f"{SCOPE}/step_{i}_{w}"
            nodes += [queue(ctx, q, f"parallax_ng/step/{i}/{w}", [tf.int32], device),
                      emit.const(f"{q}/token", 0, tf.int32, device),
                      emit.node_def(f"{q}/put", "QueueEnqueueV2",
                                    [q, f"{q}/token"] + [f"^{e}" for e in ends_of[writer]],
                                    device, Tcomponents=[tf.int32], timeout_ms=-1)]
            for consumer in sorted({c for e in ends_of[writer]
                                    for c in ir.node_consumers.get(e, ())}):
                nd = changed.get(consumer) or copy_node(ir.node(consumer))
                nd.input.append(f"^{q}/put")
                changed[consumer] = nd
    return nodes, changed


def waits(ctx, writers: list[str], pushes: dict, reached: dict) -> list:
    """The barrier inside the training run, another worker's side: each
    silenced training writer takes the chief's token for it (after this
    worker's pushes of the runs it is `reached` by: its train op's), so
    the run ends once the chief has written."""
    plan = ctx.plan
    device, nodes = plan.servers[0], []
    for i, writer in enumerate(writers):
        runs, q = reached.get(writer, ()), f"{SCOPE}/step_{i}"
        after = ["^" + p for ps in pushes.values() for p, above, r in ps
                 if not above and (not runs or r in runs)]
        nodes += [queue(ctx, q, f"parallax_ng/step/{i}/{plan.worker}", [tf.int32], device),
                  emit.node_def(f"{q}/take", "QueueDequeueV2", [q] + after, device,
                                component_types=[tf.int32], timeout_ms=-1)]
    return nodes
