"""Building new nodes for a GraphDef.

Requires: nothing beyond TensorFlow. Guarantees: NodeDefs with deterministic
names. Hot, simple nodes (collective reduce, AddN, ConcatV2) are written
directly; composite subgraphs are traced once from TensorFlow Python code in
a scratch graph and spliced in (`emit_traced`), so their attrs are always
what TensorFlow itself would write.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .ir import parse_input

_AttrValue = tf.compat.v1.AttrValue


def node_def(name: str, op: str, inputs=(), device: str = "", **attrs):
    nd = tf.compat.v1.NodeDef(name=name, op=op, device=device)
    nd.input.extend(inputs)
    for key, value in attrs.items():
        nd.attr[key].CopyFrom(_attr(value))
    return nd


def _attr(value) -> _AttrValue:
    if isinstance(value, _AttrValue):
        return value
    if isinstance(value, tf.DType):
        return _AttrValue(type=value.as_datatype_enum)
    if isinstance(value, bool):
        return _AttrValue(b=value)
    if isinstance(value, int):
        return _AttrValue(i=value)
    if isinstance(value, float):
        return _AttrValue(f=value)
    if isinstance(value, str):
        return _AttrValue(s=value.encode())
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return _AttrValue(list=_AttrValue.ListValue(i=value))
    if isinstance(value, list) and all(isinstance(v, tf.DType) for v in value):
        return _AttrValue(list=_AttrValue.ListValue(
            type=[v.as_datatype_enum for v in value]))
    raise TypeError(f"cannot make an attr from {value!r}")


def like(node, name: str, device: str):
    """A NodeDef of `node`'s op and attrs (not its colocation group, `_class`)
    under `name` on `device`, without inputs."""
    nd = tf.compat.v1.NodeDef(name=name, op=node.op, device=device)
    for key, value in node.attr.items():
        if key != "_class":
            nd.attr[key].CopyFrom(value)
    return nd


def const(name: str, value, dtype: tf.DType, device: str = ""):
    proto = tf.make_tensor_proto(value, dtype=dtype)
    return node_def(name, "Const", (), device, dtype=dtype,
                    value=_AttrValue(tensor=proto))


def segment_sums(scope: str, values: list[str], indices: list[str], rows: int, itype, dtype,
                 devices: list[str], host: str):
    """(nodes, sums, every row): values[k]'s rows summed at indices[k] into
    a tensor of `rows` rows (UnsortedSegmentSum on devices[k]), and the
    indices 0 .. rows - 1 (a constant on `host`)."""
    nodes = [const(f"{scope}/rows", rows, itype, host),
             const(f"{scope}/every_row", np.arange(rows), itype, host)]
    nodes += [node_def(f"{scope}/{k}", "UnsortedSegmentSum", [v, i, nodes[0].name], device,
                       T=dtype, Tindices=itype, Tnumsegments=itype)
              for k, (v, i, device) in enumerate(zip(values, indices, devices))]
    return nodes, [n.name for n in nodes[2:]], nodes[1].name


def fifo_queue(name: str, shared_name: str, dtypes, device: str, capacity: int = 2):
    """A FIFOQueueV2 of unknown element shapes that every worker's graph
    names alike (`shared_name`), so they share the one on `device`."""
    return node_def(name, "FIFOQueueV2", [], device, component_types=list(dtypes),
                    shapes=_AttrValue(list=_AttrValue.ListValue()),
                    capacity=capacity, container="", shared_name=shared_name)


def collective_reduce(name: str, tensor: str, dtype: tf.DType, device: str, *,
                      group_size: int, group_key: int, instance_key: int,
                      mean: bool, timeout: float, hint: str = "auto"):
    """All-reduce (sum, or mean with `mean`) of `tensor` over a group."""
    return node_def(name, "CollectiveReduce", [tensor], device, T=dtype,
                    group_size=group_size, group_key=group_key,
                    instance_key=instance_key, merge_op="Add",
                    final_op="Div" if mean else "Id", subdiv_offsets=[0],
                    wait_for=[], communication_hint=hint,
                    timeout_seconds=float(timeout))


def emit_traced(fn, inputs: list[tuple[str, tf.DType, object]], scope: str,
                device: str = "") -> tuple[list, list[str]]:
    """Trace `fn(*placeholders)` under `scope/` and return (nodes, output names).

    `inputs` are (tensor name in the target graph, dtype, shape); the
    placeholders standing for them are replaced by those names.
    """
    g = tf.Graph()
    with g.as_default():
        phs = [tf.compat.v1.placeholder(dt, shape, name=f"parallax_template_input_{i}")
               for i, (_, dt, shape) in enumerate(inputs)]
        with tf.compat.v1.name_scope(scope + "/"), tf.device(device or None):
            outs = fn(*phs)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    mapping = {ph.op.name: name for ph, (name, _, _) in zip(phs, inputs)}
    nodes = []
    for nd in g.as_graph_def().node:
        if nd.name in mapping:
            continue
        for i, text in enumerate(nd.input):
            src, idx, control = parse_input(text)
            if src in mapping:
                if control:
                    raise ValueError("a traced template may not control-depend on its inputs")
                target, tidx, _ = parse_input(mapping[src])
                nd.input[i] = target if tidx == 0 else f"{target}:{tidx}"
        if device and not nd.device:
            nd.device = device
        nodes.append(nd)
    return nodes, [t.name for t in outs]


def flattened(scope: str, tensors: list[str], dtype: tf.DType, shapes: list, device: str):
    """(nodes, name): `tensors`, of static `shapes`, flattened and joined
    into one vector (for one exchange in place of one each)."""
    nodes, (out,) = emit_traced(lambda *xs: tf.concat([tf.reshape(x, [-1]) for x in xs], 0),
                                [(t, dtype, shape) for t, shape in zip(tensors, shapes)],
                                scope, device)
    return nodes, out


def unflattened(scope: str, vector: str, dtype: tf.DType, shapes: list, device: str):
    """(nodes, names): what `flattened` joined, cut back into `shapes`."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    return emit_traced(lambda y: [tf.reshape(p, shape) for p, shape in
                                  zip(tf.split(y, sizes), shapes)],
                       [(vector, dtype, [sum(sizes)])], scope, device)
