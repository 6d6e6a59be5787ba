"""Losses and optimizers as tf.compat.v1 scripts write them, 2 replicas
against one device with the global batch (every variable and slot within
1e-5 after 8 steps, each run option): tf.compat.v1.losses with per-example
weights (SUM_BY_NONZERO_WEIGHTS: a weighted mean over the examples whose
weight is not zero, a count that differs between replicas), label
smoothing plus the regularization losses, a masked mean over tokens
(sum(loss * mask) / sum(mask)), means over the examples or tokens a mask
picks (tf.boolean_mask, tf.gather at tf.where, tf.dynamic_partition: each
replica picks its own number), a piecewise-constant learning rate; and
centered RMSProp and AdagradDA on an embedding read by a gather."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import train_both

tf1 = tf.compat.v1
TOL = 1e-5
N_EX = 256


def arrays():
    """Ids of 6 tokens with a length each, features, a label among 3 and a
    weight (0 for about 40% of the examples)."""
    rng = np.random.RandomState(5)
    ids = rng.randint(0, 30, size=(N_EX, 6)).astype(np.int32)
    lengths = rng.randint(1, 7, size=(N_EX,)).astype(np.int32)
    x = rng.randn(N_EX, 5).astype(np.float32)
    label = rng.randint(0, 3, size=(N_EX,)).astype(np.int32)
    w = (rng.rand(N_EX) > 0.4).astype(np.float32) * rng.rand(N_EX).astype(np.float32)
    return ids, lengths, x, label, w


def builder(kind, optimizer):
    def build(batch):
        g = tf.Graph()
        with g.as_default():
            tf1.set_random_seed(1)
            ds = pn.shard(tf.data.Dataset.from_tensor_slices(arrays())).batch(batch).repeat()
            it = tf1.data.make_initializable_iterator(ds)
            ids, lengths, x, label, w = it.get_next()
            rng = np.random.RandomState(2)
            emb = tf1.get_variable("emb", initializer=rng.randn(30, 4).astype(np.float32))
            rows = tf1.nn.embedding_lookup(emb, ids)                 # [b, 6, 4]
            mask = tf.sequence_mask(lengths, 6, dtype=tf.float32)   # [b, 6]
            pooled = tf.reduce_sum(rows * mask[:, :, None], 1) / tf.reduce_sum(mask, 1,
                                                                              keepdims=True)
            h = tf1.layers.dense(tf.concat([pooled, x], 1), 8, tf.nn.relu,
                                 kernel_regularizer=tf.keras.regularizers.l2(0.01)
                                 if kind == "reg" else None,
                                 kernel_initializer=tf1.constant_initializer(
                                     rng.randn(9, 8).astype(np.float32) * 0.3))
            logits = tf1.layers.dense(h, 3, kernel_initializer=tf1.constant_initializer(
                rng.randn(8, 3).astype(np.float32) * 0.3))
            step = tf1.train.get_or_create_global_step()
            if kind == "reg":
                onehot = tf.one_hot(label, 3)
                loss = tf1.losses.softmax_cross_entropy(onehot, logits, label_smoothing=0.1)
                loss = loss + tf1.losses.get_regularization_loss()
            elif kind == "weighted":
                loss = tf1.losses.sparse_softmax_cross_entropy(label, logits, weights=w)
            elif kind == "token":
                # per-token loss over the ids, masked mean by token count
                tok = tf.reduce_sum(rows, 2)                       # [b, 6]
                per = tf.square(tok - tf.cast(label, tf.float32)[:, None])
                loss = tf.reduce_sum(per * mask) / tf.reduce_sum(mask)
            elif kind == "selected":      # a mean over the weighted examples' rows
                per = tf1.losses.sparse_softmax_cross_entropy(
                    label, logits, reduction=tf1.losses.Reduction.NONE)
                loss = tf.reduce_mean(tf.boolean_mask(per, w > 0))
            elif kind == "gathered":      # the same, gathered at tf.where's indices
                per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label, logits=logits)
                picked = tf.gather(per, tf.where(w > 0)[:, 0])
                loss = tf.reduce_sum(picked) / tf.cast(tf.size(picked), tf.float32)
            elif kind == "partitioned":   # a mean over each partition of the examples
                per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label, logits=logits)
                parts = tf.dynamic_partition(per, tf.cast(w > 0, tf.int32), 2)
                loss = tf.reduce_mean(parts[1]) + 0.5 * tf.reduce_mean(parts[0])
            elif kind == "selected-tokens":       # a mean over the tokens a mask keeps
                tok = tf.reduce_sum(rows, 2) - tf.cast(label, tf.float32)[:, None]
                loss = tf.reduce_mean(tf.square(tf.boolean_mask(tok, mask > 0)))
            else:
                loss = tf1.losses.sparse_softmax_cross_entropy(label, logits)
            lr = tf1.train.piecewise_constant(step, [3, 6], [0.1, 0.05, 0.02])
            opt = optimizer(lr)
            train = opt.minimize(loss, global_step=step)
            init = tf1.global_variables_initializer()
        return g, {"train": train, "loss": loss, "init": init,
                   "iterator_init": it.initializer}
    return build


OPTS = {
    "rms-centered": lambda lr: tf1.train.RMSPropOptimizer(lr, momentum=0.3, centered=True),
    "adagrad-da": lambda lr: tf1.train.AdagradDAOptimizer(
        0.1, tf1.train.get_global_step(), l1_regularization_strength=0.001,
        l2_regularization_strength=0.001),
    "nesterov": lambda lr: tf1.train.MomentumOptimizer(lr, 0.9, use_nesterov=True),
    "adam": lambda lr: tf1.train.AdamOptimizer(lr),
}
CASES = [(k, o, r) for k in ("plain", "reg", "weighted", "token") for o in OPTS
         for r in ("hybrid", "allreduce", "ps")
         if k == "plain" or o in ("adam", "nesterov")] + [
    (k, "adam", r) for k in ("selected", "gathered", "selected-tokens", "partitioned")
    for r in ("hybrid", "allreduce", "ps")]


@pytest.mark.parametrize("kind,opt,run", CASES, ids=["-".join(c) for c in CASES])
def test_replicas_equal_one_device(kind, opt, run):
    parallel, single, names = train_both(builder(kind, OPTS[opt]), 2, 8,
                                         config={"run_option": run}, batch=6)
    worst = []
    for name in names:
        for k, got in enumerate(parallel[name]):
            diff = float(np.max(np.abs(np.asarray(got) - single[name])))
            worst.append((diff, name, k))
    worst.sort(reverse=True)
    assert worst[0][0] <= TOL, worst[:4]
