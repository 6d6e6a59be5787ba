"""State written from reductions over the batch (transforms/extremes.py):
a running maximum and minimum of the inputs (a quantizer's calibration), a
moving average of each batch's minimum, a total of each batch's maximum,
and values assigned from sums (the batch's sum, a decayed total, a moving
average of the sum of squares, each feature's norm), from a reduction of
reductions (the batch's standard deviation) or from the batch's row count
(`tf.shape(x)[0]`, `tf.size(x)`: a replica's is 1/N of one device's, the
same on every replica, so nothing told them apart before); so per class
(tf.math.unsorted_segment_max and _min at labels the data sets: before,
averaged and named). 2 replicas against one device
with the global batch: every variable equal (float32, 1e-6; the reductions
are exchanged, extremes exactly, the rest is float32 rounding); before,
the replicas' values were averaged, silently (a running maximum 0.27 below
one device's after 2 epochs of a Keras `fit`; an assigned sum half one
device's). A value that mixes the batch's examples otherwise (its top k)
is averaged and named in a warning."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local, read_name, state_variable
from passkit import context, op_counts, run_passes
from task_env import TASK_PATH
from transforms.aggregate import AggregatePass
from transforms.replicate import ReplicatePass
from transforms.state_sync import StateSyncPass

tf1 = tf.compat.v1
STATE = ("running_max", "running_min", "min_average", "max_total", "ref_max", "batch_sum",
         "decayed_total", "squares_average", "norm", "deviation", "max_plus_mean", "rows",
         "rows_average", "class_max", "class_min_average")
TOL = 1e-6


def extremes_graph(mixed=False):
    """A placeholder batch of 3 features; the step writes the state above
    beside an SGD step of a loss that reads the new running maximum (not
    the batch's). `mixed`: one more write takes each feature's second
    largest value (no exchange makes it one device's)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        hi, lo, avg, total, ref_hi, summed, decayed, squares, norm, deviation, both, rows, \
            rows_avg, class_hi, class_lo = (state_variable(n, n != "ref_max") for n in STATE)
        label = tf.cast(x[:, 0] > 0, tf.int32) + tf.cast(x[:, 1] > 0, tf.int32)   # 3 classes
        updates = [tf1.assign(hi, tf.maximum(hi, tf.reduce_max(tf.abs(x), 0))),
                   tf1.assign(lo, tf.minimum(lo, tf.reduce_min(x, 0))),
                   tf1.assign_sub(avg, (avg - tf.reduce_min(x, 0)) * 0.3),
                   tf1.assign_add(total, tf.reduce_max(x) * tf.ones([3])),
                   tf1.assign(ref_hi, tf.maximum(ref_hi, tf.reduce_max(x, [0]) * 2.0)),
                   tf1.assign(summed, tf.reduce_sum(x, 0)),
                   tf1.assign(decayed, 0.9 * decayed + tf.reduce_sum(x, 0)),
                   tf1.assign_sub(squares, (squares - tf.reduce_sum(x * x, 0)) * 0.1),
                   tf1.assign(norm, tf.norm(x, axis=0)),
                   tf1.assign(deviation, tf.math.reduce_std(x, 0)),
                   tf1.assign(both, tf.reduce_max(x, 0) + tf.reduce_mean(x, 0)),
                   tf1.assign(rows, tf.cast(tf.shape(x)[0], tf.float32) * tf.ones([3])),
                   tf1.assign(rows_avg, 0.5 * rows_avg + tf.cast(tf.size(x), tf.float32)),
                   tf1.assign(class_hi, tf.maximum(class_hi, tf.math.unsorted_segment_max(
                       tf.abs(x[:, 2]), label, 3))),       # per class (by a label)
                   tf1.assign_sub(class_lo, (class_lo - tf.math.unsorted_segment_min(
                       x[:, 2], label, 3)) * 0.3)]
        if mixed:
            second = state_variable("second")
            updates.append(tf1.assign(second, tf.math.top_k(tf.transpose(x), 2).values[:, 1]))
        with tf.control_dependencies(updates):          # the step's new maximum
            loss = tf.reduce_mean(tf.reduce_sum(x / (hi.read_value() + 1.0) * w, 1) ** 2)
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g


def batches(steps, rows=8):
    return np.random.default_rng(3).normal(size=(steps, rows, 3)).astype(np.float32)


def values(run, graph):
    names = ("w",) + STATE
    return dict(zip(names, run([graph.get_tensor_by_name(
        n + (":0" if n == "ref_max" else "/Read/ReadVariableOp:0")) for n in names])))


def one_device(data):
    g = extremes_graph()
    with tf1.Session(graph=g) as sess:
        sess.run(tf1.global_variables_initializer())
        for batch in data:
            sess.run("train", {"x:0": batch})
        return values(sess.run, g)


@pytest.mark.parametrize("run_option", ["hybrid", "allreduce", "ps"])
def test_state_from_the_batchs_extremes_equals_one_device(run_option):
    data = batches(4)
    g = extremes_graph()
    with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
        runner.run([v.initializer for v in g.get_collection("variables")])
        for batch in data:
            runner.run("train", {"x:0": batch})
        got = values(runner.run, g)
    want = one_device(data)
    assert want["running_max"].min() > 1.0 and want["running_min"].max() < -1.0
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=TOL, rtol=0, err_msg=name)


def test_writes_that_vary_through_reductions_alone_read_the_jobs():
    """Each reduction over the batch that the state reads is exchanged once
    (a standard deviation's two means, the maximum and the mean added), the
    extremes (per class too) as a sum of rows of zeros, the batch's row counts (its first
    dimension, its size) as sums; a write from the batch's top k keeps
    its sync (averaged), and a warning names it and why."""
    graph = extremes_graph(mixed=True)
    ctx = context(n=2, graph=graph)
    with pytest.warns(UserWarning, match=r"\('second', \"TopKV2: the top k along the batch"):
        ir = run_passes(ctx, ReplicatePass(), AggregatePass(), StateSyncPass())
    made = [re.sub(r"^parallax/extremes/(.*?)(/rows)?/replica_1$", r"\1", n.name)
            for n in ir.nodes if n.name.startswith("parallax/extremes/") and
            n.op == "CollectiveReduce" and n.name.endswith("replica_1")]
    assert sorted(made) == [
        "Cast_2", "Cast_3", "Max", "Max_1", "Max_2", "Max_3", "Mean", "Min", "Min_1", "Sum",
        "Sum_1", "Sum_2", "UnsortedSegmentMax", "UnsortedSegmentMin", "norm_1/Sum",
        "reduce_std/reduce_variance/Mean", "reduce_std/reduce_variance/Mean_1"]
    assert op_counts(ir, "parallax/extremes/")["Pad"] == 2 * 8        # Max and Min (per class)
    second = [op.name for op in graph.get_operations() if op.type == "AssignVariableOp"
              and op.inputs[0].op.name == "second" and not op.name.startswith("second/")]
    synced = {n.name.split("/")[2] for n in ir.nodes
              if n.name.startswith("parallax/state_sync/")}
    assert synced == set(second), synced


def stats_model(lib):
    """A layer of `lib` ("keras": Keras 3, or "tf_keras") that keeps each
    input's largest absolute value and smallest value seen, a decayed
    total of its absolute values, a count of the examples and a decayed
    total of the batches' row counts, and scales
    its input by the first; Dense layers; Adam."""
    import keras
    keras = __import__("tf_keras") if lib == "tf_keras" else keras

    class Calibration(keras.layers.Layer):
        def build(self, shape):
            zeros = dict(shape=(shape[-1],), initializer="zeros", trainable=False)
            self.hi = self.add_weight(name="hi", **zeros)
            self.lo = self.add_weight(name="lo", **zeros)
            self.decayed = self.add_weight(name="decayed", **zeros)
            self.seen = self.add_weight(name="seen", shape=(), initializer="zeros",
                                        trainable=False)
            self.rows = self.add_weight(name="rows", shape=(), initializer="zeros",
                                        trainable=False)

        def call(self, x, training=None):
            if training:
                self.hi.assign(tf.maximum(self.hi, tf.reduce_max(tf.abs(x), 0)))
                self.lo.assign(tf.minimum(self.lo, tf.reduce_min(x, 0)))
                self.decayed.assign(0.5 * self.decayed + tf.reduce_sum(tf.abs(x), 0))
                self.seen.assign_add(tf.cast(tf.shape(x)[0], tf.float32))
                self.rows.assign(0.5 * self.rows + tf.cast(tf.shape(x)[0], tf.float32))
            return x / (self.hi + 1.0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), Calibration(),
                              keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_fit_with_a_calibration_layer_equals_one_device(lib):
    """Keras `fit`, 2 epochs of 4 batches of 16: the layer's maximum and
    minimum are the global batch's, the decayed total, the count and every
    weight and Adam slot equal one device's, and so do the epochs' losses (before: the
    maximum 0.27 below one device's, the losses 4e-3 apart)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 5)).astype(np.float32), rng.normal(size=(64, 1)).astype(
        np.float32)
    parallel, single = stats_model(lib), stats_model(lib)
    single.set_weights(parallel.get_weights())
    pn.parallelize(parallel, local(2))
    got = parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    want = single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], atol=1e-5, rtol=0)
    for a, b in zip(parallel.weights + parallel.optimizer.variables,
                    single.weights + single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0,
                                   err_msg=getattr(a, "path", a.name))
    hi = np.asarray(single.layers[0].hi)
    np.testing.assert_array_equal(hi, np.abs(x).max(0))      # every batch's, exactly
    np.testing.assert_array_equal(np.asarray(parallel.layers[0].hi), hi)


JOB_SCRIPT = """
import sys
import numpy as np
import tensorflow as tf
sys.path.insert(0, {tests!r})
import parallax_ng as pn
from test_extremes import STATE, batches, extremes_graph, values

g = extremes_graph()
runner = pn.get_runner(g, None, {config!r})
runner.run([v.initializer for v in g.get_collection("variables")])
w = runner.plan.worker
for batch in batches(4):
    runner.run("train", {{"x:0": batch[4 * w:4 * w + 4]}})
got = values(runner.run, g)
np.savez({out!r} + f".{{w}}.npz", **got)
print("servers", runner.plan.reduces_on_servers, flush=True)
"""


def run_job(tmp_path, text: str, **fields):
    """(the finished run, the prefix of its workers' .npz files): `text`
    (a script with {tests}, {out} and `fields`) run as a job of 2 workers
    of one device and a server; a failure ends the test with its stderr."""
    from test_cluster import resources
    script, out = tmp_path / "job.py", str(tmp_path / "out")
    script.write_text(text.format(tests=os.path.dirname(os.path.abspath(__file__)), out=out,
                                  **fields))
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
         resources(tmp_path, 2, 1, servers=1)], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    return done, out


def test_a_job_that_sums_on_the_servers_exchanges_extremes_there(tmp_path):
    """2 workers and a server, fusion buffers (state sums go through the
    server, no collective op): both workers' state and weight equal one
    device's."""
    done, out = run_job(tmp_path, JOB_SCRIPT, config={"dense_method": "bfb"})
    assert done.stdout.count("servers True") == 2, done.stdout[-2000:]
    want = one_device(batches(4))
    for w in (0, 1):
        got = dict(np.load(f"{out}.{w}.npz"))
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=TOL, rtol=0,
                                       err_msg=f"worker {w}: {name}")


SCALINGS = {
    "largest": lambda x, w: (x / tf.reduce_max(tf.abs(x)), w),
    "standardized": lambda x, w: ((x - tf.reduce_mean(x, 0)) / tf.math.reduce_std(x, 0), w),
    "min-max": lambda x, w: ((x - tf.reduce_min(x, 0)) /
                             (tf.reduce_max(x, 0) - tf.reduce_min(x, 0)), w),
    "weights over their sum": lambda x, w: (x, w / tf.reduce_sum(w) * 16.0),
    "weights over the rows' count": lambda x, w: (x, w / tf.cast(tf.shape(w)[0], tf.float32)),
    "weights about their mean": lambda x, w: (x, w - tf.reduce_mean(w)),
    "loss over the largest target": lambda x, w: (x, w),     # (in the step)
    "weights balanced by the other class's fraction": lambda x, w: (x, balanced(w)),
}


def balanced(w):
    """A class-balanced loss's weights (HED's): each example weighs the
    fraction of the batch's elements of the other class, a Sum of the data
    over `tf.size`."""
    c = tf.cast(w > 1.0, tf.float32)
    beta = tf.reduce_sum(1.0 - c) / tf.cast(tf.size(c), tf.float32)
    return beta * c + (1.0 - beta) * (1.0 - c)


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_a_step_that_scales_its_data_by_the_batchs_statistics_equals_one_device(scaling,
                                                                              capsys):
    """A TF2 step that scales its inputs by the batch's statistics (its
    largest value, its mean and deviation, its minimum and maximum) or its
    examples' weights by their sum, about their mean or by the fraction of
    the other class (a Sum over the size of the batch's labels, whose
    count is the job's too), before a weighted
    mean loss, or divides the loss by the batch's largest target: the
    statistics are the job's (graph/normalization.py `data_statistics`,
    exchanged), so 6 steps of 2 replicas equal one
    device, 1e-6 in loss and weights, with no warning and no line naming
    them. Before: 0.013 to 0.11 apart, the largest value, min-max and
    weight sums silently; the balanced weights' job's sum over the
    replica's count, silently, 0.14 in the first step's loss."""
    import warnings

    import keras

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)

        def step(x, y, w):
            x, w = SCALINGS[scaling](x, w)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x)[:, 0] - y) * w)
                if scaling == "loss over the largest target":
                    loss = loss / tf.reduce_max(tf.abs(y))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))
            return loss
        return model, step
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 16, 5)).astype(np.float32), rng.normal(size=(6, 16)).astype(
        np.float32)
    w = rng.uniform(0.0, 2.0, size=(6, 16)).astype(np.float32)
    (parallel, fn), (single, ref_fn) = make(), make()
    ref = tf.function(ref_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = pn.function(fn, local(2))
        for k in range(6):
            np.testing.assert_allclose(step(x[k], y[k], w[k]), ref(x[k], y[k], w[k]).numpy(),
                                       atol=TOL, rtol=TOL)
    step.sync()
    for a, b in zip(parallel.weights, single.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=0)
    assert "over the batch's axis" not in capsys.readouterr().err


def test_a_sum_of_the_data_over_a_count_the_exchange_does_not_read_is_named():
    """The balanced weights' Sum over a product of shapes (`tf.shape(c)[0]
    * 1`): its exchange would divide the job's sum by the replica's count,
    so it stays the replica's, and the build says so, naming the Sum."""
    import keras
    model, optimizer = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)]), \
        keras.optimizers.SGD(0.1)

    def step(x, y, w):
        c = tf.cast(w > 1.0, tf.float32)
        beta = tf.reduce_sum(1.0 - c, name="negatives") / tf.cast(tf.shape(c)[0] * 1,
                                                                   tf.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)[:, 0] - y) * (beta * c + 1.0 - beta))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss
    rng = np.random.default_rng(0)
    with pytest.warns(UserWarning, match="the batch's sum 'negatives' of the data scales its "
                                         "rows with a count or value the exchange does not"):
        pn.function(step, local(2))(rng.normal(size=(16, 5)).astype(np.float32),
                                    *rng.uniform(0.0, 2.0, size=(2, 16)).astype(np.float32))


def policy_graph():
    """A TF1 policy-gradient step: fed observations min-max scaled about
    the batch's mean, a softmax policy, the rewards' advantage over their
    batch mean in units of their deviation (the data's statistics alone);
    SGD."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        reward = tf1.placeholder(tf.float32, [None], name="reward")
        scaled = (x - tf.reduce_mean(x, 0)) / (tf.reduce_max(x, 0) - tf.reduce_min(x, 0))
        w = tf1.get_variable("w", initializer=np.full([4, 3], 0.3, np.float32))
        logp = tf.nn.log_softmax(tf.matmul(scaled, w))[:, 0]
        advantage = (reward - tf.reduce_mean(reward)) / (tf.math.reduce_std(reward) + 1e-6)
        loss = tf.negative(tf.reduce_mean(logp * advantage), name="loss")
        tf1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("run_option", ["hybrid", "ps"])
def test_a_tf1_policy_gradient_on_the_batchs_statistics_equals_one_device(run_option):
    """5 steps of 2 replicas equal one device, losses and weights, 1e-6
    (before: 0.037 apart, with a line naming the statistics)."""
    rng = np.random.default_rng(1)
    feeds = [{"x:0": rng.normal(size=(16, 4)).astype(np.float32),
              "reward:0": rng.normal(size=16).astype(np.float32)} for _ in range(5)]
    out = []
    for parallel in (False, True):
        g = policy_graph()
        with (pn.get_runner(g, local(2), {"run_option": run_option}) if parallel else
              tf1.Session(graph=g)) as run:
            run.run([v.initializer for v in g.get_collection("variables")])
            losses = [run.run(["train", "loss:0"], feed)[1] for feed in feeds]
            out.append((losses, run.run(g.get_tensor_by_name("w/Read/ReadVariableOp:0"))))
    (want, w1), (got, w2) = out
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    np.testing.assert_allclose(w2, w1, atol=TOL, rtol=0)


def rate_graph(rate):
    """A TF1 step whose optimizers' learning rates read the fed batch:
    `rate(x)` for momentum SGD on `w` and Adam on `v`."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=np.full([3], 0.5, np.float32))
        v = tf1.get_variable("v", initializer=np.full([3], -0.5, np.float32))
        loss = tf.reduce_mean((tf.reduce_sum(x * w, 1) + tf.reduce_sum(x * v, 1) - 1.0) ** 2)
        tf.group(tf1.train.MomentumOptimizer(rate(x), 0.9).minimize(loss, var_list=[w]),
                 tf1.train.AdamOptimizer(rate(x) / 10).minimize(loss, var_list=[v]),
                 name="train")
    return g


RATES = {   # the linear scaling rule on the rows; a rate from the batch's mean
    "rows": lambda x: 0.05 * tf.cast(tf.shape(x)[0], tf.float32) / 16.0,
    "mean": lambda x: 0.05 / (1.0 + tf.abs(tf.reduce_mean(x))),
}


@pytest.mark.parametrize("rate", sorted(RATES))
@pytest.mark.parametrize("run_option", ["allreduce", "ps"])
def test_a_learning_rate_computed_from_the_batch_equals_one_device(rate, run_option):
    """An optimizer's learning rate scaled by the batch's row count or
    computed from its mean: the job's, so 2 replicas equal one device after
    4 steps, every variable and slot (1e-6; before: refused, the message
    calling the trained weight non-trainable state). A rate read from one
    example's value is refused, naming the variable."""
    data = batches(4, rows=16)
    out = []
    for parallel in (False, True):
        g = rate_graph(RATES[rate])
        names = [v.op.name for v in g.get_collection("variables")]
        with (pn.get_runner(g, local(2), {"run_option": run_option}) if parallel else
              tf1.Session(graph=g)) as run:
            run.run([v.initializer for v in g.get_collection("variables")])
            for batch in data:
                run.run("train", {"x:0": batch})
            out.append(dict(zip(names, run.run(g.get_collection("variables")))))
    assert len(out[0]) == 7, sorted(out[0])         # w, v, momentum, Adam's m, v and powers
    for name in out[0]:
        np.testing.assert_allclose(out[1][name], out[0][name], atol=TOL, rtol=0, err_msg=name)
    g = rate_graph(lambda x: 0.05 * tf.abs(x[0, 0]))
    with pytest.raises(pn.errors.GraphError, match=r"writes variable '[wv]' with a value .* "
                       r"computed from one replica's batch"):
        pn.get_runner(g, local(2), {"run_option": run_option})


RATE_JOB = """
import sys
import numpy as np
import tensorflow as tf
sys.path.insert(0, {tests!r})
import parallax_ng as pn
from test_extremes import RATES, batches, rate_graph

g = rate_graph(RATES["rows"])
runner = pn.get_runner(g, None, {{"run_option": "ps"}})
runner.run([v.initializer for v in g.get_collection("variables")])
w = runner.plan.worker
for batch in batches(4, rows=16):
    runner.run("train", {{"x:0": batch[8 * w:8 * w + 8]}})
names = [v.op.name for v in g.get_collection("variables")]
np.savez({out!r} + f".{{w}}.npz", **dict(zip(names, runner.run(g.get_collection("variables")))))
"""


def test_a_job_of_two_workers_scales_a_servers_update_by_the_jobs_rows(tmp_path):
    """2 workers and a server, `ps`: the update runs once, on the chief,
    and reads the job's row count (the other worker's share goes through
    the server's queues, pulled by its silenced update): every variable
    equals one device's on both workers."""
    _, out = run_job(tmp_path, RATE_JOB)
    g = rate_graph(RATES["rows"])
    with tf1.Session(graph=g) as sess:
        sess.run([v.initializer for v in g.get_collection("variables")])
        for batch in batches(4, rows=16):
            sess.run("train", {"x:0": batch})
        want = dict(zip([v.op.name for v in g.get_collection("variables")],
                        sess.run(g.get_collection("variables"))))
    for w in (0, 1):
        got = dict(np.load(f"{out}.{w}.npz"))
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=TOL, rtol=0,
                                       err_msg=f"worker {w}: {name}")


def test_rows_a_center_loss_adds_by_each_labels_count_in_the_batch_are_named():
    """A center loss's update (the centers move towards their examples by
    1 / (1 + the label's count in the batch), tf.unique_with_counts): the
    replicas' rows are summed at their indices, which is not one device's
    (each replica counts its own rows); a warning names the variable and
    the count (before: 0.18 apart after 5 steps, silently)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        label = tf1.placeholder(tf.int32, [None], name="label")
        features = tf.matmul(x, tf1.get_variable("w", initializer=np.ones([4, 3], np.float32)))
        centers = tf1.get_variable("centers", initializer=np.zeros([5, 3], np.float32),
                                   trainable=False)
        picked = tf.gather(centers, label)
        _, at, count = tf.unique_with_counts(label)
        seen = tf.cast(tf.gather(count, at), tf.float32)[:, None]
        step = (picked - features) * 0.5 / (1.0 + seen)
        loss = tf.reduce_mean(tf.reduce_sum(tf.square(features - picked), 1))
        with tf.control_dependencies([tf1.scatter_sub(centers, label, step)]):
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    with pytest.warns(UserWarning, match=r"\('centers', .*a count of each value among the "
                                         r"batch's examples"):
        run_passes(context(n=2, graph=g), ReplicatePass(), AggregatePass(), StateSyncPass())


def test_a_queue_of_the_batchs_rows_written_in_a_branch_is_named():
    """MoCo's queue of keys (`queue.assign(tf.concat([k, queue[:-n]], 0))`)
    takes the job's keys (tests/test_job_rows.py), but not in a tf.cond's
    branch, which a replica may skip: there the replicas' queues are
    averaged, which is not one device's, and a warning names the variable
    and the concatenation (before: silently, 1.4 apart after 4 steps)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        flag = tf1.placeholder_with_default(True, [], name="flag")
        w = tf1.get_variable("w", initializer=np.ones([4, 3], np.float32))
        queue = tf1.get_variable("queue", initializer=np.eye(8, 3, dtype=np.float32),
                                 trainable=False)
        q = tf.nn.l2_normalize(tf.matmul(x, w), 1)
        keys = tf.stop_gradient(q)
        logits = tf.concat([tf.reduce_sum(q * keys, 1, keepdims=True),
                            tf.matmul(q, queue, transpose_b=True)], 1)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.zeros([tf.shape(x)[0]], tf.int32), logits=logits))
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.control_dependencies([train]):
            tf.cond(flag, lambda: queue.assign(tf.concat([keys, queue[:-tf.shape(keys)[0]]], 0)),
                    lambda: queue.read_value(), name="enqueue")
    with pytest.warns(UserWarning, match=r"\('queue', .*the batch's rows joined along their "
                                         r"axis with rows that are not examples"):
        pn.get_runner(g, local(2)).close()


def test_inputs_standardized_by_their_moments_are_the_jobs_with_no_line(capsys):
    """tf.nn.moments of the fed inputs alone (no variable upstream): with
    the default `batch_norm` they are exchanged, 5 SGD steps of 2 replicas
    equal one device (1e-6), and no line calls them a batch normalization
    of each replica's rows (it did, though the loss's form had them
    exchanged already)."""
    def graph():
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 4], name="x")
            y = tf1.placeholder(tf.float32, [None], name="y")
            mean, var = tf.nn.moments(x, [0])
            w = tf1.get_variable("w", initializer=np.full([4], 0.3, np.float32))
            h = tf.reduce_sum((x - mean) / tf.sqrt(var + 1e-3) * w, 1)
            loss = tf.reduce_mean(tf.square(h - y), name="loss")
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        return g
    rng = np.random.default_rng(1)
    feeds = [{"x:0": rng.normal(size=(16, 4)).astype(np.float32) * 3 + 1,
              "y:0": rng.normal(size=16).astype(np.float32)} for _ in range(5)]
    out = []
    for parallel in (False, True):
        g = graph()
        with (pn.get_runner(g, local(2)) if parallel else tf1.Session(graph=g)) as run:
            run.run([v.initializer for v in g.get_collection("variables")])
            losses = [run.run(["train", "loss:0"], feed)[1] for feed in feeds]
            out.append((losses, run.run(g.get_tensor_by_name("w/Read/ReadVariableOp:0"))))
    (want, w1), (got, w2) = out
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(w2, w1, atol=TOL, rtol=0)
    assert "normalizes each replica's rows" not in capsys.readouterr().err


@pytest.mark.parametrize("loop", ["tf.while_loop", "AutoGraph"])
def test_the_data_scaled_by_its_largest_value_in_a_tf2_steps_loop_is_named(loop):
    """The same statistic in a TF2 step's loop (a functional While,
    lowered when the step is traced): a warning names it. Before, the
    import of the lowered loop left its ops without a rank, the statistic
    was not found, and the weights trained 0.06 from one device after 4
    steps, with no line (graph/inlining.py `loop_shapes`)."""
    w = tf.Variable(tf.ones((3, 1)))

    def step(x, y):
        with tf.GradientTape() as tape:
            if loop == "tf.while_loop":
                def body(i, acc):
                    xs = x * (1.0 + tf.cast(i, tf.float32))
                    return i + 1, acc + tf.matmul(xs / tf.reduce_max(tf.abs(xs)), w)
                _, out = tf.while_loop(lambda i, a: i < 2, body,
                                       [tf.constant(0), tf.zeros_like(y)])
            else:
                out = tf.zeros_like(y)
                for i in tf.range(2):
                    xs = x * (1.0 + tf.cast(i, tf.float32))
                    out += tf.matmul(xs / tf.reduce_max(tf.abs(xs)), w)
            loss = tf.reduce_mean((out - y) ** 2)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss
    x, y = np.ones((8, 3), np.float32), np.ones((8, 1), np.float32)
    with pytest.warns(UserWarning, match=r"values \['while/body/_\d+/while/Max:0'\] that the "
                      r"replicas would exchange .* are computed inside a tf.while_loop's body"):
        pn.function(step, local(2))(x, y)


def test_the_data_scaled_by_its_largest_value_in_a_v1_loops_body_is_named():
    """A statistic of the data alone computed in a tf.while_loop's body
    (TensorFlow's v1 frames, as a `disable_v2_behavior` script builds it)
    stays each replica's (an exchange runs once a step, the body every
    turn): a warning names it, where before nothing did (the weights 0.04
    from one device after 4 steps of a TF2 step of the same loop)."""
    from test_branches import lowered_conds
    g = tf.Graph()
    with g.as_default(), lowered_conds():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w = tf1.get_variable("w", initializer=np.ones([3, 1], np.float32))

        def body(i, acc):
            xs = x * (1.0 + tf.cast(i, tf.float32))
            return i + 1, acc + tf.matmul(xs / tf.reduce_max(tf.abs(xs), name="top"), w)
        _, out = tf1.while_loop(lambda i, a: i < 2, body, [tf.constant(0), tf.zeros_like(y)])
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean((out - y) ** 2))
    with pytest.warns(UserWarning, match=r"values \['while/top:0'\] that the replicas would "
                      r"exchange .* are computed inside a tf.while_loop's body"):
        pn.get_runner(g, local(2)).close()


CLASS_COUNTS = {     # the batch's labels y, per-example losses l: the loss
    "a weight per class from a one-hot sum":
        lambda y, m, l: tf.reduce_mean(l / tf.gather(tf.reduce_sum(tf.one_hot(y, 3), 0), y)),
    "a weight per class from a segment sum": lambda y, m, l: tf.reduce_mean(
        l / tf.gather(tf.math.unsorted_segment_sum(tf.ones_like(l), y, 3), y)),
    "a weight per class from a bincount of fixed length": lambda y, m, l: tf.reduce_mean(
        l / tf.cast(tf.gather(tf.math.bincount(y, minlength=3, maxlength=3), y), tf.float32)),
    "a weight per class from counted conditions": lambda y, m, l: tf.reduce_mean(
        l / tf.gather(tf.reduce_sum(tf.cast(tf.equal(y[:, None], tf.range(3)[None]),
                                            tf.float32), 0), y)),
    "a log prior per class added to the logits": None,      # (in the graph)
    "a mean written per row": lambda y, m, l: tf.reduce_sum(
        l * (1.0 / tf.cast(tf.shape(l)[0], tf.float32))),
    "a masked mean written per row": lambda y, m, l: tf.reduce_sum(
        l * tf.cast(m, tf.float32) / tf.reduce_sum(tf.cast(m, tf.float32))),
}


def class_counts_graph(kind, rows):
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 3, 64).astype(np.int32)
    m = rng.uniform(size=64) > 0.3
    g = tf.Graph()
    with g.as_default():
        data = tf.data.Dataset.from_tensor_slices((x, y, m))
        xs, ys, ms = tf1.data.make_one_shot_iterator(pn.shard(data).batch(rows).repeat()) \
            .get_next()
        logits = tf.matmul(xs, tf1.get_variable("w", initializer=np.ones((4, 3), np.float32)
                                                * np.float32([0.3, -0.2, 0.1])))
        if CLASS_COUNTS[kind] is None:
            prior = tf.reduce_sum(tf.one_hot(ys, 3), 0) / tf.cast(tf.shape(ys)[0], tf.float32)
            logits += tf.math.log(prior + 1e-3)
        loss = tf.identity((CLASS_COUNTS[kind] or (lambda y, m, l: tf.reduce_mean(l)))(
            ys, ms, tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys, logits=logits)),
            "loss")
        tf1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("run_option", ["allreduce", "ps"])
@pytest.mark.parametrize("kind", sorted(CLASS_COUNTS))
def test_a_loss_weighted_by_the_batchs_counts_equals_one_device(kind, run_option):
    """A loss that weighs each example by its class's count in the batch
    (a one-hot sum, a segment sum, a bincount of fixed length or counted
    conditions, gathered at the labels), adds a log prior per class from
    the batch's labels to the logits, or writes a (masked) mean as a sum
    of each row's loss over the rows' (or the mask's) count: the counts
    are the job's (graph/applied.py: taken back to the rows, or meeting
    them alone; transforms/extremes.py exchanges them), so 4 steps of 2
    replicas (6 rows each) equal one device with 12 rows, 1e-6 in loss and
    weights, with no warning. Before: the mean written per row twice one
    device's (summed gradients), the others each replica's counts, up to
    3.2 apart; silently but for the segment sum and the bincount (named
    as mixing the batch)."""
    import warnings
    g = class_counts_graph(kind, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
            runner.run(g.get_collection("variables")[0].initializer)
            got = [runner.run(["train", "loss:0"])[1] for _ in range(4)]
            w = runner.run(read_name("w", g))
    g1 = class_counts_graph(kind, 12)
    with tf1.Session(graph=g1) as sess:
        sess.run(tf1.global_variables_initializer())
        want = [sess.run(["train", "loss:0"])[1] for _ in range(4)]
        np.testing.assert_allclose(w, sess.run(read_name("w", g1)), atol=TOL, rtol=0)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_fit_with_a_loss_weighted_by_the_batchs_class_counts_equals_one_device(lib):
    """Keras `fit` with a loss function of the program's that weighs each
    example by the batch's size over its class's count in the batch (a
    one-hot sum gathered at the labels): the counts are the job's, so 2
    epochs of 8 batches of 12 on 2 replicas equal one device, every weight
    and the epochs' losses (1e-5). Before: each replica's counts, the
    losses 0.086 apart, silently."""
    import keras
    keras = __import__("tf_keras") if lib == "tf_keras" else keras

    def balanced(y_true, y_pred):
        y = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
        counts = tf.reduce_sum(tf.one_hot(y, 3), 0)
        return keras.losses.sparse_categorical_crossentropy(y, y_pred) / tf.gather(
            counts, y) * tf.cast(tf.shape(y)[0], tf.float32) / 3.0

    def make():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=balanced)
        return model
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 5)).astype(np.float32), rng.integers(0, 3, 96).astype(np.int32)
    keras.utils.set_random_seed(1)
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    pn.parallelize(parallel, local(2))
    got = parallel.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    want = single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], atol=1e-5, rtol=0)
    for a, b in zip(parallel.get_weights(), single.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
