"""Scripts as ported TF1 code writes them: fed placeholders with an unknown
batch dimension and a sparse embedding. Runs in the main suite and again,
from test_v1_behavior.py, in a process that called
tf.compat.v1.disable_v2_behavior() (v1 TensorShape: dimensions are
`Dimension` objects, never None)."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from conftest import V1_BEHAVIOR
from models import local, read_name
from parallax_ng import compat
from parallax_ng.graph import frontend
from parallax_ng.planning.analysis import analyze

tf1 = tf.compat.v1
VOCAB, STEPS = 12, 10


def fed_model(optimizer):
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        rng = np.random.RandomState(0)
        emb = tf1.get_variable("emb", initializer=rng.randn(VOCAB, 3).astype(np.float32))
        w = tf1.get_variable("w", initializer=rng.randn(3, 1).astype(np.float32))
        h = tf1.nn.embedding_lookup(emb, ids) * x
        pred = tf.identity(tf.matmul(h, w), name="pred")
        loss = tf.reduce_mean(tf.square(pred - y), name="loss")
        optimizer().minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g


def batches(steps, rows):
    rng = np.random.RandomState(1)
    for _ in range(steps):
        yield {"ids:0": rng.randint(0, VOCAB, rows).astype(np.int32),
               "x:0": rng.randn(rows, 3).astype(np.float32),
               "y:0": rng.randn(rows, 1).astype(np.float32)}


def test_the_mode_under_test():
    dim = tf.TensorShape([None, 3])[0]
    assert isinstance(dim, tf1.Dimension) == V1_BEHAVIOR
    assert compat.dim(tf.TensorShape([None, 3]), 0) is None
    assert compat.dim(tf.TensorShape([5, 3]), 1) == 3
    assert compat.dim(tf.TensorShape(None), 0) is None


def test_sparse_gradient_analysis_and_per_replica_placeholders():
    tg = frontend.load(fed_model(lambda: tf1.train.AdagradOptimizer(0.1)))
    info = analyze(tg)
    assert info["emb"].sparse and info["emb"].alpha is None   # lookups per step unknown
    assert {"ids", "x", "y"} <= tg.variant


@pytest.mark.parametrize("run_option", ["hybrid", "allreduce", "ps"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fed_batches_split_and_training_equals_one_device(run_option, optimizer):
    make = {"sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
            "adam": lambda: tf1.train.AdamOptimizer(0.05)}[optimizer]
    g = fed_model(make)
    names = [v.op.name for v in g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)]
    reads = [read_name(n, g) for n in names]
    with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
        runner.run("init")
        first = next(batches(1, 8))
        per = runner.run("pred:0", first, per_replica=True)
        assert [p.shape for p in per] == [(4, 1), (4, 1)]    # each replica half the rows
        for feed in batches(STEPS, 8):
            runner.run("train", feed)
        parallel = runner.run(reads, per_replica=True)
    single_graph = fed_model(make)
    with tf1.Session(graph=single_graph) as sess:
        sess.run("init")
        for feed in batches(STEPS, 8):
            sess.run("train", feed)
        single = sess.run(reads)
    for name, copies, want in zip(names, parallel, single):
        for k, got in enumerate(copies):
            assert np.max(np.abs(got - want)) <= 1e-5, (name, k)
