import numpy as np
import tensorflow as tf

import parallax_ng as pn
from models import local
from passkit import context, run_passes
from transforms.initial_values import InitPass
from transforms.replicate import ReplicatePass

tf1 = tf.compat.v1


def test_copies_initialize_from_replica_zero_initial_values():
    ctx = context(n=3, optimizer="momentum", run_option="hybrid")
    ir = run_passes(ctx, ReplicatePass(), InitPass())
    init0 = ir.node("dense/w/Assign")
    for k in (1, 2):
        assert ir.node(f"parallax/replica_{k}/dense/w/Assign").input[1] == init0.input[1]
    # the shared embedding is initialized once
    assert "parallax/replica_1/emb/Assign" not in ir


def test_random_initializers_give_equal_replicas():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", [4, 3], initializer=tf1.random_normal_initializer())
        loss = tf.reduce_mean(tf.matmul(x, w))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    with pn.get_runner(g, local(3)) as runner:
        runner.run(init)
        copies = runner.run(w, per_replica=True)
    assert np.std(copies[0]) > 0.1
    for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0])


def test_golden_tiny_graph():
    """Replica 1's initializer of w assigns replica 0's initial value."""
    from passkit import tiny_graph
    ctx = context(n=2, graph=tiny_graph(), run_option="allreduce")
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    out, report = InitPass().run(ir, ctx)
    value = ctx.tg.ir.node("w/Assign").input[1]
    assert out.node("parallax/replica_1/w/Assign").input[1] == value
    assert out.node("w/Assign").input[1] == value
    assert len(out) == len(ir) and report == {"initializers": 1, "broadcasts": 0}


def test_a_warm_start_from_a_checkpoint_initializes_every_replica(tmp_path):
    """tf.compat.v1.train.init_from_checkpoint makes a reference variable's
    initializer a tensor (Assign:0), not an op: the build failed ("no node
    named 'Assign:0'"). Every replica starts from the checkpoint's values,
    resource variables too."""
    with tf.Graph().as_default():
        old = [tf1.get_variable(f"old/{n}", [4, 3], use_resource=False) for n in "ab"]
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            saved = sess.run(old)
            tf1.train.Saver().save(sess, str(tmp_path / "ck"))
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        ref = tf1.get_variable("ref", [4, 3], use_resource=False)
        res = tf1.get_variable("res", [4, 3], use_resource=True)
        tf1.train.init_from_checkpoint(str(tmp_path), {"old/a": "ref", "old/b": "res"})
        loss = tf.reduce_mean(tf.matmul(x, ref) * tf.matmul(x, res))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    with pn.get_runner(g, local(2)) as runner:
        runner.run(init)
        for var, want in zip((ref, res), saved):
            for copy in runner.run(var, per_replica=True):
                np.testing.assert_array_equal(copy, want)
