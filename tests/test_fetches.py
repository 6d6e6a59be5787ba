"""Fetch and feed mapping: how each kind of fetch is run and combined."""
import numpy as np
import pytest
import tensorflow as tf
from models import ctc_model, embedding_regression, local

import parallax_ng as pn


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


def test_fetches_join_along_the_batchs_axis_or_reduce_as_the_graph_shows():
    """A time-major tensor joins the replicas' parts along its second axis;
    a tensor summed over the batch (per feature) is the replicas' sum, one
    averaged over it their mean; per-example booleans and strings join
    too (a prediction's correctness, its class name), a boolean reduced
    by any or all is the replicas' any or all, a largest or smallest value
    over the batch their max or min, a norm over it the norm of their
    norms, the batch's shape theirs with the rows added, counts per class
    (bincount, a confusion matrix, a histogram) their sum (all had been
    joined or averaged); each equals one device's value."""
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
                   tf.reduce_max(tf.reduce_max(h, 2), 0, name="largest_per_step"),
                   tf.shape(h, name="shape"), tf.norm(h, name="norm"),
                   tf.math.bincount(tf.cast(h[:, 0, 0] > 0, tf.int32), minlength=2,
                                    name="per_class"),
                   tf.math.confusion_matrix(tf.cast(h[:, 0, 0] > 0, tf.int32),
                                            tf.cast(h[:, 1, 1] > 0, tf.int32), 2,
                                            name="confusion"),
                   tf.histogram_fixed_width(h[:, 0, 0], [-3.0, 3.0], nbins=4, name="histogram")]
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
                                                ("all", 0), ("max", 0), ("min", 0), ("max", 0),
                                                ("shape", 0), ("norm", 0), ("sum", 0),
                                                ("sum", 0), ("sum", 0)]
    # replica 0 alone would give the answers opposite to these; the replicas'
    # mean (the rule before max and min) is not the batch's largest value
    assert want[5] and not want[6]
    assert abs(np.mean([2 * batch[:2].max(), 2 * batch[2:].max()]) - want[7]) > 0.05
    for a, b in zip(got, want):
        if b.dtype.kind in "bOS":
            assert np.asarray(a).tolist() == b.tolist()
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_ctc_models_loss_and_sparse_decoding_equal_one_device(capsys):
    """CTC's loss per sequence is a batch's (its mean is a mean: no warning),
    and the greedy decoder's SparseTensor, fetched as TF1 scripts print it,
    joins the replicas' rows as one device's batch (it could not be
    fetched before); 3 Momentum steps equal one device's, 1e-6."""
    rng = np.random.RandomState(0)
    steps = []
    for _ in range(3):
        rows = [(i, j) for i in range(4) for j in range(rng.randint(1, 3))]
        steps.append((rng.randn(4, 6, 3).astype(np.float32), np.array([6, 4, 5, 6], np.int32),
                      tf.compat.v1.SparseTensorValue(np.array(rows, np.int64),
                                                     rng.randint(0, 4, len(rows)).astype(np.int32),
                                                     np.array([4, 2], np.int64))))
    results = []
    for parallel in (False, True):
        g, h = ctc_model()
        with (pn.get_runner(g, local(2)) if parallel else tf.compat.v1.Session(graph=g)) as run:
            run.run(h["init"])
            fetch = [h["cost"], h["errors"], h["decoded"]]
            results.append([run.run(fetch if k < 2 else fetch + [h["train"]],
                                    {h["x"]: x, h["lengths"]: n, h["labels"]: y})
                            for k, (x, n, y) in enumerate(steps)] + [run.run(h["w"])])
    assert "parallax_ng" not in capsys.readouterr().err
    (*one, w1), (*two, w2) = results
    for a, b in zip(one, two):
        np.testing.assert_allclose(a[:2], b[:2], rtol=0, atol=1e-6)
        assert isinstance(b[2], tf.compat.v1.SparseTensorValue) and len(b[2].values)
        for part in range(3):
            np.testing.assert_array_equal(a[2][part], b[2][part])
    np.testing.assert_allclose(w1, w2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("run_option,reduce", [("hybrid", "mean"), ("allreduce", "mean"),
                                               ("ps", "sum")])
def test_fetched_gradients_are_one_devices(run_option, reduce):
    """A gradient fetched as debugging scripts print them: the trained
    gradients of a dense weight (it came back as the replicas' [6, 1]
    concatenated, not one device's [3, 1]) and of an embedding (its rows:
    each replica's of its own mean, 2x one device's), a second
    tf.gradients of the weight and of the looked-up rows (per example), a
    histogram of the weight's gradient (its buckets had been added over
    the replicas: twice one device's counts), the gradients' global
    norm, and the embedding's gradient as the tf.IndexedSlices it is (a
    session gives its values, indices and shape; it was refused). All one
    device's, 1e-6, fetched with the train op and before it, each alone
    (an all-reduced gradient, or its norm, fetched alone ran in replica 0
    only, and waited for the others until the run's timeout)."""
    def build():
        g = tf.Graph()
        with g.as_default():
            ids = tf.compat.v1.placeholder(tf.int32, [None], "ids")
            y = tf.compat.v1.placeholder(tf.float32, [None, 1], "y")
            emb = tf.compat.v1.get_variable(
                "emb", initializer=np.random.RandomState(0).randn(10, 3).astype(np.float32))
            w = tf.compat.v1.get_variable(
                "w", initializer=np.random.RandomState(1).randn(3, 1).astype(np.float32))
            rows = tf.nn.embedding_lookup(emb, ids)
            loss = getattr(tf, f"reduce_{reduce}")(tf.square(tf.matmul(rows, w) - y))
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            pairs = opt.compute_gradients(loss)
            train = opt.apply_gradients(pairs)
            (g_emb, _), (g_w, _) = sorted(pairs, key=lambda p: p[1].name)
            fetches = dict(w=g_w, emb_rows=g_emb.values, emb_ids=g_emb.indices,
                           again=tf.compat.v1.gradients(loss, [w])[0],
                           rows=tf.compat.v1.gradients(loss, rows)[0],
                           histogram=tf.compat.v1.summary.histogram("w_grad", g_w),
                           norm=tf.linalg.global_norm([g_w, g_emb]), slices=g_emb)
            init = tf.compat.v1.global_variables_initializer()
        return g, ids, y, fetches, train, init
    feed = [np.array([1, 2, 3, 1, 5, 6, 2, 9], np.int32),
            np.random.RandomState(2).randn(8, 1).astype(np.float32)]
    got = []
    for parallel in (False, True):
        g, ids, y, fetches, train, init = build()
        config = {"run_option": run_option, "communication": {"timeout_seconds": 30}}
        with (pn.get_runner(g, local(2), config) if parallel
              else tf.compat.v1.Session(graph=g)) as run:
            run.run(init)
            alone = {k: run.run(t, {ids: feed[0], y: feed[1]}) for k, t in fetches.items()}
            if parallel:    # each replica's own IndexedSlices: of its half of the rows
                each = run.run(fetches["slices"], {ids: feed[0], y: feed[1]}, per_replica=True)
                assert [sorted(e.indices) for e in each] == [[1, 1, 2, 3], [2, 5, 6, 9]]
            got.append((alone, run.run([fetches, train], {ids: feed[0], y: feed[1]})[0]))
    for one, two in zip(*got):
        histograms = [tf.compat.v1.Summary.FromString(v.pop("histogram")).value[0].histo
                      for v in (one, two)]
        assert histograms[0].num == histograms[1].num == 3
        assert histograms[0].sum == pytest.approx(histograms[1].sum, abs=1e-6)
        dense = []          # the IndexedSlices whole, as a session gives it: its rows added
        for slices in (one.pop("slices"), two.pop("slices")):
            assert type(slices).__name__ == "IndexedSlicesValue"
            np.testing.assert_array_equal(slices.dense_shape, [10, 3])
            dense.append(np.zeros([10, 3]))
            np.add.at(dense[-1], slices.indices, slices.values)
        np.testing.assert_allclose(*dense, rtol=0, atol=1e-6)
        for name in one:
            assert np.shape(two[name]) == np.shape(one[name]), name
            np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "summed"])
def test_a_loss_of_a_form_the_graph_hides_is_fetched_as_its_gradients_combine(average):
    """A TF1 graph whose loss, a sum over the batch, is a tf.function's
    output (a call the analysis does not open): its gradients are averaged
    by default, with a line saying so, or summed where the config sums them
    (as the line advises), and the
    fetched loss follows (before: averaged either way, half of one
    device's where the config sums)."""
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(3, 8, 4)), rng.normal(size=(3, 8, 1))

    def build():
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float64, [None, 4])
            y = tf.compat.v1.placeholder(tf.float64, [None, 1])
            w = tf.compat.v1.get_variable("w", initializer=np.ones((4, 1)))
            loss = tf.function(lambda p, t: tf.reduce_sum(tf.square(p - t)))(x @ w, y)
            train = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
        return g, x, y, w, loss, train
    g, x, y, w, loss, train = build()
    config = {"run_option": "allreduce"} if average else \
        {"run_option": "allreduce", "average_dense": False, "average_sparse": False}
    with pn.get_runner(g, local(2), config) as runner:
        runner.run(w.initializer)
        fetched = [runner.run([train, loss], {x: a, y: b})[1] for a, b in zip(xs, ys)]
        parallel = runner.run(w)
        assert any("is a mean or a sum" in line for line in runner.plan.unmet()) == average
    g, x, y, w, loss, train = build()
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(w.initializer)
        single = [sess.run([train, loss], {x: a, y: b})[1] for a, b in zip(xs, ys)]
        assert (np.abs(parallel - sess.run(w)).max() <= 1e-12) != average
    # the first step's loss is before any update: the replicas' losses combined
    np.testing.assert_allclose(fetched[0], single[0] / (2 if average else 1), rtol=1e-12)
    if not average:
        np.testing.assert_allclose(fetched, single, rtol=1e-12)
