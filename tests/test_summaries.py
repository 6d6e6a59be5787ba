"""TF1 summaries fetched from the replicas equal one device's over the
global batch: scalars combined as their tensors are, histograms of the
batch's rows added bucket by bucket, the rest from replica 0."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.runtime import summaries

tf1 = tf.compat.v1
RNG = np.random.RandomState(3)
X, Y = RNG.randn(64, 6).astype(np.float32), RNG.randint(0, 3, 64)


def histogram_of(*parts):
    """TensorFlow's histogram summary of each part: serialized Summaries."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None])
        h = tf1.summary.histogram("h", x)
    with tf1.Session(graph=g) as sess:
        return [sess.run(h, {x: p}) for p in parts]


def parsed(value):
    out = tf1.Summary()
    out.ParseFromString(value)
    return {v.tag: v for v in out.value}


def same_histogram(a, b, rtol=1e-12):
    """Equal buckets and counts; sums to `rtol` (float32 values computed in
    another order differ by their rounding)."""
    assert list(a.bucket_limit) == list(b.bucket_limit)
    assert list(a.bucket) == list(b.bucket)
    assert (a.min, a.max, a.num) == (b.min, b.max, b.num)
    np.testing.assert_allclose([a.sum, a.sum_squares], [b.sum, b.sum_squares], rtol=rtol)


@pytest.mark.parametrize("split", [(3, 5), (0, 8), (8, 0)], ids=["parts", "empty-first",
                                                                 "empty-second"])
def test_added_histograms_are_the_histogram_of_the_whole(split):
    values = np.concatenate([RNG.randn(6) * 10.0 ** RNG.randint(-3, 6, 6), [0.0, -1e-13]])
    first, second = values[:split[0]], values[split[0]:split[0] + split[1]]
    halves = histogram_of(first, second)
    whole, = histogram_of(values[:sum(split)])
    merged = summaries.merge(halves, (("h", "histogram"),))
    same_histogram(parsed(merged)["h"].histo, parsed(whole)["h"].histo)


def test_scalars_are_averaged_summed_or_taken_from_replica_0():
    def summary(**values):
        return tf1.Summary(value=[tf1.Summary.Value(tag=k, simple_value=v)
                                  for k, v in values.items()]).SerializeToString()
    merged = parsed(summaries.merge(
        [summary(loss=1.0, count=3.0, lr=0.5, unknown=7.0, top=2.0, low=-1.0, norm=3.0),
         summary(loss=2.0, count=4.0, lr=0.5, unknown=9.0, top=5.0, low=-3.0, norm=4.0)],
        (("loss", "mean"), ("count", "sum"), ("lr", "first"), ("top", "max"), ("low", "min"),
         ("norm", "norm"))))
    assert {k: v.simple_value for k, v in merged.items()} == {
        "loss": 1.5, "count": 7.0, "lr": 0.5, "unknown": 7.0, "top": 5.0, "low": -3.0,
        "norm": 5.0}


def model():
    """A classifier whose summaries are those of TensorFlow's
    mnist_with_summaries: weights' and activations' histograms, the loss,
    the accuracy, a fed keep probability; also a count of correct examples."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        keep = tf1.placeholder(tf.float32, [], name="keep")
        w = tf1.Variable(tf1.truncated_normal([6, 3], stddev=0.5), name="weights")
        tf1.summary.histogram("weights", w)
        logits = tf.matmul(tf1.nn.dropout(x, rate=1.0 - keep), w)
        tf1.summary.histogram("logits", logits)
        loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        tf1.summary.scalar("loss", loss)
        right = tf.equal(tf.argmax(logits, 1), y)
        tf1.summary.scalar("accuracy", tf.reduce_mean(tf.cast(right, tf.float32)))
        tf1.summary.scalar("correct", tf.reduce_sum(tf.cast(right, tf.float32)))
        tf1.summary.scalar("keep", keep)
        train = tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
        merged = tf1.summary.merge_all()
        tf1.global_variables_initializer()
    return g, train, merged


def test_a_merged_summary_fetched_with_the_train_op_is_one_device_s():
    feeds = [{"x:0": X[i * 16:(i + 1) * 16], "y:0": Y[i * 16:(i + 1) * 16], "keep:0": 1.0}
             for i in range(3)]
    g, train, merged = model()
    with pn.get_runner(g, local(2)) as runner:
        runner.run("init")
        assert runner.fetches.fetch(merged).how == "summary"
        parallel = [runner.run(merged, feed_dict=f) for f in feeds[:1]] + \
            [runner.run([merged, train], feed_dict=f)[0] for f in feeds[1:]]
    g, train, merged = model()
    with tf1.Session(graph=g) as sess:
        sess.run("init")
        single = [sess.run(merged, feed_dict=f) for f in feeds[:1]] + \
            [sess.run([merged, train], feed_dict=f)[0] for f in feeds[1:]]
    for p, s in zip(parallel, single):
        p, s = parsed(p), parsed(s)
        assert list(p) == list(s)
        assert list(p) == ["weights_1", "logits", "loss", "accuracy", "correct", "keep_1"]
        for tag in ("loss", "accuracy", "correct", "keep_1"):
            np.testing.assert_allclose(p[tag].simple_value, s[tag].simple_value, rtol=1e-5,
                                       err_msg=tag)
        same_histogram(p["logits"].histo, s["logits"].histo, rtol=1e-5)
    # the weights' value, read in a run that also trains them, is a race on one device too
    same_histogram(parsed(parallel[0])["weights_1"].histo, parsed(single[0])["weights_1"].histo,
                   rtol=1e-5)


def test_fetch_reduction_first_gives_replica_0_s_summary():
    g, _, merged = model()
    feed = {"x:0": X[:16], "y:0": Y[:16], "keep:0": 1.0}
    config = {"fetch_reduction": {merged.name: "first"}}
    with pn.get_runner(g, local(2), config) as runner:
        runner.run("init")
        assert runner.fetches.fetch(merged).how == "first"
        first = parsed(runner.run(merged, feed_dict=feed))
        each = [parsed(v) for v in runner.run(merged, feed_dict=feed, per_replica=True)]
    assert first["logits"].histo.num == each[0]["logits"].histo.num == 8 * 3
    assert first["loss"].simple_value == each[0]["loss"].simple_value
