"""A traced function's graph with every call inlined, as the analysis reads it.

The passes read a step's ops one by one: a function call is a single op
whose inside they cannot see (a loss computed in it has no form, a
variable read in it no gradient they can aggregate). Grappler's function
optimizer inlines calls and lowers tf.cond / while_loop to Switch/Merge,
as TensorFlow's own graph freezing runs it, but it leaves alone a
function marked to be compiled by XLA (`tf.function(jit_compile=True)`,
Keras's `jit_compile=True` steps, a tf_keras optimizer's update on a GPU)
or marked not to be inlined. Those marks are taken off first: the
parallel step runs such a function's ops as ordinary ops (what XLA would
fuse, the replicas run unfused; its numbers are the ops' own).

Requires: a tf.function's ConcreteFunction.
Guarantees: a GraphDef of its graph in which no call of the library is
left but where the function optimizer keeps one (a function it cannot
inline), and no alternative implementation (`api_implements`) is kept;
`body_shapes` gives the traced shapes of the ops that came from function
bodies, and `loop_shapes` those of a lowered loop's own ops, which an
import of the GraphDef does not infer.
"""
from __future__ import annotations

import tensorflow as tf

from .. import compat

# the function attributes that keep Grappler from inlining a call
_KEPT_APART = ("_XlaMustCompile", "_noinline", "api_implements")


def inlined(concrete, keep=()):
    """The traced graph with every function call inlined and tf.cond /
    while_loop lowered to Switch/Merge, keeping what the outputs and the
    stateful ops (the function's control outputs) need. A tensor named in
    `keep` (what the step's tapes differentiated) keeps its name: a call's
    output becomes that of an IdentityN named as the call. Grappler runs on
    a virtual cluster of one CPU: the function optimizer does not look at
    devices, and the machine's own cluster would start a session and probe
    for GPUs each time (two log lines per traced function)."""
    from tensorflow.core.protobuf import (config_pb2, device_properties_pb2,
                                          meta_graph_pb2, rewriter_config_pb2)
    from tensorflow.python.grappler import cluster as gcluster
    from tensorflow.python.grappler import tf_optimizer
    graph_def = concrete.graph.as_graph_def()
    unmarked(graph_def)
    _shaped(graph_def, concrete.graph)
    # no collections: what Grappler keeps is the train_op collection below
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph_def, graph=concrete.graph,
                                                collection_list=[])
    fetch = meta_graph_pb2.CollectionDef()
    nodes = {node.name for node in graph_def.node}
    fetch.node_list.value.extend([t.name for t in concrete.inputs + concrete.outputs] +
                                 [op.name for op in concrete.graph.control_outputs] +
                                 [name for name in keep if name.split(":")[0] in nodes])
    meta.collection_def["train_op"].CopyFrom(fetch)
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.min_graph_nodes = -1
    rewrite.optimizers.append("function")
    rewrite.function_optimization = rewriter_config_pb2.RewriterConfig.AGGRESSIVE
    cpu = device_properties_pb2.NamedDevice(
        name="/job:localhost/replica:0/task:0/device:CPU:0",
        properties=device_properties_pb2.DeviceProperties(type="CPU"))
    out = tf_optimizer.OptimizeGraph(config, meta, cluster=gcluster.Cluster(devices=[cpu]))
    untied(out, {op.name for op in concrete.graph.control_outputs} -
           {name.split(":")[0] for name in keep})
    return out


def _shaped(graph_def, graph) -> None:
    """Mark each node of `graph_def`'s functions with its outputs' shapes
    in the function's traced graph (`_output_shapes`, which the inliner
    keeps on the node it inlines: `body_shapes` takes them off)."""
    for f in graph_def.library.function:
        try:
            body = compat.function_graph(graph, f.signature.name)
        except (RuntimeError, ValueError, TypeError, KeyError):
            continue        # (a body that calls a function the rebuilt graph lacks: CTC's)
        if body is None:
            continue
        for node in f.node_def:
            try:
                op = body.get_operation_by_name(node.name)
            except KeyError:
                continue
            if op.type == node.op and op.outputs:
                node.attr["_output_shapes"].list.shape.extend(
                    o.shape.as_proto() for o in op.outputs)


def body_shapes(graph_def) -> dict:
    """{node: (op type, its outputs' traced shapes)} of the inlined nodes
    that came from function bodies, taken off `graph_def`. An import
    infers none of them in a lowered loop's body (it reads a Merge before
    the body's value that comes back to it: unknown, and so is everything
    after it); a later rewrite that changes a node would make its mark
    wrong, so they are kept beside the graph (tracing.py sets them)."""
    out = {}
    for node in graph_def.node:
        if "_output_shapes" in node.attr:
            out[node.name] = (node.op, [tf.TensorShape(s) for s in
                                        node.attr["_output_shapes"].list.shape])
            del node.attr["_output_shapes"]
    return out


_PASSED = {"Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration",
           "Switch", "RefSwitch", "Identity", "Merge", "RefMerge"}


def loop_shapes(graph: tf.Graph) -> None:
    """Set the shapes an import leaves unknown of a lowered loop's own ops
    (Enter, Merge, Switch, NextIteration, Exit, and the Identity ops that
    pass its variables into its body): each passes its input's; a Merge
    takes the shape compatible with what enters the loop and what the
    body passes back, assumed to be what enters while the body is read
    (as TensorFlow's own while_loop sets them)."""
    ops = [op for op in graph.get_operations() if op.type in _PASSED and op.outputs and
           op.outputs[0].shape.rank is None]
    shape = {}

    def of(t):
        return shape.get(t.name) if t.shape.rank is None else t.shape
    for _ in range(len(ops) + 1):
        changed = False
        for op in ops:
            if op.type.endswith("Merge"):
                ins = [s for s in map(of, op.inputs) if s is not None]
                new = ins[0] if ins else None
                for s in ins[1:]:
                    new = new.most_specific_compatible_shape(s)
            else:
                new = of(op.inputs[0]) if op.inputs else None
            outs = op.outputs[:2] if op.type.endswith("Switch") else op.outputs[:1]
            for t in outs:
                if new is not None and shape.get(t.name) != new:
                    shape[t.name], changed = new, True
        if not changed:
            break
    for op in ops:
        for t in op.outputs[:2]:
            if t.name in shape and shape[t.name].rank is not None:
                try:
                    t.set_shape(shape[t.name])
                except ValueError:
                    pass


def untied(graph_def, controls) -> None:
    """Make each IdentityN the inliner leaves named as a call that is only
    run (a stateful call among the function's control outputs) a NoOp
    after the same ops: its outputs, which no op reads, would otherwise
    read every output of the call (a fused batch normalization's reserve
    spaces, which only its gradient should read)."""
    read = {i.split(":")[0] for node in graph_def.node for i in node.input
            if not i.startswith("^")}
    for node in graph_def.node:
        if node.op == "IdentityN" and node.name in controls and node.name not in read:
            name, device = node.name, node.device
            after = list(dict.fromkeys("^" + i.lstrip("^").split(":")[0] for i in node.input))
            node.Clear()
            node.name, node.op, node.device = name, "NoOp", device
            node.input.extend(after)


def unmarked(graph_def) -> None:
    """Take the marks that keep a call apart off `graph_def`'s functions
    and off every call to them (in the graph and in function bodies)."""
    for f in graph_def.library.function:
        for key in _KEPT_APART:
            if key in f.attr:
                del f.attr[key]
    for nodes in [graph_def.node] + [f.node_def for f in graph_def.library.function]:
        for node in nodes:
            for key in _KEPT_APART:
                if key in node.attr:
                    del node.attr[key]
