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
Horovod's `backward_passes_per_step` does. The mean over N replicas of their
accumulators equals one device's accumulator with N times the batch, so the
update is one device's.

Requires: a TrainingGraph with writers and readers, the autodiff's ops, and
the front end's walk back from a tensor to the autodiff (`walk`).
Guarantees: reads the graph only; an accumulator is a variable that is not
trained, that a writer adds a gradient of the trained variable to
(AssignAdd, or Assign of `acc + g`, g not reading the accumulator). The
front end asks only when the update reaches the autodiff through such
reads alone (an optimizer's own accumulator, as Adagrad's, is read beside
the gradient).
"""
from __future__ import annotations

from .ir import TensorRef


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


def reader(tg, var: str, walk):
    """A function of a TensorRef: True when it reads an accumulator of
    `var`'s gradient. `walk(starts)`: the autodiff tensors of `var`'s
    gradient found back from `starts` (the front end's walk)."""
    cache: dict[str, bool] = {}

    def accumulates(acc: str) -> bool:
        if acc not in cache:
            v = tg.variables.get(acc)
            writers = [w for w in tg.writers.get(acc, ()) if v and w != v.initializer]
            added = [a for w in writers if (a := _added(tg, acc, w)) is not None]
            cache[acc] = bool(added) and not v.trainable and acc != var and bool(walk(added))
        return cache[acc]

    def reads(ref: TensorRef) -> bool:
        acc = read_variable(tg, ref)
        return acc is not None and accumulates(acc)
    return reads


def _added(tg, acc: str, writer: str) -> TensorRef | None:
    """What `writer` adds to `acc`: AssignAdd's value, or x of an Assign of
    `acc + x`, when x does not read `acc` (an optimizer's moving average,
    `m += (g - m) * c`, reads its slot: not an accumulation)."""
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
    elif op not in ("AssignAdd", "AssignAddVariableOp"):
        return None
    readers = set(tg.readers.get(acc, ()))
    return None if tg.ir.ancestors({added.node}, data_only=True) & readers else added
