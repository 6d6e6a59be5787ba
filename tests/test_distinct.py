"""Distinct ids (parallax_ng/graph/distinct.py): which sparse gradients hold
each id once on one device."""
import tensorflow as tf
from models import embedding_regression

from parallax_ng.graph import distinct, frontend


def test_gradients_that_hold_each_id_once():
    """embedding_lookup_sparse gathers the batch's distinct ids (a Unique):
    its table's gradient holds each id once (rows_unique), and so does each
    part of a table in row ranges; a gather of the ids themselves repeats
    them."""
    gathered, _ = embedding_regression(4, "adagrad")
    tg = frontend.load(gathered)
    assert tg.rows_unique == frozenset()
    assert not distinct.holds_each_id_once(tg, tg.gradients["emb"].indices)
    tg = frontend.load(embedding_regression(4, "adagrad", lookup="sparse")[0])
    assert tg.rows_unique == {"emb"} and not tg.rows_alike
    parts = frontend.load(embedding_regression(4, "adagrad", lookup="sparse", partitions=2)[0])
    assert parts.rows_unique == {"emb/part_0", "emb/part_1"}


def test_ids_computed_from_the_batch_are_not_distinct():
    """A part of ids that are not one Unique's (the batch's own ids split
    by DynamicPartition) repeats them."""
    g = tf.Graph()
    with g.as_default():
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        parts = tf.dynamic_partition(ids, ids % 2, 2)
        table = tf.Variable(tf.ones([10, 2]), name="table")
        loss = tf.reduce_sum(tf.gather(table, parts[0]))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert frontend.load(g).rows_unique == frozenset()
