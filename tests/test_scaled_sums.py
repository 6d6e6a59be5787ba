"""Scaled sums (transforms/scaled_sums.py): a TF1 loss fed by placeholders
that sums over the batch and scales the sum by a number (`reduce_sum(e) /
BATCH_SIZE`, `* (1 / B)`, over B times the elements per row, `/ 2 / 4`,
plus a weight penalty; over a batch size fed beside the batch, which
every replica is fed whole; and a scaled count fetched beside the loss, a
hand-written accuracy) equals one device, decided each step from the rows
fed: over the rows fed, the feed's mean (one device's with that feed);
over a replica's rows, a mean (as before); over any other number (a
partial last batch, a data set's size), the sum times the number, as one
device computes it. 2 replicas against one device, Adam: every variable
and slot and the fetched losses, float32, 1e-6. Before, every such loss
was averaged, with a warning: 0.087 apart after 4 steps where the number
was the rows fed, and the fetched loss half one device's; over a fed
size, silently (0.109 apart after 4 Adam steps). Beside the sum, means
(a Mean times a number, one plus a mean over a count) are averaged as they
are; in a Keras `fit`, a layer's added losses are decided alike."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local
from parallax_ng.pipeline.passes import REPLICA_PREFIX
from passkit import context, run_passes
from task_env import TASK_PATH
from transforms.replicate import ReplicatePass
from transforms.scaled_sums import ScaledSumsPass

tf1 = tf.compat.v1
TOL = 1e-6
B = 8
RNG = np.random.default_rng(0)
X, Y = RNG.normal(size=(64, 5)).astype(np.float32), RNG.normal(size=(64, 3)).astype(np.float32)

LOSSES = {
    "over the rows fed": lambda e, w: e / B,
    "times one over them": lambda e, w: e * (1.0 / B),
    "over a cast": lambda e, w: tf.math.divide(e, tf.cast(B, tf.float32)),
    "over the elements fed": lambda e, w: e / (B * 3),
    "twice": lambda e, w: e / 2 / (B // 2),
    "by a number": lambda e, w: e / 100.0,
    "with a penalty": lambda e, w: e / B + 0.01 * tf.nn.l2_loss(w),
    # a batch size fed beside the batch, whole to every replica (the rows fed)
    "over a fed size": lambda e, w: e / tf.cast(w.graph.get_tensor_by_name("size:0"),
                                                 tf.float32),
    "times one over it": lambda e, w: e * tf.math.reciprocal(
        tf.cast(w.graph.get_tensor_by_name("size:0"), tf.float32)),
    # a loss weight fed beside the batch (its default here): the sum times it
    "times a fed weight": lambda e, w: e * tf1.placeholder_with_default(0.25, []),
    # beside means: a Mean times a number, and a Mean plus a sum over a count of elements
    "beside a scaled mean": lambda e, w: e / 100.0 + 0.1 * _mse(w),
    "beside a mean and a count's": lambda e, w: e / 100.0 + (_mse(w) + tf.reduce_sum(
        _mse(w, "errors")) / tf.cast(tf.size(_mse(w, "errors")), tf.float32)),
}


def _mse(w, name="mse"):
    return w.graph.get_tensor_by_name(f"{name}:0")


def graph(loss, over=None):
    """x (rows x 5) -> w -> squared error summed, scaled by `loss`; Adam.
    `over`: the sum divided by this number instead. Fetched beside it,
    `close`: the outputs within 1 of their targets, over B (or `over`)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], "x")
        y = tf1.placeholder(tf.float32, [None, 3], "y")
        tf1.placeholder(tf.int32, [], "size")
        w = tf1.get_variable("w", initializer=np.full((5, 3), 0.1, np.float32))
        err = tf.matmul(x, w) - y       # (read before the update: its gradient needs it)
        e = tf.reduce_sum(tf.square(err))
        tf.reduce_mean(tf.square(tf.abs(err), "errors"), name="mse")    # (for a mean beside)
        made = loss(e, w) if over is None else e / float(over)
        tf.identity(made, "loss")
        close = tf.reduce_sum(tf.cast(tf.abs(err) < 1.0, tf.float32))
        tf.identity(close / float(over or B), "close")     # fetched beside: no loss reads it
        tf1.train.AdamOptimizer(0.1).minimize(made, name="train")
    return g


def feeds(sizes):
    start = np.cumsum([0] + list(sizes))
    return [{"x:0": X[a:a + n], "y:0": Y[a:a + n], "size:0": n} for a, n in zip(start, sizes)]


def trained(g, run, batches):
    losses = [run(["train", "loss:0", "close:0"], f)[1:] for f in batches]
    names = [v.op.name for v in g.get_collection("variables")]
    return dict(zip(names, run(g.get_collection("variables")))), losses


def compare(loss, sizes, capsys, over=None, config=None):
    """2 replicas fed `sizes` rows a step against one device fed the same
    (its graph's sum over `over` where given): every variable and slot and
    the fetched losses and `close` within TOL; (the lines the runner printed, its plan)."""
    g = graph(loss)
    capsys.readouterr()
    with pn.get_runner(g, local(2), config) as runner:
        runner.run([v.initializer for v in g.get_collection("variables")])
        start = runner.run(g.get_collection("variables"))
        got, got_losses = trained(g, runner.run, feeds(sizes))
        plan = runner.plan
    said = [line for line in capsys.readouterr().err.splitlines() if "parallax_ng" in line]
    one = graph(loss, over)
    with tf1.Session(graph=one) as sess:
        sess.run([v.initializer for v in one.get_collection("variables")])
        load_values(sess, one, dict(zip(got, start)))
        want, want_losses = trained(one, sess.run, feeds(sizes))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=TOL, rtol=0, err_msg=name)
    np.testing.assert_allclose(got_losses, want_losses, rtol=TOL, atol=TOL)
    return said, plan


@pytest.mark.parametrize("form", sorted(LOSSES))
def test_a_sum_scaled_by_a_number_equals_one_device_fed_the_same_rows(form, capsys):
    """Full steps of B rows, then a last one of 6 (the number is then no
    longer the rows fed: one device's sum times it): one device, no line."""
    said, plan = compare(LOSSES[form], [B, B, B, 6], capsys)
    assert not said, said
    assert len(plan.scaled_sums) == 2          # the loss's and close's


@pytest.mark.parametrize("run_option", ["allreduce", "ps"])
def test_every_run_option_decides_the_scaled_sum_alike(run_option, capsys):
    said, _ = compare(LOSSES["over the rows fed"], [B, B, 6], capsys,
                      config={"run_option": run_option})
    assert not said, said


def test_a_sum_over_a_replicas_rows_is_their_mean_as_before(capsys):
    """B rows fed to 2 replicas, each dividing its sum by B / 2 (a script
    written for one device of B / 2 rows): the mean over the global batch,
    one device's sum over B."""
    said, _ = compare(lambda e, w: e / (B // 2), [B, B, B], capsys, over=B)
    assert not said, said


def test_a_sum_scaled_by_a_variable_keeps_its_warning_and_the_config_wins(capsys):
    """A number the graph does not fix (a variable) is not decided: the
    warning names the loss, as before; with average_dense/average_sparse
    set, the plan has no scaled sums."""
    scale = {}

    def by_variable(e, w):
        scale["v"] = tf1.get_variable("scale", initializer=0.125, trainable=False)
        return e * scale["v"]
    capsys.readouterr()
    with pn.get_runner(graph(by_variable), local(2)) as runner:
        assert [site.op for site in runner.plan.scaled_sums] == ["truediv"]     # close's
    assert "'mul:0' sums over the batch and scales the sum by a number" in \
        capsys.readouterr().err
    with pn.get_runner(graph(LOSSES["over the rows fed"]), local(2),
                       {"average_dense": True, "average_sparse": True}) as runner:
        assert runner.plan.scaled_sums == ()


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_fit_with_losses_a_layer_adds_beside_the_compiled_one_equals_one_device(lib):
    """A layer's `add_loss` of a Sum over the batch times a number (an L1
    penalty on activations) and of a Mean times one, beside the compiled
    mean: the traced step's sum is decided as the loop's are, also where
    a tracker adds the loss without gradients (validation, `evaluate`).
    Every weight and slot, every logged value and `evaluate`'s. Before,
    averaged (the Sum's part 1/N of one device's; a Mean times a number was
    taken for another sum, so the sum was not decided): here 0.21 apart,
    and in Keras 3 warned; validation's loss was apart where training's
    agreed."""
    import keras
    k = keras if lib == "keras3" else __import__("tf_keras")

    class Penalized(k.layers.Layer):
        def call(self, h):
            self.add_loss(0.1 * tf.reduce_mean(tf.square(h)))
            self.add_loss(0.01 * tf.reduce_sum(tf.abs(h)))
            return h

    def model():
        k.utils.set_random_seed(1)
        x = k.Input((5,))
        m = k.Model(x, k.layers.Dense(4)(Penalized()(k.layers.Dense(8, "relu")(x))))
        m.compile(k.optimizers.SGD(0.05, momentum=0.9), metrics=["accuracy"],
                  loss=k.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
    parallel, single = model(), model()
    pn.parallelize(parallel, local(2))
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0.5).astype(np.int64)
    logs = [m.fit(X, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  validation_data=(X[:32], y[:32])).history for m in (parallel, single)]
    for key in logs[1]:
        np.testing.assert_allclose(logs[0][key], logs[1][key], atol=TOL, rtol=0, err_msg=key)
    np.testing.assert_allclose(parallel.evaluate(X, y, batch_size=16, verbose=0),
                               single.evaluate(X, y, batch_size=16, verbose=0),
                               atol=TOL, rtol=0)
    for v1, v2 in zip(parallel.weights + parallel.optimizer.variables,
                      single.weights + single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), atol=TOL, rtol=0)


def test_the_pass_scales_the_number_the_forward_and_gradient_read():
    """The forward division and the autodiff's divisions by the number
    read the decided number; a replica's rows are its feed's shape."""
    ctx = context(2, graph=graph(LOSSES["over the rows fed"]))
    assert len(ctx.plan.scaled_sums) == 2
    site = ctx.plan.scaled_sums[0]
    nodes = {n.name: n for n in run_passes(ctx, ReplicatePass(), ScaledSumsPass()).nodes}
    number = f"parallax/scaled_sums/{site.op}/number"
    readers = [n.name for n in nodes.values() if number in n.input]
    assert site.op in readers and REPLICA_PREFIX.format(1) + site.op in readers
    assert any("gradients" in r for r in readers)
    assert nodes[f"parallax/scaled_sums/{site.op}/replica_1/shape"].input[0].startswith(
        REPLICA_PREFIX.format(1))


def test_the_job_of_two_workers_takes_each_feeds_mean(tmp_path):
    """2 workers of 2 devices and a server, each fed its 4 rows of the
    global 8 and dividing its sum by 4 (the worker's batch, the usual
    script; each replica holds 2): the mean over the global batch, one
    device's sum over 8, on both workers."""
    from test_cluster import resources
    script, out = tmp_path / "job.py", str(tmp_path / "out")
    script.write_text(JOB.format(tests=os.path.dirname(os.path.abspath(__file__)), out=out,
                                 half=B // 2))
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
         resources(tmp_path, 2, 2, servers=1)], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    one = graph(None, over=B)
    with tf1.Session(graph=one) as sess:
        sess.run([v.initializer for v in one.get_collection("variables")])
        want, _ = trained(one, sess.run, feeds([B] * 3))
    for w in (0, 1):
        got = dict(np.load(f"{out}.{w}.npz"))
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=TOL, rtol=0,
                                       err_msg=f"worker {w}: {name}")


JOB = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
import parallax_ng as pn
from test_scaled_sums import graph, feeds, trained
g = graph(lambda e, w: e / {half})
runner = pn.get_runner(g, None, None)
runner.run([v.initializer for v in g.get_collection("variables")])
w = runner.plan.worker
parts = [{{k: v[{half} * w:{half} * (w + 1)] if np.ndim(v) else {half} for k, v in f.items()}}
         for f in feeds([8] * 3)]
got, _ = trained(g, runner.run, parts)
np.savez({out!r} + f".{{w}}.npz", **got)
"""
