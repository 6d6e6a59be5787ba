"""transforms/selected_means.py: a mean over the rows a mask picks
(tf.boolean_mask) on 2 replicas equals one device with the global batch,
though a replica picks no row in the first step (its mean alone is NaN):
the fetched loss (a masked metric and a count of rows too) every step and every
variable and slot after 6 steps within 1e-5, in a TF1 graph (all-reduce
and parameter servers), a Keras 3 `pn.function` loop, jobs of 2 workers
(all-reduce; with a server, hybrid and ps) and `model.fit` in both
Kerases; in a branch, warned. A tf.reduce_mean added to a sum over the
batch (widened: over N times its count) likewise: TF1 with shapes known at
run time or static, a job of 2 workers and a server, `fit` in both."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local, read_name, variable_names
from test_tf2 import keras3_dense

tf1 = tf.compat.v1
TOL, STEPS, BATCH = 1e-5, 6, 8       # BATCH: the global batch


def arrays():
    """Features and targets; the first global batch has one positive target
    (row 0), so in it one replica's rows, however split, hold none."""
    rng = np.random.RandomState(3)
    x = rng.randn(STEPS * BATCH, 5).astype(np.float32)
    y = rng.randn(STEPS * BATCH, 1).astype(np.float32)
    y[:BATCH] = -np.abs(y[:BATCH])
    y[0] = 1.0
    return x, y


def masked_loss(pred, y):
    """The squared error over the rows whose target is positive."""
    return tf.reduce_mean(tf.square(tf.boolean_mask(pred - y, y[:, 0] > 0)))


def tf1_model(batch, losses, static=False):
    """A TF1 graph of two layers on the shard of `arrays()`, trained by Adam
    on the first of `losses(pred, y)` (the others fetched beside it); with
    `static`, batches of a shape the graph fixes."""
    g = tf.Graph()
    with g.as_default():
        ds = pn.shard(tf.data.Dataset.from_tensor_slices(arrays())).batch(
            batch, drop_remainder=static)
        it = tf1.data.make_initializable_iterator(ds)
        x, y = it.get_next()
        rng = np.random.RandomState(4)
        w = tf1.get_variable("w", initializer=rng.randn(5, 4).astype(np.float32))
        v = tf1.get_variable("v", initializer=rng.randn(4, 1).astype(np.float32))
        fetched = losses(tf.matmul(tf.tanh(tf.matmul(x, w)), v), y)
        train = tf1.train.AdamOptimizer(0.05).minimize(fetched[0])
        init = tf1.global_variables_initializer()
    return g, train, fetched, init, it.initializer


def check_tf1(losses, run, static=False) -> dict:
    """tf1_model on 2 replicas (run option `run`) against one device with
    the global batch: the fetched values every step and every variable
    after STEPS steps within TOL; the rewritten graph's {node: op}."""
    g, train, fetched, init, it_init = tf1_model(BATCH // 2, losses, static)
    names = variable_names(g)
    reads = [read_name(n, g) for n in names]
    with pn.get_runner(g, local(2), {"run_option": run}) as runner:
        runner.run([init, it_init])
        start = runner.run(reads)
        got = [runner.run([train, fetched])[1] for _ in range(STEPS)]
        parallel = dict(zip(names, runner.run(reads, per_replica=True)))
        made = {n.name: n.op for n in runner.graph.as_graph_def().node}
    g1, train1, fetched1, init1, it_init1 = tf1_model(BATCH, losses, static)
    with tf1.Session(graph=g1) as sess:
        sess.run([init1, it_init1])
        load_values(sess, g1, dict(zip(names, start)))
        want = [sess.run([train1, fetched1])[1] for _ in range(STEPS)]
        single = dict(zip(names, sess.run(reads)))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert len(names) >= 6                  # the weights and Adam's slots
    for name in names:
        for value in parallel[name]:
            np.testing.assert_allclose(value, single[name], atol=TOL, rtol=0, err_msg=name)
    return made


def loss_and_metric(pred, y):
    """The masked loss, a metric not trained (the mean absolute error over
    the other rows) and the count of picked rows (one device's: the sum)."""
    others = tf.boolean_mask(pred - y, y[:, 0] <= 0)
    return [masked_loss(pred, y), tf.reduce_mean(tf.abs(others)),
            tf.cast(tf.size(others), tf.float32)]


@pytest.mark.parametrize("run", ["allreduce", "ps"])
def test_a_tf1_mean_over_masked_rows_equals_one_device(run):
    made = check_tf1(loss_and_metric, run)
    # each replica's mean is its sum over the job's count, under the mean's name
    assert made["Mean"] == made["Mean_1"] == "RealDiv" and made["Mean/parallax_sum"] == "Sum"
    assert any(n.startswith("parallax/selected_means/Mean/job_count") for n in made)


def step_of(model, optimizer):
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = masked_loss(model(x, training=True), y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return train_step


def test_a_keras3_loop_of_a_mean_over_masked_rows_equals_one_device():
    keras.utils.set_random_seed(0)
    a, b = keras3_dense(), keras3_dense()
    b.set_weights(a.get_weights())
    oa, ob = keras.optimizers.Adam(0.05), keras.optimizers.Adam(0.05)
    step, ref = pn.function(step_of(a, oa), local(2)), tf.function(step_of(b, ob))
    x, y = arrays()
    for k in range(STEPS):
        at = slice(k * BATCH, (k + 1) * BATCH)
        got, want = step(x[at], y[at]), ref(x[at], y[at])
        np.testing.assert_allclose(got, want.numpy(), atol=TOL, rtol=0)
    step.sync()
    for v1, v2 in zip(a.weights + oa.variables, b.weights + ob.variables):
        np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), atol=TOL, rtol=0,
                                   err_msg=v1.path)


def test_a_job_of_two_workers_equals_one_device(tmp_path):
    """tf2_job_script.py --selected: the Keras 3 loop above as a job of 2
    workers x 1 device on 127.0.0.1 (the job's count all-reduced between them)."""
    from test_tf2 import run_job
    out, done = run_job(tmp_path, "--selected")
    assert "worker 1 of 2: done" in done.stdout
    workers = [dict(np.load(f"{out}.{k}.npz")) for k in range(2)]
    model, optimizer = keras3_dense(), keras.optimizers.Adam(0.05)
    model.set_weights([workers[0][f"start{i}"] for i in range(len(model.weights))])
    ref = tf.function(step_of(model, optimizer))
    x, y = arrays()
    for k in range(5):
        ref(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
    for w in workers:
        for i, v in enumerate(model.weights):
            np.testing.assert_allclose(w[f"w{i}"], np.asarray(v), atol=TOL, rtol=0)
        for i, v in enumerate(optimizer.variables):
            np.testing.assert_allclose(w[f"o{i}"], np.asarray(v), atol=TOL, rtol=0)



@pytest.mark.parametrize("run_option", ["hybrid", "ps"])
def test_a_job_with_a_server_equals_one_device(tmp_path, run_option):
    """tests/cluster_script.py --masked: 2 workers and a server (the count
    summed on it where the dense gradients go there), the embedding
    regression's loss a mean over the examples whose target is positive,
    Adam with clipping and moving averages, 10 steps: every variable."""
    from models import embedding_regression, train_single
    from test_cluster import load, run_job
    done, out, _ = run_job(tmp_path, 2, 1, "10", "--run-option", run_option, "--masked",
                           servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    single = train_single(*embedding_regression(8, "adam", clip=True, ema=True, masked=True),
                          10)
    parallel = load(out, 2)
    assert set(parallel) == set(single)
    for name, copies in parallel.items():
        for got in copies:
            np.testing.assert_allclose(got, single[name], atol=TOL, rtol=0, err_msg=name)


def test_a_mean_over_picked_rows_in_a_branch_is_warned():
    """Not every replica may run a branch (tf.cond as Switch/Merge, as
    disable_v2_behavior makes it): its mean keeps the replica's own count,
    and the build says so, naming it."""
    from test_branches import lowered_conds
    g = tf.Graph()
    with g.as_default(), lowered_conds():
        x = tf1.placeholder(tf.float32, [None, 5], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        pred = tf.matmul(x, tf1.get_variable("w", initializer=np.ones((5, 1), np.float32)))
        whole = tf1.placeholder_with_default(False, [], name="whole")
        loss = tf1.cond(whole, lambda: tf.reduce_mean(tf.square(pred - y)),
                        lambda: masked_loss(pred, y))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.warns(UserWarning, match=r"means over rows a mask picks \['cond/Mean_1'\] sit "
                                         r"in a branch or a loop"):
        pn.get_runner(g, local(2)).close()


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_fit_with_a_loss_over_masked_rows_equals_one_device(lib):
    """`model.fit` with the masked loss as a Keras loss function: the
    logged losses, every weight and slot after an epoch."""
    k = keras if lib == "keras3" else __import__("tf_keras")

    def make():
        return k.Sequential([k.Input((5,)), k.layers.Dense(8, activation="relu"),
                             k.layers.Dense(1)])
    k.utils.set_random_seed(0)
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=k.optimizers.Adam(0.05), loss=lambda y, p: masked_loss(p, y))
    pn.parallelize(parallel, local(2))
    x, y = arrays()
    h1, h2 = (m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
              for m in (parallel, single))
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=TOL, rtol=0)
    assert np.all(np.isfinite(h1.history["loss"]))
    for v1, v2 in zip(parallel.weights + parallel.optimizer.variables,
                      single.weights + single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), atol=TOL, rtol=0,
                                   err_msg=getattr(v1, "path", v1.name))


def sum_and_mean(pred, y):
    """A sum of squares over the batch plus half a tf.reduce_mean of the
    absolute errors, and that Mean fetched apart."""
    part = tf.reduce_mean(tf.abs(pred - y))
    return [tf.reduce_sum(tf.square(pred - y)) + 0.5 * part, part]


@pytest.mark.parametrize("run,static", [("allreduce", False), ("ps", False), ("hybrid", True)],
                         ids=["allreduce", "ps", "hybrid, static shapes"])
def test_a_mean_added_to_a_sum_over_the_batch_equals_one_device(run, static):
    """The replicas' gradients are summed (the loss sums over the batch)
    and every replica's tf.reduce_mean is its value over N, its gradient's
    division by N times its count (a constant where the shapes are
    static), so the sums are one device's; the Mean fetched alone is the
    replicas' sum. Before, the gradients were averaged (the sum's part 1/N
    of one device's, warned): 3.4 apart after 7 steps in a sweep."""
    made = check_tf1(sum_and_mean, run, static)
    assert {"Mean/parallax_mean", "parallax/replica_1/Mean/parallax_mean"} <= set(made)
    assert made["Mean"] == "Mul"


def test_a_job_of_a_summed_loss_and_a_mean_equals_one_device(tmp_path):
    """tests/cluster_script.py --sum-and-mean: 2 workers and a server
    (hybrid), the embedding regression's summed loss plus a tf.reduce_mean,
    Adam with clipping and moving averages, 6 steps: every variable (each
    Mean over N = the job's replicas, not a worker's)."""
    from models import embedding_regression, train_single
    from test_cluster import load, run_job
    done, out, _ = run_job(tmp_path, 2, 1, "6", "--run-option", "hybrid", "--sum-and-mean",
                           servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    single = train_single(*embedding_regression(8, "adam", clip=True, ema=True,
                                                loss_sum="and mean"), 6)
    parallel = load(out, 2)
    assert set(parallel) == set(single)
    for name, copies in parallel.items():
        for got in copies:
            np.testing.assert_allclose(got, single[name], atol=TOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_fit_with_a_summed_loss_and_a_mean_a_layer_adds_equals_one_device(lib):
    """`model.fit` with `reduction="sum"` and a layer's
    `add_loss(0.1 * tf.reduce_mean(...))` (a Keras user's penalty): the
    logged losses, every weight and slot after 2 epochs, and `evaluate`.
    Before, warned and averaged: 0.40 apart in a sweep."""
    k = keras if lib == "keras3" else __import__("tf_keras")

    class Penalty(k.layers.Layer):
        def call(self, h):
            self.add_loss(0.1 * tf.reduce_mean(tf.square(h)))
            return h

    def make():
        inputs = k.Input((5,))
        h = Penalty()(k.layers.Dense(8, activation="tanh")(inputs))
        return k.Model(inputs, k.layers.Dense(1)(h))
    k.utils.set_random_seed(0)
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=k.optimizers.SGD(0.01, momentum=0.9),
                  loss=k.losses.MeanSquaredError(reduction="sum"))
    pn.parallelize(parallel, local(2))
    x, y = arrays()
    h1, h2 = (m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
              for m in (parallel, single))
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=TOL, rtol=1e-6)
    for v1, v2 in zip(parallel.weights + parallel.optimizer.variables,
                      single.weights + single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), atol=TOL, rtol=0,
                                   err_msg=getattr(v1, "path", v1.name))
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=BATCH, verbose=0),
                               single.evaluate(x, y, batch_size=BATCH, verbose=0),
                               atol=TOL, rtol=1e-6)


def sum_and_masked_mean(pred, y):
    """A sum of squares over the batch plus the masked loss (a mean over the
    rows a mask picks), and that mean."""
    part = masked_loss(pred, y)
    return [tf.reduce_sum(tf.square(pred - y)) + part, part]


@pytest.mark.parametrize("run", ["allreduce", "ps"])
def test_a_mean_over_masked_rows_added_to_a_sum_equals_one_device(run):
    """The gradients are summed and every replica divides its picked rows'
    sum by the job's count of them (the replicas' sum, not their mean), a
    replica that picks none adding 0; fetched alone, the mean is the
    replicas' sum. Before, averaged with a warning, the sum's part 1/N of
    one device's."""
    made = check_tf1(sum_and_masked_mean, run)
    assert made["Mean"] == made["parallax/replica_1/Mean"] == "RealDiv"    # over the job's

