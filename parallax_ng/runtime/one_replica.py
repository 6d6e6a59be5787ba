"""Replica 0 alone: a run that trains nothing, given a batch the replicas
cannot split evenly (a test set of 10,000 rows over 3 replicas, one
example to predict), runs on replica 0 with the whole batch, as one device
would run it; the other replicas do not run.

A TF1 script evaluates so (`runner.run(accuracy, {x: test_images, ...})`)
and predicts so; split over the replicas, a batch of uneven parts would
make every mean over it a mean of unequal parts' means, and a part of no
rows a NaN. Replica 0 holds every variable's value (mirrored copies are
alike after each step; shared ones are read where they live). A run whose
fetches reach a collective (a value the passes exchange between the
replicas: a masked ratio's job-wide count, a metric's synced total, a
gradient) needs every replica, and its uneven feed stays an error.

Requires: the step graph the runner runs, and the fetch map's `Fetch`es
of a run (parallax_ng/runtime/combining.py). Guarantees: `alone` keeps
each fetch's replica 0 value, as `combine` gives it; `needs_every_replica`
and `reaches` read the graph only (`Reach`: once per set of fetches);
`refuse_untrained` raises for a run that would take a part of a job's
training step on its servers.
"""
from __future__ import annotations

from dataclasses import replace

import tensorflow as tf

from ..errors import FetchError
from ..graph.rules import COLLECTIVE_OPS, writes_state
from .combining import Fetch


def alone(fetches: list[Fetch]) -> list[Fetch]:
    """The fetches as replica 0 alone gives them (its copy of each op and
    tensor is the first of a Fetch's names)."""
    out = []
    for f in fetches:
        if f.how == "none":
            out.append(replace(f, names=f.names[:1]))
        elif f.how.startswith(("sparse", "slices")):
            parts = tuple(alone(list(f.parts)))
            out.append(replace(f, names=tuple(n for p in parts for n in p.names),
                               how="sparse first" if f.how.startswith("sparse") else f.how,
                               parts=parts))
        elif f.how in ("list", "handles"):
            out.append(replace(f, names=f.names[:1], replicas=(0,)))
        else:
            out.append(replace(f, names=f.names[:1], how="first", parts=()))
    return out


class Reach:
    """`needs_every_replica` of a step graph, read once per set of fetches
    (an evaluation loop asks at every uneven batch)."""

    def __init__(self, graph: tf.Graph):
        self.graph, self._known = graph, {}

    def needs_every_replica(self, fetches: list[Fetch]) -> bool:
        key = tuple(fetches)
        if key not in self._known:
            self._known[key] = needs_every_replica(self.graph, fetches)
        return self._known[key]


def needs_every_replica(graph: tf.Graph, fetches: list[Fetch]) -> bool:
    """Whether replica 0's fetches need an op that meets the other replicas
    (a collective, Horovod's or NCCL's ops, the job's queues), or write a
    variable (a metric's total, a counter: replica 0's copy alone would
    part from the others')."""
    return reaches(graph, [n for f in alone(fetches) for n in f.names], writes=True)


def reaches(graph: tf.Graph, names, writes: bool = False) -> bool:
    """Whether the ops and tensors `names` (of the step graph) need an op
    that meets the other replicas, or (with `writes`) write a variable."""
    todo = [graph.get_operation_by_name(n) if isinstance(n, str) and ":" not in n else
            n if isinstance(n, tf.Operation) else graph.get_tensor_by_name(n).op
            for n in names]
    seen = set()
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in COLLECTIVE_OPS or op.type.startswith(("Horovod", "Nccl")) or \
                writes and _writes(op) or op.name.startswith("parallax/") and "Queue" in op.type:
            return True
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return False


def refuse_untrained(tg, plan, reached: frozenset) -> None:
    """A run that trains nothing, in a job whose servers apply some
    variables, must not read those variables' gradients (user ops
    `reached`): worker 0's run would take a part of a training step's
    exchange on the servers, which the others' runs (each reading its own
    gradients) do not push, and the next step would wait for it. The same
    answer on every worker (the user's graph and the plan decide)."""
    if plan.num_workers < 2:
        return
    variables = getattr(plan, "variables", {})      # (layer-to-layer's plan all-reduces)
    read = sorted(v for v, g in tg.gradients.items() if v in variables and
                  variables[v].shared and {g.values.node, g.indices and g.indices.node} & reached)
    if read:
        raise FetchError(
            f"this run trains nothing but reads the gradient of {read[0]!r}, which the job's "
            "servers apply and exchange once per training step (a value computed from it, "
            "as a global norm): fetch it in the training op's run, runner.run([train_op, "
            "value]) (each worker's own replicas' value), or keep the dense variables off "
            "the servers (dense_method: allreduce or bfb)")


def _writes(op: tf.Operation) -> bool:
    """A resource variable's writer, or a reference variable's; not a
    random op's call counter (transforms/counted_draws.py), which is each
    copy's own: replica 0 alone draws as one device does."""
    return writes_state(op.type) and "/parallax_draws/" not in op.name
