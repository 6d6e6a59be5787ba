"""The orderings pass (transforms/orderings.py): readers of an IdentityN of
several tensors read Identities of their own, so Grappler's dependency
optimizer keeps a read of a variable ordered before a later write of it;
a tf.recompute_grad step, whose backward reads a weight again for another
weight's gradient, equals one device under every aggregation."""
import numpy as np
import pytest
import tensorflow as tf
from models import local, recompute_step
from tensorflow.core.protobuf import device_properties_pb2, meta_graph_pb2
from tensorflow.python.grappler import cluster as gcluster
from tensorflow.python.grappler import tf_optimizer

import parallax_ng as pn
from parallax_ng.graph.ir import GraphIR
from transforms.orderings import split_identity_n

tf1 = tf.compat.v1
WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def lost_orderings(graph_def) -> list[tuple[str, str]]:
    """(read, write) control edges of one variable in `graph_def` that the
    graph Grappler makes of it (the default session options, the writes
    fetched) no longer orders."""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        meta = tf1.train.export_meta_graph(graph=graph)
    pairs = [(c.name, op.name) for op in graph.get_operations()
             if op.type in WRITES or op.type.startswith("ResourceApply")
             for c in op.control_inputs
             if c.type == "ReadVariableOp" and c.inputs[0].name == op.inputs[0].name]
    fetch = meta_graph_pb2.CollectionDef()
    fetch.node_list.value.extend(sorted(op.name for op in graph.get_operations()
                                        if op.type in WRITES or "Apply" in op.type))
    meta.collection_def["train_op"].CopyFrom(fetch)
    cpu = device_properties_pb2.NamedDevice(    # a virtual CPU: no probe for GPUs
        name="/job:localhost/replica:0/task:0/device:CPU:0",
        properties=device_properties_pb2.DeviceProperties(type="CPU"))
    nodes = {n.name: n for n in tf_optimizer.OptimizeGraph(
        tf1.ConfigProto(), meta, cluster=gcluster.Cluster(devices=[cpu])).node}

    def above(name):
        seen, stack = set(), [name]
        while stack:
            for ref in nodes[stack.pop()].input:
                src = ref.lstrip("^").split(":")[0]
                if src in nodes and src not in seen:
                    seen.add(src)
                    stack.append(src)
        return seen
    return [(r, w) for r, w in pairs if r in nodes and w in nodes and r not in above(w)]


def test_grappler_drops_a_recompute_step_s_ordering_and_the_split_keeps_it():
    """The step's own trace: the backward's read of the second weight is
    ordered before that weight's update by an edge Grappler drops, since a
    path through the optimizer's IdentityN of both gradients seemed to
    order them (TensorFlow 2.21); with the IdentityNs split, none is lost."""
    _, _, step = recompute_step()
    spec = tf.TensorSpec([16, 4], tf.float64), tf.TensorSpec([16, 1], tf.float64)
    graph_def = tf.function(step).get_concrete_function(*spec).graph.as_graph_def()
    lost = lost_orderings(graph_def)
    assert [(r.split("/")[0], w.split("/")[-1]) for r, w in lost] == \
        [("matmul_3", "AssignAddVariableOp_1")]
    out, split = split_identity_n(GraphIR(graph_def))
    assert split == 3 and lost_orderings(out.graph_def) == []


def test_readers_read_identities_and_the_identity_n_stays_for_fetches_and_controls():
    graph = tf.Graph()
    with graph.as_default():
        a, b = tf.constant([1.0]), tf.constant([2], tf.int32)
        first = tf.identity_n([a, b], name="first")
        second = tf.identity_n([first[0], tf.constant([3.0])], name="second")
        alone = tf.identity_n([a], name="alone")
        with tf1.control_dependencies([first[0].op]):
            tf.no_op(name="after")
        tf.add(second[0], alone[0], name="total")
        tf.cast(first[1], tf.float32, name="ints")
    ir = GraphIR(graph.as_graph_def())
    out, split = split_identity_n(ir)
    assert split == 2
    assert out.node("total").input[:] == ["second/output_0", "alone"]
    assert out.node("ints").input[:] == ["first/output_1"]
    assert out.node("second/output_0").input[:] == ["first/output_0"]
    assert out.node("first/output_1").attr["T"].type == tf.int32.as_datatype_enum
    assert out.node("after").input[:] == ["^first"]
    assert out.node("first") is ir.node("first") and out.node("alone") is ir.node("alone")
    values = []
    for gd in (ir.graph_def, out.graph_def):      # the same numbers, fetched by the old names
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(gd, name="")
        with tf1.Session(graph=g) as sess:
            values.append(sess.run(["total:0", "ints:0", "second:1"]))
    np.testing.assert_array_equal(np.concatenate(values[0]), np.concatenate(values[1]))


@pytest.mark.parametrize("config", [{"run_option": "ps"}, {"buckets": {"mode": "none"}},
                                    {}], ids=["ps", "allreduce-apart", "bucket"])
def test_a_recompute_block_keeps_its_orderings_and_equals_one_device(config):
    """Before: under `ps` and with one all-reduce per variable, the second
    weight's update was ordered after the backward's read of it only by an
    edge Grappler dropped (a bucket's all-reduce made a true path). The one
    device runs eagerly: its own tf.function has the same race."""
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(4, 16, 4)), rng.normal(size=(4, 16, 1))
    (wa, oa, sa), (wb, ob, sb) = recompute_step(), recompute_step()
    parallel = pn.function(sa, local(2), config)
    for x, y in zip(xs, ys):
        parallel(x, y), sb(x, y)
    parallel.sync()
    assert lost_orderings(parallel.runner.graph.as_graph_def()) == []
    for a, b in zip(wa + oa.variables, wb + ob.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-12, rtol=0)
