import numpy as np
import tensorflow as tf

from parallax_ng.graph import emit

tf1 = tf.compat.v1


def test_nodes_written_directly_import_and_run():
    gd = tf1.GraphDef()
    gd.node.extend([
        emit.const("a", [1.0, 2.0], tf.float32),
        emit.const("b", [3.0, 4.0], tf.float32),
        emit.node_def("sum", "AddN", ["a", "b"], T=tf.float32, N=2),
    ])
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf1.Session(graph=g) as sess:
        np.testing.assert_array_equal(sess.run("sum:0"), [4.0, 6.0])


def test_collective_reduce_attrs():
    nd = emit.collective_reduce("r", "x", tf.float32, "/device:CPU:1", group_size=4,
                                group_key=1, instance_key=9, mean=True, timeout=7)
    assert nd.op == "CollectiveReduce" and nd.device == "/device:CPU:1"
    assert nd.attr["final_op"].s == b"Div" and nd.attr["group_size"].i == 4
    assert nd.attr["timeout_seconds"].f == 7.0 and list(nd.input) == ["x"]


def test_traced_template_is_spliced_onto_named_inputs():
    nodes, outs = emit.emit_traced(lambda a, b: tf.identity(a * b + 1.0, "out"),
                                   [("x:0", tf.float32, [2]), ("y", tf.float32, [2])],
                                   "parallax/test", "/device:CPU:0")
    assert outs == ["parallax/test/out:0"]
    assert all(n.name.startswith("parallax/test/") for n in nodes)
    assert all(n.device == "/device:CPU:0" for n in nodes)
    inputs = {i for n in nodes for i in n.input}
    assert "x" in inputs and "y" in inputs       # x:0 is written x
    assert not any("parallax_template_input" in i for i in inputs)


def test_like_copies_op_and_attrs_but_not_the_colocation_group():
    import tensorflow as tf
    from parallax_ng.graph import emit
    node = emit.node_def("g", "GatherV2", ["a", "b", "c"], "/cpu:0", Tparams=tf.float32,
                         Tindices=tf.int32, Taxis=tf.int32, batch_dims=0)
    node.attr["_class"].list.s.append(b"loc:@a")
    copy = emit.like(node, "h", "/job:ps/task:0")
    assert (copy.name, copy.op, copy.device, list(copy.input)) == ("h", "GatherV2",
                                                                   "/job:ps/task:0", [])
    assert set(copy.attr) == {"Tparams", "Tindices", "Taxis", "batch_dims"}


def test_segment_sums_add_each_parts_rows_at_their_indices():
    gd = tf1.GraphDef()
    gd.node.extend([emit.const("v0", [[1.0], [2.0], [4.0]], tf.float32),
                    emit.const("i0", [2, 0, 2], tf.int64),
                    emit.const("v1", [[8.0]], tf.float32), emit.const("i1", [1], tf.int64)])
    nodes, sums, every = emit.segment_sums("dense", ["v0", "v1"], ["i0", "i1"], 4, tf.int64,
                                           tf.float32, ["", ""], "")
    gd.node.extend(nodes)
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf1.Session(graph=g) as sess:
        a, b, rows = sess.run([f"{sums[0]}:0", f"{sums[1]}:0", f"{every}:0"])
    np.testing.assert_array_equal(a, [[2.0], [0.0], [5.0], [0.0]])
    np.testing.assert_array_equal(b, [[0.0], [8.0], [0.0], [0.0]])
    np.testing.assert_array_equal(rows, [0, 1, 2, 3])
