"""Time-major feeds (graph/time_major.py): placeholders fed `[time, batch,
...]`, found where a recurrence reads their first axis step by step
(dynamic_rnn(time_major=True), static_rnn over tf.unstack,
bidirectional_dynamic_rnn) or named by config `batch_feeds: {NAME: 1}`,
are split over the replicas along their batch axis, through a batch-major
twin in the front end's copy. 2 replicas against one device fed the same
sequences, Adam, 4 steps: every variable and slot, and the fetched loss
and per-step rows, 1e-5. Before, such feeds were split along time: each
replica ran half of every sequence from a zero state (0.37 apart after 4
steps, with a line that did not say why)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local
from parallax_ng.errors import ConfigError
from parallax_ng.graph import time_major
from task_env import TASK_PATH

tf1 = tf.compat.v1
TOL = 1e-5
V, E, H, T, B = 10, 6, 8, 6, 8
RNG = np.random.default_rng(0)
IDS, TARGETS = RNG.integers(2, V, (T, 64)), RNG.integers(2, V, (T, 64))
LENGTHS = RNG.integers(1, T + 1, 64)
# the cells' kernels from seeded initializers: tf_keras' own draw from a state
# the process's earlier tests move, and from some starts Adam (0.05) carries
# an element whose gradient nearly cancels, and with it float32 rounding,
# past 1e-5 in 4 steps (up to 1.4e-5 seen; SGD from the same starts: 6e-7)
SEEDED = tf1.glorot_uniform_initializer
POOLED_X, POOLED_Y = RNG.normal(size=(5, 64, 3)).astype(np.float32), RNG.normal(size=(64, 1))


def seq_graph(kind: str):
    """ids and targets [T or None, None] -> embedding -> GRU by `kind` ->
    logits; the loss a mean over the real steps (a mask from the lengths,
    fed batch-major). `kind` "batch-major" and "map_fn" feed [batch, time]
    (the mask as long as the ids' second dimension, which a map_fn over
    the rows and this size do not make time-major)."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        major = kind not in ("batch-major", "map_fn")
        shape = [T, None] if kind == "static" else [None, None]
        ids = tf1.placeholder(tf.int32, shape, "ids")
        targets = tf1.placeholder(tf.int32, shape, "targets")
        lengths = tf1.placeholder(tf.int32, [None], "lengths")
        emb = tf1.get_variable("emb", [V, E], initializer=tf1.random_uniform_initializer(-1, 1))
        x = tf.nn.embedding_lookup(emb, ids)
        cell = tf1.nn.rnn_cell.GRUCell(H, kernel_initializer=SEEDED(2))
        if kind == "static":
            out = tf.stack(tf1.nn.static_rnn(cell, tf.unstack(x), dtype=tf.float32)[0])
        elif kind == "bidirectional":
            (fw, bw), _ = tf1.nn.bidirectional_dynamic_rnn(
                cell, tf1.nn.rnn_cell.GRUCell(H, kernel_initializer=SEEDED(3)), x, lengths,
                dtype=tf.float32, time_major=True)
            out = tf.concat([fw, bw], -1)
        else:
            if kind == "map_fn":
                x = tf.map_fn(lambda row: row * 2.0, x)      # over the batch's rows
            out, _ = tf1.nn.dynamic_rnn(cell, x, lengths, dtype=tf.float32, time_major=major)
        w = tf1.get_variable("w", [out.shape[-1], V])
        logits = tf.tensordot(out, w, 1)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
        mask = tf.sequence_mask(lengths, T if major else tf.shape(ids)[1], dtype=tf.float32)
        mask = tf.transpose(mask) if major else mask
        loss = tf.reduce_sum(xent * mask) / tf.reduce_sum(mask)
        step = tf.reduce_sum(x, -1, name="per_step")          # [T, B] (or [B, T])
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        init = tf1.global_variables_initializer()

    def feeds(s, rows):
        cut = slice(s * rows, (s + 1) * rows)
        a, b = IDS[:, cut], TARGETS[:, cut]
        return {ids: a if major else a.T, targets: b if major else b.T, lengths: LENGTHS[cut]}
    return g, dict(train=train, loss=loss, init=init, feeds=feeds, step=step, logits=logits)


def variables(g):
    return g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)


def compare(build, config=None, steps=4):
    """Every variable (and slot) and the fetched loss, per-step rows and
    logits of 2 replicas against one device fed the same global batches."""
    g, h = build()
    fetched = ["train", "loss", "step", "logits"]
    with pn.get_runner(g, local(2), config) as runner:
        runner.run(h["init"])
        start = dict(zip([v.op.name for v in variables(g)], runner.run(variables(g))))
        got = [runner.run([h[k] for k in fetched], h["feeds"](s, B))[1:]
               for s in range(steps)]
        trained = runner.run(variables(g))
    g1, h1 = build()
    with tf1.Session(graph=g1) as sess:
        sess.run(h1["init"])
        load_values(sess, g1, start)
        want = [sess.run([h1[k] for k in fetched], h1["feeds"](s, B))[1:]
                for s in range(steps)]
        for v, value in zip(variables(g1), trained):
            np.testing.assert_allclose(value, sess.run(v), atol=TOL, rtol=0, err_msg=v.op.name)
    for (loss, *rows), (loss1, *rows1) in zip(got, want):
        assert abs(loss - loss1) < TOL
        for a, b in zip(rows, rows1):       # joined along the batch's axis
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind,mode", [("dynamic", "hybrid"), ("dynamic", "allreduce"),
                                       ("dynamic", "ps"), ("static", "hybrid"),
                                       ("bidirectional", "hybrid")])
def test_time_major_feeds_train_as_one_device(kind, mode, capsys):
    compare(lambda: seq_graph(kind), {"run_option": mode})
    said = capsys.readouterr().err
    assert "placeholders 'ids', 'targets' are fed time-major" in said
    # the lengths meet the batch through the transposed mask; the logits' rows
    # (tf.tensordot over [time, batch, units]) are read, and so is the loss's form
    assert "'lengths'" not in said and "does not show" not in said, said


def test_batch_major_feeds_and_a_map_fn_over_the_batch_are_not_taken(capsys):
    for kind in ("batch-major", "map_fn"):
        assert time_major.axes(seq_graph(kind)[0], {}) == {}
    assert "time-major" not in capsys.readouterr().err
    compare(lambda: seq_graph("map_fn"))


def ctc_graph():
    """Features fed [time, batch, 5] into an LSTM run time-major, logits
    reshaped to [time, batch, classes] from the features' shape, CTC against
    labels in a sparse placeholder and lengths per sequence (batch-major)."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        features = tf1.placeholder(tf.float32, [None, None, 5], "features")
        labels = tf1.sparse_placeholder(tf.int32, name="labels")
        lengths = tf1.placeholder(tf.int32, [None], "lengths")
        out, _ = tf1.nn.dynamic_rnn(tf1.nn.rnn_cell.LSTMCell(H, initializer=SEEDED(2)), features,
                                    lengths, dtype=tf.float32, time_major=True)
        w = tf1.get_variable("w", [H, 5])
        shape = tf.shape(features)
        logits = tf.reshape(tf.matmul(tf.reshape(out, [-1, H]), w), [shape[0], shape[1], 5])
        per_sequence = tf1.nn.ctc_loss(labels, logits, lengths)
        loss = tf.reduce_mean(per_sequence)
        train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()

    def feeds(s, rows):
        cut = range(s * rows, (s + 1) * rows)
        rows_of = [CTC_LABELS[i] for i in cut]
        indices = [(r, k) for r, row in enumerate(rows_of) for k in range(len(row))]
        sparse = tf1.SparseTensorValue(np.array(indices, np.int64),
                                       np.array([v for row in rows_of for v in row], np.int32),
                                       np.array([rows, 2], np.int64))
        return {features: CTC_FEATURES[:, cut.start:cut.stop], labels: sparse,
                lengths: CTC_LENGTHS[cut.start:cut.stop]}
    return g, dict(train=train, loss=loss, init=init, feeds=feeds, step=per_sequence,
                   logits=logits)


CTC_FEATURES = RNG.normal(size=(T, 64, 5)).astype(np.float32)
CTC_LENGTHS = RNG.integers(4, T + 1, 64)
CTC_LABELS = [list(RNG.integers(1, 4, RNG.integers(1, 3))) for _ in range(64)]


def test_a_time_major_ctc_script_beside_sparse_labels(capsys):
    """The features are time-major, the sparse labels' indices (rank 2, an
    open second dimension) are not: split by their rows, as before."""
    compare(ctc_graph, {"run_option": "hybrid"})
    assert "placeholder 'features' is fed time-major" in capsys.readouterr().err


def pooled_graph():
    """x fed [time, batch, 3], averaged over time, then a dense layer: no
    recurrence shows the layout, so config `batch_feeds: {x: 1}` names it."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, None, 3], "x")
        y = tf1.placeholder(tf.float32, [None, 1], "y")
        w = tf1.get_variable("w", initializer=np.full((3, 1), 0.1, np.float32))
        pred = tf.matmul(tf.reduce_mean(x, 0), w)
        loss = tf.reduce_mean(tf.square(pred - y))
        step = tf.identity(x[:, :, 0], "per_step")
        train = tf1.train.AdamOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()

    def feeds(s, rows):
        cut = slice(s * rows, (s + 1) * rows)
        return {x: POOLED_X[:, cut], y: POOLED_Y[cut]}
    return g, dict(train=train, loss=loss, init=init, feeds=feeds, step=step, logits=pred)


def test_config_names_a_time_major_feed():
    assert time_major.axes(pooled_graph()[0], {}) == {}
    compare(pooled_graph, {"batch_feeds": {"x": 1}})


def test_config_keeps_a_feed_batch_major_and_refuses_a_bad_axis(capsys):
    g = seq_graph("dynamic")[0]
    assert time_major.axes(g, {"targets": True}) == {"ids": 1}
    assert "placeholder 'ids' is fed time-major (its batch" in capsys.readouterr().err
    assert time_major.axes(g, {"targets": 1, "ids": False}) == {"targets": 1}
    for bad in (0, -1, 1.5, "time"):
        with pytest.raises(ConfigError, match=r"batch_feeds\.x.*the axis that holds the batch"):
            pn.get_runner(pooled_graph()[0], local(2), {"batch_feeds": {"x": bad}})
    with pytest.raises(ConfigError, match=r"batch_feeds\.x' is 3, but the placeholder has 3"):
        pn.get_runner(pooled_graph()[0], local(2), {"batch_feeds": {"x": 3}})
    with pytest.raises(ConfigError, match=r"batch_feeds\.z' gives an axis, but the graph has "
                                          "no placeholder 'z'"):
        pn.get_runner(pooled_graph()[0], local(2), {"batch_feeds": {"z": 1}})


def test_layer_by_layer_execution_refuses_a_time_major_feed_by_name():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, None, 3], "x")
        h = tf.reduce_mean(x, 0)
        for k in range(2):
            with tf1.variable_scope(f"stack/layer_{k}"):
                h = tf.tanh(tf.matmul(h, tf1.get_variable("w", [3, 3])))
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(h), name="train")
        init = tf1.global_variables_initializer()
    config = {"l2l": {"layers": r"stack/layer_(\d+)/"}, "batch_feeds": {"x": 1}}
    with pn.get_runner(g, local(1), config) as runner:
        runner.run(init)
        with pytest.raises(pn.FetchError, match="does not split placeholders fed time-major "
                                                r"\('x:0'"):
            runner.run("train", {x: np.ones([5, 4, 3], np.float32)})


def test_a_job_of_two_workers_each_fed_half_of_the_batch_equals_one_device(tmp_path):
    from test_cluster import resources
    script, out = tmp_path / "job.py", str(tmp_path / "out")
    script.write_text(JOB.format(tests=os.path.dirname(os.path.abspath(__file__)), out=out))
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
         resources(tmp_path, 2, 1, servers=1)], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "placeholders 'ids', 'targets' are fed time-major" in done.stderr
    g, h = seq_graph("dynamic")
    with tf1.Session(graph=g) as sess:
        sess.run(h["init"])     # then the job's: tf_keras's GRU draws anew in each graph
        load_values(sess, g, dict(np.load(f"{out}.start.npz")))
        for s in range(4):
            sess.run(h["train"], h["feeds"](s, B))
        want = dict(zip([v.op.name for v in variables(g)], sess.run(variables(g))))
    for w in (0, 1):
        got = dict(np.load(f"{out}.{w}.npz"))
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=TOL, rtol=0,
                                       err_msg=f"worker {w}: {name}")


JOB = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
import parallax_ng as pn
from test_time_major import B, seq_graph, variables
g, h = seq_graph("dynamic")
runner = pn.get_runner(g, None, None)
runner.run(h["init"])
w, half = runner.plan.worker, B // 2
if w == 0:
    np.savez({out!r} + ".start.npz",
             **dict(zip([v.op.name for v in variables(g)], runner.run(variables(g)))))
for s in range(4):
    part = {{k: v[..., half * w:half * (w + 1)] for k, v in h["feeds"](s, B).items()}}
    runner.run(h["train"], part)
np.savez({out!r} + f".{{w}}.npz",
         **dict(zip([v.op.name for v in variables(g)], runner.run(variables(g)))))
"""
