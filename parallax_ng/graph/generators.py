"""tf.random.Generator's draws, as ops the passes know.

A `tf.random.Generator` (tf_keras's random image layers draw from one; TF2
loops create their own) keeps its state in an int64 variable: Philox's
128-bit counter as two words, then its key. Each draw reads that state
and advances the counter in one op, `RngReadAndSkip`, and passes the old
state to a stateless op as key and counter. No pass knows that op's write:
`edit` replaces each one (top level, in the copy graph/cond_lowering.py
makes, after its conds) by ops that say the same in the terms the passes
read:

    <op>/parallax_generator_state  ReadVariableOp(state)
    <op>/parallax_generator_next   AddV2(that, [0, 1, 0])   # the counter's high word
                                   (or TensorFlow's advance, for a fixed count)
    <op>/parallax_generator_write  AssignVariableOp(state, next)
    <op>                           Identity(state read, ^write)

A call whose count of values is not a constant (a draw of the batch's
shape) advances the high word of the counter by one, where TensorFlow
advances the low word by 256 per value drawn: a call's values take the
counter's low word from where the state has it, and no call draws 2**64
blocks, so no two calls share a value. A call of a fixed count advances
the low word as TensorFlow does (`_advanced`, the carry too), so a
generator drawn in fixed shapes alone (noise added to the gradients) keeps
one device's state and numbers. The advance is the same on every
replica (it does not depend on the replica's rows), so the replicas'
copies of the state stay equal with no exchange, and a checkpoint holds
it: a restarted job draws what the uninterrupted one draws.
The plan decides each such read like a random op (graph/randomness.py):
under `distinct`, replica r > 0 reads the key XORed with
`randomness.seed_mask(r)` (`randomness.key_mask`), so the replicas draw
their own numbers and replica 0 the user's stream. The state a step
leaves differs from one device's (another counter), as draws on several
replicas differ from one device's.

Requires: a tf.Graph. Guarantees: no edit where the graph draws from no
generator; else one made in a copy (the user's graph is left as it is). A
generator of another algorithm than Philox (ThreeFry runs under XLA only)
is refused by name.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import tensorflow as tf

from ..errors import GraphError
from . import emit
from .forms import constant_value
from .randomness import GENERATOR_READ as READ

OP = "RngReadAndSkip"
_PHILOX = (1, 3)    # RNG_ALG_PHILOX, and AUTO_SELECT (Philox on CPU and GPU)


def edit(graph: tf.Graph):
    """The edit of a meta graph that lowers each top-level RngReadAndSkip
    (cond_lowering.lowered makes it in its copy, after the conds, whose
    branches may hold draws), or None where the graph has none."""
    library = graph.as_graph_def().library.function
    if not any(op.type == OP for op in graph.get_operations()) and \
            not any(n.op == OP for f in library for n in f.node_def):
        return None
    deltas = {op.name: constant_value(op.inputs[2]) for op in graph.get_operations()
              if op.type == OP}       # a draw's values, where its shape is fixed
    return lambda meta: _lower(meta.graph_def, deltas)


def _lower(graph_def, deltas: dict) -> None:
    consts = {n.name: n for n in graph_def.node if n.op == "Const"}
    out = []
    for node in graph_def.node:
        if node.op != OP:
            out.append(node)
            continue
        resource, alg = node.input[:2]
        value = consts.get(alg.split(":")[0])
        if value is None or int(tf.make_ndarray(value.attr["value"].tensor)) not in _PHILOX:
            raise GraphError(
                f"op {node.name!r} draws from a tf.random.Generator whose algorithm is not "
                "Philox (or not a constant); parallax_ng replicates Philox generators "
                "(tf.random.Generator.from_seed(seed) on CPU and GPU): create it with "
                "alg='philox'")
        name, dev = node.name, node.device
        controls = [i for i in node.input if i.startswith("^")]
        read = emit.node_def(name + READ, "ReadVariableOp", [resource] + controls, dev,
                             dtype=tf.int64)
        delta = deltas.get(name)    # (None: a draw of the batch's shape, by the high word)
        if delta is None or np.ndim(delta):
            step = emit.const(name + "/parallax_generator_step", np.int64([0, 1, 0]),
                              tf.int64, dev)
            made = [step, emit.node_def(name + "/parallax_generator_next", "AddV2",
                                        [read.name, step.name], dev, T=tf.int64)]
            nxt = made[-1].name
        else:                   # of a fixed shape: TensorFlow's own advance
            made, (nxt,) = emit.emit_traced(partial(_advanced, by=256 * int(delta)),
                                            [(read.name, tf.int64, [3])],
                                            name + "/parallax_generator_next", dev)
        write = emit.node_def(name + "/parallax_generator_write", "AssignVariableOp",
                              [resource, nxt], dev, dtype=tf.int64)
        state = emit.node_def(name, "Identity", [read.name, "^" + write.name], dev,
                              T=tf.int64)
        out.extend([read, *made, write, state])
    del graph_def.node[:]
    graph_def.node.extend(out)


def _advanced(state, by: int):
    """Philox's state with its 128-bit counter (two words, low first) plus
    `by`, as RngReadAndSkip advances it: 256 per value a draw reserves."""
    low = state[0] + by
    carry = tf.cast(tf.bitcast(low, tf.uint64) < tf.bitcast(state[0], tf.uint64), tf.int64)
    return tf.stack([low, state[1] + carry, state[2]])
