"""N replicas with batch b each == one device with batch N*b, for every mode.

After 10 steps every variable (weights, optimizer slots, beta powers, moving
averages, global step) of every replica matches single-device training with
max abs diff <= 1e-5 (float32).
"""
import itertools

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import (OPTIMIZERS, embedding_regression, local, read_name, train_both, train_single,
                    variable_names)

STEPS, BATCH, TOL = 10, 4, 1e-5
CASES = list(itertools.product(["hybrid", "allreduce", "ps"], sorted(OPTIMIZERS),
                               ["plain", "clip+ema"], [2, 4]))


def train_parallel(n, run_option, optimizer, extras, steps=STEPS):
    g, h = embedding_regression(BATCH, optimizer, **extras)
    with pn.get_runner(g, local(n), {"run_option": run_option}) as runner:
        runner.run([h["init"], h["iterator_init"]])
        losses = [runner.run([h["train"], h["loss"]])[1] for _ in range(steps)]
        names = variable_names(g)
        values = runner.run([read_name(v, g) for v in names], per_replica=True)
    return dict(zip(names, values)), losses


@pytest.mark.parametrize("run_option,optimizer,variant,n", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_replicas_match_one_device(run_option, optimizer, variant, n):
    extras = {"clip": True, "ema": True} if variant == "clip+ema" else {}
    parallel, losses = train_parallel(n, run_option, optimizer, extras)
    single = train_single(*embedding_regression(BATCH * n, optimizer, **extras), STEPS)
    assert set(parallel) == set(single)
    assert len(single) >= 5   # weights plus optimizer state
    for name, want in single.items():
        copies = parallel[name]
        assert len(copies) == n
        for k, got in enumerate(copies):
            diff = np.max(np.abs(np.asarray(got) - want))
            assert diff <= TOL, f"{name} on replica {k}: max abs diff {diff}"
    assert np.all(np.isfinite(losses))


MORE_OPTIMIZERS = {
    "ftrl": lambda: tf.compat.v1.train.FtrlOptimizer(
        0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01,
        l2_shrinkage_regularization_strength=0.01),
    "adadelta": lambda: tf.compat.v1.train.AdadeltaOptimizer(1.0),
    "proximal-adagrad": lambda: tf.compat.v1.train.ProximalAdagradOptimizer(
        0.1, l1_regularization_strength=0.01),
    "proximal-sgd": lambda: tf.compat.v1.train.ProximalGradientDescentOptimizer(
        0.1, l2_regularization_strength=0.01),
    "nesterov": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=True)}
MORE_CASES = [(name, "hybrid", "gather") for name in sorted(MORE_OPTIMIZERS)] + [
    ("ftrl", "ps", "sparse"), ("adadelta", "allreduce", "sparse")]


@pytest.mark.parametrize("optimizer,run_option,lookup", MORE_CASES,
                         ids=["-".join(c) for c in MORE_CASES])
def test_more_tf1_optimizers_equal_one_device(optimizer, run_option, lookup):
    """The other tf.compat.v1.train optimizers (their sparse kernels on the
    embedding's rows, their dense ones on the layers), 2 replicas, 10 steps."""
    parallel, single, names = train_both(
        lambda b: embedding_regression(b, MORE_OPTIMIZERS[optimizer], lookup=lookup), 2, STEPS,
        config={"run_option": run_option}, batch=BATCH)
    assert len(names) >= 5
    for name in names:
        for k, got in enumerate(parallel[name]):
            diff = np.max(np.abs(np.asarray(got) - single[name]))
            assert diff <= TOL, f"{name} on replica {k}: max abs diff {diff}"


LOOKUP_CASES = [("hybrid", "adagrad", {}, None), ("hybrid", "adam", {}, None),
                ("allreduce", "adam", {}, None), ("ps", "momentum", {}, None),
                ("allreduce", "adagrad", {"sparse_method": "alltoall"}, None),
                ("allreduce", "adam", {"sparse_method": "allreduce"}, None),
                ("hybrid", "adagrad", {}, 2)]


@pytest.mark.parametrize("run_option,optimizer,config,partitions", LOOKUP_CASES,
                         ids=[f"{r}-{o}-{c.get('sparse_method', 'default')}-{p}"
                              for r, o, c, p in LOOKUP_CASES])
def test_a_lookup_of_distinct_ids_with_clipping_equals_one_device(run_option, optimizer,
                                                                  config, partitions):
    """embedding_lookup_sparse: one device's gradient holds each distinct id
    of the batch once, the replicas' rows repeat the ids they share. With
    gradients clipped by their global norm (the rows' squares) every
    variable and slot of 2 replicas equals one device (1e-5) under every
    sparse method, and with the table in 2 row ranges (each part's rows
    distinct too): the job's rows are summed by id before any use."""
    extras = {"clip": True, "ema": True, "lookup": "sparse", "partitions": partitions}
    g, h = embedding_regression(BATCH, optimizer, **extras)
    with pn.get_runner(g, local(2), {"run_option": run_option, **config}) as runner:
        tables = [v for v in runner.plan.variables if v.startswith("emb")]
        assert len(tables) == (partitions or 1)
        assert all(runner.plan.variables[v].unique_rows for v in tables)
        assert "summed by id before the update" in runner.plan.format()
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(STEPS):
            runner.run(h["train"])
        names = variable_names(g)
        values = runner.run([read_name(v, g) for v in names], per_replica=True)
    single = train_single(*embedding_regression(2 * BATCH, optimizer, **extras), STEPS)
    for name, want in single.items():
        for k, got in enumerate(values[names.index(name)]):
            diff = np.max(np.abs(np.asarray(got) - want))
            assert diff <= TOL, f"{name} on replica {k}: max abs diff {diff}"


def fixed_batch_classifier(batch):
    """mnist's fully_connected_feed: placeholders of a fixed batch,
    tf.compat.v1.losses, a count of correct examples by in_top_k, a
    streaming mean of the loss."""
    rng = np.random.RandomState(3)
    g = tf.Graph()
    with g.as_default():
        images = tf.compat.v1.placeholder(tf.float32, (batch, 6), name="images")
        labels = tf.compat.v1.placeholder(tf.int32, (batch,), name="labels")
        w = tf.compat.v1.get_variable("w", initializer=rng.randn(6, 8).astype(np.float32))
        v = tf.compat.v1.get_variable("v", initializer=rng.randn(8, 3).astype(np.float32))
        logits = tf.matmul(tf.nn.relu(tf.matmul(images, w)), v)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(tf.cast(labels, tf.int64),
                                                                 logits)
        correct = tf.reduce_sum(tf.cast(tf.compat.v1.nn.in_top_k(logits, labels, 1), tf.int32))
        _, mean_update = tf.compat.v1.metrics.mean(loss, name="mean_loss")
        _, accuracy = tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1, tf.int32))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        init = tf.group(tf.compat.v1.global_variables_initializer(),
                        tf.compat.v1.local_variables_initializer())
    return g, {"train": train, "loss": loss, "correct": correct, "mean": mean_update,
               "accuracy": accuracy, "init": init}


def test_fixed_batch_placeholders_with_tf1_losses_equal_one_device():
    """Fed N times the placeholders' batch: every variable, the loss, the
    count of correct examples (int32, summed), the streaming mean and
    accuracy equal one device's (were: gradients and the loss the
    replicas' sum, 2x, the count their mean, 1/2x, forms.constant_value and
    in_top_k's rows; the accuracy 2x, its count of a static batch folded to
    a constant each replica added alone, state_sync._rows_counted)."""
    rng = np.random.RandomState(4)
    x, y = rng.rand(6, 16, 6).astype(np.float32), rng.randint(0, 3, (6, 16)).astype(np.int32)
    runs = []
    for batch, parallel in [(8, True), (16, False)]:
        g, h = fixed_batch_classifier(batch)
        session = pn.get_runner(g, local(2)) if parallel else tf.compat.v1.Session(graph=g)
        with session as s:
            s.run(h["init"])
            out = [s.run([h["train"], h["loss"], h["correct"], h["mean"], h["accuracy"]],
                         {"images:0": x[k], "labels:0": y[k]})[1:] for k in range(6)]
            runs.append((out, s.run([read_name(n, g) for n in ("w", "v")])))
    (got, got_vars), (want, want_vars) = runs
    for (loss, correct, mean, acc), (loss1, correct1, mean1, acc1) in zip(got, want):
        assert abs(loss - loss1) <= 1e-5 and abs(mean - mean1) <= 1e-5
        assert abs(acc - acc1) <= 1e-6
        assert correct == correct1 and np.asarray(correct).dtype == np.int32
    for a, b in zip(got_vars, want_vars):
        assert np.max(np.abs(a - b)) <= TOL


def test_loss_fetch_is_global_batch_mean():
    """Fetching the loss returns the mean over replicas = the global batch loss."""
    g, h = embedding_regression(BATCH, "sgd")
    with pn.get_runner(g, local(2), {"run_option": "hybrid"}) as runner:
        runner.run([h["init"], h["iterator_init"]])
        loss = runner.run(h["loss"])
    g1, h1 = embedding_regression(2 * BATCH, "sgd")
    with tf.compat.v1.Session(graph=g1) as sess:
        sess.run([h1["init"], h1["iterator_init"]])
        want = sess.run(h1["loss"])
    assert abs(loss - want) <= 1e-6 * max(1.0, abs(want))


@pytest.mark.parametrize("run_option,asked", [("hybrid", False), ("allreduce", False),
                                              ("ps", False), ("hybrid", "auto"), ("ps", "auto")])
def test_summed_losses_with_summed_gradients(run_option, asked):
    """A loss that sums over the batch (tf.reduce_sum): the replicas'
    gradients summed match one device, asked for (average_dense/
    average_sparse false) or by default (auto: the loss's form; before,
    the default averaged them, each step half of one device's)."""
    # a sum over 2*BATCH examples makes steps 2*BATCH times larger: small rate
    small = lambda: tf.compat.v1.train.MomentumOptimizer(0.005, 0.9)  # noqa: E731
    g, h = embedding_regression(BATCH, small, loss_sum=True)
    config = {"run_option": run_option} if asked == "auto" else \
        {"run_option": run_option, "average_dense": asked, "average_sparse": asked}
    with pn.get_runner(g, local(2), config) as runner:
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(STEPS):
            runner.run(h["train"])
        names = variable_names(g)
        got = dict(zip(names, runner.run([read_name(v, g) for v in names])))
    single = train_single(*embedding_regression(2 * BATCH, small, loss_sum=True), STEPS)
    for name, want in single.items():
        assert np.max(np.abs(got[name] - want)) <= TOL, name


SUMS = {   # losses that sum over the batch, with the op that hid their form before
    # tf.nn.l2_loss(pred - y) plus a weight penalty: averaged with a warning,
    # each step half of one device's (0.044 off after 3 steps)
    "l2_loss": lambda pred, y, w, wt: tf.nn.l2_loss(pred - y) + 0.01 * tf.nn.l2_loss(w),
    # a weighted sum of per-example pairwise terms behind tf.where(count > 0,
    # sum, 0), the per-example sums over tf.range(1, tf.rank(d)): the same
    "pairwise": lambda pred, y, w, wt: tf.compat.v1.losses.mean_pairwise_squared_error(
        tf.tile(y, [1, 2]), tf.concat([pred, 2.0 * pred], 1), weights=wt),
}


@pytest.mark.parametrize("run_option", ["hybrid", "ps"])
@pytest.mark.parametrize("kind", sorted(SUMS))
def test_losses_that_sum_over_the_batch_sum_the_replicas_gradients(kind, run_option, capsys):
    """A loss read as a sum over the batch: the replicas' gradients are
    summed (a penalty on the weights divided among them), exact, with no
    warning (replica 0's examples all weigh 0 in the weighted one)."""
    def build():
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
            y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
            wt = tf.compat.v1.placeholder(tf.float32, [None, 1], name="wt")
            w = tf.compat.v1.get_variable("w", initializer=np.full((4, 1), 0.1, np.float32))
            loss = SUMS[kind](tf.matmul(x, w), y, w, wt)
            train = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
            init = tf.compat.v1.global_variables_initializer()
        return g, dict(x=x, y=y, wt=wt, w=w, loss=loss, train=train, init=init)
    rng = np.random.default_rng(0)
    feed = [rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32),
            np.float32([[0], [0], [0], [0], [1], [0.5], [0], [2]])]
    fed = ("x", "y", "wt") if kind == "pairwise" else ("x", "y")
    _three_steps_equal(build, lambda h: dict(zip((h[k] for k in fed), feed)), run_option, capsys)


def _three_steps_equal(build, feeds, run_option, capsys):
    """3 steps of `build()`'s graph on one device and on 2 replicas: each
    step's loss and the weight w after them equal (1e-6), no warning."""
    runs = []
    for parallel in (False, True):
        g, h = build()
        with (pn.get_runner(g, local(2), {"run_option": run_option}) if parallel
              else tf.compat.v1.Session(graph=g)) as run:
            run.run(h["init"])
            runs.append([run.run([h["loss"], h["train"]], feeds(h))[0] for _ in range(3)] +
                        [run.run(h["w"])])
    assert "parallax_ng" not in capsys.readouterr().err
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


FUNCTIONS = {    # losses that are functions of means over the batch, not linear in them
    "rmse": lambda e, wt: tf.sqrt(tf.reduce_mean(e)),
    "log-mean-exp": lambda e, wt: tf.math.log(tf.reduce_mean(tf.exp(e))),
    "ratio": lambda e, wt: tf.reduce_mean(e) / tf.reduce_mean(e * wt + 1.0),
    "masked-rmse-plus-mse": lambda e, wt: tf.sqrt(tf.reduce_sum(e * wt) / tf.reduce_sum(wt)) +
    0.1 * tf.reduce_mean(e),
}


@pytest.mark.parametrize("run_option", ["hybrid", "ps", "allreduce"])
@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_a_function_of_means_is_taken_of_the_jobs_means(kind, run_option, capsys):
    """Each replica takes the function of the replicas' mean (exchanged,
    forward and in the gradient), so the averaged gradient is one device's:
    exact, no warning. Before, the form was unknown: averaged with a warning,
    0.034 off one device after 3 steps for the RMSE."""
    def build():
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
            y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
            wt = tf.compat.v1.placeholder(tf.float32, [None], name="wt")
            w = tf.compat.v1.get_variable("w", initializer=np.full((4, 1), 0.1, np.float32))
            e = tf.square(tf.squeeze(tf.matmul(x, w), 1) - y)
            loss = FUNCTIONS[kind](e, wt)
            train = tf.compat.v1.train.GradientDescentOptimizer(0.05).minimize(loss)
            init = tf.compat.v1.global_variables_initializer()
        return g, dict(x=x, y=y, wt=wt, w=w, loss=loss, train=train, init=init)
    rng = np.random.default_rng(0)
    feed = [rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=8).astype(np.float32),
            np.float32([1, 0, 0, 0, 1, 1, 0, 1])]     # 1 and 3 kept rows in the replicas
    _three_steps_equal(build, lambda h: dict(zip((h["x"], h["y"], h["wt"]), feed)), run_option,
                       capsys)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_a_sparse_gradient_all_reduced_as_dense(optimizer):
    """sparse_method allreduce: the embedding's rows summed by index into a
    dense tensor, all-reduced, the touched rows applied (momentum: rows no
    replica touched stay), next to dense gradients in one bucket; clipping
    by the global norm and moving averages."""
    seen = {}
    parallel, single, names = train_both(
        lambda b: embedding_regression(b, optimizer, clip=True, ema=True), 2, STEPS,
        config={"run_option": "allreduce", "sparse_method": "allreduce",
                "buckets": {"mode": "single"}}, seen=seen)
    assert seen["plan"].variables["emb"].method == "allreduce"
    assert all("emb" not in b.variables for b in seen["plan"].buckets)
    for name, want in single.items():
        for got in parallel[name]:
            assert np.max(np.abs(np.asarray(got) - want)) <= TOL, name


def _sparse_bias(batch):
    """A 1-D table read by id (a sparse bias) beside a 2-D one, Adagrad."""
    g = tf.Graph()
    with g.as_default():
        ids = tf.data.Dataset.from_tensor_slices(np.arange(64) * 7 % 23).batch(batch).repeat()
        it = tf.compat.v1.data.make_initializable_iterator(pn.shard(ids))
        words = it.get_next()
        emb = tf.compat.v1.get_variable("emb", initializer=np.ones([23, 3], np.float32))
        bias = tf.compat.v1.get_variable("bias", initializer=np.zeros([23], np.float32))
        x = tf.reduce_sum(tf.nn.embedding_lookup(emb, words), 1) + tf.gather(bias, words)
        loss = tf.reduce_mean(tf.square(x - 2.0))
        train = tf.compat.v1.train.AdagradOptimizer(0.3).minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    return g, {"train": train, "init": init, "iterator_init": it.initializer}


def test_a_one_dimensional_sparse_gradient_all_reduced_as_dense():
    parallel, single, _ = train_both(_sparse_bias, 2, STEPS, config={
        "run_option": "allreduce", "sparse_method": "allreduce"})
    for name, want in single.items():
        for got in parallel[name]:
            assert np.max(np.abs(np.asarray(got) - want)) <= TOL, name


def test_rows_seen_one_by_one_cannot_be_summed_as_dense():
    g = tf.Graph()
    with g.as_default():
        ids = tf.compat.v1.placeholder(tf.int32, [None])
        emb = tf.compat.v1.get_variable("emb", initializer=np.ones([10, 4], np.float32))
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        gv = opt.compute_gradients(tf.reduce_mean(tf.nn.embedding_lookup(emb, ids)))
        tf.identity(tf.reduce_sum(gv[0][0].values), name="grad_total")
        opt.apply_gradients(gv)
    with pytest.raises(pn.ConfigError,
                       match="variable_methods.emb' is allreduce.*use alltoall, allgather, ps"):
        pn.get_runner(g, local(2), {"variable_methods": {"emb": "allreduce"}})
    plan = pn.transform_plan(g, local(2), {"sparse_method": "allreduce"})
    assert plan.variables["emb"].method == "ps"       # the run option's, hybrid


def feature_column_model():
    """ids -> tf.compat.v1.feature_column.embedding_column (sqrtn) through
    input_layer (safe_embedding_lookup_sparse: each distinct id once), a
    dense layer, Adam, gradients clipped by their global norm."""
    fc = tf.compat.v1.feature_column
    g = tf.Graph()
    with g.as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None, 3], name="ids")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        column = fc.embedding_column(fc.categorical_column_with_identity("ids", 30), 4,
                                     combiner="sqrtn",
                                     initializer=tf.compat.v1.random_normal_initializer(seed=1))
        h = fc.input_layer({"ids": ids}, [column])
        w = tf.compat.v1.get_variable("w", [4, 1], initializer=tf.compat.v1.ones_initializer())
        opt = tf.compat.v1.train.AdamOptimizer(0.05)
        pairs = opt.compute_gradients(tf.reduce_mean(tf.square(tf.matmul(h, w) - y)))
        clipped, _ = tf.clip_by_global_norm([grad for grad, _ in pairs], 0.1)
        train = opt.apply_gradients(zip(clipped, [v for _, v in pairs]))
        init = tf.compat.v1.global_variables_initializer()
    return g, ids, y, train, init


@pytest.mark.parametrize("run_option", ["hybrid", "allreduce", "ps"])
def test_a_feature_column_embedding_with_clipping_equals_one_device(run_option):
    """The TF1 feature-column pattern (an embedding column read through
    input_layer, clipping): 6 Adam steps on 2 replicas equal one device,
    every variable and slot (1e-5)."""
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 30, (8, 3)).astype(np.int64),
             rng.normal(size=(8, 1)).astype(np.float32)) for _ in range(6)]
    g, ids, y, train, init = feature_column_model()
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        for i, labels in data:
            sess.run(train, {ids: i, y: labels})
        single = sess.run(g.get_collection("variables"))
    g, ids, y, train, init = feature_column_model()
    with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
        assert runner.ctx.tg.rows_unique == {"input_layer/ids_embedding/embedding_weights"}
        runner.run(init)
        for i, labels in data:
            runner.run(train, {ids: i, y: labels})
        for var, want in zip(g.get_collection("variables"), single):
            np.testing.assert_allclose(runner.run(var), want, atol=TOL, rtol=0,
                                       err_msg=var.name)
