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
