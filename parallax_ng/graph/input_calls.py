"""A TF1 graph's gradient calls taken with respect to its inputs, not its
variables (`tf.gradients(loss, x)`: FGSM's perturbation, a penalty on the
inputs' gradient), told apart from its training calls.

A traced TF2 step's tape says what each call differentiates
(graph/recorders.py notes it). A TF1 graph holds only the calls' ops, each
call in a scope of its own (`gradients/`, `gradients_1/`, ...; a second
derivative through another call's ops nests that call's scope in its own).
A training call's scope holds the gradient some trained variable's update
reads (the front end finds it); a call whose scope holds none takes the
gradient of the inputs only, and is noted where the step computes with
its result, a batch's rows (a fetched one is combined by the fetch map);
each result the step reads is noted with the tensor it is the gradient
of (its rows: graph/rows.py), found by the autodiff's names.

Requires: a TrainingGraph whose gradients the front end found.
Guarantees: `note` leaves the user's graph as it is: where it finds such
calls, the TrainingGraph's `graph` becomes a copy of the user's graph (same
names) holding them in graph/recorders.py's collection, which
graph/forms.py (they are no losses) and transforms/input_gradients.py
(their seeds) read. Where a gradient the updates read lies outside every
autodiff scope (an accumulator's read, a sum of two calls' gradients), the
calls cannot be told apart and every call counts as training, as before.
"""
from __future__ import annotations

from .. import compat
from . import cond_lowering, recorders, rules


def calls(tg) -> list[tuple[list[str], list[str], list]]:
    """(target names, seed names, []) of each tf.gradients call of `tg`'s
    graph that differentiates its inputs only."""
    grads = [ref.node for g in tg.gradients.values()
             for ref in (g.values, g.indices) if ref is not None]
    if tg.accumulators or not all(rules.is_autodiff(name) for name in grads):
        return []
    ops = tg.graph.get_operations()
    out = []
    for op in ops:
        if op.type != "Fill" or not recorders.GRAD_YS.search(op.name):
            continue
        scope = op.name[:op.name.rindex("/") + 1]
        if not any(name.startswith(scope) for name in grads) and _of_rows(ops, scope):
            out.append(([t.name for t in recorders.seeded(op)], [op.outputs[0].name],
                        _sources(tg.graph, ops, scope)))
    return out


def _sources(graph, ops, scope: str) -> list[tuple[str, str]]:
    """(result, source) names of the call in `scope`: each result read
    outside the autodiff (a penalty's square of it) has the rows of the
    tensor it is the gradient of, found by the autodiff's name for the
    result's op (`<scope><consumer>_grad/...`, through an AddN of several
    consumers' parts): the consumer's one input of the result's shape."""
    def source(t, hops=8):
        if t.op.type in ("AddN", "Identity") and hops:
            found = {source(x, hops - 1) for x in t.op.inputs} - {None}
            return found.pop() if len(found) == 1 else None
        name = t.op.name[len(scope):]
        if not t.op.name.startswith(scope) or "_grad/" not in name:
            return None
        try:
            consumer = graph.get_operation_by_name(name.split("_grad/")[0])
        except KeyError:
            return None
        like = {x.name for x in consumer.inputs
                if x.dtype == t.dtype and x.shape.is_compatible_with(t.shape)}
        return like.pop() if len(like) == 1 else None
    read = {x.name: x for op in ops if not rules.is_autodiff(op.name) for x in op.inputs
            if x.op.name.startswith(scope)}
    return [(name, found) for name, x in read.items() if (found := source(x))]


def _of_rows(ops, scope: str) -> bool:
    """Whether ops outside every autodiff scope read results of the call in
    `scope` (FGSM's sign, a penalty's square), each of rows the graph
    leaves open (a batch's: `[None, ...]`). A call only fetched (a
    debugging print of a gradient) is left to the fetch map, and one of a
    variable's value (a meta-learning step's fast weights, of a static
    shape) is left as it was."""
    read = [x for op in ops if not rules.is_autodiff(op.name) for x in op.inputs
            if x.op.name.startswith(scope)]
    return bool(read) and all(x.shape.rank and compat.dim(x.shape, 0) is None for x in read)


def note(tg) -> None:
    """Note `calls(tg)` in a copy of the graph, which becomes `tg.graph`."""
    found = calls(tg)
    if not found:
        return
    if tg.graph is tg.user_graph:
        tg.graph = cond_lowering.copied(tg.graph)
    recorders.note_input_gradients(tg.graph, found)

