"""Ops that mix the batch's examples (parallax_ng/graph/mixing.py): found
between the data and a loss where the loss compares examples with each
other, and not in the usual layers (dense, attention within an example,
softmax over classes, a scan over time)."""
import pytest
import tensorflow as tf

from parallax_ng.graph.mixing import mixing

tf1 = tf.compat.v1


def scores(x):
    return tf.sigmoid(tf.matmul(x[:, 0], tf.Variable(tf.ones((4, 4)))))


def per_example(x):
    return tf.reduce_sum(tf.square(tf.matmul(x[:, 0], tf.ones((4, 4)))), 1)     # [batch]


def labels(x):
    return tf.cast(x[:, 0, 0] > 0, tf.int32)


def label_counts(x):
    """Each example's count of its label among the batch's."""
    _, at, count = tf.unique_with_counts(labels(x))
    return tf.cast(tf.gather(count, at), tf.float32)


def virtual(x):
    """tf_keras BatchNormalization's virtual batches of 2: [2, -1, ...]."""
    return tf.reshape(scores(x), [2, -1, 4])


MIXING = {   # name: (loss of x [batch, time, 4], what the op does)
    "hardest k": (lambda x: tf.reduce_mean(tf.math.top_k(per_example(x), 3)[0]), "top k"),
    "sorted": (lambda x: tf.reduce_sum(tf.sort(per_example(x))[:2]), "top k"),
    "softmax over the batch": (lambda x: -tf.reduce_sum(tf.nn.log_softmax(per_example(x))),
                               "softmax"),
    "running total": (lambda x: tf.reduce_sum(tf.cumsum(per_example(x))), "running total"),
    "in-batch negatives": (
        lambda x: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.range(tf.shape(x)[0]), tf.matmul(x[:, 0], x[:, 1], transpose_b=True))),
        "every example scored against every other"),
    "einsum pairs": (lambda x: tf.reduce_sum(tf.einsum("id,jd->ij", x[:, 0], x[:, 1])),
                     "einsum"),
    "dice": (lambda x: 1.0 - 2.0 * tf.reduce_sum(x[:, 0] * scores(x)) / (
        tf.reduce_sum(x[:, 0]) + tf.reduce_sum(scores(x)) + 1e-7), "Dice"),
    "balanced by unique counts": (      # each example weighed by 1 / its label's count
        lambda x: tf.reduce_sum(per_example(x) / label_counts(x)), "count of each value"),
    "balanced by bincount": (
        lambda x: tf.reduce_sum(per_example(x) / tf.cast(tf.gather(tf.math.bincount(
            labels(x), minlength=4), labels(x)), tf.float32)), "count of each value"),
    # batch-hard triplet mining: distances of every example to every other
    "pairwise distances": (lambda x: tf.reduce_mean(tf.reduce_max(tf.reduce_sum(tf.square(
        scores(x)[:, None, :] - scores(x)[None, :, :]), -1), 1)), "broadcast pairs"),
    "log-sum-exp over the batch": (lambda x: tf.reduce_logsumexp(per_example(x)), "log of a sum"),
    "log of a sum by hand": (lambda x: -tf.reduce_sum(per_example(x)) + 8.0 * tf.math.log(
        tf.reduce_sum(tf.exp(per_example(x)))), "log of a sum"),
    "labels compared pairwise": (lambda x: tf.reduce_sum(per_example(x) * tf.reduce_sum(
        tf.cast(tf.equal(labels(x)[None], labels(x)[:, None]), tf.float32), 0)),
        "broadcast pairs"),
    # mixup with the batch reversed, rolled or shuffled: example i meets another
    "mixup by a reversal": (lambda x: tf.reduce_mean(scores(0.7 * x + 0.3 * tf.reverse(
        x, [0]))), "another order"),
    "shifted pairs": (lambda x: tf.reduce_mean(per_example(x) * tf.roll(per_example(x), 1, 0)),
                      "another order"),
    "mixup by a reversed range": (lambda x: tf.reduce_mean(scores(x + tf.gather(
        x, tf.range(tf.shape(x)[0] - 1, -1, -1)))), "another order"),
    "mixup by a shuffle": (lambda x: tf.reduce_mean(scores(x + tf.gather(x, tf.random.shuffle(
        tf.range(tf.shape(x)[0]))))), "another order"),
    # a statistic per label over the batch: prototypes, class centers, a mean per class
    "prototypes": (lambda x: tf.reduce_mean(tf.square(scores(x) - tf.gather(
        tf.math.unsorted_segment_mean(scores(x), labels(x), 2), labels(x)))), "per group"),
    "class centers by hand": (lambda x: tf.reduce_sum(tf.square(scores(x) - tf.gather(
        tf.math.unsorted_segment_sum(scores(x), labels(x), 2), labels(x)))), "per group"),
    # class centers as a product of the labels' one-hot codes with the rows:
    # a sum over the batch of what the model computes, gathered at the labels
    "class centers of a one-hot product": (lambda x: tf.reduce_sum(tf.square(scores(x) - tf.gather(
        tf.matmul(tf.one_hot(labels(x), 2), scores(x), transpose_a=True), labels(x)))),
        "taken back to each example"),
    "a largest loss per class": (lambda x: tf.reduce_sum(tf.math.unsorted_segment_max(
        per_example(x), labels(x), 2)), "per group"),
    # ghost batch normalization: virtual batches of rows a stride apart
    "virtual batches": (lambda x: tf.reduce_sum(tf.square(virtual(x) - tf.reduce_mean(
        virtual(x), 0))), "the batch's over k"),
    "virtual batches, legacy": (lambda x: tf.reduce_sum(tf.square(virtual(x) - tf.reduce_mean(
        virtual(x), 1, keepdims=True))), "the batch's over k"),
    # an AUC surrogate: each positive's score against each negative's,
    # picked by masks of the labels
    "pairs of masked rows": (lambda x: tf.reduce_mean(tf.sigmoid(tf.boolean_mask(
        per_example(x), labels(x) > 0)[None, :] - tf.boolean_mask(
        per_example(x), labels(x) < 1)[:, None])), "broadcast pairs"),
    "rows appended": (lambda x: tf.reduce_mean(tf.concat([per_example(x), tf.zeros([3])], 0)),
                      "not examples"),
}
SEPARATE = {
    "dense classifier": lambda x: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        tf.zeros([tf.shape(x)[0]], tf.int32), tf.matmul(x[:, 0], tf.ones((4, 3))))),
    "attention within an example": lambda x: tf.reduce_sum(tf.matmul(tf.nn.softmax(tf.matmul(
        x, x, transpose_b=True)), x)),
    "attention by einsum": lambda x: tf.reduce_sum(tf.einsum("bts,bsd->btd", tf.nn.softmax(
        tf.einsum("btd,bsd->bts", x, x)), x)),
    "top k of classes": lambda x: tf.reduce_sum(tf.math.top_k(x[:, 0], 2)[0]),
    "unique labels, each its own": lambda x: tf.reduce_sum(per_example(x) * tf.cast(
        tf.gather(tf.unique(labels(x))[0], tf.unique(labels(x))[1]), tf.float32)),
    "scan over time": lambda x: tf.reduce_mean(tf.cumsum(x, 1)),
    # a one-hot or multi-hot code per row (tf_keras's Hashing and
    # CategoryEncoding): counts within each row, as tf.math.bincount's axis=-1
    # makes them (was taken for a count over the batch)
    "counts within each row": lambda x: tf.reduce_mean(scores(x) * tf.cast(tf.math.bincount(
        tf.cast(tf.abs(x[:, 0]) * 3, tf.int32), minlength=4, maxlength=4, axis=-1,
        binary_output=True), tf.float32)),
    # broadcasting within an example: an outer product of its features, its
    # time steps against each other, a time-major tensor and a row per example
    "outer product per example": lambda x: tf.reduce_sum(x[:, 0, :, None] * x[:, 0, None, :]),
    "time steps pairwise": lambda x: tf.reduce_sum(tf.abs(x[:, :, None] - x[:, None, :])),
    "log-sum-exp per example": lambda x: tf.reduce_mean(tf.reduce_logsumexp(x[:, 0], 1)),
    "log of a sum over time": lambda x: tf.reduce_sum(tf.math.log(tf.reduce_sum(
        tf.exp(x), 1))),
    "time-major plus a row": lambda x: tf.reduce_sum(tf.transpose(x, [1, 0, 2]) + x[:, 0]),
    "gram matrix of the batch": lambda x: tf.reduce_sum(tf.matmul(x[:, 0], x[:, 0],
                                                                  transpose_a=True)),
    # rows reordered alike, or reduced alone: each example meets itself
    "reversed twice": lambda x: tf.reduce_sum(scores(tf.reverse(tf.reverse(x, [0]), [0])) *
                                              x[:, 0]),
    "rolled alike": lambda x: tf.reduce_mean(tf.roll(scores(x), 2, 0) * tf.roll(x[:, 0], 2, 0)),
    "a mean of shuffled rows": lambda x: tf.reduce_mean(tf.random.shuffle(per_example(x))),
    "reversed along time": lambda x: tf.reduce_sum(tf.reverse(x, [1]) * x),
    # a sum per class weighed per class is a sum of the examples' terms
    "pairs of consecutive rows": lambda x: tf.reduce_sum(tf.reduce_mean(tf.reshape(
        scores(x), [-1, 2, 4]), 1)),
    "two batches joined": lambda x: tf.reduce_mean(tf.concat([x[:, 0], x[:, 1]], 0)),
    "features joined": lambda x: tf.reduce_mean(tf.concat([x[:, 0], tf.zeros_like(x[:, 0])],
                                                          1)),
    "class-weighted sums": lambda x: tf.reduce_sum(tf.math.unsorted_segment_sum(
        per_example(x), labels(x), 2) * tf.constant([1.0, 2.0])),
    "masked mean": lambda x: tf.reduce_sum(scores(x) * tf.cast(x[:, 0] > 0, tf.float32)) / (
        tf.reduce_sum(tf.cast(x[:, 0] > 0, tf.float32)) + 1.0),
    "a mean of masked rows": lambda x: tf.reduce_mean(tf.boolean_mask(per_example(x),
                                                                       labels(x) > 0)),
    "masked rows met with their masked labels": lambda x: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.boolean_mask(labels(x), x[:, 0, 1] > 0), tf.boolean_mask(scores(x),
                                                                      x[:, 0, 1] > 0))),
    "mean over a count": lambda x: tf.reduce_sum(scores(x)) / tf.cast(tf.size(x), tf.float32),
    # TF1's losses divide by a count of `ones_like(losses)`: the model's
    # outputs' shape, not their values
    "tf1 log loss": lambda x: tf1.losses.log_loss(x[:, 0], scores(x)),
    "tf1 weighted squared error": lambda x: tf1.losses.mean_squared_error(
        x[:, 0], scores(x), weights=tf.cast(x[:, 0] > 0.5, tf.float32)),
    "tf1 softmax cross entropy": lambda x: tf1.losses.sparse_softmax_cross_entropy(
        tf.zeros([tf.shape(x)[0]], tf.int32), scores(x)),
    # weights from the model's outputs (a focal weighting): TF1 divides by
    # the count of nonzero weights, a count of a condition
    "tf1 loss weighted by the model": lambda x: tf1.losses.mean_squared_error(
        x[:, 0], scores(x), weights=tf.square(1.0 - scores(x)),
        reduction=tf1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS),
}


def loss_of(build):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, (None, 5, 4), name="x")
        loss = build(x)
    return loss


@pytest.mark.parametrize("name", sorted(MIXING))
def test_a_loss_that_compares_examples_is_found(name):
    build, what = MIXING[name]
    found = mixing(loss_of(build), ["x"])
    assert found is not None and what in found[1], found


@pytest.mark.parametrize("name", sorted(SEPARATE))
def test_per_example_layers_do_not_mix(name):
    assert mixing(loss_of(SEPARATE[name]), ["x"]) is None


def test_a_ratio_of_means_the_replicas_exchange_does_not_mix():
    """A mean of the model's outputs over another (forms.LossForm.exchanged):
    each replica divides by the job's mean, so the division mixes nothing;
    a Dice loss's division by a sum stays found."""
    from parallax_ng.graph.forms import loss_form
    ratio = loss_of(lambda x: tf.reduce_mean(scores(x)) / tf.reduce_mean(tf.square(scores(x))))
    assert "a division by a sum" in mixing(ratio, ["x"])[1]
    exchanged = loss_form(ratio, ["x"], None).exchanged
    assert len(exchanged) == 2 and mixing(ratio, ["x"], exchanged) is None
    dice = loss_of(lambda x: tf.reduce_sum(scores(x)) / tf.reduce_sum(tf.square(scores(x))))
    assert loss_form(dice, ["x"], None).exchanged == []
    assert "a division by a sum" in mixing(dice, ["x"], [])[1]


def test_a_fed_flag_beside_the_rows_is_no_pair():
    """A scalar fed beside the batch (a lowered tf.cond's flag at its Switch,
    a weight that multiplies the rows) holds no rows: not a broadcast pair
    (before: a count the nested conds of tests/test_cond_lowering.py add
    to was averaged as one)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, (None, 5, 4), name="x")
        flag = tf1.placeholder(tf.bool, [], name="flag")
        scale = tf1.placeholder(tf.float32, [], name="scale")
        taken = tf.raw_ops.Switch(data=scores(x), pred=flag)[1]
        loss = tf.reduce_sum(taken * scale)
    assert mixing(loss, ["x", "flag", "scale"]) is None


def test_ghost_batch_normalization_is_named(capsys):
    """tf_keras's BatchNormalization with `virtual_batch_size`: its virtual
    batches hold rows a stride apart in the batch (0.32 apart from one
    device after 4 steps, silently, before this line)."""
    import numpy as np

    import parallax_ng as pn
    from models import local
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        h = tf1.layers.batch_normalization(tf1.layers.dense(x, 8), training=True,
                                           virtual_batch_size=2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf1.layers.dense(h, 3)))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    with pn.get_runner(g, local(2)) as runner:
        runner.run(init)
        runner.run(train, {x: np.ones((8, 6), np.float32), y: np.zeros(8, np.int32)})
    err = capsys.readouterr().err
    assert "mixes the batch's examples" in err and "virtual_batch_size" in err, err
