import pytest

from parallax_ng import compat
from parallax_ng.graph import rules
from parallax_ng.errors import GraphError


def test_resource_uses():
    assert rules.classify_resource_use("ResourceApplyAdam", "n", "v") == "write"
    assert rules.classify_resource_use("ResourceSparseApplyMomentum", "n", "v") == "write"
    assert rules.classify_resource_use("AssignSubVariableOp", "n", "v") == "write"
    assert rules.classify_resource_use("ReadVariableOp", "n", "v") == "read"
    assert rules.classify_resource_use("ResourceGather", "n", "v") == "read"
    assert rules.classify_resource_use("Identity", "n", "v") == "pass"
    with pytest.raises(GraphError, match="op 'n' of type MysteryOp uses variable 'v'"):
        rules.classify_resource_use("MysteryOp", "n", "v")


def test_reference_uses_follow_the_op_definition():
    assert compat.ref_input_positions("Assign") == (True, False)
    assert compat.outputs_ref("ScatterAdd") and not compat.outputs_ref("Identity")
    assert rules.classify_ref_use("ApplyAdam", 1) == "write"      # a slot
    assert rules.classify_ref_use("ApplyAdam", 3) == "read"       # beta1_power value
    assert rules.classify_ref_use("Identity", 0) == "read"        # dereferences
    assert rules.classify_ref_use("RefIdentity", 0) == "pass"
    assert rules.classify_ref_use("IsVariableInitialized", 0) == "read"
    with pytest.raises(GraphError, match="NoSuchRefOp.*no registered definition"):
        rules.classify_ref_use("NoSuchRefOp", 0)


def test_state_writers_are_variables_writers_not_tf_scatter_nd():
    assert all(map(rules.writes_state, ["AssignVariableOp", "Assign", "ScatterAdd",
                                        "ScatterNdUpdate", "ApplyAdam", "SparseApplyFtrl",
                                        "ResourceScatterAdd", "CountUpTo"]))
    assert not any(map(rules.writes_state, ["ScatterNd", "ScatterNdNonAliasingAdd",
                                            "TensorScatterUpdate", "ReadVariableOp"]))


def test_tables():
    assert rules.is_autodiff("gradients/MatMul_grad/MatMul")
    assert rules.is_autodiff("Adam/gradients_3/x") and not rules.is_autodiff("my_gradients/x")
    assert rules.is_host_only("TensorSliceDataset") and rules.is_host_only("IteratorGetNext")
    assert not rules.is_host_only("MatMul")
    assert list(rules.inputs_of_output("IdentityN", 2, 4)) == [2]
    assert list(rules.inputs_of_output("Mul", 0, 2)) == [0, 1]
    assert rules.state_sync_reduction("AssignAdd", "n", "v", "x:0") == "sum"
    assert rules.state_sync_reduction("AssignSubVariableOp", "n", "v", "x:0") == "mean"
    with pytest.raises(GraphError, match=r"'n' of type ResourceApplyAdam writes variable 'w' "
                       r"with a value \(lr:0\) computed from one replica's batch"):
        rules.state_sync_reduction("ResourceApplyAdam", "n", "w", "lr:0")


def test_output_dtypes_from_op_signatures():
    import tensorflow as tf
    from parallax_ng.graph import emit
    add_n = emit.node_def("s", "AddN", ["a", "b"], T=tf.float32, N=2)
    assert compat.output_dtypes(add_n) == [(tf.float32, False)]
    deq = emit.node_def("d", "QueueDequeueV2", ["q"], component_types=[tf.float32, tf.int64])
    assert compat.output_dtypes(deq) == [(tf.float32, False), (tf.int64, False)]
    split = emit.node_def("p", "Split", ["axis", "x"], T=tf.int32, num_split=3)
    assert compat.output_dtypes(split) == [(tf.int32, False)] * 3
    ref = emit.node_def("v", "VariableV2", [], dtype=tf.float32, shape=tf.compat.v1.AttrValue())
    assert compat.output_dtypes(ref) == [(tf.float32, True)]
    assert compat.output_dtypes(emit.node_def("f", "NoSuchOp")) is None


def test_from_autodiff_is_the_gradients_and_what_they_reach():
    """tf.gradients' ops and every op their outputs reach (the update's
    math), not the forward ops, nor a read after the update."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    with tf.Graph().as_default() as g:
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        w = tf1.get_variable("w", initializer=tf.ones([2, 1]), use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w), name="loss")
        grad = tf.gradients(loss, w)[0]
        scaled = tf.multiply(grad, tf.norm(grad), name="scaled")
        update = w.assign_sub(scaled, name="update")
        later = tf.identity(w.read_value(), name="later")
    found = rules.from_autodiff(g)
    assert grad.op.name in found and "scaled" in found and update.op.name in found
    assert "loss" not in found and "x" not in found and later.op.name not in found


def test_tails_are_a_name_past_each_scope():
    assert rules.tails("StatefulPartitionedCall/dense/MatMul") == ["dense/MatMul", "MatMul"]
    assert rules.tails("MatMul") == []


def test_past_identities_is_what_identities_pass_on():
    import tensorflow as tf
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2])
        assert rules.past_identities(tf.identity(tf.identity(x))) is x
        assert rules.past_identities(x * 2.0).op.type == "Mul"
