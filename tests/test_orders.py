"""graph/orders.py: rows of the batch in another order (tf.roll, tf.reverse,
tf.random.shuffle, tf.gather of a permutation along the batch's axis) keep
the batch's axis; where they meet the rows in their own order (mixup) the
loss is named as mixing the batch, and where they meet rows reordered
alike 2 replicas equal one device with the global batch (every variable
and slot after 4 steps within 1e-5, no line); a fetch of reordered rows is
joined with a line, not silently."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local, read_name, variable_names
from parallax_ng.graph.orders import order, permutation, reorders
from parallax_ng.graph.rows import reading
from parallax_ng.runtime.combining import default_reduction

tf1 = tf.compat.v1
TOL, STEPS, BATCH = 1e-5, 4, 8       # BATCH: the global batch


def graph_of(build):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], "x")
        out = build(x)
    return out, reading(["x"], g)


def test_permutations_of_the_rows_are_read():
    def build(x):
        n = tf.shape(x)[0]
        return {"reversed range": tf.range(n - 1, -1, -1), "range": tf.range(n),
                "shuffled": tf.random.shuffle(tf.range(n)), "fixed range": tf.range(4),
                "range over features": tf.range(tf.shape(x)[1])}
    found, rows = graph_of(build)
    assert {k for k, t in found.items() if permutation(t, rows)} == {
        "reversed range", "range", "shuffled"}


def test_reordered_rows_keep_the_axis_and_name_their_order():
    def build(x):
        n = tf.shape(x)[0]
        return {"roll": tf.roll(x, 1, axis=0), "roll by 2": tf.roll(x, 2, axis=0),
                "reverse": tf.reverse(x, [0]), "shuffle": tf.random.shuffle(x),
                "gather": tf.gather(x, tf.range(n - 1, -1, -1)),
                "twice": tf.reverse(tf.reverse(x, [0]), [0]),
                "along features": tf.roll(x, 1, axis=1), "plain": tf.tanh(x)}
    found, rows = graph_of(build)
    assert all(rows.axis(t) == 0 for t in found.values())
    orders = {k: order(t, rows) for k, t in found.items()}
    assert orders["twice"] == orders["along features"] == orders["plain"] == frozenset()
    assert orders["roll"] != orders["roll by 2"] and len(orders["roll"]) == 1
    assert all(len(orders[k]) == 1 for k in ("reverse", "shuffle", "gather"))
    assert reorders(found["along features"].op, rows) is None


def test_a_gather_at_other_indices_is_no_reordering():
    """A table's rows gathered by ids, or the batch's rows picked at fixed
    places: not a permutation of the batch's rows."""
    def build(x):
        table = tf.ones((10, 3))
        ids = tf.cast(x[:, 0], tf.int32)
        return tf.gather(table, ids), tf.gather(x, [0, 1])
    (looked_up, picked), rows = graph_of(build)
    assert reorders(looked_up.op, rows) is None and reorders(picked.op, rows) is None
    assert rows.axis(looked_up) == 0 and order(looked_up, rows) == frozenset()


def test_a_fetch_of_reordered_rows_is_not_joined_silently():
    def build(x):
        return tf.reverse(tf.tanh(x), [0]), tf.tanh(x)
    (reversed_rows, rows_), _ = graph_of(build)
    assert default_reduction(reversed_rows, ["x"]) == ("concat", 0, False)
    assert default_reduction(rows_, ["x"]) == ("concat", 0, True)


def data():
    rng = np.random.RandomState(5)
    return (rng.randn(STEPS * BATCH, 5).astype(np.float32),
            rng.randint(0, 3, STEPS * BATCH).astype(np.int32))


def build_model(kind):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], "x")
        y = tf1.placeholder(tf.int32, [None], "y")
        rng = np.random.RandomState(6)
        w = tf1.get_variable("w", initializer=rng.randn(5, 3).astype(np.float32))
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits
        if kind == "mixup":         # each example mixed with its mirror in the batch
            logits = tf.matmul(0.7 * x + 0.3 * tf.reverse(x, [0]), w)
            loss = tf.reduce_mean(ce(labels=y, logits=logits))
        else:                       # logits and labels rolled alike: each its own
            loss = tf.reduce_mean(ce(labels=tf.roll(y, 3, 0), logits=tf.roll(
                tf.matmul(x, w), 3, 0)))
        train = tf1.train.AdamOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, (x, y), train, loss, init


def train(kind, start=None, n=1):
    """{variable: value} after STEPS steps of `kind` and the losses fetched,
    on one device from `start`, or on n replicas (and their start)."""
    g, (x, y), op, loss, init = build_model(kind)
    names = variable_names(g)
    reads = [read_name(k, g) for k in names]
    xs, ys = data()
    if n == 1:
        with tf1.Session(graph=g) as sess:
            sess.run(init)
            load_values(sess, g, start)
            losses = [sess.run([op, loss], {x: xs[s * BATCH:(s + 1) * BATCH],
                                            y: ys[s * BATCH:(s + 1) * BATCH]})[1]
                      for s in range(STEPS)]
            return dict(zip(names, sess.run(reads))), losses
    with pn.get_runner(g, local(n)) as runner:
        runner.run(init)
        start = dict(zip(names, runner.run(reads)))
        losses = [runner.run([op, loss], {x: xs[s * BATCH:(s + 1) * BATCH],
                                          y: ys[s * BATCH:(s + 1) * BATCH]})[1]
                  for s in range(STEPS)]
        return dict(zip(names, runner.run(reads))), losses, start


def test_rows_rolled_alike_equal_one_device_and_mixup_is_named(capsys):
    parallel, losses, start = train("rolled alike", n=2)
    assert "mixes the batch" not in capsys.readouterr().err
    single, want = train("rolled alike", start)
    assert len(parallel) >= 3           # w and Adam's two slots
    np.testing.assert_allclose(losses, want, atol=TOL, rtol=0)
    for name, value in single.items():
        np.testing.assert_allclose(parallel[name], value, atol=TOL, rtol=0, err_msg=name)
    train("mixup", n=2)
    err = capsys.readouterr().err
    assert "mixes the batch's examples" in err and "in another order" in err, err


@pytest.mark.parametrize("how", ["reverse", "roll"])
def test_a_fetch_of_reordered_rows_names_how_it_is_joined(how, capsys):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], "x")
        v = tf1.get_variable("v", initializer=np.ones((2, 2), np.float32))
        h = tf.matmul(x, v)
        out = tf.reverse(h, [0]) if how == "reverse" else tf.roll(h, 1, 0)
        step = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(h)))
        init = tf1.global_variables_initializer()
    with pn.get_runner(g, local(2)) as runner:
        runner.run(init)
        _, got = runner.run([step, out], {x: np.arange(8, dtype=np.float32).reshape(4, 2)})
    assert got.shape == (4, 2)
    assert f"values of {out.name!r}" in capsys.readouterr().err
