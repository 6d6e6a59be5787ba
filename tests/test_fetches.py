"""Fetch and feed mapping: how each kind of fetch is run and combined."""
import numpy as np
import pytest
import tensorflow as tf
from models import embedding_regression, local

import parallax_ng as pn
from parallax_ng.runtime.fetches import Fetch, combine


def test_each_kind_of_fetch():
    g, h = embedding_regression(4, "adam")
    with pn.get_runner(g, local(2), {"run_option": "hybrid"}) as runner:
        fm = runner.fetches
        op = fm.fetch(h["train"])
        assert op.how == "none" and len(op.names) == 2            # every replica's train op
        assert fm.fetch("dense/w/Read/ReadVariableOp:0").how == "first"    # equal everywhere
        loss = fm.fetch("loss:0")
        assert loss.how == "mean" and loss.names == ("loss:0", "parallax/replica_1/loss:0")
        assert fm.fetch(h["pred"]).how == "concat"
        shared = fm.fetch("emb/Read/ReadVariableOp:0", per_replica=True)
        assert shared.how == "list" and len(shared.replicas) == 2


def test_combining_values():
    a, b = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    assert combine([a, b], Fetch(("x", "y"), "mean", "x")).tolist() == [2.0, 3.0]
    assert combine([a, b], Fetch(("x", "y"), "sum", "x")).tolist() == [4.0, 6.0]
    assert combine([a, b], Fetch(("x", "y"), "concat", "x")).tolist() == [1, 2, 3, 4]
    assert combine([a, b], Fetch(("x", "y"), "max", "x")).tolist() == [3.0, 4.0]
    assert combine([a, b], Fetch(("x", "y"), "min", "x")).tolist() == [1.0, 2.0]
    assert combine([a], Fetch(("x",), "list", "x", (0, 0)))[1] is a
    assert combine([a, b], Fetch(("x", "y"), "first", "x")) is a
    assert combine([None], Fetch(("x",), "none", "x")) is None
    with pytest.raises(ValueError):
        combine([a, np.array(5.0)], Fetch(("x", "y"), "mean", "x"))   # shapes disagree


def test_fetches_join_along_the_batchs_axis_or_reduce_as_the_graph_shows():
    """A time-major tensor joins the replicas' parts along its second axis;
    a tensor summed over the batch (per feature) is the replicas' sum, one
    averaged over it their mean; per-example booleans and strings join
    too (a prediction's correctness, its class name), a boolean reduced
    by any or all is the replicas' any or all, a largest or smallest value
    over the batch their max or min; each equals one device's value."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (None, 3, 2), name="x")
        w = tf.compat.v1.get_variable("w", initializer=np.eye(2, dtype=np.float32) * 2)
        h = tf.tensordot(x, w, 1)
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(h)))
        fetches = [tf.transpose(h, [1, 0, 2], name="time_major"),
                   tf.reduce_sum(h, [0, 1], name="sums"), tf.reduce_mean(h, 0, name="means"),
                   tf.greater(h[:, 0, 0], 0.0, name="positive"),
                   tf.gather(tf.constant(["no", "yes"]), tf.cast(h[:, 0, 0] > 0, tf.int32),
                             name="answer"),
                   tf.reduce_any(h > 2.65, name="any"), tf.reduce_all(h > -3.0, name="all"),
                   tf.reduce_max(h, name="largest"), tf.reduce_min(h, [0, 1], name="smallest"),
                   tf.reduce_max(tf.reduce_max(h, 2), 0, name="largest_per_step")]
        init = tf.compat.v1.global_variables_initializer()
    batch = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        want = sess.run(fetches, {x: batch})
    with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
        runner.run(init)
        got = runner.run([f.name for f in fetches], {"x:0": batch})
        kinds = [runner.fetches.fetch(f.name) for f in fetches]
    assert [(f.how, f.axis) for f in kinds] == [("concat", 1), ("sum", 0), ("mean", 0),
                                                ("concat", 0), ("concat", 0), ("any", 0),
                                                ("all", 0), ("max", 0), ("min", 0), ("max", 0)]
    # replica 0 alone would give the answers opposite to these; the replicas'
    # mean (the rule before max and min) is not the batch's largest value
    assert want[5] and not want[6]
    assert abs(np.mean([2 * batch[:2].max(), 2 * batch[2:].max()]) - want[7]) > 0.05
    for a, b in zip(got, want):
        if b.dtype.kind in "bOS":
            assert np.asarray(a).tolist() == b.tolist()
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
