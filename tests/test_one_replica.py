"""parallax_ng/runtime/one_replica.py: a run that trains nothing, fed a
batch the replicas cannot split evenly (a whole test set, one example to
predict), runs on replica 0 alone and returns one device's values; it was
an error ("feed ... do not split evenly"). A run that trains, or whose
fetches need the other replicas (a value the passes exchange between
them) or write a variable, keeps the error. 3 replicas after 5 Adam steps
against one device with the global batch: accuracy and loss over 1,000
and 17 rows and the logits of one row, equal within 1e-6."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.errors import UnevenFeed
from parallax_ng.runtime.combining import Fetch, combine
from parallax_ng.runtime.one_replica import alone

tf1 = tf.compat.v1
N, TOL = 3, 1e-6


def build():
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, [None, 5], name="x")
        labels = tf1.placeholder(tf.int32, [None], name="labels")
        keep = tf1.placeholder_with_default(1.0, [], name="keep")
        w1, w2 = tf1.get_variable("w1", [5, 8]), tf1.get_variable("w2", [8, 3])
        hidden = tf.nn.dropout(tf.nn.relu(tf.matmul(x, w1)), rate=1 - keep)
        logits = tf.matmul(hidden, w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        train = tf1.train.AdamOptimizer(0.01).minimize(loss)
        correct = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels),
                          tf.float32)
        accuracy = tf.reduce_mean(correct)
        real = tf.cast(labels > 0, tf.float32)          # a masked ratio the replicas share
        masked = tf.reduce_sum(correct * real) / tf.reduce_sum(real)
        evals = tf1.get_variable("evals", [], trainable=False,
                                 initializer=tf1.zeros_initializer())
        with tf.control_dependencies([evals.assign_add(1.0)]):  # a write: every copy's
            counted = tf.identity(accuracy)
        confusion = tf.math.confusion_matrix(labels, tf.argmax(logits, 1), num_classes=3)
        init = tf1.global_variables_initializer()
    return g, dict(x=x, labels=labels, train=train, loss=loss, accuracy=accuracy,
                   logits=logits, masked=masked, counted=counted, init=init,
                   confusion=confusion)


def _data(rows, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 5)).astype(np.float32), rng.integers(0, 3, rows)


def _session_and_runner():
    out = []
    for parallel in (False, True):
        g, t = build()
        session = pn.get_runner(g, local(N), {}) if parallel else tf1.Session(graph=g)
        session.run(t["init"])
        x, y = _data(12 * N, 0)
        for _ in range(5):
            session.run(t["train"], {t["x"]: x, t["labels"]: y})
        out.append((session, t))
    return out


def test_an_uneven_evaluation_runs_on_replica_0_alone_as_one_device():
    (single, s), (runner, p) = _session_and_runner()
    try:
        for rows in (1000, 17):
            x, y = _data(rows, rows)
            want = single.run([s["accuracy"], s["loss"]], {s["x"]: x, s["labels"]: y})
            got = runner.run([p["accuracy"], p["loss"]], {p["x"]: x, p["labels"]: y})
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
            # a confusion matrix's ScatterNd makes a tensor, no write (it was
            # taken for one, and the uneven feed refused)
            np.testing.assert_array_equal(
                runner.run(p["confusion"], {p["x"]: x, p["labels"]: y}),
                single.run(s["confusion"], {s["x"]: x, s["labels"]: y}))
        one = single.run(s["logits"], {s["x"]: x[:1]})
        np.testing.assert_allclose(runner.run(p["logits"], {p["x"]: x[:1]}), one, atol=TOL)
        [each] = runner.run([p["logits"]], {p["x"]: x[:1]}, per_replica=True)
        assert len(each) == 1 and np.allclose(each[0], one, atol=TOL)
        with pytest.raises(UnevenFeed, match="17 rows, which do not split evenly over 3"):
            runner.run(p["train"], {p["x"]: x, p["labels"]: y})        # it trains
        with pytest.raises(UnevenFeed, match="do not split evenly"):   # the replicas share
            runner.run(p["masked"], {p["x"]: x, p["labels"]: y})      # its count
        with pytest.raises(UnevenFeed, match="do not split evenly"):   # it writes a variable
            runner.run(p["counted"], {p["x"]: x, p["labels"]: y})
        x, y = _data(2 * N, 1)                                         # an even feed: split
        np.testing.assert_allclose(runner.run(p["masked"], {p["x"]: x, p["labels"]: y}),
                                   single.run(s["masked"], {s["x"]: x, s["labels"]: y}),
                                   atol=TOL)
    finally:
        runner.close()
        single.close()


def test_alone_keeps_replica_0s_value_of_each_fetch():
    values = [np.float32(1.0), np.float32(3.0), np.float32(5.0)]
    names = ("a:0", "parallax/replica_1/a:0", "parallax/replica_2/a:0")
    for how in ("mean", "sum", "concat", "max", "first"):
        [f] = alone([Fetch(names, how, "a")])
        assert f.names == names[:1] and combine(values[:1], f) == 1.0
    [listed] = alone([Fetch(names, "list", "a", (0, 1, 2))])
    assert combine(values[:1], listed) == [1.0]
    [op] = alone([Fetch(("op", "parallax/replica_1/op"), "none", "op")])
    assert op.names == ("op",)
    parts = tuple(Fetch((f"{p}:0", f"parallax/replica_1/{p}:0"), "list", p, (0, 1))
                  for p in ("i", "v", "s"))
    [sparse] = alone([Fetch(tuple(n for q in parts for n in q.names), "sparse rows", "sp",
                            parts=parts)])
    assert sparse.names == ("i:0", "v:0", "s:0") and sparse.how == "sparse first"
    value = combine([np.array([[0, 1]]), np.array([2.0]), np.array([1, 4])], sparse)
    assert value.dense_shape.tolist() == [1, 4] and value.values.tolist() == [2.0]
