"""Which placeholders are fed batches (parallax_ng/graph/batch.py): decided from
the graph, not from the static shape alone; the runner splits only those
(parallax_ng/runtime/fetches.py). DeepFM-shaped models as their authors feed them
are in tests/test_tutorials.py."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import ctc_model, local
from parallax_ng.graph import batch, forms, frontend
from tutorials import deepfm

tf1 = tf.compat.v1


def kinds(graph):
    return {name: kind for name, (kind, _) in batch.kinds(frontend.load(graph)).items()}


def test_deepfm_s_data_is_batch_and_its_keep_probabilities_are_not():
    g, _ = deepfm(4)
    assert kinds(g) == {"feat_index": "batch", "feat_value": "batch", "label": "batch",
                        "dropout_keep_fm": "whole", "dropout_keep_deep": "whole"}


def model(use):
    """x [None, 3] -> a dense layer -> a loss; `use` adds a use of v [None]."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        v = tf1.placeholder(tf.float32, [None], name="v")
        y = tf1.placeholder(tf.int32, [None], name="y")
        logits = tf.matmul(x, tf1.get_variable("w", [3, 4]))
        per_example = tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(use(v, per_example, logits, y))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return g


@pytest.mark.parametrize("use,kind", [
    (lambda v, e, lg, y: e * v, "batch"),                           # a weight per example
    (lambda v, e, lg, y: e * tf.gather(v, y), "whole"),             # a weight per class
    (lambda v, e, lg, y: e * v[0] + v[1], "whole"),                 # hyper-parameters
    (lambda v, e, lg, y: e + tf.reduce_sum(lg * v, 1), "whole"),    # broadcast over classes
    (lambda v, e, lg, y: e + tf.reduce_sum(v), "unknown"),          # summed, alone
    # an index among its rows, then element-wise (was an IndexError: a
    # scalar taken to have the rows' dimension)
    (lambda v, e, lg, y: e + tf.cast(tf.argmax(v), tf.float32), "unknown"),
    (lambda v, e, lg, y: e * tf.cast(tf.math.top_k(v, 2).indices[0], tf.float32), "unknown"),
    (lambda v, e, lg, y: e, "whole"),           # read by nothing (no warning when fed)
    # a weight per example of a sum per example over tf.range(1, tf.rank(x))
    # (tf.compat.v1.losses.mean_pairwise_squared_error's): was "unknown"
    (lambda v, e, lg, y: tf.reduce_sum(lg * lg, tf.range(1, tf.rank(lg))) * v, "batch"),
])
def test_a_vector_placeholder_is_what_its_uses_make_it(use, kind):
    got = kinds(model(use))
    assert got["x"] == got["y"] == "batch"
    assert got["v"] == kind


def test_an_update_fed_from_outside_is_whole_and_its_readers_the_same_on_every_replica():
    """A gradient summed in Python and fed to apply_gradients (its first
    dimension open): written into a variable, which every replica holds
    whole, so it goes whole (it was split as a batch) and nothing it
    computes differs by replica (graph/variance.py `whole_feeds`); config
    `batch_feeds` says otherwise where it names it."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 4])
        loss = tf.reduce_mean(tf.matmul(x, w))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        fed = tf1.placeholder(tf.float32, [None, 4], name="fed")
        tf1.train.AdamOptimizer(0.1).apply_gradients([(fed, w)])
        tf1.identity(fed * 2.0, name="doubled")
    assert kinds(g) == {"x": "batch", "fed": "whole"}
    from parallax_ng.graph.variance import whole_feeds
    for said, whole in (({}, {"fed"}), ({"fed": True}, set()), ({"x": False}, {"fed", "x"})):
        tg = frontend.load(g, batch_feeds=said)
        assert whole_feeds(tg) == whole
        assert ("doubled" in tg.variant) == (not whole) and ("Mean" in tg.variant) == \
            ("x" not in whole)


def test_data_and_labels_partitioned_by_a_task_per_example_are_batches():
    """A loss per task: logits and labels cut by tf.dynamic_partition by a
    task id per example, a mean over each part (before: all three
    "unknown", with a line each, though split right)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        task = tf1.placeholder(tf.int32, [None], name="task")
        logits = tf.matmul(x, tf1.get_variable("w", [3, 4]))
        parts = zip(tf.dynamic_partition(logits, task, 2), tf.dynamic_partition(y, task, 2))
        loss = tf.add_n([tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(
            labels=b, logits=a)) for a, b in parts])
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert kinds(g) == {"x": "batch", "y": "batch", "task": "batch"}


def test_rows_a_mask_of_the_labels_picks_are_batches():
    """A pairwise ranking loss (an AUC surrogate) over the scores of the
    positive and the negative examples, each picked by tf.boolean_mask
    with a mask of the labels: the data's and the mask's rows are one
    dimension (before: both "unknown", with a line each). A table fed
    whole, read at the columns where a mask of the data is true, is no
    batch: a 2-D mask's places are not rows of the table."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        table = tf1.placeholder(tf.float32, [None], name="table")
        score = tf.matmul(x, tf1.get_variable("w", [3, 1]))[:, 0]
        positive = tf.equal(y, 1)
        pos, neg = (tf.boolean_mask(score, m) for m in (positive, tf.logical_not(positive)))
        loss = tf.reduce_mean(tf.sigmoid(neg[None, :] - pos[:, None])) + tf.reduce_sum(
            tf.gather(table, tf.where(x > 0)[:, 1]))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert kinds(g) == {"x": "batch", "y": "batch", "table": "whole"}


def test_a_pick_per_row_by_gather_nd_lines_up_the_rows():
    """A DQN's Q value of each example's action, tf.gather_nd(q, tf.stack(
    [tf.range(n), a], 1)) or tf.gather(q, a[:, None], batch_dims=1): the
    states and actions are batches (were
    "unknown", each with a warning when fed), in int64 too; a tensor
    gathered by other coordinates is not read (it could be a table or the
    batch), so it is split with a warning."""
    g = tf.Graph()
    with g.as_default():
        s = tf1.placeholder(tf.float32, [None, 3], name="s")
        a = tf1.placeholder(tf.int32, [None], name="a")
        table = tf1.placeholder(tf.float32, [None, 4], name="table")
        at = tf1.placeholder(tf.int32, [None, 2], name="at")
        q = tf.matmul(s, tf1.get_variable("w", [3, 4]))
        picked = tf.gather_nd(q, tf.stack([tf.range(tf.shape(a)[0]), a], axis=1)) + \
            tf.gather_nd(q, tf.stack([tf.range(tf.shape(a, out_type=tf.int64)[0]),
                                      tf.cast(a, tf.int64)], axis=1)) + \
            tf.squeeze(tf.gather(q, a[:, None], batch_dims=1), 1)
        loss = tf.reduce_sum(tf.square(picked)) + tf.reduce_mean(
            tf.gather_nd(table, at) * tf.reduce_sum(q, 1))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        only = tf.reduce_sum(tf.square(picked))
    assert kinds(g) == {"s": "batch", "a": "batch", "table": "unknown", "at": "batch"}
    # the picked values' rows are the batch's: their sum is a sum over it
    assert forms.loss_form(only, forms.sources(g), None).kind == "sum"


@tf.custom_gradient
def _scaled_gradient(x):
    return tf.identity(x), lambda dy: 0.5 * dy


def test_a_custom_gradient_passes_the_batch_on():
    """tf.custom_gradient's IdentityN passes each input on (was "unknown":
    a warning for each placeholder when fed)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        h = _scaled_gradient(tf.matmul(x, tf1.get_variable("w", [3, 1])))
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(h - y)))
    assert kinds(g) == {"x": "batch", "y": "batch"}


@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_ids_looked_up_in_a_partitioned_table_are_a_batch(strategy):
    """tf.compat.v1.fixed_size_partitioner's table: the lookup partitions
    the ids (DynamicPartition), stitches the parts' rows and reshapes them
    to the ids' shape (was "unknown" for the ids and the labels: a warning
    for each when fed)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.int64, [None, 3], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf1.get_variable("emb", [20, 4], partitioner=tf1.fixed_size_partitioner(3))
        e = tf.reduce_sum(tf1.nn.embedding_lookup(emb, x, partition_strategy=strategy), 1)
        loss = tf.reduce_mean(tf.square(tf.matmul(e, tf1.get_variable("w", [4, 1])) - y))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert kinds(g) == {"x": "batch", "y": "batch"}


def test_strings_through_feature_columns_are_batches():
    """Census's wide & deep with tf.compat.v1 feature columns on string
    placeholders: an embedding column reshapes its lookup to the
    SparseTensor's dense_shape[:-1] (a slice of tf.shape of the strings),
    an indicator column makes the ids dense in that shape (SparseToDense);
    crossed, bucketized and hashed columns in linear_model. Every
    placeholder is a batch (the strings were "unknown": a line for each
    when fed, though split as batches all the same)."""
    g = tf.Graph()
    with g.as_default():
        fc = tf1.feature_column
        ph = {"edu": tf1.placeholder(tf.string, [None, 1], name="edu"),
              "occ": tf1.placeholder(tf.string, [None, 1], name="occ"),
              "tags": tf1.placeholder(tf.string, [None, 3], name="tags"),
              "age": tf1.placeholder(tf.float32, [None, 1], name="age")}
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        edu = fc.categorical_column_with_vocabulary_list("edu", ["a", "b", "c"])
        occ = fc.categorical_column_with_hash_bucket("occ", 20)
        age = fc.bucketized_column(fc.numeric_column("age"), [18, 30, 45])
        wide = fc.linear_model({"edu": ph["edu"], "occ": ph["occ"], "age": ph["age"]},
                               [edu, age, fc.crossed_column(["edu", "occ"], 30)])
        h = fc.input_layer(ph, [fc.indicator_column(edu), fc.embedding_column(occ, 3),
                                fc.embedding_column(fc.categorical_column_with_hash_bucket(
                                    "tags", 15), 2, combiner="sqrtn")])
        logits = wide + tf.matmul(h, tf1.get_variable("w", [h.shape[1], 1]))
        tf1.train.AdagradOptimizer(0.1).minimize(tf1.losses.sigmoid_cross_entropy(y, logits))
    assert kinds(g) == {"edu": "batch", "occ": "batch", "tags": "batch", "age": "batch",
                        "y": "batch"}
    only = tf.Graph()       # the embedding column alone: its rows meet the labels'
    with only.as_default():
        words = tf1.placeholder(tf.string, [None, 1], name="words")
        y = tf1.placeholder(tf.float32, [None, 2], name="y")
        h = fc.input_layer({"words": words}, [fc.embedding_column(
            fc.categorical_column_with_hash_bucket("words", 9), 2)])
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(h - y)))
    assert kinds(only) == {"words": "batch", "y": "batch"}


@pytest.mark.parametrize("loss", ["softmax", "squared"])
def test_ids_run_through_a_time_major_loop_meet_the_labels_rows(loss):
    """dynamic_rnn's form: ids [None, None] embedded, transposed to time
    major, run through a loop over time, transposed back, and met by the
    labels in a loss. The first dimension's rules stop at the transpose;
    graph/rows.py follows the rows through it, so the ids are a batch
    without a warning (before: "does not show", split anyway)."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None, None], name="ids")
        y = tf1.placeholder(tf.int32, [None, None], name="y")
        e = tf.nn.embedding_lookup(tf1.get_variable("emb", [20, 4]), ids)
        u = tf1.get_variable("u", [4, 4])
        steps = tf.scan(lambda h, x: tf.tanh(x + tf.matmul(h, u)), tf.transpose(e, [1, 0, 2]),
                        initializer=tf.zeros_like(e[:, 0]))
        logits = tf.tensordot(tf.transpose(steps, [1, 0, 2]), tf1.get_variable("w", [4, 3]), 1)
        if loss == "softmax":
            per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        else:
            per_token = tf.square(logits[:, :, 0] - tf.cast(y, tf.float32))
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(per_token))
    assert kinds(g) == {"ids": "batch", "y": "batch"}


def test_a_lone_input_averaged_by_the_loss_is_a_batch():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        loss = tf.reduce_mean(tf.square(tf.matmul(x, tf1.get_variable("w", [2, 1])) - 1.0))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert kinds(g) == {"x": "batch"}


def test_the_mnist_tutorial_s_placeholders_are_batches():
    """mnist_deep ported the usual way: images reshaped to [-1, 28, 28, 1],
    a convolution, dropout by a keep probability fed without a shape (its
    rank unknown), and the softmax loss, which flattens its logits and
    labels by a computed shape ([-1] and the last dimension)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 16], name="x")
        y = tf1.placeholder(tf.float32, [None, 3], name="y")
        keep = tf1.placeholder(tf.float32, name="keep_prob")
        img = tf.reshape(x, [-1, 4, 4, 1])
        h = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(img, tf1.get_variable("k", [2, 2, 1, 2]),
                                                     1, "SAME")), 2, 2, "SAME")
        h = tf1.nn.dropout(tf.reshape(h, [-1, 8]), keep)
        logits = tf.matmul(h, tf1.get_variable("w", [8, 3]))
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert kinds(g) == {"x": "batch", "y": "batch"}


def ptb_like(state_rows=None):
    """PTB's language model ported the usual way: ids [None, T] through an
    embedding and an RNN built as a while loop (time-major inside), its state
    fed and fetched, labels [None, T] against logits [None, T, V] by the
    sparse softmax loss (which flattens both and gives back the labels'
    shape), averaged over examples and summed over time; also a flatten by
    `[tf.shape(x)[0], -1]`."""
    import tf_keras  # noqa: F401  tf.compat.v1.nn.rnn_cell lives there under Keras 3
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.int32, [None, 3], name="x")
        y = tf1.placeholder(tf.int32, [None, 3], name="y")
        flat = tf1.placeholder(tf.float32, [None, 2, 2], name="flat")
        cell = tf1.nn.rnn_cell.BasicRNNCell(4)
        state = cell.zero_state(tf.shape(x)[0], tf.float32)
        inputs = tf.nn.embedding_lookup(tf1.get_variable("emb", [10, 4]), x)
        out, final = tf1.nn.dynamic_rnn(cell, inputs, initial_state=state)
        logits = tf.reshape(tf.matmul(tf.reshape(out, [-1, 4]), tf1.get_variable("w", [4, 10])),
                            [-1, 3, 10])
        xent = tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        side = tf.matmul(tf.reshape(flat, [tf.shape(flat)[0], -1]), tf1.get_variable("v", [4, 1]))
        loss = tf.reduce_sum(tf.reduce_mean(xent, 0)) + tf.reduce_mean(side)
        train = tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"x": x, "y": y, "flat": flat, "state": state, "final": final, "loss": loss,
               "train": train, "init": init}


def test_ptbs_labels_and_a_flatten_by_the_batchs_size_are_batches():
    """Before, the labels were unknown: the loss's values came back in the
    labels' shape through tf.shape(labels), which the table did not follow.
    The ids, lost to the table in the loop's time-major frames, meet the
    labels' rows as graph/rows.py follows them."""
    g, _ = ptb_like()
    got = kinds(g)
    assert got["y"] == got["flat"] == got["x"] == "batch"


def test_labels_beside_a_sparse_batch_through_a_layer_and_ctcs_inputs_are_batches():
    """Labels lined up with logits of a sparse batch (a linear layer by
    sparse_tensor_dense_matmul, a weighted embedding_lookup_sparse) were
    unknown, as were CTC's features (through tf.tensordot and a time-major
    transpose) and sequence lengths."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.sparse_placeholder(tf.float32, name="x")
        ids = tf1.sparse_placeholder(tf.int64, name="ids")
        weights = tf1.sparse_placeholder(tf.float32, name="weights")
        y = tf1.placeholder(tf.float32, [None], name="y")
        deep = tf.nn.embedding_lookup_sparse(tf1.get_variable("emb", [9, 1]), ids, weights)
        logits = tf.squeeze(tf1.sparse_tensor_dense_matmul(x, tf1.get_variable("w", [9, 1])) +
                            deep, 1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert kinds(g)["y"] == "batch"
    got = kinds(ctc_model()[0])
    assert got["x"] == got["lengths"] == "batch"


def test_a_fed_rnn_state_beside_a_batch_of_as_many_rows_is_split_silently(capsys):
    """The state PTB fetches and feeds back is a tensor (zero_state's Fill),
    not a placeholder: beside the ids' batch of as many rows it is split
    without a word (the ids are a batch: they meet the labels' rows); a
    fed tensor alone is split with a line naming it as a fed tensor."""
    g, h = ptb_like()
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 10, (4, 3)).astype(np.int32)
    with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
        runner.run(h["init"])
        state = runner.run(h["final"], {h["x"]: ids})
        assert "parallax_ng: placeholder 'x'" not in capsys.readouterr().err
        feed = {h["x"]: ids, h["y"]: ids, h["flat"]: np.ones((4, 2, 2), np.float32),
                h["state"]: state}
        runner.run(h["train"], feed)
        assert "parallax_ng" not in capsys.readouterr().err
        parts = runner.run(h["final"], feed, per_replica=True)
        assert [p.shape for p in parts] == [(2, 4), (2, 4)]
    g = tf.Graph()
    with g.as_default():
        rows = tf1.placeholder_with_default(4, [])
        start = tf.zeros([rows, 2], name="start")        # a Fill of open rows, fed alone
        out = tf.matmul(start, tf1.get_variable("w", [2, 1]))
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(out))
        init = tf1.global_variables_initializer()
    with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
        runner.run(init)
        parts = runner.run(out, {start: np.ones((4, 2), np.float32)}, per_replica=True)
        err = capsys.readouterr().err
    assert [p.shape for p in parts] == [(2, 1), (2, 1)]
    assert "fed tensor (Fill) 'start'" in err, err
    assert "only placeholders are read for batches" in err


def test_arrays_that_fill_an_input_pipeline_are_whole():
    """The placeholders of Dataset.from_tensor_slices that an initializable
    iterator is fed with hold the whole data set: the pipeline (pn.shard)
    gives each replica its examples, so the runner must not split the feed
    too (it did: each replica saw a quarter of the data, every other row of
    its half)."""
    g = tf.Graph()
    with g.as_default():
        xs = tf1.placeholder(tf.float32, [None, 2], name="xs")
        ys = tf1.placeholder(tf.float32, [None, 1], name="ys")
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((xs, ys))).batch(4).repeat()
        x, y = tf1.data.make_initializable_iterator(ds).get_next()
        loss = tf.reduce_mean(tf.square(tf.matmul(x, tf1.get_variable("w", [2, 1])) - y))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert kinds(g) == {"xs": "whole", "ys": "whole"}


def test_the_runner_splits_batches_and_gives_the_rest_whole(capsys):
    """Per-class weights fed as `[None]` (4 values over 2 replicas, then 3):
    every replica gets them whole, without a word; an undecided placeholder
    is split as a batch, with one line naming it and the config key."""
    build = {"w": lambda v, e, lg, y: e * tf.gather(v, y),
             "u": lambda v, e, lg, y: e + tf.reduce_sum(v)}
    x = np.ones([4, 3], np.float32)
    y = np.array([0, 1, 2, 0], np.int32)
    for key, use in build.items():
        g = model(use)
        loss = g.get_tensor_by_name("Mean:0")
        with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
            runner.run(runner.ctx.tg.variables["w"].initializer)
            feed = {"x:0": x, "y:0": y, "v:0": np.arange(4, dtype=np.float32)}
            runner.run(loss, feed)
            if key == "w":
                feed["v:0"] = np.ones(3, np.float32)
                runner.run(loss, feed)
            else:
                parts = runner.run("Sum:0", feed, per_replica=True)
                assert [float(p) for p in parts] == [1.0, 5.0]      # 0+1 and 2+3
        err = capsys.readouterr().err
        if key == "w":
            assert "placeholder" not in err
        else:
            assert err.count("placeholder 'v'") == 1, err
            assert "is split over the replicas as a batch" in err
            assert "batch_feeds: {v: false}" in err
    g = model(build["u"])
    with pn.get_runner(g, local(2), {"run_option": "allreduce",
                                     "batch_feeds": {"v": False}}) as runner:
        runner.run(runner.ctx.tg.variables["w"].initializer)
        runner.run("Mean:0", {"x:0": x, "y:0": y, "v:0": np.ones(4, np.float32)})
    assert "placeholder" not in capsys.readouterr().err
    g = model(lambda v, e, lg, y: e * v)         # a weight per example: split
    with pn.get_runner(g, local(2), {"run_option": "allreduce",
                                     "batch_feeds": {"x": True}}) as runner:
        runner.run(runner.ctx.tg.variables["w"].initializer)
        got = runner.run("mul:0", {"x:0": x, "y:0": y, "v:0": np.arange(4, dtype=np.float32)},
                         per_replica=True)
        assert [len(part) for part in got] == [2, 2]
    with pytest.raises(pn.ConfigError, match="batch_feeds.v' must be true"):
        pn.get_runner(g, local(2), {"batch_feeds": {"v": "yes"}})


def sparse_model():
    """A sparse placeholder of ids (rows of 1 to 3 ids) read by
    embedding_lookup_sparse, a dense layer, Adagrad; the graph and its
    (ids, y, train op, variables)."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.sparse_placeholder(tf.int64, name="ids")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf1.get_variable("emb", [50, 4],
                               initializer=tf1.random_normal_initializer(seed=1))
        w = tf1.get_variable("w", [4, 1], initializer=tf1.ones_initializer())
        h = tf.nn.embedding_lookup_sparse(emb, ids, None, combiner="mean")
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - y))
        train = tf1.train.AdagradOptimizer(0.1).minimize(loss)
    return g, ids, y, train, [emb, w] + [v for v in g.get_collection("variables")
                                         if "Adagrad" in v.name]


def sparse_batches(steps, rows):
    """`steps` batches of `rows` rows: (indices, values, dense_shape), labels."""
    rng = np.random.RandomState(3)
    out = []
    for _ in range(steps):
        counts = rng.randint(1, 4, rows)
        indices = np.array([[r, j] for r in range(rows) for j in range(counts[r])], np.int64)
        out.append(((indices, rng.randint(0, 50, len(indices)).astype(np.int64),
                     np.array([rows, 3], np.int64)), rng.randn(rows, 1).astype(np.float32)))
    return out


@pytest.mark.parametrize("how", ["sparse-tensor", "value", "components", "names"])
def test_a_sparse_placeholder_is_split_by_its_rows(how):
    """A sparse placeholder fed a global batch (as a SparseTensor key with
    a SparseTensorValue or a tuple, or its three tensors one by one, by
    tensor or by name): each
    replica gets its rows' ids, numbered from 0, so 6 steps on 2 replicas
    equal one device, every variable and slot within 1e-6 (absolute and
    relative: the accumulators reach 30). Rows that do not
    divide are an error naming the feed."""
    data = sparse_batches(6, 8)
    g, ids, y, train, variables = sparse_model()
    with tf1.Session(graph=g) as s:
        s.run(tf1.global_variables_initializer())
        for (i, v, shape), labels in data:
            s.run(train, {ids: tf1.SparseTensorValue(i, v, shape), y: labels})
        single = s.run(variables)
    g, ids, y, train, variables = sparse_model()
    with g.as_default():
        init = tf1.global_variables_initializer()
    runner = pn.get_runner(g, local(2), {"run_option": "allreduce"})
    runner.run(init)
    for (i, v, shape), labels in data:
        if how == "sparse-tensor":
            feed = {ids: tf1.SparseTensorValue(i, v, shape)}
        elif how == "value":
            feed = {ids: (i, v, shape)}
        elif how == "components":
            feed = {ids.indices: i, ids.values: v, ids.dense_shape: shape}
        else:
            feed = {"ids/indices": i, "ids/values:0": v, "ids/shape": shape}
        runner.run(train, {**feed, y: labels})
    for var, want in zip(variables, single):
        np.testing.assert_allclose(runner.run(var), want, atol=1e-6, rtol=1e-6, err_msg=var.name)
    (i, v, _), labels = data[0]
    with pytest.raises(pn.errors.FetchError, match=r"sparse feed 'ids' has 7 rows .* 2 "
                                                   r"replicas.*batch_feeds: \{ids/indices"):
        runner.run(train, {ids: (i[i[:, 0] < 7], v[i[:, 0] < 7], np.array([7, 3])),
                           y: labels[:7]})


def fixed_model(rows):
    """Ids and targets in placeholders of `rows` rows (a script built for
    its batch size), an embedding read by the ids, Adam; the graph and its
    (ids, y, predictions, train op, init, variables)."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [rows, 3], name="ids")
        y = tf1.placeholder(tf.float32, [rows, 1], name="y")
        emb = tf1.get_variable("emb", [20, 4], initializer=tf1.random_normal_initializer(seed=1))
        w = tf1.get_variable("w", [4, 1], initializer=tf1.ones_initializer())
        pred = tf.matmul(tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), 1), w, name="pred")
        train = tf1.train.AdamOptimizer(0.1).minimize(tf.reduce_mean(tf.square(pred - y)))
        init = tf1.global_variables_initializer()
    return g, ids, y, pred, train, init, [emb, w] + [v for v in g.get_collection("variables")
                                                     if "Adam" in v.name]


def test_placeholders_of_a_fixed_batch_size_fed_the_global_batch():
    """A script built for a replica's batch (placeholders of 4 rows) fed 8
    rows on 2 replicas: each replica gets its 4, so its ids differ from the
    other's (the embedding's rows are gathered, not summed row for row as a
    lookup of positions alike on every replica would be) and 5 Adam steps
    equal one device with 8 rows (1e-6); predictions come back as 8 rows."""
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 20, (8, 3)).astype(np.int32),
             rng.normal(size=(8, 1)).astype(np.float32)) for _ in range(5)]
    g, ids, y, pred, train, init, variables = fixed_model(8)
    with tf1.Session(graph=g) as s:
        s.run(init)
        first = s.run(pred, {ids: data[0][0]})
        for i, labels in data:
            s.run(train, {ids: i, y: labels})
        single = s.run(variables)
    g, ids, y, pred, train, init, variables = fixed_model(4)
    with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
        assert runner.ctx.tg.fixed_batches == {"ids", "y"} and not runner.ctx.tg.rows_alike
        runner.run(init)
        np.testing.assert_allclose(runner.run(pred, {ids: data[0][0]}), first, atol=1e-6)
        for i, labels in data:
            runner.run(train, {ids: i, y: labels})
        for var, want in zip(variables, single):
            np.testing.assert_allclose(runner.run(var), want, atol=1e-6, rtol=1e-6,
                                       err_msg=var.name)


def looped_graph(write: bool = False):
    """x [None, 4, 3] read only inside a tf.while_loop (one step a turn, a
    hand-made recurrence) and y [None, 2]; `write`: the body also moves a
    statistic `mm` toward each turn's batch mean."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, [None, 4, 3], name="x")
        y = tf1.placeholder(tf.float32, [None, 2], name="y")
        w = tf1.get_variable("w", [5, 2])
        mm = tf1.get_variable("mm", [2], initializer=tf1.zeros_initializer(), trainable=False)

        def body(t, h):
            z = tf.matmul(tf.concat([x[:, t], h[:, :2]], 1), w)
            mean = tf.reduce_mean(z, 0)
            if write:
                with tf.control_dependencies([tf1.assign_sub(mm, 0.1 * (mm - mean))]):
                    z = tf.identity(z)
            return t + 1, tf.concat([tf.tanh(z), z], 1)[:, :3]
        _, h = tf1.while_loop(lambda t, h: t < 4, body,
                              [tf.constant(0), tf.zeros([tf.shape(x)[0], 3])])
        loss = tf.reduce_mean(tf.square(h[:, :2] - y), name="loss")
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, dict(x=x, y=y, w=w, mm=mm, loss=loss, train=train, init=init)


def test_a_placeholder_read_inside_a_while_loop_is_a_batch():
    """A While op (TF2 behavior) has variant outputs (its gradient's
    accumulators); x, read by nothing else, was taken for an input
    pipeline's ("whole": fed whole to every replica, which then failed
    on its shapes or trained on the whole batch each). Only a tf.data
    dataset op fills a pipeline; x's rows meet y's in the loss, and two
    replicas equal one device, 4 SGD steps, 1e-5."""
    g, t = looped_graph()
    assert kinds(g) == {"x": "batch", "y": "batch"}
    rng = np.random.default_rng(0)
    feeds = [(rng.normal(size=(8, 4, 3)), rng.normal(size=(8, 2))) for _ in range(4)]
    out, start = [], None
    for session in (pn.get_runner(g, local(2)), tf1.Session(graph=g)):
        with session:
            session.run(t["init"])
            if start is None:
                start = session.run(t["w"])
            else:
                t["w"].load(start, session)
            losses = [session.run([t["train"], t["loss"]], {t["x"]: a, t["y"]: b})[1]
                      for a, b in feeds]
            out.append((losses, session.run(t["w"])))
    np.testing.assert_allclose(out[0][0], out[1][0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[0][1], out[1][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("v2", [True, False], ids=["functional", "v1-frames"])
def test_placeholders_that_meet_only_inside_a_loop_s_body_are_batches(v2):
    """x and m read only inside a tf.while_loop's body, where their columns
    at turn t meet in a product summed into the loop's total (a loss
    summed over time steps): both batches. A functional While's body is a
    function of the graph, which was not read (both "unknown", each with
    a line); v1 frames were."""
    g = tf.Graph()
    if not v2:
        tf1.disable_control_flow_v2()
    try:
        with g.as_default():
            _summed_in_a_loop()
    finally:
        tf1.enable_control_flow_v2()
    assert kinds(g) == {"x": "batch", "m": "batch"}


def _summed_in_a_loop():
    x = tf1.placeholder(tf.float32, [None, 5], name="x")
    m = tf1.placeholder(tf.float32, [None, 5], name="m")
    per = tf.square(tf.matmul(x, tf1.get_variable("w", [5, 5])))
    step = lambda t, total: (t + 1, total + tf.reduce_sum(per[:, t] * m[:, t]))  # noqa: E731
    _, loss = tf1.while_loop(lambda t, total: t < 5, step, [0, 0.0])
    tf1.train.GradientDescentOptimizer(0.1).minimize(loss)


@pytest.mark.parametrize("column,kind", [(None, "batch"), (0, "batch"), (1, "unknown"),
                                         ("cast", "unknown"), ("reversed", "unknown")])
def test_a_dense_feed_made_sparse_in_the_graph_is_read_through_its_coordinates(column, kind):
    """ids [None, 3] fed dense and made a SparseTensor in the graph
    (`tf.sparse.from_dense`: coordinates by `tf.where`) into
    embedding_lookup_sparse: its combiner's rows are the coordinates'
    column 0, the rows of ids, a batch (before: "the graph does not show
    whether its first dimension is the batch"); segments from column 1
    are not the rows, nor column 0 of the coordinates reversed."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int64, [None, 3], name="ids")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf1.get_variable("emb", [10, 4])
        sparse = tf.sparse.from_dense(ids)
        if column is not None:      # "cast": column 1 of the coordinates cast first
            at = tf.cast(sparse.indices, tf.int32)[:, 1] if column == "cast" else \
                sparse.indices[:, ::-1][:, 0] if column == "reversed" else sparse.indices[:, column]
            rows = tf.math.segment_mean(tf.gather(emb, sparse.values), at)
        else:
            rows = tf1.nn.embedding_lookup_sparse(emb, sparse, None, combiner="sqrtn")
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(rows, 1, keepdims=True) - y))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert kinds(g)["ids"] == kind
