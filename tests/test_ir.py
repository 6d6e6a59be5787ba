import pytest
import tensorflow as tf

from parallax_ng.errors import GraphError
from parallax_ng.graph.ir import GraphIR, TensorRef, format_input, parse_input, parse_tensor


def small_graph_def():
    g = tf.Graph()
    with g.as_default():
        a = tf.constant(1.0, name="a")
        b = tf.constant(2.0, name="b")
        s = tf.add(a, b, name="s")
        with tf.control_dependencies([s]):
            tf.identity(a, name="after")
        tf.unique(tf.constant([1, 1]), name="u")
        tf.identity(tf.unique(tf.constant([3]))[1], name="uses_u1")
    return g.as_graph_def()


def test_parse_input_forms():
    assert parse_input("x") == ("x", 0, False)
    assert parse_input("x:2") == ("x", 2, False)
    assert parse_input("^x") == ("x", -1, True)
    assert parse_input("scope/x_1:10") == ("scope/x_1", 10, False)
    assert format_input("x", 0) == "x" and format_input("x", 3) == "x:3"
    assert format_input("x", -1) == "^x"
    assert parse_tensor("x") == TensorRef("x", 0)
    with pytest.raises(GraphError):
        parse_tensor("^x")


def test_index_consumers_and_order():
    ir = GraphIR(small_graph_def())
    assert ir.node("s").op == "AddV2"
    assert ir.data_inputs("s") == [TensorRef("a"), TensorRef("b")]
    assert ir.control_inputs("after") == ["s"]
    assert ("s", 0) in ir.consumers[TensorRef("a")]
    assert ir.node_consumers["s"] == {"after"}
    order = ir.topo_order
    assert order.index("a") < order.index("s") < order.index("after")
    assert ir.ancestors(["after"]) >= {"after", "a", "s", "b"}
    assert "after" in ir.descendants(["b"])
    # "after" reads "s" by a control edge only; a stop is reached, not passed
    assert ir.descendants(["b"], data_only=True) == {"b", "s"}
    assert ir.descendants(["b"], stop=lambda name: name == "s") == {"b", "s"}
    # what a fetch of each ends in: nodes no node reads, those `keep` holds for
    assert ir.ends(["b", "after"]) == {"b": {"after"}, "after": {"after"}}
    assert ir.ends(["a"], keep=lambda name: name != "after") == {"a": frozenset()}


def test_verify_names_dangling_input_and_rejects_duplicates():
    gd = small_graph_def()
    gd.node[-1].input.append("missing")
    with pytest.raises(GraphError, match="missing"):
        GraphIR(gd).verify()
    dup = small_graph_def()
    dup.node.add().CopyFrom(dup.node[0])
    with pytest.raises(GraphError, match="duplicate"):
        GraphIR(dup)


def test_verify_finds_cycles():
    gd = small_graph_def()
    for nd in gd.node:
        if nd.name == "a":
            nd.input.append("^after")
    with pytest.raises(GraphError, match="cycle"):
        GraphIR(gd).verify()


def test_input_graph_def_is_not_mutated():
    gd = small_graph_def()
    before = gd.SerializeToString()
    ir = GraphIR(gd)
    GraphIR.from_nodes(list(ir.nodes)[:2], ir)
    ir.replace({}, [])
    _ = ir.topo_order, ir.consumers
    assert gd.SerializeToString() == before
