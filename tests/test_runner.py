import os

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng.errors import FetchError, ResourceError

tf1 = tf.compat.v1


def feed_graph():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        scale = tf1.placeholder(tf.float32, [], name="scale")
        w = tf1.get_variable("w", initializer=np.array([[1.0], [2.0]], np.float32))
        pred = tf.identity(tf.matmul(x, w) * scale, name="pred")
        loss = tf.reduce_mean(tf.square(pred), name="loss")
        tf.identity(tf.shape(x)[0], name="rows")          # a count of the batch's rows
        tf1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g


def test_feeds_split_by_batch_and_fetches_combine():
    g = feed_graph()
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    with pn.get_runner(g, local(2)) as runner:
        runner.run("init")
        pred, loss, w = runner.run(["pred:0", "loss:0", "w/Read/ReadVariableOp:0"],
                                   {"x:0": x, "scale:0": 2.0})
        per = runner.run("pred:0", {"x:0": x, "scale:0": 2.0}, per_replica=True)
        nested = runner.run({"a": ["loss:0"], "b": ("w/Read/ReadVariableOp:0",)},
                            {"x:0": x, "scale:0": 1.0})
        assert runner.run("rows:0", {"x:0": x, "scale:0": 1.0}) == 4   # the replicas' sum
    want = x @ np.array([[1.0], [2.0]]) * 2
    np.testing.assert_allclose(pred, want)                 # concatenated in order
    np.testing.assert_allclose(loss, np.mean(want ** 2), rtol=1e-6)
    assert len(per) == 2 and per[0].shape == (2, 1)
    assert set(nested) == {"a", "b"} and isinstance(nested["b"], tuple)


def test_training_with_feeds_equals_one_device():
    g = feed_graph()
    x = np.random.RandomState(0).randn(6, 2).astype(np.float32)
    with pn.get_runner(g, local(3)) as runner:
        runner.run("init")
        for _ in range(5):
            runner.run("train", {"x:0": x, "scale:0": 1.5})
        got = runner.run("w/Read/ReadVariableOp:0")
    with tf1.Session(graph=feed_graph()) as sess:
        sess.run("init")
        for _ in range(5):
            sess.run("train", {"x:0": x, "scale:0": 1.5})
        want = sess.run("w/Read/ReadVariableOp:0")
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_fetch_errors_name_the_problem():
    g = feed_graph()
    with pn.get_runner(g, local(2)) as runner:
        with pytest.raises(FetchError, match=r"'los:0' is not in the training graph; "
                                             r"did you mean \['loss:0'"):
            runner.run("los:0")
        with pytest.raises(FetchError, match=r"did you mean \['train'"):   # an op: no value
            runner.run("trian")
        runner.run("init")
        with pytest.raises(FetchError) as e:      # every suggestion can be fetched
            runner.run("prd")
        for suggestion in eval(str(e.value).split("did you mean ")[1].rstrip("?")):
            runner.run(suggestion, {"x:0": np.zeros([2, 2], np.float32), "scale:0": 1.0})
        other = tf.Graph()
        with other.as_default():
            foreign = tf.constant(1.0)
        with pytest.raises(FetchError, match="another graph"):
            runner.run(foreign)
        with pytest.raises(FetchError, match="not a tensor"):
            runner.run("loss:7")
        with pytest.raises(FetchError, match="split evenly over 2"):    # a run that trains
            runner.run("train", {"x:0": np.zeros([3, 2], np.float32), "scale:0": 1.0})
        with pytest.raises(FetchError, match="cannot fetch"):
            runner.run(3.5)


def test_fetch_reduction_override():
    g = feed_graph()
    x = np.ones([4, 2], np.float32)
    with pn.get_runner(g, local(2), {"fetch_reduction": {"loss:0": "sum"}}) as runner:
        runner.run("init")
        loss = runner.run("loss:0", {"x:0": x, "scale:0": 1.0})
    assert loss == pytest.approx(2 * 9.0)


def test_meta_graph_input_and_one_shot_iterator(tmp_path):
    g, h = embedding_regression(4, "adam", one_shot=True)
    path = str(tmp_path / "m.meta")
    with g.as_default():
        tf1.train.export_meta_graph(filename=path)
    with pn.get_runner(path, local(2)) as runner:
        runner.run(h["init"].name)
        losses = [runner.run([h["train"].name, "loss:0"])[1] for _ in range(30)]
    assert losses[-1] < losses[0]


def test_multi_host_resources_need_the_cluster_launcher():
    g = feed_graph()
    res = {"hosts": [{"devices": ["cpu:0"]}, {"address": "127.0.0.2", "devices": ["cpu:0"]}]}
    with pytest.raises(ResourceError, match="2 hosts"):
        pn.get_runner(g, res)


def test_checkpoint_round_trip_restores_every_replica(tmp_path):
    g, h = embedding_regression(4, "adam")
    with g.as_default():
        saver = tf1.train.Saver()
    names = ["emb", "dense/w", "dense/w/Adam", "global_step"]
    reads = [n + "/Read/ReadVariableOp:0" for n in names]
    with pn.get_runner(g, local(2), {"run_option": "hybrid"}) as runner:
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(3):
            runner.run(h["train"])
        path = runner.save(saver, str(tmp_path / "ckpt"))
        saved = runner.run(reads)
        for _ in range(3):
            runner.run(h["train"])
        runner.restore(saver, path)
        restored = runner.run(reads, per_replica=True)
    for want, copies in zip(saved, restored):
        for got in copies:
            np.testing.assert_array_equal(got, want)
    # the checkpoint is a plain single-device checkpoint
    with tf1.Session(graph=g) as sess:
        saver.restore(sess, path)
        np.testing.assert_array_equal(sess.run(reads[1]), saved[1])


def test_a_saver_s_global_step_state_file_and_max_to_keep_as_on_one_device(tmp_path):
    """`runner.save(saver, path, global_step=...)` takes Saver.save's
    arguments (it refused `global_step`): the prefix `path-<step>`, the
    state file `tf.train.latest_checkpoint` reads (a ported script's resume
    found none and started afresh), `max_to_keep` and the meta graph of the
    single-device graph, which a one-device script imports and restores."""
    g, h = embedding_regression(4, "adam")
    with g.as_default():
        saver = tf1.train.Saver(max_to_keep=2)
        step = tf1.train.get_global_step()
    with pn.get_runner(g, local(2), {"run_option": "hybrid"}) as runner:
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(3):
            runner.run(h["train"])
            path = runner.save(saver, str(tmp_path / "model"), global_step=step)
        saved = runner.run("dense/w/Read/ReadVariableOp:0")
    assert path == str(tmp_path / "model-3") == tf1.train.latest_checkpoint(str(tmp_path))
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".index")) == [
        "model-2.index", "model-3.index"]
    with tf.Graph().as_default() as one, tf1.Session(graph=one) as sess:
        tf1.train.import_meta_graph(path + ".meta").restore(sess, path)
        np.testing.assert_array_equal(sess.run("dense/w/Read/ReadVariableOp:0"), saved)


def test_ops_made_after_get_runner_run_in_every_replica():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        w = tf1.get_variable("w", [2, 1], initializer=tf1.random_normal_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    runner = pn.get_runner(g, local(2))
    with g.as_default():
        init = tf1.global_variables_initializer()     # made after get_runner
        doubled = loss * 2.0                           # replica-dependent
    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    with runner:
        runner.run(init)
        copies = runner.run(w, per_replica=True)
        np.testing.assert_array_equal(copies[0], copies[1])
        runner.run(train, {x: data})
        got_loss, got_doubled = runner.run([loss, doubled], {x: data})
        assert got_doubled == pytest.approx(2 * got_loss)
        with g.as_default():
            late_var = tf1.get_variable("late", [1])
        with pytest.raises(FetchError, match="created after get_runner"):
            runner.run(late_var.initializer)


def test_first_training_step_measures_sparsity():
    g, h = embedding_regression(4, "adagrad")
    with pn.get_runner(g, local(2), {"run_option": "hybrid"}) as runner:
        before = runner.plan.variables["emb"].info
        assert before.alpha_source == "estimate"
        runner.run([h["init"], h["iterator_init"]])
        assert runner.plan.variables["emb"].info.alpha_source == "estimate"  # init: no step
        runner.run(h["train"])
        after = runner.plan.variables["emb"].info
    # replica 0 looked up 4 examples x 3 ids out of 40 rows: at most 12 distinct rows
    assert after.alpha_source == "measured" and 0 < after.alpha <= 12 / 40
    assert "measured" not in runner.plan.variables["dense/w"].info.alpha_source


def fixed_batch_graph(rows):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [rows, 2], name="x")
        w = tf1.get_variable("w", initializer=np.array([[1.0], [2.0]], np.float32))
        pred = tf.identity(tf.matmul(x, w), name="pred")
        tf1.train.GradientDescentOptimizer(0.01).minimize(tf.reduce_mean(tf.square(pred)),
                                                         name="train")
        tf1.global_variables_initializer()
    return g


def test_a_fixed_batch_fed_whole_warns_once_naming_the_placeholder():
    x = np.ones([4, 2], np.float32)
    with pn.get_runner(fixed_batch_graph(4), local(2)) as runner:
        runner.run("init")
        with pytest.warns(UserWarning, match="placeholder 'x:0' has a fixed batch dimension "
                                             "of 4.*each of the 2 replicas.*feed 8 rows"):
            per = runner.run("pred:0", {"x:0": x}, per_replica=True)
        assert [p.shape for p in per] == [(4, 1), (4, 1)]
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            runner.run("train", {"x:0": x})     # once only
    with pn.get_runner(fixed_batch_graph(4), local(2), {"batch_feeds": {"x": False}}) as runner:
        runner.run("init")
        with warnings.catch_warnings():       # whole on purpose: said by the config
            warnings.simplefilter("error")
            per = runner.run("pred:0", {"x:0": x}, per_replica=True)
        assert [p.shape for p in per] == [(4, 1), (4, 1)]


def test_a_time_major_placeholder_fed_whole_is_told_to_name_its_batch_axis():
    """A placeholder [time, None, features] (time-major data) no recurrence
    reads: its first dimension is fixed and its feed goes whole to every
    replica; the warning names config `batch_feeds: {x: 1}`, which splits
    the feed along axis 1 (tests/test_time_major.py trains with it)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [3, None, 2], name="x")
        w = tf1.get_variable("w", initializer=np.ones([2, 1], np.float32))
        loss = tf.reduce_mean(tf.square(tf.einsum("tbd,de->tbe", x, w)))
        tf1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    with pn.get_runner(g, local(2)) as runner:
        runner.run(init)
        with pytest.warns(UserWarning, match="fixed batch dimension of 3.*If its axis 1 is the "
                                             "batch \\(time-major data\\), set config "
                                             "`batch_feeds: {x: 1}`"):
            runner.run("train", {"x:0": np.ones([3, 4, 2], np.float32)})
    with pn.get_runner(g, local(2), {"batch_feeds": {"x": 1}}) as runner:
        runner.run(init)
        parts = runner.run("x:0", {"x:0": np.arange(24, dtype=np.float32).reshape(3, 4, 2)},
                           per_replica=True)
        assert [p.shape for p in parts] == [(3, 2, 2), (3, 2, 2)]
        np.testing.assert_array_equal(np.concatenate(parts, 1).ravel(), np.arange(24))


def test_n_times_a_fixed_batch_is_split_and_equals_one_device():
    """A feed of N times a fixed leading dimension is the replicas' global
    batch (e.g. an RNN state fetched concatenated and fed back): split."""
    x = np.random.RandomState(0).randn(8, 2).astype(np.float32)
    with pn.get_runner(fixed_batch_graph(4), local(2)) as runner:
        runner.run("init")
        per = runner.run("pred:0", {"x:0": x}, per_replica=True)
        for _ in range(3):
            runner.run("train", {"x:0": x})
        got = runner.run("w/Read/ReadVariableOp:0")
    assert [p.shape for p in per] == [(4, 1), (4, 1)]
    with tf1.Session(graph=fixed_batch_graph(8)) as sess:
        sess.run("init")
        for _ in range(3):
            sess.run("train", {"x:0": x})
        np.testing.assert_allclose(got, sess.run("w/Read/ReadVariableOp:0"), atol=1e-6)


def test_devices_the_machine_lacks_fail_at_once_naming_them():
    import os
    import time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    gpus = len(tf.config.list_physical_devices("GPU"))
    start = time.monotonic()
    with pytest.raises(ResourceError, match=f"lists gpu:{gpus}.* TensorFlow sees"):
        pn.get_runner(feed_graph(), {"hosts": [{"devices": [f"gpu:{gpus}"]}]})
    if gpus < 2:      # the shipped GPU resource file, on a machine without two GPUs
        with pytest.raises(ResourceError, match="gpu:1"):
            pn.get_runner(feed_graph(), os.path.join(root, "configs", "resources_gpus.yaml"))
    assert time.monotonic() - start < 30
