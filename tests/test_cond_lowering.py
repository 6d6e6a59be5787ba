"""A tf.cond of TF2 behavior whose branch writes a variable, lowered to
Switch/Merge before the analysis (parallax_ng/graph/cond_lowering.py): names
kept, the user's graph untouched, and the writes synced as those of v1
control flow are (before, each replica kept its own copy, with a warning).
"""
import warnings

import numpy as np
import tensorflow as tf

import parallax_ng as pn
from models import local, read_name
from test_branches import lowered_conds
from parallax_ng.graph import cond_lowering, frontend

tf1 = tf.compat.v1


def bn_graph(seed=1, bias=True):
    """tf.compat.v1.layers.batch_normalization under a `training` tensor (an
    If per moving statistic, with TF2 behavior), Adam; `bias`: the dense
    layer before it has one."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        training = tf1.placeholder_with_default(True, [], name="training")
        h = tf1.layers.dense(x, 8, kernel_initializer=tf1.glorot_uniform_initializer(seed=seed),
                             use_bias=bias)
        h = tf1.layers.batch_normalization(h, training=training, momentum=0.9)
        out = tf1.layers.dense(tf.nn.relu(h), 1,
                               kernel_initializer=tf1.glorot_uniform_initializer(seed=seed + 1))
        loss = tf.reduce_mean(tf.square(out - y), name="loss")
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train = tf1.train.AdamOptimizer(0.01).minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    return g, dict(x=x, y=y, training=training, out=out, loss=loss, train=train, init=init)


DATA = np.random.RandomState(0)
XS = (DATA.randn(5, 16, 4) * 2 + 1).astype(np.float32)
YS = DATA.randn(5, 16, 1).astype(np.float32)


def train(call, t, steps=5):
    call(t["init"])
    losses = [call([t["train"], t["loss"]], {t["x"]: XS[k], t["y"]: YS[k]})[1]
              for k in range(steps)]
    return losses


def test_a_graph_without_such_a_cond_is_the_users_own():
    g = tf.Graph()
    with g.as_default():
        flag = tf1.placeholder(tf.bool, [])
        tf.cond(flag, lambda: tf.constant(1.0), lambda: tf.constant(2.0))
    assert cond_lowering.lowered(g) is g


def test_writing_conds_become_switch_merge_and_keep_their_names():
    g, t = bn_graph()
    before = g.as_graph_def()
    ifs = {n.name for n in before.node if n.op in cond_lowering.LOWERED}
    writing = set(cond_lowering._writing_ifs(before))
    assert writing and writing < ifs          # the gradient's Ifs write nothing: kept
    low = cond_lowering.lowered(g)
    assert low is not g and g.as_graph_def() == before        # the user's graph untouched
    nodes = {n.name: n for n in low.as_graph_def().node}
    for name in writing:
        assert nodes[name].op == "IdentityN"
        assert len(low.get_operation_by_name(name).outputs) == \
            len(g.get_operation_by_name(name).outputs)
    kept = {n for n, d in nodes.items() if d.op in cond_lowering.LOWERED}
    assert ifs - writing <= kept
    assert any(d.op == "AssignSubVariableOp" and d.name.startswith(f"{name}/lowered/then/")
               for d in nodes.values() for name in writing)
    assert {v.name for v in low.get_collection("variables")} == \
        {v.name for v in g.get_collection("variables")}
    assert [op.name for op in low.get_collection(tf1.GraphKeys.UPDATE_OPS)] == \
        [op.name for op in g.get_collection(tf1.GraphKeys.UPDATE_OPS)]


def test_the_lowered_graph_computes_what_the_users_does():
    """One session each, the same initial values and batches: every
    variable (and Adam's slots) equal after 5 steps, inference included."""
    g, t = bn_graph()
    low = cond_lowering.lowered(g)
    with tf1.Session(graph=g) as a, tf1.Session(graph=low) as b:
        want = train(a.run, t)
        got = train(b.run, {k: v.name for k, v in t.items()})
        names = [read_name(v.op.name, g) for v in g.get_collection("variables")]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for name, x, y in zip(names, a.run(names), b.run(names)):
            np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7, err_msg=name)
        fed = {"x:0": XS[0], "training:0": False}
        np.testing.assert_allclose(b.run(t["out"].name, fed), a.run(t["out"], fed), rtol=1e-6)


def test_moving_statistics_under_a_training_tensor_are_synced_as_with_v1_conds():
    """2 replicas, 5 Adam steps: every variable equal to the same graph
    built with v1 control flow (1e-6), with no warning (each replica had
    kept its own moving statistics: 0.016 apart after 5 steps); the moving
    mean after one step is one device's with the global batch (1e-5)."""
    with lowered_conds():
        g1, t1 = bn_graph()
    with pn.get_runner(g1, local(2)) as runner:
        want = train(runner.run, t1)
        want_vars = {v.op.name: runner.run(v) for v in g1.get_collection("variables")}
    g2, t2 = bn_graph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner = pn.get_runner(g2, local(2))
    with runner:
        got = train(runner.run, t2)
        for v in g2.get_collection("variables"):
            a, b = runner.run(v, per_replica=True)
            assert np.array_equal(a, b), v.op.name
            np.testing.assert_allclose(a, want_vars[v.op.name], rtol=1e-6, atol=1e-7,
                                       err_msg=v.op.name)
        out = runner.run(t2["out"], {t2["x"]: XS[0], t2["training"]: False})
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert out.shape == (16, 1)
    g3, t3 = bn_graph()
    mean = read_name("batch_normalization/moving_mean", g3)
    with tf1.Session(graph=g3) as sess:
        sess.run(t3["init"])
        sess.run(t3["train"], {t3["x"]: XS[0], t3["y"]: YS[0]})
        one = sess.run(mean)
    g4, t4 = bn_graph()
    with pn.get_runner(g4, local(2)) as runner:
        runner.run(t4["init"])
        runner.run(t4["train"], {t4["x"]: XS[0], t4["y"]: YS[0]})
        two = runner.run(read_name("batch_normalization/moving_mean", g4))
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)


def nested_graph():
    """A write inside a cond inside a cond: lowered level by level."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        outer = tf1.placeholder(tf.bool, [], name="outer")
        inner = tf1.placeholder(tf.bool, [], name="inner")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        seen = tf1.get_variable("seen", initializer=np.float32(0), trainable=False)

        def counted():
            return tf.cond(inner, lambda: tf1.assign_add(seen, tf.reduce_sum(x)),
                           lambda: tf.identity(seen.read_value()))
        update = tf.cond(outer, counted, lambda: tf.identity(seen.read_value()), name="outer_cond")
        loss = tf.reduce_mean(tf.reduce_sum(x * w, 1))
        with tf.control_dependencies([update]):
            step = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    return g, dict(x=x, outer=outer, inner=inner, seen=seen, train=step, init=init)


def test_a_write_in_nested_conds_is_lowered_and_counted_as_one_device_counts():
    g, t = nested_graph()
    low = cond_lowering.lowered(g)
    assert not [n for n in low.as_graph_def().node if n.op in cond_lowering.LOWERED]
    assert frontend.load(g).function_writes == []
    flags = [(True, True), (True, False), (False, True), (True, True)]

    def run(call, t):
        call(t["init"])
        for k, (o, i) in enumerate(flags):
            call(t["train"], {t["x"]: XS[k, :8, :3], t["outer"]: o, t["inner"]: i})
        return call(t["seen"])
    with tf1.Session(graph=g) as sess:
        want = run(sess.run, t)
    g2, t2 = nested_graph()
    with pn.get_runner(g2, local(2)) as runner:
        got = run(runner.run, t2)
    assert want != 0
    np.testing.assert_allclose(got, want, rtol=1e-6)
