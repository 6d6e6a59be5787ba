"""Small single-device training graphs used across the test suite.

Each builder returns (graph, handles) where handles names the ops and tensors a
training script would use. Data is generated deterministically, so a graph
built with batch N*b and one with batch b (run on N replicas) see the same
examples in each step.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import parallax_ng as pn

tf1 = tf.compat.v1

OPTIMIZERS = {
    "sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf1.train.MomentumOptimizer(0.05, 0.9),
    "adam": lambda: tf1.train.AdamOptimizer(0.01),
    "adagrad": lambda: tf1.train.AdagradOptimizer(0.1),
    "rmsprop": lambda: tf1.train.RMSPropOptimizer(0.01, momentum=0.5),
}

VOCAB, DIM, FEATURES, EXAMPLES = 40, 4, 5, 256


def dataset_arrays(dtype=np.float32):
    rng = np.random.RandomState(1234)
    ids = rng.randint(0, VOCAB, size=(EXAMPLES, 3)).astype(np.int32)
    x = rng.randn(EXAMPLES, FEATURES).astype(dtype)
    y = rng.randn(EXAMPLES).astype(dtype)
    return ids, x, y


def embedding_regression(batch, optimizer="adam", clip=False, ema=False,
                         dtype=tf.float32, one_shot=False, loss_sum=False, partitions=None,
                         dim=DIM, random_table=False, dropout=0.0, static_batch=False,
                         lookup="gather", masked=False, bn=None):
    """An embedding (sparse gradient) plus a dense layer, with a global step.
    With `partitions`, the embedding is that many row ranges (pn.partitioner);
    `dim` columns; with `random_table`, drawn by a random initializer; with
    `dropout`, the hidden layer's units dropped at that rate (seeded); with
    `static_batch`, batches of a size the graph knows; with `lookup`
    "sparse", each example's ids read by embedding_lookup_sparse (the same
    mean, but the gradient holds each distinct id of the batch once); with
    `loss_sum` "and mean", the summed loss plus half a tf.reduce_mean of
    the hidden units' magnitudes (a penalty); with
    `masked`, the loss is the mean over the examples whose target is
    positive (tf.boolean_mask: a replica may pick none); with `bn`
    ("moments" or "fused"), the dense layer's input is normalized by the
    batch's statistics (tf.nn.moments, or the fused kernel on the features
    as 1x1 images), which the embedding's gradient passes through; "keras":
    tf_keras's layer on those images (its fused kernel), told training by
    the placeholder `handles["training"]` (default True: a tf.cond)."""
    np_dtype = dtype.as_numpy_dtype
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(7)
        ds = tf.data.Dataset.from_tensor_slices(dataset_arrays(np_dtype))
        ds = pn.shard(ds).batch(batch, drop_remainder=static_batch).repeat()
        if one_shot:
            it = tf1.data.make_one_shot_iterator(ds)
        else:
            it = tf1.data.make_initializable_iterator(ds)
        ids, x, y = it.get_next()
        table = rng.randn(VOCAB, dim).astype(np_dtype)
        if partitions:
            def rows(shape, dtype=None, partition_info=None):
                start = partition_info.var_offset[0] if partition_info else 0
                return tf.constant(table[start:start + shape[0]])
            emb = tf1.get_variable("emb", [VOCAB, DIM], np_dtype, initializer=rows,
                                   partitioner=pn.partitioner(parts=partitions))
        elif random_table:
            emb = tf1.get_variable("emb", [VOCAB, dim], np_dtype)
        else:
            emb = tf1.get_variable("emb", initializer=table)
        w = tf1.get_variable("dense/w", initializer=rng.randn(dim + FEATURES, 8).astype(np_dtype))
        b = tf1.get_variable("dense/b", initializer=np.zeros([8], np_dtype))
        v = tf1.get_variable("out/v", initializer=rng.randn(8, 1).astype(np_dtype))
        if lookup == "sparse":
            at = tf.where(ids >= 0)
            bags = tf.SparseTensor(at, tf.cast(tf.gather_nd(ids, at), tf.int64),
                                   tf.shape(ids, out_type=tf.int64))
            h = tf1.nn.embedding_lookup_sparse(emb, bags, None, combiner="mean",
                                               partition_strategy="div")
        else:
            h = tf.reduce_mean(tf1.nn.embedding_lookup(emb, ids, partition_strategy="div"), 1)
        features = tf.concat([h, x], 1)
        if bn == "moments":
            mean, var = tf.nn.moments(features, [0])
            features = (features - mean) * tf.math.rsqrt(var + 1e-3)
        elif bn == "own":           # standardized by hand: its Means exchanged
            centred = features - tf.reduce_mean(features, 0)
            features = centred / tf.sqrt(tf.reduce_mean(tf.square(centred), 0) + 1e-3)
        elif bn == "weighted":      # tf.nn.weighted_moments over rows a mask keeps: sums
            keep = tf.cast(x[:, :1] > -0.5, np_dtype)
            mean, var = tf.nn.weighted_moments(features, [0], keep, keepdims=True)
            features = (features - mean) * tf.math.rsqrt(var + 1e-3)
        elif bn == "fused":
            width = dim + FEATURES
            images, _, _ = tf1.nn.fused_batch_norm(
                tf.reshape(features, [-1, 1, 1, width]), tf.ones([width], np_dtype),
                tf.zeros([width], np_dtype), is_training=True)
            features = tf.reshape(images, [-1, width])
        elif bn == "keras":
            import tf_keras
            width = dim + FEATURES
            training = tf1.placeholder_with_default(True, [], name="training")
            layer = tf_keras.layers.BatchNormalization(momentum=0.8)
            images = layer(tf.reshape(features, [-1, 1, 1, width]), training=training)
            features = tf.reshape(images, [-1, width])
        hidden = tf.tanh(tf.matmul(features, w) + b)
        if dropout:
            hidden = tf1.nn.dropout(hidden, rate=dropout, seed=11)
        pred = tf.squeeze(tf.matmul(hidden, v), 1)
        reduce = tf.reduce_sum if loss_sum else tf.reduce_mean
        err = tf.square(pred - y)
        loss = reduce(tf.boolean_mask(err, y > 0) if masked else err,
                      name="loss" if loss_sum != "and mean" else "data")
        if loss_sum == "and mean":
            loss = tf.add(loss, 0.5 * tf.reduce_mean(tf.abs(hidden)), name="loss")
        step = tf1.train.get_or_create_global_step()
        opt = OPTIMIZERS[optimizer]() if isinstance(optimizer, str) else optimizer()
        grads_and_vars = opt.compute_gradients(loss)
        if clip:
            grads, tvars = zip(*grads_and_vars)
            grads, _ = tf.clip_by_global_norm(grads, 0.5)
            grads_and_vars = list(zip(grads, tvars))
        train = opt.apply_gradients(grads_and_vars, global_step=step)
        if bn == "keras":                   # its moving statistics
            train = tf.group(train, *layer.updates)
        if ema:
            averages = tf1.train.ExponentialMovingAverage(0.9)
            with tf.control_dependencies([train]):
                train = averages.apply(tf1.trainable_variables())
        init = tf1.global_variables_initializer()
    handles = {"train": train, "loss": loss, "init": init, "pred": pred,
               "iterator_init": None if one_shot else it.initializer,
               "training": "training:0" if bn == "keras" else None}
    return g, handles


def counting_graph(predicate: str, step=None, applied=False):
    """A count of positive inputs (or `step`'s constant) added to `hits`
    inside a tf.cond on the data's mean ("data"), or on a fed scalar every
    replica shares ("fed"); with `applied`, the optimizer's update is
    applied under that cond too."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        flag = tf1.placeholder(tf.bool, [], name="flag")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        hits = tf1.get_variable("hits", initializer=np.float32(0), trainable=False)
        pred = tf.reduce_mean(x) > 0 if predicate == "data" else flag
        added = tf.reduce_sum(tf.sign(x)) if step is None else tf.constant(step)
        update = tf.cond(pred, lambda: tf1.assign_add(hits, added),
                         lambda: tf.identity(hits.read_value()))
        loss = tf.reduce_mean(tf.reduce_sum(x * w, 1))
        with tf.control_dependencies([update]):
            opt = tf1.train.GradientDescentOptimizer(0.1)
            train = tf.cond(pred, lambda: tf.group(opt.minimize(loss)), tf.no_op,
                            name="train") if applied else opt.minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    return g, dict(x=x, flag=flag, hits=hits, train=train, init=init, update=update)


def state_variable(name: str, resource: bool = True, width: int = 3):
    """A non-trainable float32 vector of zeros (state a step writes)."""
    return tf1.get_variable(name, initializer=np.zeros([width], np.float32), trainable=False,
                            use_resource=resource)


def variable_names(graph) -> list[str]:
    return [v.op.name for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)]


def read_name(var: str, graph) -> str:
    """A tensor holding the variable's value (resource or reference variable)."""
    if graph.get_operation_by_name(var).type == "VariableV2":
        return var + ":0"
    return var + "/Read/ReadVariableOp:0"


def train_single(graph, handles, steps, feeds=lambda step: None):
    """Train on one device with a plain Session (fed `feeds(step)` at each
    step); return every variable's value."""
    with tf1.Session(graph=graph) as sess:
        sess.run([h for h in (handles["init"], handles["iterator_init"]) if h is not None])
        for step in range(steps):
            sess.run(handles["train"], feeds(step))
        names = variable_names(graph)
        return dict(zip(names, sess.run([read_name(n, graph) for n in names])))


def fed_both(build, config, feeds: list) -> tuple[list, list]:
    """(2 replicas' values, one device's) of the tensors `build()` names
    (it returns the graph and their names) after a run of op "train" per
    feed dict of `feeds` (global batches), each from the graph's
    initializers."""
    g, reads = build()
    with pn.get_runner(g, local(2), config) as runner:
        runner.run([v.initializer for v in g.get_collection("variables")])
        for feed in feeds:
            runner.run("train", feed)
        got = runner.run(reads)
    g1, reads1 = build()
    with tf1.Session(graph=g1) as sess:
        sess.run(tf1.global_variables_initializer())
        for feed in feeds:
            sess.run("train", feed)
        return got, sess.run(reads1)


def worker_seed(base: int) -> int:
    """A seed for a job's script: different on each worker (so equal
    starting values prove worker 0's were broadcast), the same in every
    run (Adam turns float rounding in a gradient element that sums to about
    its epsilon into 1e-4 of difference; fresh draws in each run met one
    such element in about thirty runs)."""
    import os

    from parallax_ng import cluster
    info = cluster.from_env()
    return base + (info.task if info else int(os.environ.get("HOROVOD_RANK", "0")))


def local(n: int) -> dict:
    return {"hosts": [{"address": "127.0.0.1", "devices": [f"cpu:{k}" for k in range(n)]}]}


def load_values(sess, graph, values: dict) -> None:
    """Set variables of a plain session to `values` through their initializers."""
    by_name = {v.op.name: v for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)}
    for name, value in values.items():
        op = by_name[name].initializer
        sess.run(op, {op.inputs[1]: value})


def train_both(build, n, steps, resources=None, config=None, batch=4, seen=None):
    """Train build(batch) on n replicas and build(n*batch) on one device.

    The single-device run starts from the parallel run's initial values (so
    random initializers need no seed). Returns (parallel per-replica values,
    single values, names); `seen` (a dict) gets the runner's final plan and
    profile.
    """
    g, h = build(batch)
    names = variable_names(g)
    reads = [read_name(v, g) for v in names]
    with pn.get_runner(g, resources or local(n), config) as runner:
        runner.run([x for x in (h["init"], h.get("iterator_init")) if x is not None])
        start = runner.run(reads)
        for _ in range(steps):
            runner.run(h["train"])
        parallel = dict(zip(names, runner.run(reads, per_replica=True)))
        if seen is not None:
            seen.update(plan=runner.plan, profile=runner.profile)
    g1, h1 = build(n * batch)
    with tf1.Session(graph=g1) as sess:
        sess.run([x for x in (h1["init"], h1.get("iterator_init")) if x is not None])
        load_values(sess, g1, dict(zip(names, start)))
        for _ in range(steps):
            sess.run(h1["train"])
        single = dict(zip(names, sess.run(reads)))
    return parallel, single, names


def ctc_model():
    """A speech model in the usual CTC tutorials' shape: features, sequence
    lengths, a sparse_placeholder of labels, a time-major projection,
    tf.compat.v1.nn.ctc_loss, greedy decoding and its label error rate."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 6, 3], name="x")
        lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
        labels = tf.compat.v1.sparse_placeholder(tf.int32, name="labels")
        w = tf.compat.v1.get_variable(
            "w", initializer=np.random.RandomState(3).randn(3, 5).astype(np.float32) * 1.5)
        logits = tf.transpose(tf.tensordot(x, w, 1), (1, 0, 2))
        cost = tf.reduce_mean(tf.compat.v1.nn.ctc_loss(labels, logits, lengths))
        train = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(cost)
        decoded, _ = tf.compat.v1.nn.ctc_greedy_decoder(logits, lengths)
        errors = tf.reduce_mean(tf.edit_distance(tf.cast(decoded[0], tf.int32), labels))
        init = tf.compat.v1.global_variables_initializer()
    return g, dict(x=x, lengths=lengths, labels=labels, cost=cost, train=train,
                   decoded=decoded[0], errors=errors, init=init, w=w)


def recompute_step(optimizer: str = "sgd"):
    """(weights, Keras 3 optimizer, step) of two float64 dense layers in a
    tf.recompute_grad block, trained on a mean squared error: the backward
    reads the second layer's weights again for the first layer's gradient."""
    import keras
    r = np.random.default_rng(1)
    ws = [tf.Variable(r.normal(size=(4, 6))), tf.Variable(r.normal(size=(6, 1)))]
    opt = keras.optimizers.Adam(0.05) if optimizer == "adam" else \
        keras.optimizers.SGD(0.05, momentum=0.9)
    block = tf.recompute_grad(lambda x: tf.tanh(x @ ws[0]) @ ws[1])

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(block(x) - y))
        opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
        return loss
    return ws, opt, step

