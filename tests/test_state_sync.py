import warnings

import numpy as np
import pytest
import tensorflow as tf

from models import state_variable
from passkit import context, op_counts, run_passes
from transforms.aggregate import AggregatePass
from transforms.replicate import ReplicatePass
from transforms.state_sync import StateSyncPass
from task_env import TASK_PATH

tf1 = tf.compat.v1


def stats_graph(trainable=False):
    """A running mean of the batch and a running count of examples."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        mean = tf1.get_variable("running_mean", initializer=np.zeros([3], np.float32),
                                trainable=trainable)
        count = tf1.get_variable("count", initializer=np.float32(0), trainable=False)
        upd_mean = tf1.assign_sub(mean, (mean - tf.reduce_mean(x, 0)) * 0.5)
        upd_count = tf1.assign_add(count, tf.cast(tf.shape(x)[0], tf.float32))
        loss = tf.reduce_mean(tf.reduce_sum(x * w, 1))
        with tf.control_dependencies([upd_mean, upd_count]):
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


def test_state_written_from_replica_data_is_all_reduced():
    ctx = context(n=2, graph=stats_graph())
    ir = run_passes(ctx, ReplicatePass(), AggregatePass(), StateSyncPass())
    synced = [n for n in ir.nodes if n.name.startswith("parallax/state_sync/")]
    assert op_counts(ir, "parallax/state_sync/")["CollectiveReduce"] == 4
    ops = {n.name.split("/input_")[0].removeprefix("parallax/state_sync/"):
           n.attr["final_op"].s for n in synced}
    assert ops == {"AssignSubVariableOp": b"Div", "AssignAddVariableOp": b"Id"}
    assert ir.node("parallax/replica_1/AssignAddVariableOp").input[1] == \
        "parallax/state_sync/AssignAddVariableOp/input_1/replica_1"
    # the optimizer's own writes get aggregated gradients, not state sync
    assert not any("ResourceApply" in n.name for n in synced)


@pytest.mark.parametrize("trainable", [True, False])
def test_a_trainable_variable_synced_as_state_is_named_in_a_warning(trainable):
    """A trainable variable the step writes from each replica's data with
    no gradient found (a trained weight the analysis missed, or state left
    trainable) is synced as state, averaged, which is exact only where the
    write is linear in the data: a warning names it, and only it."""
    ctx = context(n=2, graph=stats_graph(trainable))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_passes(ctx, ReplicatePass(), AggregatePass(), StateSyncPass())
    said = [str(w.message) for w in caught if "no gradient of a variable" in str(w.message)]
    assert len(said) == int(trainable)
    if trainable:
        assert "['running_mean']" in said[0] and "trainable=False" in said[0]


def test_a_slot_written_from_gradient_rows_no_variable_claims_is_named_in_a_warning():
    """A momentum the script keeps by hand for an embedding (not trainable,
    named apart from it: no owner known), written by a scatter-add of the
    gradient's rows, and the table updated from it: no gradient of a
    variable is found there, so each replica's rows are added (summed over
    the replicas, twice one device's rows for a mean loss). Before, that
    was silent; a warning now names the slot."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        table = tf1.get_variable("table", initializer=np.ones([6, 2], np.float32))
        velocity = tf1.get_variable("velocity", initializer=np.zeros([6, 2], np.float32),
                                    trainable=False)
        w = tf1.get_variable("w", initializer=np.ones([2], np.float32))
        loss = tf.reduce_mean(tf.square(tf.gather(table, ids) * w))
        grad, grad_w = tf.gradients(loss, [table, w])
        decayed = tf1.assign(velocity, velocity * 0.9)
        with tf.control_dependencies([decayed]):
            added = tf1.scatter_add(velocity, grad.indices, grad.values)
        tf.group(tf1.assign_sub(table, 0.1 * added), tf1.assign_sub(w, 0.1 * grad_w),
                 name="train")
    ctx = context(n=2, graph=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_passes(ctx, ReplicatePass(), AggregatePass(), StateSyncPass())
    said = [str(w.message) for w in caught if "no gradient of a variable" in str(w.message)]
    assert len(said) == 1 and "['velocity']" in said[0], said


def test_synced_state_equals_one_device():
    import parallax_ng as pn
    from models import local
    g = stats_graph()
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    with pn.get_runner(g, local(2)) as runner:
        runner.run([v.initializer.name for v in g.get_collection("variables")])
        runner.run("train", {"x:0": data})
        mean, count = runner.run(["running_mean/Read/ReadVariableOp:0",
                                  "count/Read/ReadVariableOp:0"], per_replica=True)
    np.testing.assert_allclose(mean[0], data.mean(0) * 0.5, rtol=1e-6)
    np.testing.assert_array_equal(mean[0], mean[1])
    assert count == [8.0, 8.0]


def state_rows_graph(rows, use_resource):
    """An RNN whose state lives in a variable, one row per example of a
    fixed batch of `rows`, written after each training step."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [rows, 2], name="x")
        y = tf1.placeholder(tf.float32, [rows, 1], name="y")
        state = tf1.get_variable("state", [rows, 3], initializer=tf1.zeros_initializer(),
                                 trainable=False, use_resource=use_resource)
        wx = tf1.get_variable("wx", initializer=np.full((2, 3), 0.3, np.float32))
        wh = tf1.get_variable("wh", initializer=np.eye(3, dtype=np.float32) * 0.5)
        wo = tf1.get_variable("wo", initializer=np.full((3, 1), 0.2, np.float32))
        h = tf.tanh(tf.matmul(x, wx) + tf.matmul(state, wh))
        loss = tf.reduce_mean(tf.square(tf.matmul(h, wo) - y))
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf1.control_dependencies([train]):
            tf1.assign(state, tf.stop_gradient(h), name="step")
        tf1.global_variables_initializer()
    return g


@pytest.mark.parametrize("use_resource", [False, True], ids=["ref", "resource"])
@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_per_example_state_stays_with_each_replicas_examples(use_resource, mode):
    """2 replicas of a graph built for 4 rows, fed 8, against one device
    built for 8: each replica keeps its own examples' state rows (before,
    the state sync averaged the two replicas' rows, 1.4e-3 off one device
    after 10 steps, silently); a fetch of the state joins them."""
    import parallax_ng as pn
    from models import local
    from parallax_ng.pipeline.results import PerExampleState
    rng = np.random.RandomState(0)
    xs, ys = rng.randn(6, 8, 2).astype(np.float32), rng.randn(6, 8, 1).astype(np.float32)
    names = ["state", "wx", "wh", "wo"]

    def read(g):
        by_name = {v.op.name: v for v in g.get_collection("variables")}
        return [by_name[n] for n in names]
    g = state_rows_graph(8, use_resource)
    with tf1.Session(graph=g) as sess:
        sess.run("init")
        losses = [sess.run(["Mean:0", "step"], {"x:0": a, "y:0": b})[0] for a, b in zip(xs, ys)]
        want = [np.array(v, copy=True) for v in sess.run(read(g))]   # (a ref variable aliases)
    g = state_rows_graph(4, use_resource)
    with pn.get_runner(g, local(2), {"run_option": mode}) as runner:
        assert runner.ctx.result(PerExampleState).axes == (("state", 0),)
        runner.run("init")
        got_losses = [runner.run(["Mean:0", "step"], {"x:0": a, "y:0": b})[0]
                      for a, b in zip(xs, ys)]
        got = [np.array(v, copy=True) for v in runner.run(read(g))]
        parts = [np.array(v, copy=True) for v in runner.run(read(g)[0], per_replica=True)]
    np.testing.assert_allclose(got_losses, losses, rtol=0, atol=1e-6)
    for name, a, b in zip(names, got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(np.concatenate(parts), got[0])


def totals_graph(chained=False, apart=False):
    """A metric's total and count, both added from the replica's batch;
    `chained`: the count's increment is computed after the total's write;
    `apart`: the count counts the rows of another fed tensor."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        total = tf1.get_variable("total", initializer=np.zeros([3], np.float32),
                                 trainable=False)
        count = tf1.get_variable("count", initializer=np.float32(0), trainable=False)
        add_total = tf1.assign_add(total, tf.reduce_sum(x, 0))
        y = tf1.placeholder(tf.float32, [None], name="y")
        rows = tf.cast(tf.shape(y if apart else x)[0], tf.float32)
        with tf.control_dependencies([add_total] if chained else []):
            add_count = tf1.assign_add(count, tf.identity(rows))
        loss = tf.reduce_mean(tf.reduce_sum(x * w, 1))
        with tf.control_dependencies([add_total, add_count]):
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("chained,apart", [(False, False), (True, False), (False, True)],
                         ids=["together", "chained", "other-feed"])
def test_states_of_one_kind_are_reduced_as_one_tensor(chained, apart):
    """A step's sums of one dtype (a [3] total and a scalar count) go as one
    vector per replica, one exchange instead of two, and are cut back into
    their shapes; a state whose increment comes after what another's sum
    feeds stays alone (together they would wait for each other), and so do
    states computed from other feeds (a run may feed one only). Either way
    both equal one device's with the global batch."""
    import parallax_ng as pn
    from models import local
    ctx = context(n=2, graph=totals_graph(chained, apart))
    ir = run_passes(ctx, ReplicatePass(), AggregatePass(), StateSyncPass())
    reduces = [n.name for n in ir.nodes if n.name.startswith("parallax/state_sync/")
               and n.op == "CollectiveReduce"]
    alone = chained or apart
    assert len(reduces) == (4 if alone else 2)
    assert all(("/together_" in n) != alone for n in reduces)
    g = totals_graph(chained, apart)
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    with pn.get_runner(g, local(2)) as runner:
        runner.run([v.initializer.name for v in g.get_collection("variables")])
        for _ in range(2):
            runner.run("train", {"x:0": data, "y:0": data[:, 0]})
        total, count = runner.run(["total/Read/ReadVariableOp:0",
                                   "count/Read/ReadVariableOp:0"], per_replica=True)
    np.testing.assert_array_equal(total[0], 2 * data.sum(0))
    np.testing.assert_array_equal(total[0], total[1])
    assert count == [16.0, 16.0]


def test_states_of_one_kind_go_through_a_server_as_one_tensor():
    """In a job that sums on the servers, the total and count of a step
    take one server sum (one queue element per worker each way)."""
    from passkit import cluster_transform
    ir, ctx = cluster_transform(totals_graph(), worker=0, servers=2, run_option="ps")
    step = ir.ancestors(["train"])
    totals = [n for n in step if n.startswith("parallax/state_sync/") and n.endswith("/total")]
    assert len(totals) == 1 and "/together_" in totals[0]
    assert ir.node(totals[0]).device.startswith("/job:ps/")


def test_golden_tiny_counter():
    """A counter of every replica's rows: its AssignAdd input is summed over
    the replicas (one CollectiveReduce each, final op Id)."""
    from passkit import devices, tiny_graph
    ctx = context(n=2, graph=tiny_graph(counter=True), run_option="allreduce")
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    out, report = StateSyncPass().run(ir, ctx)
    writer = next(n.name for n in ctx.tg.ir.nodes if n.op.startswith("AssignAdd"))
    added = sorted(n.name for n in out.nodes if n.name not in ir)
    assert added == [f"parallax/state_sync/{writer}/input_1/replica_{k}"
                     for k in range(2)]
    for k in range(2):
        node = out.node(added[k])
        assert node.op == "CollectiveReduce" and node.device == devices(2)[k]
        assert node.attr["final_op"].s == b"Id"
    assert out.node(f"parallax/replica_1/{writer}").input[1] == added[1]
    assert report == {"synced": 1}


ON_SERVERS = [{"dense_method": "bfb"}, {"run_option": "ps"}]


@pytest.mark.parametrize("config", ON_SERVERS, ids=["fusion-buffers", "ps"])
def test_in_a_job_with_gradients_on_the_servers_state_is_summed_there(config):
    """No collective op in the step: the running statistics' sums go through
    the servers like the gradients (fusion buffers, or every variable on
    the servers: a collective would make the step two session runs)."""
    from passkit import cluster_transform
    ir, ctx = cluster_transform(stats_graph(), worker=0, servers=2, **config)
    assert ctx.plan.reduces_on_servers
    step = ir.ancestors(["train"])
    assert not [n for n in step if ir.node(n).op.startswith("Collective")]
    totals = sorted(n for n in step if n.startswith("parallax/state_sync/")
                    and n.endswith("/total"))
    assert len(totals) == 2 and {ir.node(n).device.split("/device")[0] for n in totals} == {
        "/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"}


JOB_SCRIPT = """
import sys
import numpy as np
import tensorflow as tf
sys.path.insert(0, {tests!r})
import parallax_ng as pn
from test_state_sync import stats_graph

g = stats_graph()
runner = pn.get_runner(g, None, {config!r})
runner.run([v.initializer.name for v in g.get_collection("variables")])
data = np.arange(24, dtype=np.float32).reshape(8, 3)
w = runner.plan.worker
runner.run("train", {{"x:0": data[4 * w:4 * w + 4]}})
mean, count = runner.run(["running_mean/Read/ReadVariableOp:0",
                          "count/Read/ReadVariableOp:0"])
print("runs", runner.session_runs("train"), "state", mean.tolist(), float(count), flush=True)
"""


@pytest.mark.parametrize("config", ON_SERVERS, ids=["fusion-buffers", "ps"])
def test_a_job_with_gradients_on_the_servers_keeps_state_equal_to_one_device(tmp_path,
                                                                             config):
    import os
    import re
    import subprocess
    import sys
    from test_cluster import resources
    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "stats.py"
    script.write_text(JOB_SCRIPT.format(tests=tests, config=config))
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
         resources(tmp_path, 2, 1, servers=1)], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    mean = np.arange(24, dtype=np.float32).reshape(8, 3).mean(0) * 0.5
    for w in (0, 1):
        line = next(x for x in done.stdout.splitlines() if x.startswith(f"[worker {w}] runs"))
        assert line.startswith(f"[worker {w}] runs 1 state"), line
        numbers = [float(v) for v in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", line)]
        np.testing.assert_allclose(numbers[:3], mean, rtol=1e-6)
        assert numbers[3] == 8.0, line


def accumulation_graph():
    """Writes told apart by what they compute: `total.assign(total + sum)`
    accumulates (Keras 3's metrics), as does its reference-variable twin;
    `ema.assign_add((mean - ema) * 0.5)` is a moving average written as an
    add; `last.assign(last * 0 + mean)` reads itself under a product."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        total, ref_total, ema, last = (state_variable("total"),
                                       state_variable("ref_total", False),
                                       state_variable("ema"), state_variable("last"))
        updates = [total.assign(total + tf.reduce_sum(x, 0)),
                   tf1.assign(ref_total, ref_total + tf.reduce_sum(x, 0)),
                   ema.assign_add((tf.reduce_mean(x, 0) - ema) * 0.5),
                   last.assign(last * 0.0 + tf.reduce_mean(x, 0))]
        loss = tf.reduce_mean(tf.reduce_sum(x * w, 1))
        with tf.control_dependencies(updates):
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf1.global_variables_initializer()
        for v in (total, ref_total, ema, last):
            tf.identity(v, name=v.op.name + "_value")
    return g


def test_accumulations_are_summed_and_averages_averaged():
    import parallax_ng as pn
    from models import local
    g = accumulation_graph()
    names = ["total", "ref_total", "ema", "last"]
    data = np.arange(48, dtype=np.float32).reshape(16, 3)
    with tf1.Session(graph=g) as sess:
        sess.run("init")
        for k in range(2):
            sess.run("train", {"x:0": data[8 * k:8 * k + 8]})
        one = sess.run([f"{v}_value:0" for v in names])
    with pn.get_runner(g, local(2), {"batch_feeds": {"x": True}}) as runner:
        runner.run("init")
        for k in range(2):
            runner.run("train", {"x:0": data[8 * k:8 * k + 8]})
        got = runner.run([f"{v}_value:0" for v in names], per_replica=True)
    for name, want, replicas in zip(names, one, got):
        for value in replicas:
            np.testing.assert_allclose(value, want, rtol=1e-6, err_msg=name)


def metrics_graph(data=None):
    """A classifier with tf.compat.v1 metrics: the mean of the (mean) loss,
    accuracy, AUC; and a fetched count of correct examples. `data`: a
    function giving (x, y) from a dataset instead of placeholders."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        if data is None:
            x = tf1.placeholder(tf.float32, [None, 5], name="x")
            y = tf1.placeholder(tf.int64, [None], name="y")
        else:
            x, y = data()
        h = tf.nn.relu(tf.matmul(x, tf1.get_variable("w1", [5, 8])))
        logits = tf.matmul(h, tf1.get_variable("w2", [8, 2]))
        loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        gs = tf1.train.get_or_create_global_step()
        lr = tf1.train.exponential_decay(0.2, gs, 2, 0.5, staircase=True)
        train = tf1.train.MomentumOptimizer(lr, 0.9).minimize(loss, global_step=gs)
        pred = tf.argmax(logits, 1)
        correct = tf.reduce_sum(tf.cast(tf.equal(pred, y), tf.float32), name="correct")
        metrics = [tf1.metrics.mean(loss), tf1.metrics.accuracy(y, pred),
                   tf1.metrics.auc(y, tf.nn.softmax(logits)[:, 1], num_thresholds=20)]
        init = [tf1.global_variables_initializer(), tf1.local_variables_initializer()]
    return g, dict(x=x, y=y, train=train, loss=loss, correct=correct, init=init,
                   updates=[m[1] for m in metrics], values=[m[0] for m in metrics])


@pytest.mark.parametrize("mode", ["hybrid", "ps"])
def test_tf1_metrics_and_fetched_sums_equal_one_device(mode):
    """tf.compat.v1.metrics.mean(loss) adds a replica's mean loss and counts
    one: the replicas' means are averaged (one device adds the global
    batch's), not summed, which had made the mean twice one device's;
    accuracy and AUC sum their counts; a fetched count of correct examples
    (a sum over the batch) is the replicas' sum, a fetched loss their
    mean. Then the metrics' updates run alone (an evaluation pass): every
    replica's copy runs (replica 0's alone had waited for the others in
    the sync until the timeout). 6 steps of 8 rows on 2 replicas, every
    variable, 1e-5."""
    import parallax_ng as pn
    from models import local
    rng = np.random.RandomState(0)
    xs = rng.randn(48, 5).astype(np.float32)
    ys = (xs @ rng.randn(5, 1) > 0).astype(np.int64).ravel()

    def run(call, t):
        call(t["init"])
        out = [call([t["train"], t["loss"], t["correct"]] + t["updates"],
                    {t["x"]: xs[k * 8:(k + 1) * 8], t["y"]: ys[k * 8:(k + 1) * 8]})[1:]
               for k in range(6)]
        # an evaluation pass: the updates alone (no training op) on more rows
        evaluated = call(t["updates"], {t["x"]: xs[:16], t["y"]: ys[:16]})
        return out, [evaluated, call(t["values"])]

    g1, t1 = metrics_graph()
    with tf1.Session(graph=g1) as sess:
        want, want_metrics = run(sess.run, t1)
        want_vars = {v.op.name: sess.run(v) for v in g1.get_collection("variables") +
                     g1.get_collection("local_variables")}
    g2, t2 = metrics_graph()
    runner = pn.get_runner(g2, local(2), {"run_option": mode})
    got, got_metrics = run(runner.run, t2)
    got_vars = {v.op.name: runner.run(v) for v in g2.get_collection("variables") +
                g2.get_collection("local_variables")}
    runner.close()
    assert sum(step[1] for step in want) > 10          # correct examples were counted
    np.testing.assert_allclose(np.array(got, np.float64), np.array(want, np.float64),
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_metrics, want_metrics, atol=1e-5, rtol=0)
    assert set(got_vars) == set(want_vars) and len(want_vars) > 8
    for name, value in want_vars.items():
        np.testing.assert_allclose(got_vars[name], value, atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("mode", ["hybrid", "allreduce"])
def test_tf1_metrics_of_arrays_and_their_fetched_updates_equal_one_device(mode, capsys):
    """The value an update op returns reads the synced state: equal on every
    replica, it comes back as replica 0's. mean_iou's confusion matrix,
    false_negatives_at_thresholds' counts and mean_tensor's means had come
    back joined ([6, 3] for [3, 3]) with a warning; mean_tensor of a
    per-column mean over the batch summed the replicas' means (twice one
    device's). mean_per_class_accuracy scatter-adds its counts per class
    (it was refused: ScatterAdd was no write the replicas could sync): the
    replicas' counts are summed by class (a scatter_sub's rows too). 5 steps of 8 rows on 2 replicas,
    1e-5, no warning."""
    import parallax_ng as pn
    from models import local
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(5, 8, 4)).astype(np.float32), rng.integers(0, 3, (5, 8))

    def build():
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 4], name="x")
            y = tf1.placeholder(tf.int64, [None], name="y")
            w = tf1.get_variable("w", initializer=np.random.default_rng(1).normal(
                size=(4, 3)).astype(np.float32))
            logits = tf.matmul(x, w)
            probs, pred = tf.nn.softmax(logits), tf.argmax(logits, 1)
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)))
            metrics = [tf1.metrics.mean_iou(y, pred, 3),
                       tf1.metrics.false_negatives_at_thresholds(tf.equal(y, 1), probs[:, 1],
                                                                 [0.3, 0.5]),
                       tf1.metrics.mean_tensor(tf.reduce_mean(probs, 0)),
                       tf1.metrics.mean_per_class_accuracy(y, pred, 3),
                       tf1.metrics.accuracy(y, pred)]
            owed = tf1.get_variable("owed", initializer=tf.zeros([3]), trainable=False,
                                    collections=[tf1.GraphKeys.LOCAL_VARIABLES])
            metrics.append((owed, tf1.scatter_sub(owed, y, tf.reduce_max(probs, 1))))
            init = [tf1.global_variables_initializer(), tf1.local_variables_initializer()]
        return g, x, y, train, metrics, init
    runs = []
    for parallel in (False, True):
        g, x, y, train, metrics, init = build()
        with (pn.get_runner(g, local(2), {"run_option": mode}) if parallel
              else tf1.Session(graph=g)) as run:
            run.run(init)
            updates = [run.run([train] + [u for _, u in metrics], {x: xs[k], y: ys[k]})[1:]
                       for k in range(5)]
            runs.append((updates, run.run([v for v, _ in metrics])))
    assert "parallax_ng" not in capsys.readouterr().err
    (got, got_values), (want, want_values) = runs[1], runs[0]
    for a, b in zip(got + [got_values], want + [want_values]):
        for u, v in zip(a, b):
            assert np.shape(u) == np.shape(v)
            np.testing.assert_allclose(u, v, atol=1e-5, rtol=0)


def test_tf1_metrics_over_a_batch_of_static_shape_equal_one_device():
    """A dataset batched with drop_remainder (a static batch of 4 rows per
    replica): accuracy's and AUC's counts of the batch's rows are folded to
    constants that every replica adds alike; one device adds the global
    batch's, so each replica adds its constant times the replicas (the
    accuracy had been twice one device's). 6 steps on 2 replicas, every
    variable and metric, 1e-5."""
    import parallax_ng as pn
    from models import local
    rng = np.random.RandomState(1)
    xs = rng.randn(48, 5).astype(np.float32)
    ys = (xs @ rng.randn(5, 1) > 0).astype(np.int64).ravel()

    def data(parallel):
        def make():           # in the classifier's graph
            ds = tf.data.Dataset.from_tensor_slices((xs, ys))
            ds = pn.shard(ds).batch(4, drop_remainder=True) if parallel else \
                ds.batch(8, drop_remainder=True)
            return tf1.data.make_one_shot_iterator(ds).get_next()
        return make
    runs = []
    for parallel in (True, False):
        g, t = metrics_graph(data(parallel))
        with (pn.get_runner(g, local(2)) if parallel else tf1.Session(graph=g)) as s:
            s.run(t["init"])
            for _ in range(6):
                s.run([t["train"]] + t["updates"])
            runs.append((s.run(t["values"]), {v.op.name: s.run(v) for v in
                                              g.get_collection("local_variables")}))
    (got, got_vars), (want, want_vars) = runs
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert set(got_vars) == set(want_vars) and len(want_vars) > 4
    for name, value in want_vars.items():
        np.testing.assert_allclose(got_vars[name], value, atol=1e-5, rtol=0, err_msg=name)


def test_a_keras_mean_of_the_loss_in_a_custom_loop_equals_one_device():
    """keras.metrics.Mean().update_state(loss) in a TF2 step: its total
    grows by the replica's mean loss and its count by one, so the replicas'
    increments are averaged (it had been twice one device's)."""
    import keras

    import parallax_ng as pn
    from models import local
    keras.utils.set_random_seed(1)
    models = [keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    means = [keras.metrics.Mean() for _ in range(2)]

    def step_of(model, optimizer, mean):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x)[:, 0] - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            mean.update_state(loss)
            return loss
        return step
    step = pn.function(step_of(models[0], keras.optimizers.SGD(0.1), means[0]), local(2))
    ref = tf.function(step_of(models[1], keras.optimizers.SGD(0.1), means[1]))
    rng = np.random.default_rng(0)
    for _ in range(4):
        x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=8).astype(np.float32)
        step(x, y)
        ref(x, y)
    step.sync()
    assert float(means[1].count) == 4.0
    for a, b in zip(means[0].variables, means[1].variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(models[0].weights[0]), np.asarray(models[1].weights[0]),
                               atol=1e-5, rtol=0)


def masked_graph(weighted):
    """Sequences of 4 tokens padded with 0; the loss a mean over the real
    tokens: a sum over the batch divided by the mask's sum (or
    tf.compat.v1.losses' mean over nonzero weights). Beside it, as scripts
    print them: a masked accuracy (`acc`, fetched only), the running
    tf.compat.v1.metrics.mean of another (`running`), an RMSE and an
    R-squared."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(2)
        ids = tf1.placeholder(tf.int32, [None, 4], name="ids")
        y = tf1.placeholder(tf.float32, [None, 4], name="y")
        emb = tf1.get_variable("emb", [20, 3])
        h = tf.tanh(tf.einsum("bsd,de->bse", tf.nn.embedding_lookup(emb, ids),
                              tf1.get_variable("w", [3, 1])))[:, :, 0]
        mask = tf.cast(ids > 0, tf.float32)
        if weighted:
            loss = tf1.losses.mean_squared_error(y, h, weights=mask)
        else:
            loss = tf.reduce_sum(tf.square(h - y) * mask) / tf.reduce_sum(mask)
        hits = [tf.cast(tf.abs(h - y) < bound, tf.float32) for bound in (0.5, 1.0)]
        acc, near = (tf.reduce_sum(hit * mask) / tf.reduce_sum(mask) for hit in hits)
        _, running = tf1.metrics.mean(near)
        rmse = tf.sqrt(tf.reduce_mean(tf.square(h - y)))
        per_position = tf.sqrt(tf.reduce_mean(tf.square(h - y), 0))
        spread = tf.math.reduce_std(h, 0)
        per_position_acc = tf.reduce_sum(hits[0] * mask, 0) / tf.reduce_sum(mask, 0)
        per_token = [tf.math.unsorted_segment_sum(hits[0] * mask, ids, 20) / tf.maximum(
            tf.math.unsorted_segment_sum(mask, ids, 20), 1.0),     # an accuracy per token id
            tf.math.unsorted_segment_mean(tf.abs(h - y), ids, 20),
            tf.math.unsorted_segment_max(tf.abs(h - y), ids, 20),
            tf.math.unsorted_segment_sum(mask, ids, 20)]
        variance = tf.math.reduce_variance(h - y)      # of the model's outputs (residuals)
        deviation = tf.reduce_mean(tf.abs(h - tf.reduce_mean(h)))
        variance_per_position = tf.math.reduce_variance(h, 0)
        r2 = r_squared(y, h)
        train = tf1.train.AdamOptimizer(0.05).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        init = [tf1.global_variables_initializer(), tf1.local_variables_initializer()]
    return g, dict(ids=ids, y=y, loss=loss, train=train, init=init, acc=acc, running=running,
                   rmse=rmse, r2=r2, per_position=per_position, spread=spread,
                   per_position_acc=per_position_acc, per_token=per_token, variance=variance,
                   deviation=deviation, variance_per_position=variance_per_position)


@pytest.mark.parametrize("weighted,mode", [(False, "hybrid"), (True, "allreduce"),
                                           (False, "ps")])
def test_a_masked_mean_divides_by_the_jobs_count(weighted, mode):
    """Replica 0's rows hold far fewer real tokens than replica 1's: each
    divides its masked sum by the replicas' mean count (every use of the
    count: the loss and its gradient), so the mean of their gradients and
    losses is one device's; dividing by its own count had weighed replica
    0's tokens 4 times more. So do the masked accuracies beside it, a
    fetched one and one a running metric adds up (each replica's own ratio
    had been averaged: 0.17 off); a fetched RMSE is the root of the job's
    mean, an R-squared centred on the job's mean; so are an RMSE and a
    standard deviation per position, vectors (each the replicas' own roots
    averaged before: 0.14 off), and a masked accuracy per position (before,
    NaN: replica 0's rows have no real token past the first); so are values
    per token id by tf.math.unsorted_segment_* (an accuracy, a mean error,
    the largest error, a count: before, the replicas' joined, twice the
    ids), and the variance and mean absolute deviation of the model's
    outputs (before, each replica's centred on its own mean: 0.93 off in a
    sweep). 5 steps, every variable, 1e-5."""
    rng = np.random.RandomState(1)
    ids = rng.randint(1, 20, size=(80, 4)).astype(np.int32)
    ids[:, 1:] *= (np.arange(80) % 16 >= 8)[:, None]    # rows 0-7 of 16: one real token
    ys = rng.randn(80, 4).astype(np.float32)
    (want, want_vars), (got, got_vars), _ = one_device_and_two_replicas(
        lambda: masked_graph(weighted), mode, ids, ys,
        ["loss", "acc", "running", "rmse", "r2", "per_position", "spread", "per_position_acc",
         "per_token", "variance", "deviation", "variance_per_position"])
    assert np.shape(got[0][7]) == (4,) and np.shape(got[0][8]) == (4, 20)
    np.testing.assert_allclose(*[[np.concatenate([np.ravel(v) for v in step]) for step in run]
                                 for run in (got, want)], atol=1e-5, rtol=0)
    for name, value in want_vars.items():
        np.testing.assert_allclose(got_vars[name], value, atol=1e-5, rtol=0, err_msg=name)


def masked_token_loss(label, logits):
    """The masked loss and accuracy of TensorFlow's Transformer tutorial:
    sums over the real (nonzero) tokens over their count."""
    mask = tf.cast(label != 0, tf.float32)
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(label, tf.int32), logits)
    return tf.reduce_sum(per * mask) / tf.reduce_sum(mask)


def masked_token_accuracy(label, logits):
    match = tf.cast(tf.equal(tf.cast(label, tf.int64), tf.argmax(logits, axis=2)), tf.float32)
    mask = tf.cast(label != 0, tf.float32)
    return tf.reduce_sum(match * mask) / tf.reduce_sum(mask)


def label_rms(label, logits):
    """A root of a mean that differs between the replicas' rows."""
    return tf.sqrt(tf.reduce_mean(tf.square(tf.cast(label, tf.float32) -
                                            tf.reduce_sum(logits, -1))))


def r_squared(y, pred):
    """The coefficient of determination as scripts write it for a Keras
    metric: the batch's values less their mean, a ratio of two sums."""
    residual = tf.reduce_sum(tf.square(y - pred))
    total = tf.reduce_sum(tf.square(y - tf.reduce_mean(y)))
    return 1.0 - residual / (total + 1e-7)


def label_r2(label, logits):
    return r_squared(tf.cast(label, tf.float32), tf.reduce_sum(logits, -1))


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_fit_with_masked_and_root_mean_metrics_equals_one_device(lib):
    """`model.fit` with the masked loss, and as metrics (functions Keras
    averages over the batches) a masked accuracy, a root of a mean and an
    R-squared: each replica's accuracy divides by the replicas' mean count
    of real tokens, each takes the root of the job's mean, and each centres
    its labels on the job's mean and divides by the job's total, so their
    mean is one device's (each replica's own, averaged, had been 0.011,
    0.32 and 1.2 off in the logs). Every log, training and validation, and
    every weight, 1e-5."""
    import keras
    import tf_keras
    k = keras if lib == "keras" else tf_keras
    import parallax_ng as pn
    from models import local
    rng = np.random.RandomState(3)
    ids = rng.randint(1, 12, size=(48, 5))
    labels = rng.randint(1, 12, size=(48, 5))
    labels[:, 1:] *= (np.arange(48) % 8 >= 4)[:, None]   # rows 0-3 of 8: one real token

    def make():
        k.utils.set_random_seed(0)
        model = k.Sequential([k.Input((5,), dtype="int32"), k.layers.Embedding(12, 6),
                              k.layers.Dense(12)])
        model.compile(optimizer=k.optimizers.SGD(0.5), loss=masked_token_loss,
                      metrics=[masked_token_accuracy, label_rms, label_r2])
        return model
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    pn.parallelize(parallel, local(2))
    got, want = (m.fit(ids, labels, batch_size=8, epochs=2, shuffle=False, verbose=0,
                       validation_data=(ids[:16], labels[:16])).history
                 for m in (parallel, single))
    assert set(got) == set(want) and len(want) == 8
    for key, values in want.items():
        np.testing.assert_allclose(got[key], values, atol=1e-5, rtol=0, err_msg=key)
    for a, b in zip(parallel.weights, single.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def positives(y, pred):
    """Per batch, as Keras 2 scripts wrote precision, recall and F1 (sums of
    rounded values over their sums, and a function of the two ratios)."""
    true = tf.reduce_sum(tf.round(tf.clip_by_value(y * pred, 0, 1)))
    return (true, tf.reduce_sum(tf.round(tf.clip_by_value(pred, 0, 1))),
            tf.reduce_sum(tf.round(tf.clip_by_value(y, 0, 1))))


def precision(y, pred):
    true, predicted, _ = positives(y, pred)
    return true / (predicted + 1e-7)


def recall(y, pred):
    true, _, possible = positives(y, pred)
    return true / (possible + 1e-7)


def f1(y, pred):
    p, r = precision(y, pred), recall(y, pred)
    return 2 * p * r / (p + r + 1e-7)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_fit_with_batch_precision_recall_and_f1_metrics_equals_one_device(lib):
    """Positives fall unevenly between the replicas' rows: each replica's
    ratios divide by the replicas' mean counts and F1 takes the job's
    ratios, so the logs are one device's (each replica's own, averaged,
    had been up to 0.22 off). Every log and weight after 3 epochs, 1e-5."""
    import keras
    import tf_keras
    k = keras if lib == "keras" else tf_keras
    import parallax_ng as pn
    from models import local
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = ((rng.normal(size=(64, 1)) + (np.arange(64)[:, None] % 16 >= 8) * 1.5) > 0.8)

    def make():
        k.utils.set_random_seed(1)
        model = k.Sequential([k.Input((5,)), k.layers.Dense(8, activation="relu"),
                              k.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=k.optimizers.SGD(0.5), loss="binary_crossentropy",
                      metrics=[f1, precision, recall])
        return model
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    pn.parallelize(parallel, local(2))
    got, want = (m.fit(x, y.astype(np.float32), batch_size=16, epochs=3, shuffle=False,
                       verbose=0, validation_data=(x[:32], y[:32].astype(np.float32))).history
                 for m in (parallel, single))
    assert set(got) == set(want) and len(want) == 8 and max(want["f1"]) > 0.3
    for key, values in want.items():
        np.testing.assert_allclose(got[key], values, atol=1e-5, rtol=0, err_msg=key)
    for a, b in zip(parallel.weights, single.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def largest_error(y, pred):
    return tf.reduce_max(tf.abs(y - pred))


def worst_four(y, pred):
    return tf.reduce_mean(tf.math.top_k(tf.reshape(tf.abs(y - pred), [-1]), k=4).values)


def test_a_metric_that_mixes_the_batch_is_averaged_and_warned():
    """A metric of the mean of the batch's worst 4 errors: no combination of
    the replicas' values is one device's. It had been summed, as a sum over
    the batch is, silently (about twice one device's in the logs); now it
    is averaged, as a fetch of such a value is, and the build names the
    metric's total and why. A metric of the batch's largest error adds the
    job's largest (transforms/extremes.py): one device's, with no word (it
    had been averaged too, and named). The weights stay still (learning
    rate 0), so the logs are, exactly, the mean over the batches of the
    replicas' mean of their own rows' worst 4, and of the batch's largest."""
    import keras
    from models import local

    import parallax_ng as pn
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = (rng.normal(size=(64, 1)) + np.arange(64)[:, None] % 16 / 4).astype(np.float32)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse",
                  metrics=[largest_error, worst_four])
    pn.parallelize(model, local(2))
    with pytest.warns(UserWarning) as caught:
        got = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    said = " ".join(str(w.message) for w in caught)
    assert "the top k along the batch's axis" in said and "maximum" not in said, said
    errors = np.abs(y - x @ np.asarray(model.weights[0]) - np.asarray(model.weights[1]))
    halves = errors.reshape(4, 2, 8)               # 4 batches, each 2 replicas' rows
    largest = halves.max(axis=(1, 2)).mean()
    assert largest > halves.max(axis=2).mean(axis=1).mean() + 0.1     # not the replicas' mean
    worst = np.sort(halves, axis=2)[:, :, -4:].mean(axis=2).mean(axis=1).mean()
    np.testing.assert_allclose(got["largest_error"], [largest], rtol=1e-5)
    np.testing.assert_allclose(got["worst_four"], [worst], rtol=1e-5)


def one_device_and_two_replicas(make, mode, ids, ys, fetched, steps=5, rows=16):
    """Train `make()`'s graph (ids, y, train, init and the `fetched` keys)
    `steps` steps on `rows` rows each, on one device and on 2 replicas in
    `mode`: ((fetched values per step, variables) of each, the plan)."""
    import parallax_ng as pn
    from models import local

    def run(call, t):
        call(t["init"])
        return [call([t["train"]] + [t[k] for k in fetched],
                     {t["ids"]: ids[k * rows:(k + 1) * rows],
                      t["y"]: ys[k * rows:(k + 1) * rows]})[1:] for k in range(steps)]
    g1, t1 = make()
    with tf1.Session(graph=g1) as sess:
        one = run(sess.run, t1), {v.op.name: sess.run(v) for v in g1.get_collection("variables")}
    g2, t2 = make()
    with pn.get_runner(g2, local(2), {"run_option": mode}) as runner:
        two = run(runner.run, t2), {v.op.name: runner.run(v)
                                    for v in g2.get_collection("variables")}
    return one, two, runner.plan


@pytest.mark.parametrize("config", ON_SERVERS, ids=["fusion-buffers", "ps"])
def test_in_a_job_with_gradients_on_the_servers_a_masked_count_is_summed_there(config):
    """The count's mean goes through a server like the gradients: the step
    keeps no collective op (it would split the step into session runs)."""
    from passkit import cluster_transform
    g, t = masked_graph(False)
    ir, ctx = cluster_transform(g, worker=0, servers=2, **config)
    step = ir.ancestors([t["train"].name])
    assert not [n for n in step if ir.node(n).op.startswith("Collective")]
    counts = [n for n in step if n.startswith("parallax/state_sync/") and "/count" in n
              and n.endswith("/total")]
    assert len(counts) == 1 and ir.node(counts[0]).device.startswith("/job:ps/")


def regularized_graph(keras_sum, mean=False):
    """A loss summed over the batch plus an L2 regularizer (a term without
    data): `tf.reduce_sum(...) + 0.01 * tf.nn.l2_loss(w)`, or Keras 3's way
    of adding its losses (`ops.sum` of a list: a Sum of a Pack); with
    `mean`, plus a tf.compat.v1.losses mean (a sum over its count), or
    ("regularized") the mean with a penalty of its own added in it."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        ids = tf1.placeholder(tf.int32, [None, 2], name="ids")
        y = tf1.placeholder(tf.float32, [None], name="y")
        emb = tf1.get_variable("emb", [20, 3])
        w = tf1.get_variable("w", [3, 1])
        h = tf.matmul(tf.reduce_sum(tf.nn.embedding_lookup(emb, ids), 1), w)[:, 0]
        data = tf.reduce_sum(tf.square(h - y))
        reg = 0.05 * tf.nn.l2_loss(w)
        part = tf1.losses.absolute_difference(y, h) if mean else reg
        if mean:
            data = data + 0.5 * (part if mean != "regularized" else part + 0.5 * reg)
        loss = tf.reduce_sum(tf.stack([data, reg])) if keras_sum else data + reg
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, dict(ids=ids, y=y, loss=loss, part=part, train=train, init=init)


def penalized_apart_graph():
    """A loss summed over the batch and a weight penalty differentiated
    apart (tf.gradients of each), their gradients added, clipped by their
    global norm and applied by Adam."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        ids = tf1.placeholder(tf.int32, [None, 2], name="ids")
        y = tf1.placeholder(tf.float32, [None], name="y")
        emb, w = tf1.get_variable("emb", [20, 3]), tf1.get_variable("w", [3, 1])
        h = tf.matmul(tf.reduce_sum(tf.nn.embedding_lookup(emb, ids), 1), w)[:, 0]
        loss = tf.reduce_sum(tf.square(h - y))
        penalty = 0.5 * tf.nn.l2_loss(w)
        data, (apart,) = tf.gradients(loss, [emb, w]), tf.gradients(penalty, [w])
        grads, _ = tf.clip_by_global_norm([data[0], data[1] + apart], 5.0)
        train = tf1.train.AdamOptimizer(0.05).apply_gradients(zip(grads, [emb, w]))
        init = tf1.global_variables_initializer()
    return g, dict(ids=ids, y=y, loss=loss, train=train, init=init)


@pytest.mark.parametrize("mode", ["hybrid", "ps"])
def test_a_penalty_differentiated_apart_from_a_summed_loss_is_added_once(mode):
    """A penalty of the weights alone, differentiated on its own and added
    to a summed loss's gradient: it reads no data, so it is neither a sum
    nor a mean; the replicas' gradients are summed (the data's loss sums)
    and each adds 1/N of the penalty's. (Before: taken for a loss that
    averages, so the gradients were averaged, with a line saying so: the
    data's part was 1/N of one device's, 1.5e-2 apart in float64.) 5 Adam
    steps, every variable and the loss, 1e-5."""
    rng = np.random.RandomState(5)
    ids = rng.randint(0, 20, size=(80, 2)).astype(np.int32)
    ys = rng.randn(80).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (want, want_vars), (got, got_vars), plan = one_device_and_two_replicas(
            penalized_apart_graph, mode, ids, ys, ["loss"])
    assert not plan.average_dense
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)
    for name, value in want_vars.items():
        np.testing.assert_allclose(got_vars[name], value, atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("keras_sum,mode,mean", [
    (False, "hybrid", False), (True, "allreduce", False), (False, "ps", False),
    (False, "hybrid", True), (True, "ps", True), (False, "hybrid", "regularized"),
    (True, "allreduce", "regularized")])
def test_a_regularizer_beside_a_summed_loss_is_added_once(keras_sum, mode, mean):
    """The replicas' gradients are summed (the loss sums over the batch) and
    each adds 1/N of the regularizer, to the loss and to the kernel's
    gradient, so the sums are one device's (averaged, the data's part was
    1/N of one device's; summed without the division, the regularizer's N
    times). A mean added to the sum (tf.compat.v1.losses': a sum over its
    count) divides by N times the count in every replica, forward and
    gradient (averaged, the sum's part was 1/N of one device's), and the
    mean fetched alone is the replicas' sum (it was their mean: 1/N); a
    penalty added inside that mean is added once too (before, N times:
    0.10 apart in a sweep, silently). 5 Adam steps, every variable, the
    fetched loss and term, 1e-5."""
    rng = np.random.RandomState(4)
    ids = rng.randint(0, 20, size=(80, 2)).astype(np.int32)
    ys = rng.randn(80).astype(np.float32)
    (want, want_vars), (got, got_vars), plan = one_device_and_two_replicas(
        lambda: regularized_graph(keras_sum, mean), mode, ids, ys, ["loss", "part"])
    assert not plan.average_dense
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)
    for name, value in want_vars.items():
        np.testing.assert_allclose(got_vars[name], value, atol=1e-5, rtol=0, err_msg=name)


def _static_means(kind):
    """Losses for test_selected_means.check_tf1 over batches of a static
    size: a sum of squares plus tf.compat.v1.losses' mean (a sum over the
    size, a constant there), a sum times 1 / the size, times 1 / the rows
    counted at run time or over them, and that mean (with the rows
    counted, an accuracy over them too)."""
    def losses(pred, y):
        rows, extra = tf.cast(tf.shape(pred)[0], tf.float32), []
        if kind == "tf.compat.v1.losses":
            part = tf1.losses.absolute_difference(y, pred)
        elif kind == "times 1 / size":
            part = tf.reduce_sum(tf.abs(pred - y)) * (1.0 / int(pred.shape[0]))
        else:       # and an accuracy over the same count of rows
            part = tf.reduce_sum(tf.abs(pred - y)) * (1.0 / rows) if kind == "times 1 / rows" \
                else tf.reduce_sum(tf.abs(pred - y)) / rows
            extra = [tf.reduce_sum(tf.cast(tf.abs(pred - y) < 1.0, tf.float32)) / rows]
        return [tf.reduce_sum(tf.square(pred - y)) + 0.5 * part, part] + extra
    return losses


@pytest.mark.parametrize("kind,run", [("tf.compat.v1.losses", "allreduce"),
                                      ("times 1 / size", "ps"), ("times 1 / rows", "hybrid"),
                                      ("over rows", "allreduce")])
def test_a_mean_over_a_static_batch_size_added_to_a_sum_equals_one_device(kind, run):
    """Where the graph fixes the batch's size, a mean divides a sum by a
    constant (or multiplies it by its inverse): added to a sum over the
    batch, every replica's constant is N times (its inverse 1/N times) a
    replica's size, forward and in the gradient, and the gradients are
    summed; the mean fetched alone is the replicas' sum. A sum times 1 /
    the rows counted at run time takes N times the count so; an accuracy
    fetched beside, over the same count (the same tensor), keeps it as it
    is (before, N times it too: half one device's, silently). Before, averaged
    with a warning (the sum's part 1/N of one device's: 3.4 apart after 7
    steps in a sweep). Fetched values every step, every variable and
    slot, 1e-5."""
    from test_selected_means import check_tf1
    check_tf1(_static_means(kind), run, static="rows" not in kind)   # (rows: counted at run time)


def _rmse_beside(mean, loss):
    """Losses for test_selected_means.check_tf1: a loss (a mean, or a sum
    plus the mean of squares below), the mean of squares (tf.reduce_mean,
    or a sum over its count), its square root (an RMSE a script fetches),
    3 times it and the root of it plus 0.01."""
    def losses(pred, y):
        sq = tf.square(pred - y)
        part = tf.reduce_mean(sq) if mean == "Mean" else \
            tf.reduce_sum(sq) / tf.cast(tf.size(sq), tf.float32)
        trained = tf.reduce_mean(tf.abs(pred - y)) if loss == "a mean" else \
            tf.reduce_sum(tf.abs(pred - y)) + part
        return [trained, part, tf.sqrt(part), part * 3.0, tf.sqrt(part + 1e-2)]
    return losses


@pytest.mark.parametrize("mean", ["Mean", "sum over its count"])
@pytest.mark.parametrize("loss", ["a mean", "a sum plus it"])
def test_a_function_of_a_mean_fetched_beside_the_loss_equals_one_device(mean, loss):
    """An RMSE fetched beside the loss takes the job's mean, written as
    tf.reduce_mean or as a sum over its count (before, the latter was each
    replica's own: the replicas' mean of RMSEs, 0.17 apart). Where the loss
    adds the mean to a sum over the batch (widened: each replica's value a
    share of one device's), the function takes the shares' sum, the loss
    the share, and a fetch linear in it is the replicas' sum (before, the
    RMSE was sqrt(1/N) or sqrt(N) times one device's); a mean computed
    from it (`mean + 0.01`) reads the job's whole, so it is exchanged as
    any other (first written, summed again: sqrt(N) times). Every fetch every
    step, every variable and slot, 1e-5."""
    from test_selected_means import check_tf1
    check_tf1(_rmse_beside(mean, loss), "allreduce")


def test_a_keras3_loop_returning_an_rmse_of_a_keras_loss_equals_one_device():
    """A `pn.function` step returning tf.sqrt and tf.math.log of Keras 3's
    MeanSquaredError (a sum over its count) beside the loss it trains:
    both are of the job's mean every step (before, each replica's own,
    averaged: 0.086 and 0.40 apart in a sweep)."""
    import keras
    import parallax_ng as pn
    from models import local
    from test_tf2 import keras3_dense

    def step_of(model, optimizer):
        def train_step(x, y):
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                loss = tf.reduce_mean(tf.abs(pred - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            mse = keras.losses.MeanSquaredError()(y, pred)
            return {"loss": loss, "rmse": tf.sqrt(mse), "log": tf.math.log(mse)}
        return train_step
    keras.utils.set_random_seed(0)
    a, b = keras3_dense(), keras3_dense()
    b.set_weights(a.get_weights())
    step = pn.function(step_of(a, keras.optimizers.SGD(0.05)), local(2))
    ref = tf.function(step_of(b, keras.optimizers.SGD(0.05)))
    rng = np.random.RandomState(2)
    for _ in range(4):
        x, y = rng.randn(16, 5).astype(np.float32), rng.randn(16, 1).astype(np.float32)
        got, want = step(x, y), ref(x, y)
        for key in want:
            np.testing.assert_allclose(np.asarray(got[key]), want[key].numpy(), atol=1e-5,
                                       rtol=1e-6, err_msg=key)


def _functions_of_shifted_means(pred, y):
    sq = tf.square(pred - y)
    mean = tf.reduce_mean(sq)
    rows = tf.cast(tf.shape(sq)[0], tf.float32)
    return [tf.reduce_mean(tf.abs(pred - y)), tf.sqrt(mean + 1e-6), tf.sqrt(2.0 * mean),
            tf.math.log(tf.reduce_mean(tf.abs(pred - y)) * 0.5 + 1.0),
            tf.sqrt(tf.reduce_sum(sq) / rows + 1e-6), tf.exp(-mean)]


def test_a_function_of_a_mean_scaled_or_shifted_fetched_beside_the_loss_equals_one_device():
    """An RMSE with an epsilon under its root (`tf.sqrt(mean + 1e-6)`), of
    twice a mean, a log of a scaled and shifted mean, of a sum over the
    rows plus an epsilon, an exponential of a negated mean: each of the
    job's mean, every step (before, each replica's own, averaged: 0.23
    apart, silently)."""
    from test_selected_means import check_tf1
    check_tf1(_functions_of_shifted_means, "allreduce")


@pytest.mark.parametrize("over", ["1.0 / rows", "tf.math.reciprocal"])
def test_a_sum_times_one_over_the_rows_counted_equals_one_device(over):
    """`tf.reduce_sum(e) * (1.0 / rows)` (or times tf.math.reciprocal(rows))
    with the rows counted at run time is a mean over each replica's rows.
    Before, 1 / rows was read as a function of a sum first, so every
    replica took the job's rows and the loss was 1/N of one device's,
    silently (0.45 against 0.90)."""
    from test_selected_means import check_tf1

    def losses(pred, y):
        rows = tf.cast(tf.shape(pred)[0], tf.float32)
        inverse = 1.0 / rows if over == "1.0 / rows" else tf.math.reciprocal(rows)
        return [tf.reduce_sum(tf.abs(pred - y)) * inverse]
    check_tf1(losses, "allreduce")
