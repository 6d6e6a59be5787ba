"""Three small training scripts in the style of TensorFlow's TF1 tutorials,
as a user ports them (tf.compat.v1, placeholders, tf.Variable, queue input):

- word2vec: word2vec_basic's skip-gram model, an embedding and NCE loss,
  GradientDescent(1.0), `[None]` placeholders fed every step;
- mnist: mnist_deep's CNN (two conv+pool layers, a dense layer, dropout fed
  through a keep_prob placeholder), Adam, on small synthetic images;
- ptb: ptb_word_lm's 2-layer LSTM language model, statically unrolled,
  gradients clipped by their global norm, GradientDescent, the RNN state
  fetched and fed back every step, steps read from a range_input_producer
  queue, the graph exported as a MetaGraphDef and trained from it;
- deepfm: a DeepFM written as its widely used TF1 implementation writes it
  (feature index and value placeholders, embeddings and first-order
  weights looked up by index, FM and deep parts, dropout keep
  probabilities fed as `[None]` placeholders with one value per layer,
  `tf.losses.log_loss`, Adam, a `tf.train.Saver` built before training).

`build(batch)` makes the graph; `train(run, handles, steps, batch, part)`
is the tutorial's loop for `run` = Session.run or Runner.run, where
`part = (index, count)` picks the rows of the global batch a worker feeds
(each worker of a job feeds its own rows).
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
MODELS = ("word2vec", "mnist", "ptb", "deepfm")
BATCH = 4              # rows per replica
SAMPLER_SEED = 11


# -- word2vec_basic -------------------------------------------------------------
VOCAB, EMBED, NUM_SAMPLED = 50, 8, 6


def word2vec(batch):
    g = tf.Graph()
    with g.as_default():
        train_inputs = tf1.placeholder(tf.int32, shape=[None], name="train_inputs")
        train_labels = tf1.placeholder(tf.int32, shape=[None, 1], name="train_labels")
        embeddings = tf1.Variable(tf1.random_uniform([VOCAB, EMBED], -1.0, 1.0),
                                  name="embeddings")
        embed = tf1.nn.embedding_lookup(embeddings, train_inputs)
        nce_weights = tf1.Variable(tf1.truncated_normal([VOCAB, EMBED],
                                                        stddev=1.0 / math.sqrt(EMBED)),
                                   name="nce_weights")
        nce_biases = tf1.Variable(tf1.zeros([VOCAB]), name="nce_biases")
        with tf1.name_scope("nce_loss"):
            sampled = tf1.nn.log_uniform_candidate_sampler(
                tf.cast(train_labels, tf.int64), 1, NUM_SAMPLED, True, VOCAB,
                seed=SAMPLER_SEED)
            loss = tf.reduce_mean(tf1.nn.nce_loss(
                weights=nce_weights, biases=nce_biases, labels=train_labels, inputs=embed,
                num_sampled=NUM_SAMPLED, num_classes=VOCAB, sampled_values=sampled),
                name="loss")
        tf1.train.GradientDescentOptimizer(1.0).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g, {"init": "init", "train": "train", "loss": "nce_loss/loss:0"}


def _skip_grams(step, rows):
    """Deterministic (input, label) pairs of a Zipf-like corpus for `step`."""
    rng = np.random.RandomState(100 + step)
    words = (rng.zipf(1.5, size=rows + 2) % VOCAB).astype(np.int32)
    return words[1:rows + 1], words[np.arange(rows) + rng.randint(0, 2, rows) * 2][:, None]


# -- mnist_deep -----------------------------------------------------------------
SIDE, CLASSES = 8, 10


def _weight(shape, dtype=tf.float32):
    return tf1.Variable(tf1.truncated_normal(shape, stddev=0.1, dtype=dtype))


def _bias(shape, dtype=tf.float32):
    return tf1.Variable(tf1.constant(0.1, shape=shape, dtype=dtype))


def mnist(batch, dtype=tf.float32):
    """`dtype` float64 for comparisons that a relu or max pool near a tie
    would turn from float32 rounding into a different gradient."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(dtype, [None, SIDE * SIDE], name="x")
        y_ = tf1.placeholder(dtype, [None, CLASSES], name="y_")
        keep_prob = tf1.placeholder(dtype, name="keep_prob")
        image = tf.reshape(x, [-1, SIDE, SIDE, 1])
        h = image
        for i, (cin, cout) in enumerate([(1, 4), (4, 8)]):
            with tf1.name_scope(f"conv{i + 1}"):
                h = tf.nn.relu(tf.nn.conv2d(h, _weight([3, 3, cin, cout], dtype), [1, 1, 1, 1],
                                            "SAME") + _bias([cout], dtype))
            with tf1.name_scope(f"pool{i + 1}"):
                h = tf.nn.max_pool2d(h, 2, 2, "SAME")
        with tf1.name_scope("fc1"):
            flat = tf.reshape(h, [-1, 2 * 2 * 8])
            h = tf.nn.relu(tf.matmul(flat, _weight([32, 16], dtype)) + _bias([16], dtype))
        with tf1.name_scope("dropout"):
            h = tf1.nn.dropout(h, rate=1 - keep_prob)
        with tf1.name_scope("fc2"):
            logits = tf.matmul(h, _weight([16, CLASSES], dtype)) + _bias([CLASSES], dtype)
        loss = tf.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(
            labels=y_, logits=logits), name="loss")
        tf1.train.AdamOptimizer(1e-3).minimize(loss, name="train")
        correct = tf.equal(tf.argmax(logits, 1), tf.argmax(y_, 1))
        tf.reduce_mean(tf.cast(correct, dtype), name="accuracy")
        tf1.global_variables_initializer()
    return g, {"init": "init", "train": "train", "loss": "loss:0"}


def _images(step, rows):
    rng = np.random.RandomState(200 + step)
    labels = rng.randint(0, CLASSES, rows)
    images = rng.rand(rows, SIDE * SIDE).astype(np.float32) * 0.3
    images[np.arange(rows), labels * 6] += 1.0       # a learnable pixel per class
    return images, np.eye(CLASSES, dtype=np.float32)[labels]


# -- ptb_word_lm ----------------------------------------------------------------
PTB_VOCAB, HIDDEN, LAYERS, NUM_STEPS = 20, 8, 2, 3


def ptb_windows(steps, rows):
    """Input and target windows of a synthetic corpus, [steps, rows, NUM_STEPS]."""
    rng = np.random.RandomState(300)
    text = (rng.zipf(1.4, size=steps * rows * (NUM_STEPS + 1)) % PTB_VOCAB).astype(np.int32)
    text = text.reshape(steps, rows, NUM_STEPS + 1)
    return text[:, :, :-1], text[:, :, 1:]


def ptb(batch, windows=None, meta_path=None):
    """The graph for `batch` rows per step; `windows` = (inputs, targets) of
    shape [epoch, batch, NUM_STEPS] (a step reads element i of the producer).
    With `meta_path`, the graph is exported there and imported back, as the
    tutorial's training loop does."""
    inputs, targets = windows if windows is not None else ptb_windows(8, batch)
    g = tf.Graph()
    with g.as_default():
        with tf1.name_scope("Train"), tf1.name_scope("Input"):
            i = tf1.train.range_input_producer(len(inputs), shuffle=False).dequeue()
            x = tf.gather(tf.constant(inputs), i)
            y = tf.gather(tf.constant(targets), i)
        init_scale = 0.1
        with tf1.variable_scope("Model", initializer=tf1.random_uniform_initializer(
                -init_scale, init_scale)):
            embedding = tf1.get_variable("embedding", [PTB_VOCAB, HIDDEN])
            emb = tf1.nn.embedding_lookup(embedding, x)
            cell = tf1.nn.rnn_cell.MultiRNNCell(
                [tf1.nn.rnn_cell.BasicLSTMCell(HIDDEN, forget_bias=0.0)
                 for _ in range(LAYERS)])
            initial_state = cell.zero_state(batch, tf.float32)
            outputs, state = tf1.nn.static_rnn(cell, tf.unstack(emb, NUM_STEPS, 1),
                                               initial_state=initial_state)
            output = tf.reshape(tf.concat(outputs, 1), [-1, HIDDEN])
            softmax_w = tf1.get_variable("softmax_w", [HIDDEN, PTB_VOCAB])
            softmax_b = tf1.get_variable("softmax_b", [PTB_VOCAB])
            logits = tf.reshape(tf1.nn.xw_plus_b(output, softmax_w, softmax_b),
                                [batch, NUM_STEPS, PTB_VOCAB])
            loss = tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            cost = tf.identity(tf.reduce_sum(loss) / batch, name="cost")
            tvars = tf1.trainable_variables()
            grads, _ = tf.clip_by_global_norm(tf1.gradients(cost, tvars), 5.0)
            tf1.train.GradientDescentOptimizer(1.0).apply_gradients(
                zip(grads, tvars), global_step=tf1.train.get_or_create_global_step(),
                name="train")
        tf1.global_variables_initializer()
        h = {"init": "init", "train": "Model/train", "loss": "Model/cost:0",
             "initial_state": [[t.name for t in layer] for layer in initial_state],
             "final_state": [[t.name for t in layer] for layer in state]}
        if meta_path:
            tf1.train.export_meta_graph(filename=meta_path)
    return (meta_path or g), h


# -- DeepFM ------------------------------------------------------------------------
FEATURES, FIELDS, K, DEEP = 60, 4, 4, (8, 8)


def deepfm(batch):
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(5)
        feat_index = tf1.placeholder(tf.int32, shape=[None, None], name="feat_index")
        feat_value = tf1.placeholder(tf.float32, shape=[None, None], name="feat_value")
        label = tf1.placeholder(tf.float32, shape=[None, 1], name="label")
        keep_fm = tf1.placeholder(tf.float32, shape=[None], name="dropout_keep_fm")
        keep_deep = tf1.placeholder(tf.float32, shape=[None], name="dropout_keep_deep")
        tf1.placeholder(tf.bool, name="train_phase")
        w = {"feature_embeddings": tf1.Variable(
                 tf1.random_normal([FEATURES, K], 0.0, 0.1), name="feature_embeddings"),
             "feature_bias": tf1.Variable(tf1.random_uniform([FEATURES, 1], 0.0, 1.0),
                                          name="feature_bias")}
        sizes = (FIELDS * K,) + DEEP
        for i in range(len(DEEP)):
            glorot = np.sqrt(2.0 / (sizes[i] + sizes[i + 1]))
            w[f"layer_{i}"] = tf1.Variable(np.random.RandomState(i).normal(
                0, glorot, (sizes[i], sizes[i + 1])).astype(np.float32), name=f"layer_{i}")
            w[f"bias_{i}"] = tf1.Variable(np.zeros((1, sizes[i + 1]), np.float32),
                                          name=f"bias_{i}")
        w["concat_projection"] = tf1.Variable(np.random.RandomState(9).normal(
            0, 0.1, (FIELDS + K + DEEP[-1], 1)).astype(np.float32), name="concat_projection")
        w["concat_bias"] = tf1.Variable(tf.constant(0.01), dtype=np.float32)
        embeddings = tf1.nn.embedding_lookup(w["feature_embeddings"], feat_index)
        value = tf.reshape(feat_value, shape=[-1, FIELDS, 1])
        embeddings = tf.multiply(embeddings, value)
        first = tf1.nn.embedding_lookup(w["feature_bias"], feat_index)
        first = tf.reduce_sum(tf.multiply(first, value), 2)
        first = tf1.nn.dropout(first, keep_fm[0])
        summed = tf.square(tf.reduce_sum(embeddings, 1))
        squared = tf.reduce_sum(tf.square(embeddings), 1)
        second = tf1.nn.dropout(0.5 * tf.subtract(summed, squared), keep_fm[1])
        deep = tf.reshape(embeddings, shape=[-1, FIELDS * K])
        deep = tf1.nn.dropout(deep, keep_deep[0])
        for i in range(len(DEEP)):
            deep = tf.nn.relu(tf.add(tf.matmul(deep, w[f"layer_{i}"]), w[f"bias_{i}"]))
            deep = tf1.nn.dropout(deep, keep_deep[1 + i])
        out = tf.add(tf.matmul(tf.concat([first, second, deep], axis=1),
                               w["concat_projection"]), w["concat_bias"])
        out = tf.nn.sigmoid(out)
        loss = tf.identity(tf1.losses.log_loss(label, out), name="loss")
        tf1.train.AdamOptimizer(learning_rate=0.01, beta1=0.9, beta2=0.999,
                                epsilon=1e-8).minimize(loss, name="train")
        tf1.global_variables_initializer()
        tf1.train.Saver()
    return g, {"init": "init", "train": "train", "loss": "loss:0"}


def _fields(step, rows):
    """Xi (each field's feature index), Xv (its value) and y, as DeepFM's
    data loader gives them."""
    rng = np.random.RandomState(400 + step)
    index = np.stack([rng.randint(f * FEATURES // FIELDS, (f + 1) * FEATURES // FIELDS, rows)
                      for f in range(FIELDS)], axis=1).astype(np.int32)
    value = rng.rand(rows, FIELDS).astype(np.float32)
    y = (index[:, 0] % 2 == 0).astype(np.float32)[:, None]
    return index, value, y


# -- one loop for Session.run and Runner.run -------------------------------------
def build(model, batch, **kwargs):
    return {"word2vec": word2vec, "mnist": mnist, "ptb": ptb,
            "deepfm": deepfm}[model](batch, **kwargs)


def train(model, run, h, steps, batch, part=(0, 1), keep_prob=1.0):
    """The tutorial's loop: `steps` steps of a global batch of `batch` rows,
    of which this process feeds part (index, count). Returns the losses."""
    index, count = part
    rows = slice(index * batch // count, (index + 1) * batch // count)
    losses = []
    if model == "ptb":
        state = run(h["initial_state"])
    for step in range(steps):
        if model == "word2vec":
            inputs, labels = _skip_grams(step, batch)
            feed = {"train_inputs:0": inputs[rows], "train_labels:0": labels[rows]}
        elif model == "mnist":
            images, labels = _images(step, batch)
            feed = {"x:0": images[rows], "y_:0": labels[rows], "keep_prob:0": keep_prob}
        elif model == "deepfm":     # as its author feeds it: keep probabilities per layer
            index, value, y = _fields(step, batch)
            feed = {"feat_index:0": index[rows], "feat_value:0": value[rows],
                    "label:0": y[rows], "dropout_keep_fm:0": [keep_prob] * 2,
                    "dropout_keep_deep:0": [keep_prob] * (1 + len(DEEP)),
                    "train_phase:0": True}
        else:
            feed = {name: value for names, values in zip(h["initial_state"], state)
                    for name, value in zip(names, values)}
        if model == "ptb":
            _, loss, state = run([h["train"], h["loss"], h["final_state"]], feed)
        else:
            _, loss = run([h["train"], h["loss"]], feed)
        losses.append(loss)
    return losses


def config(model, run_option):
    """The config a model equals one device with: the default (word2vec's
    NCE negatives drawn alike on every replica, `random: auto`). Run option
    `alltoall`: allreduce with sparse_method alltoall."""
    out = {"run_option": run_option}
    if run_option == "alltoall":
        out = {"run_option": "allreduce", "sparse_method": "alltoall"}
    return out


def single_windows(windows, replicas):
    """One device's windows for the replicas' `windows`: its step s reads
    what replicas 0..N-1 read at step s (element s*N + r of the producer)."""
    return tuple(np.stack([np.concatenate(w[s * replicas:(s + 1) * replicas])
                           for s in range(len(w) // replicas)]) for w in windows)


def start_queue_runners(sess):
    """For one device: what the tutorials' Supervisor does."""
    coord = tf.train.Coordinator()
    return coord, tf1.train.start_queue_runners(sess, coord)
