"""Graphs with while loops (tf.compat.v1.nn.dynamic_rnn) replicate correctly:
every copy gets its own loop frames, and the result matches one device."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import train_both

import tf_keras  # noqa: E402,F401  tf.compat.v1.nn.rnn_cell lives there under Keras 3
tf1 = tf.compat.v1


def lstm_model(batch):
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(0)
        x_all = rng.randn(64, 5, 3).astype(np.float32)
        y_all = rng.randn(64, 4).astype(np.float32)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((x_all, y_all))).batch(batch).repeat()
        it = tf1.data.make_initializable_iterator(ds)
        x, y = it.get_next()
        out, _ = tf1.nn.dynamic_rnn(tf1.nn.rnn_cell.BasicLSTMCell(4), x, dtype=tf.float32)
        loss = tf.reduce_mean(tf.square(out[:, -1] - y))
        train = tf1.train.AdamOptimizer(0.01).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "init": init, "iterator_init": it.initializer, "loss": loss}


@pytest.mark.parametrize("run_option", ["hybrid", "ps"])
def test_dynamic_rnn_matches_one_device(run_option):
    parallel, single, names = train_both(lstm_model, 2, 5, config={"run_option": run_option})
    assert "rnn/basic_lstm_cell/kernel/Adam" in names
    for name in names:
        for got in parallel[name]:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name


@pytest.fixture
def control_flow_v1():
    tf1.disable_control_flow_v2()
    yield
    tf1.enable_control_flow_v2()


def test_functional_while_ops_exist_per_replica():
    ir, _, _ = pn.transform(lstm_model(4)[0], {"hosts": [{"devices": ["cpu:0", "cpu:1"]}]})
    loops = [n.name for n in ir.nodes if n.op in ("While", "StatelessWhile")]
    assert loops and len(loops) % 2 == 0
    assert any(name.startswith("parallax/replica_1/") for name in loops)


def test_v1_loop_frames_are_renamed_per_replica(control_flow_v1):
    parallel, single, names = train_both(lstm_model, 2, 3)
    for name in names:
        for got in parallel[name]:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name
    ir, _, _ = pn.transform(lstm_model(4)[0], {"hosts": [{"devices": ["cpu:0", "cpu:1"]}]})
    frames = {n.attr["frame_name"].s.decode() for n in ir.nodes if n.op == "Enter"}
    assert any(f.startswith("parallax/replica_1/") for f in frames)
    assert any(not f.startswith("parallax/") for f in frames)


@pytest.mark.parametrize("v1", [True, False])
def test_an_update_inside_a_while_loop_is_refused(v1):
    """Several optimizer steps inside one tf.while_loop: each iteration's
    update would need that iteration's gradients of every replica, which
    are not aggregated inside loops; refused naming the variable (v1
    control flow; a TF2 step's `for` over tf.range: tests/test_tf2.py), or
    as an update inside a functional While's body."""
    if v1:
        tf1.disable_control_flow_v2()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3])
        w = tf1.get_variable("w", [3, 1], use_resource=True)
        opt = tf1.train.GradientDescentOptimizer(0.1)

        def body(i):
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
            with tf.control_dependencies([opt.minimize(loss)]):
                return i + 1
        tf1.while_loop(lambda i: i < 3, body, [tf.constant(0)])
    tf1.enable_control_flow_v2()
    said = "variable 'w' is updated, or its gradient taken, inside a loop" if v1 else \
        "trainable variable 'w' is written inside op 'while' .*loop in Python"
    with pytest.raises(pn.GraphError, match=said):
        pn.get_runner(g, {"hosts": [{"devices": ["cpu:0", "cpu:1"]}]})


@pytest.mark.parametrize("state", ["counter", "trainable"])
def test_state_written_in_a_tf2_steps_loop_is_state_not_an_update(state):
    """A variable without a gradient that the step assigns in a loop is
    state, though tf.Variable makes it trainable: a counter the loop adds
    to runs and equals one device (9 after 3 steps of 3 turns); a value
    from the batch's sum is named in a warning (each replica keeps its
    own, as in a v1 loop). Before, both were refused as an update whose
    gradients could not be aggregated."""
    from models import local

    def make():
        w = tf.Variable(tf.ones((3, 1)))
        c = tf.Variable(0) if state == "counter" else tf.Variable(0.0)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((x @ w - y) ** 2)
            w.assign_sub(0.1 * tape.gradient(loss, w))
            for _ in tf.range(3):
                if state == "counter":
                    c.assign_add(1)
                else:
                    c.assign(0.5 * c + tf.reduce_sum(x))
            return loss
        return w, c, step
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3, 8, 3)).astype(np.float32), rng.normal(size=(3, 8, 1)).astype(
        np.float32)
    (w1, c1, parallel), (w2, c2, single) = make(), make()
    if state == "trainable":
        with pytest.warns(UserWarning, match=r"variables \['Variable_\d+'\] are written inside "
                          r"a tf.while_loop's body"):
            pn.function(parallel, local(2))(x[0], y[0])
        return
    step, ref = pn.function(parallel, local(2)), tf.function(single)
    for k in range(3):
        step(x[k], y[k])
        ref(x[k], y[k])
    step.sync()
    assert c1.numpy() == c2.numpy() == 9
    np.testing.assert_allclose(w1.numpy(), w2.numpy(), atol=1e-6, rtol=0)


def test_a_counter_in_a_tf1_graphs_functional_loop_is_state():
    """A TF1 graph of TF2 behavior: a tf.compat.v1.while_loop is a
    functional While, which no pass opens. A trainable resource variable
    that its body only adds to (a counter) is state: it runs, and equals
    one device (6 after 2 steps of 3 turns); an update there is still
    refused (test_an_update_inside_a_while_loop_is_refused). Before, the
    counter was refused as an update."""
    from models import local

    def build():
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 3], name="x")
            w = tf1.get_variable("w", [3, 1], use_resource=True,
                                 initializer=tf1.ones_initializer())
            turns = tf1.get_variable("turns", [], use_resource=True,
                                     initializer=tf1.zeros_initializer())

            def body(i):
                with tf.control_dependencies([turns.assign_add(1.0)]):
                    return i + 1
            done = tf1.while_loop(lambda i: i < 3, body, [tf.constant(0)])
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
            with tf.control_dependencies([done]):
                tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        return g
    data = np.random.default_rng(0).normal(size=(2, 8, 3)).astype(np.float32)
    g = build()
    assert any(op.type in ("While", "StatelessWhile") for op in g.get_operations())
    with tf1.Session(graph=g) as sess:
        sess.run(tf1.global_variables_initializer())
        for batch in data:
            sess.run("train", {"x:0": batch})
        want = sess.run(["w/Read/ReadVariableOp:0", "turns/Read/ReadVariableOp:0"])
    g = build()
    with pn.get_runner(g, local(2)) as runner:
        runner.run([v.initializer for v in g.get_collection("variables")])
        for batch in data:
            runner.run("train", {"x:0": batch})
        got = runner.run([g.get_tensor_by_name("w/Read/ReadVariableOp:0"),
                          g.get_tensor_by_name("turns/Read/ReadVariableOp:0")])
    assert want[1] == got[1] == 6.0
    np.testing.assert_allclose(got[0], want[0], atol=1e-6, rtol=0)
