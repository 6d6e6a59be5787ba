"""transforms/job_rows.py: MoCo's queue of keys kept in a variable (each
step `queue.assign(tf.concat([keys, queue[:-n]], 0))`, the negatives of
the next step's contrastive loss) takes the job's keys in replica order,
so 2 replicas equal one device with the global batch: every variable (the
queue, the trained and the momentum encoder's weights) and the loss, after
5 steps within 1e-5, the last batch short (an odd count per replica), in
every run option; the count given as a constant; a Keras 3 `pn.function`
step; and jobs of 2 workers and a server, by all-gather and by sums on
the server (before: the replicas' queues were averaged, 1.4 apart after 4
steps). So do a memory bank written at the examples' ids and a ring
buffer written at places counted from the batch's row count (before: a
ring buffer's scatter was refused, its assign of a TensorScatterUpdate
failed with a shape error)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local, read_name, variable_names
from task_env import TASK_PATH

tf1 = tf.compat.v1
TOL, DEPTH = 1e-5, 12                  # DEPTH: the queue's rows
ROWS = (8, 8, 8, 8, 6)                 # each step's global batch: the last one short


def data():
    """Features, a second view of them, and each example's id."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(sum(ROWS), 5)).astype(np.float32)
    return x, x + 0.1 * rng.normal(size=x.shape).astype(np.float32), \
        rng.permutation(sum(ROWS)).astype(np.int64)


def batches(part=None, parts=1):
    """Each step's feed: the global batch's, or replica `part`'s half."""
    x, x2, ids, start = *data(), 0
    for rows in ROWS:
        a, b = (start, start + rows) if part is None else \
            (start + part * rows // parts, start + (part + 1) * rows // parts)
        yield {"x:0": x[a:b], "x2:0": x2[a:b], "ids:0": ids[a:b]}
        start += rows


def graph_of(kind="moco", count="n"):
    """`moco_graph`, `memory_graph` ("bank", "reference bank", ...) or
    `ring_graph` ("ring", "sliced ring")."""
    if kind.endswith("ring"):
        return ring_graph(kind.split()[0])
    return memory_graph(kind.split()[0]) if kind.endswith("bank") else moco_graph(count)


def ring_graph(write="ring"):
    """A ring buffer of the batch's rows (named bank), read by the next
    steps' loss: written at `(ptr + tf.range(n)) % 20` by scatter_update
    (ring) or as a slice `bank[ptr:ptr + n]` of 24 rows (sliced), the
    pointer then moved by n."""
    size = 24 if write == "sliced" else 20
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], "x")
        w = tf1.get_variable("w", initializer=(np.arange(15).reshape(5, 3) / 15.0).astype(
            np.float32))
        bank = tf1.get_variable("bank", initializer=np.zeros((size, 5), np.float32),
                                trainable=False)
        ptr = tf1.get_variable("ptr", initializer=0, trainable=False)
        q = tf.nn.l2_normalize(tf.matmul(x, w), 1)
        loss = tf.add(tf.reduce_mean(tf.square(q - 0.5)),
                      tf.reduce_mean(tf.tanh(tf.matmul(bank, w))), name="loss")
        train = tf1.train.AdamOptimizer(0.1).minimize(loss)
        with tf.control_dependencies([train]):
            n = tf.shape(x)[0]
            write = bank[ptr:ptr + n].assign(x) if write == "sliced" else \
                tf1.scatter_update(bank, (ptr + tf.range(n)) % size, x)
            with tf.control_dependencies([write]):
                moved = ptr.assign((ptr + n) % size)
        tf.group(train, write, moved, name="step")
        tf1.global_variables_initializer()
    return g


def memory_graph(write="bank"):
    """Instance discrimination: each example's embedding scored against a
    memory bank of every example's (a softmax over the data set), then its
    row of the bank moved towards the embedding at its id, written by
    `write`: bank (tf.compat.v1.scatter_update), reference (the same into
    a reference variable), nd (scatter_nd_update at [n, 1] ids), assigned
    (an assign of tf.tensor_scatter_nd_update of the bank)."""
    reference = write == "reference"
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], "x")
        ids = tf1.placeholder(tf.int64, [None], "ids")
        w = tf1.get_variable("w", initializer=(np.arange(15).reshape(5, 3) / 15.0).astype(
            np.float32))
        bank = tf1.get_variable("bank", initializer=np.tile(np.eye(3, dtype=np.float32), (
            sum(ROWS) // 3 + 1, 1))[:sum(ROWS)], trainable=False, use_resource=not reference)
        q = tf.nn.l2_normalize(tf.matmul(x, w), 1)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=ids, logits=tf.matmul(q, bank, transpose_b=True) / 0.5), name="loss")
        train = tf1.train.AdamOptimizer(0.1).minimize(loss)
        with tf.control_dependencies([train]):
            moved = tf.nn.l2_normalize(0.5 * tf.gather(bank, ids) + 0.5 * tf.stop_gradient(q), 1)
            column = ids[:, None]
            write = {"nd": lambda: tf1.scatter_nd_update(bank, column, moved),
                     "assigned": lambda: bank.assign(tf.tensor_scatter_nd_update(
                         bank, column, moved))}.get(write, lambda: tf1.scatter_update(
                             bank, ids, moved))()
        tf.group(train, write, name="step")
        tf1.global_variables_initializer()
    return g


def moco_graph(count="n"):
    """A query encoder trained on InfoNCE against its key (a momentum
    encoder's) and a queue of earlier keys; after the update the batch's
    keys go in front of the queue. `count`: how the script drops the
    oldest rows (n: the keys' count; a number: a constant)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], "x")
        x2 = tf1.placeholder(tf.float32, [None, 5], "x2")
        init = (np.arange(15).reshape(5, 3) / 15.0).astype(np.float32)
        w = tf1.get_variable("w", initializer=init)
        wk = tf1.get_variable("wk", initializer=init, trainable=False)
        queue = tf1.get_variable("queue", initializer=np.eye(DEPTH, 3, dtype=np.float32),
                                 trainable=False)
        q = tf.nn.l2_normalize(tf.matmul(x, w), 1)
        keys = tf.stop_gradient(tf.nn.l2_normalize(tf.matmul(x2, wk), 1))
        logits = tf.concat([tf.reduce_sum(q * keys, 1, keepdims=True),
                            tf.matmul(q, queue, transpose_b=True)], 1) / 0.2
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.zeros([tf.shape(x)[0]], tf.int32), logits=logits), name="loss")
        train = tf1.train.MomentumOptimizer(0.5, 0.9).minimize(loss)
        with tf.control_dependencies([train]):
            n = tf.shape(keys)[0] if count == "n" else int(count)
            enqueue = queue.assign(tf.concat([keys, queue[:-n]], 0))
            momentum = wk.assign(0.9 * wk + 0.1 * w)
        tf.group(train, enqueue, momentum, name="step")
        tf1.global_variables_initializer()
    return g


def feed(g, batch):
    return {k: v for k, v in batch.items() if k[:-2] in {op.name for op in g.get_operations()}}


def one_device(start, kind="moco", count="n", steps=len(ROWS)):
    """{variable: value} and the losses after `steps` steps on one device."""
    g = graph_of(kind, count)
    names = variable_names(g)
    with tf1.Session(graph=g) as sess:
        load_values(sess, g, start)
        losses = [sess.run(["step", "loss:0"], feed(g, batch))[1]
                  for batch in list(batches())[:steps]]
        return dict(zip(names, sess.run([read_name(k, g) for k in names]))), losses


def check(got, losses, want, want_losses):
    assert {"w", "wk", "queue", "w/Momentum"} <= set(want) or {"w", "bank", "w/Adam"} <= set(
        want)
    np.testing.assert_allclose(losses, want_losses, atol=TOL, rtol=0)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, atol=TOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("kind,run_option,count", [
    ("moco", "hybrid", "n"), ("moco", "allreduce", "n"), ("moco", "ps", "n"),
    ("moco", "hybrid", 8), ("bank", "hybrid", None), ("bank", "allreduce", None),
    ("bank", "ps", None), ("reference bank", "hybrid", None), ("nd bank", "allreduce", None),
    ("assigned bank", "hybrid", None), ("assigned bank", "ps", None), ("ring", "hybrid", None),
    ("ring", "ps", None), ("sliced ring", "allreduce", None), ("sliced ring", "hybrid", None)])
def test_a_queue_or_a_memory_bank_equals_one_device(kind, run_option, count, recwarn):
    g = graph_of(kind, count)
    names = variable_names(g)
    reads = [read_name(k, g) for k in names]
    rows = list(batches()) if count != 8 else list(batches())[:4]   # (8 rows each)
    with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
        runner.run([v.initializer for v in g.get_collection("variables")])
        start = dict(zip(names, runner.run(reads)))
        losses = [runner.run(["step", "loss:0"], feed(g, batch))[1] for batch in rows]
        got = dict(zip(names, runner.run(reads)))
        made = {n.name for n in runner.graph.as_graph_def().node}
    want, want_losses = one_device(start, kind, count, len(rows))
    check(got, losses, want, want_losses)
    assert any(n.startswith("parallax/job_rows/") for n in made)
    assert not [w for w in recwarn if "mix the batch" in str(w.message)]


def test_a_keras_3_step_with_a_queue_equals_one_device():
    """A TF2 step (Keras 3 layer, tf.Variable queue) traced by pn.function."""
    import keras

    def make():
        keras.utils.set_random_seed(1)
        dense = keras.layers.Dense(3, use_bias=False)
        dense.build((None, 5))
        queue = tf.Variable(np.eye(DEPTH, 3, dtype=np.float32), trainable=False)
        optimizer = keras.optimizers.SGD(0.3)

        def step(x, x2):
            with tf.GradientTape() as tape:
                q = tf.nn.l2_normalize(dense(x), 1)
                k = tf.stop_gradient(tf.nn.l2_normalize(dense(x2), 1))
                logits = tf.concat([tf.reduce_sum(q * k, 1, keepdims=True),
                                    tf.matmul(q, queue, transpose_b=True)], 1) / 0.2
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    tf.zeros([tf.shape(x)[0]], tf.int32), logits))
            optimizer.apply_gradients(zip(tape.gradient(loss, dense.trainable_variables),
                                          dense.trainable_variables))
            queue.assign(tf.concat([k, queue[:-tf.shape(k)[0]]], 0))
            return loss
        return dense, queue, step
    (dense, queue, fn), (dense1, queue1, fn1) = make(), make()
    step, ref = pn.function(fn, local(2)), tf.function(fn1)
    for batch in batches():
        a, b = batch["x:0"], batch["x2:0"]
        np.testing.assert_allclose(step(a, b), ref(a, b).numpy(), atol=TOL, rtol=0)
    step.sync()
    np.testing.assert_allclose(queue.numpy(), queue1.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(dense.kernel.numpy(), dense1.kernel.numpy(), atol=TOL, rtol=0)


JOB = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import parallax_ng as pn
from models import read_name, variable_names
from test_job_rows import batches, feed, graph_of

g = graph_of({kind!r})
names = variable_names(g)
reads = [read_name(k, g) for k in names]
runner = pn.get_runner(g, None, {config!r})
runner.run([v.initializer for v in g.get_collection("variables")])
w = runner.plan.worker
start = dict(zip(names, runner.run(reads)))
losses = [runner.run(["step", "loss:0"], feed(g, batch))[1] for batch in batches(w, 2)]
got = dict(zip(names, runner.run(reads)))
np.savez({out!r} + f".{{w}}.npz", losses=np.array(losses), **got,
         **{{"start/" + k: v for k, v in start.items()}})
print("servers", runner.plan.reduces_on_servers, flush=True)
"""


@pytest.mark.parametrize("kind", ["moco", "bank", "ring"])
@pytest.mark.parametrize("config,servers", [({"dense_method": "bfb"}, True),
                                            ({"run_option": "ps"}, True),
                                            ({"run_option": "allreduce"}, False)])
def test_a_job_of_two_workers_writes_the_jobs_rows(kind, config, servers, tmp_path):
    """Each worker fed its half of each batch (the last one 3 rows each):
    by sums on the server (fusion buffers, or every variable on the server:
    no collective op in the step) and by all-gather; both workers' variables
    and losses equal one device's (a worker's loss is its half's mean)."""
    from test_cluster import resources
    script, out = tmp_path / "job.py", str(tmp_path / "out")
    script.write_text(JOB.format(tests=os.path.dirname(os.path.abspath(__file__)), out=out,
                                 config=config, kind=kind))
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
         resources(tmp_path, 2, 1, servers=1)], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"servers {servers}") == 2, done.stdout[-2000:]
    saved = [dict(np.load(f"{out}.{w}.npz")) for w in (0, 1)]
    start = {k.split("/", 1)[1]: v for k, v in saved[0].items() if k.startswith("start/")}
    want, want_losses = one_device(start, kind)
    for w, got in enumerate(saved):
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, atol=TOL, rtol=0,
                                       err_msg=f"worker {w}: {name}")
    np.testing.assert_allclose(np.mean([s["losses"] for s in saved], 0), want_losses,
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("places", ["fixed", "ring in a branch"])
def test_rows_written_at_ids_that_are_not_the_examples_are_refused_by_name(places):
    """A scatter of the batch's first two rows at fixed ids (one device
    writes other rows there), or a ring buffer's write in a tf.cond's
    branch: no exchange makes it one device's, and the build says what it
    combines."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], "x")
        w = tf1.get_variable("w", initializer=np.ones((3, 3), np.float32))
        bank = tf1.get_variable("bank", initializer=np.zeros((16, 3), np.float32),
                                trainable=False)
        h = tf.matmul(x, w)
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(h))
        with tf.control_dependencies([train]):
            if places == "fixed":
                tf1.scatter_update(bank, [0, 1], tf.stop_gradient(h[:2]))
            else:
                ptr = tf1.get_variable("ptr", initializer=0, trainable=False)
                tf.cond(tf1.placeholder_with_default(True, [], "flag"),
                        lambda: tf1.scatter_update(bank, (ptr + tf.range(tf.shape(x)[0])) % 16,
                                                   x).op, tf.no_op)
    with pytest.raises(pn.errors.GraphError, match=r"writes variable 'bank' .*ScatterNdAdd of "
                                                   r"the batch's rows at ids of its examples"):
        pn.get_runner(g, local(2)).close()
