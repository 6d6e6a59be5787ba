"""Gradients accumulated in variables of the script's own.

A script that trains with a larger batch than fits (or than it wants to feed
at once) adds the gradients of k micro-batches into variables of its own and
applies their sum (or mean) in a run of its own:

    accum = [tf.Variable(tf.zeros_like(v), trainable=False) for v in tvars]
    zero = [a.assign(tf.zeros_like(a)) for a in accum]
    add = [a.assign_add(g) for a, g in zip(accum, tf.gradients(loss, tvars))]
    train = opt.apply_gradients([(a / k, v) for a, v in zip(accum, tvars)])

Nothing in `train` comes from the autodiff: its gradient is a read of the
accumulator. `reader` recognises such a read, so the front end takes it as
the variable's gradient: every replica accumulates its own micro-batches'
gradients (the accumulator is replica-local state, never synchronised), and
the accumulators' values are aggregated once, when the update reads them, as
Horovod's `backward_passes_per_step` does; any other read of an accumulator
(`other_reads`: a global norm of the accumulated gradients logged) is the
replicas' mean too. The mean over N replicas of their
accumulators equals one device's accumulator with N times the batch, so the
update is one device's.

A script may also sum its gradients in Python: fetch them each run, add
them up, and feed the sums to `apply_gradients(zip(placeholders, tvars))`
(policy-gradient tutorials' gradient buffers). `fed_updates` lets such a
graph in, whose updates read no autodiff tensor.

Requires: a TrainingGraph with writers and readers, the autodiff's ops, and
the front end's walk back from a tensor to the autodiff (`walk`).
Guarantees: reads the graph only; an accumulator is a variable that is not
trained, whose writers only set it to zeros or add to it, and add a gradient
of the trained variable (AssignAdd, a scatter-add of a sparse gradient's
rows, or Assign of `acc + g`, g not reading the accumulator). The front end
asks only when the update reaches the autodiff through such
reads alone (an optimizer's own accumulator, as Adagrad's, is read beside
the gradient).

A step may also combine gradients it computed within itself: a
`tf.function` that takes two GradientTapes over halves of its batch and
applies `g1 / 2 + g2 / 2`. Aggregating one of them (the nearer to the
update) and leaving the other a replica's own is wrong; `sums` finds the
sums of gradients by constant factors (Add, AddV2, AddN, Sub of autodiff
tensors, each maybe negated, multiplied or divided by a constant, or
made dense from an IndexedSlices; or of zeros), which the front end takes
as autodiff tensors themselves: such a sum, aggregated, is the sum of the
aggregated parts (the mean and the sum over replicas are linear), so the
update is one device's.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import branches, variance
from .ir import TensorRef
from .rules import from_autodiff

_SUMS = ("Add", "AddV2", "AddN", "Sub")
_WRITES = ("Assign", "AssignVariableOp", "AssignAdd", "AssignAddVariableOp", "ScatterAdd",
           "ResourceScatterAdd")
_LONGEST = 16            # ops between a gradient and its sum (a scale, a sign)


def sums(ir, autodiff) -> set[str]:
    """The sums of autodiff tensors (and of such sums) by constant factors,
    in the graph's order."""
    found: set[str] = set()
    grads = set(autodiff)
    for name in ir.topo_order:
        if name in grads or ir.node(name).op not in _SUMS:
            continue
        kinds = [_term(ir, ref, grads) for ref in ir.data_inputs(name)]
        if "gradient" in kinds and all(k in ("gradient", "zero") for k in kinds):
            found.add(name)
            grads.add(name)
    return found


def _term(ir, ref: TensorRef, grads) -> str | None:
    """"gradient" where `ref` is one of `grads` times a constant, "zero"
    where it is zeros, else None."""
    for _ in range(_LONGEST):
        if ref.node in grads:
            return "gradient"
        node, inputs = ir.node(ref.node), ir.data_inputs(ref.node)
        if node.op == "ZerosLike" or node.op == "Const" and _zero(node) or \
                node.op == "Fill" and ir.node(inputs[1].node).op == "Const" and \
                _zero(ir.node(inputs[1].node)):
            return "zero"
        if node.op == "UnsortedSegmentSum" and all(r.node in grads for r in inputs[:2]):
            return "gradient"          # an IndexedSlices gradient made dense
        if node.op in ("Identity", "Neg"):
            ref = inputs[0]
        elif node.op in ("RealDiv", "Div", "Mul") and _const(ir, inputs[1]):
            ref = inputs[0]
        elif node.op == "Mul" and _const(ir, inputs[0]):
            ref = inputs[1]
        else:
            return None
    return None


def _const(ir, ref: TensorRef) -> bool:
    return ir.node(ref.node).op == "Const"


def _zero(node) -> bool:
    return not np.any(tf.make_ndarray(node.attr["value"].tensor))


def read_variable(tg, ref: TensorRef) -> str | None:
    """The variable `ref` reads: a resource variable's ReadVariableOp, a
    reference variable's read (an Identity of the variable's output)."""
    node = tg.ir.get(ref.node)
    if node is None or node.op not in ("ReadVariableOp", "Identity"):
        return None
    inputs = tg.ir.data_inputs(ref.node)
    if not inputs:
        return None
    var = tg.variable_of_handle(inputs[0])
    if node.op == "Identity" and var is not None and tg.ir.node(var).op == "VarHandleOp":
        return None                 # an Identity of a handle passes it on; it reads nothing
    return var


def other_reads(tg, ref: TensorRef) -> list[TensorRef]:
    """Where `ref` is the read of an accumulator that is a variable's
    gradient, the accumulator's other reads of its whole value, save those
    its writers read (`acc.assign(acc + g)`, a reset's `zeros_like(acc)`):
    a resource variable's every `acc / k` is a read of its own, and what
    reads them (a global norm of the accumulated gradients logged) must
    see one device's value, the replicas' mean, not a replica's own sum
    (transforms/aggregate.py exchanges them)."""
    acc = read_variable(tg, ref)
    if acc is None or acc not in tg.accumulators:
        return []
    adds = tg.ir.ancestors([w for w in tg.writers.get(acc, ())], data_only=True)
    return [TensorRef(r, 0) for r in tg.readers.get(acc, ())
            if r != ref.node and r not in adds and read_variable(tg, TensorRef(r, 0)) == acc]


def reader(tg, var: str, walk):
    """A function of a TensorRef: True when it reads an accumulator of
    `var`'s gradient. `walk(starts)`: the autodiff tensors of `var`'s
    gradient found back from `starts` (the front end's walk)."""
    cache: dict[str, bool] = {}

    def accumulates(acc: str) -> bool:
        if acc not in cache:
            v = tg.variables.get(acc)
            writers = [w for w in tg.writers.get(acc, ()) if v and w != v.initializer]
            adds = {w: _added(tg, acc, w) for w in writers}
            added = [a for a in adds.values() if a is not None]
            cache[acc] = bool(added) and not v.trainable and acc != var and \
                all(_zeroes(tg, w) for w, a in adds.items() if a is None) and bool(walk(added))
        return cache[acc]

    def reads(ref: TensorRef) -> bool:
        acc = read_variable(tg, ref)
        return acc is not None and accumulates(acc)
    return reads


def adds_before(tg) -> dict[str, list[str]]:
    """{variable: the adds to its accumulator its update follows in the
    user's graph} for a reference accumulator whose `read` snapshot (made
    with the variable: no edge orders it) is the gradient, where a run adds
    and applies (after the add, or in a tf.cond on a step counter): one
    device's update reads the variable's buffer after the add, and so must
    the aggregation of the snapshot (transforms/aggregate.py; before, it
    could take the sum before the run's add). Not an add computed from the
    snapshot (no cycle); one in a tf.cond's branch by the Merges that end
    it."""
    out, memo = {}, {}
    for acc, var in sorted(tg.accumulators.items()):
        read = tg.gradients[var].values.node
        if tg.ir.node(read).op != "Identity":      # (a resource variable's: read where it is)
            continue
        before = tg.ir.ancestors(_updates(tg, var))
        later = tg.ir.descendants([read])
        adds = [w for w in _updates(tg, acc) if w in before and w not in later]
        if any(branches.switches_above(tg.ir, w, memo) for w in adds):
            adds = sorted(branches.after_branches(tg.ir, adds, before, memo))
        if adds:
            out[var] = adds
    return out


def _zeroes(tg, writer: str) -> bool:
    """Whether `writer` sets its variable to zeros (an accumulator's reset;
    an optimizer's slot is also written from itself: Adam's `m * beta1`
    before its scatter-add of a sparse gradient's rows)."""
    inputs = tg.ir.data_inputs(writer)
    return tg.ir.node(writer).op in ("Assign", "AssignVariableOp") and len(inputs) > 1 and \
        _term(tg.ir, inputs[1], frozenset()) == "zero"


def _added(tg, acc: str, writer: str) -> TensorRef | None:
    """What `writer` adds to `acc`: AssignAdd's value, a scatter-add's rows,
    or x of an Assign of `acc + x`, when x does not read `acc` (an
    optimizer's moving average, `m += (g - m) * c`, reads its slot: not an
    accumulation)."""
    op, inputs = tg.ir.node(writer).op, tg.ir.data_inputs(writer)
    if len(inputs) < 2:
        return None
    added = inputs[1]
    if op in ("Assign", "AssignVariableOp"):
        node = tg.ir.node(added.node)
        terms = tg.ir.data_inputs(added.node)
        if node.op not in ("Add", "AddV2") or len(terms) != 2:
            return None
        own = [t for t in terms if read_variable(tg, t) == acc]
        if len(own) != 1:
            return None
        added = terms[1 - terms.index(own[0])]
    elif op in ("ScatterAdd", "ResourceScatterAdd") and len(inputs) > 2:
        added = inputs[2]       # rows added at their ids (a sparse gradient's, or the
    elif op not in ("AssignAdd", "AssignAddVariableOp"):  # capture's rows of a dense add)
        return None
    readers = set(tg.readers.get(acc, ()))
    return None if tg.ir.ancestors({added.node}, data_only=True) & readers else added


def fed_updates(tg, autodiff: frozenset[str]) -> bool:
    """Whether the graph's optimizers apply fed values (placeholders) and
    nothing of the autodiff: a script that fetches its gradients, sums them
    in Python over several runs and feeds the sums to
    `apply_gradients(zip(placeholders, tvars))`. The fetched gradients are
    the replicas' mean (one device's, runtime/combining.py), the fed ones go
    whole to every replica (graph/batch.py), which all apply them alike. Not
    an update from the batch (a TF2 step's arguments, a gradient written by
    hand from the data's placeholders: graph/variance.py's sources)."""
    applied = False
    for var in tg.trainable:
        for w in _updates(tg, var):
            above = tg.ir.ancestors([w], data_only=True)
            if above & autodiff:
                return False            # an update from gradients the walk did not take
            nodes = [tg.ir.node(a) for a in above]
            if any(variance.is_input_source(tg, n) for n in nodes):
                return False    # computed from the batch (a gradient written by hand)
            applied |= _applies_fed(tg, w, nodes)
    return applied


def fed_variables(tg) -> list[str]:
    """The trained variables an optimizer updates from fed values, not from
    a gradient of the graph's nor from the batch (`fed_updates`; or beside
    variables that train from theirs)."""
    return sorted(var for var in tg.trainable if var not in tg.gradients and any(
        _applies_fed(tg, w, [tg.ir.node(a) for a in tg.ir.ancestors([w], data_only=True)])
        for w in _updates(tg, var)))


def _updates(tg, var: str) -> list[str]:
    return [w for w in tg.writers.get(var, ()) if w != tg.variables[var].initializer]


def _applies_fed(tg, write: str, above) -> bool:
    return tg.ir.node(write).op.startswith(_APPLIES) and \
        any(n.op in ("Placeholder", "PlaceholderWithDefault") for n in above) and \
        not any(variance.is_input_source(tg, n) for n in above)


_APPLIES = ("ResourceApply", "ResourceSparseApply", "Apply", "SparseApply")


def sinks(graph: tf.Graph) -> list[str]:
    """The variables (their ops' names) `graph` writes from the autodiff's
    outputs: where a step that applies no gradient puts them (accumulators
    that another step, another tf.function, applies)."""
    grads = from_autodiff(graph)
    return sorted({op.inputs[0].op.name for op in graph.get_operations()
                   if op.type in _WRITES and len(op.inputs) > 1 and
                   any(t.op.name in grads for t in op.inputs[1:])})
