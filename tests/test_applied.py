"""Statistics over the batch a step applies to its rows (graph/applied.py):
found through the ops that carry them (tf.math.divide_no_nan's too), read
as of the data where only the rows' shape comes from what the variables
compute, and what scales a Sum on its way to the rows."""
import numpy as np
import tensorflow as tf

from parallax_ng.graph.applied import alone, applied, counts_applied, fixed_bincount, of_data
from parallax_ng.graph.forms import sources
from parallax_ng.graph.rows import reading

tf1 = tf.compat.v1


def graph_of(make):
    """`make(x, z)` in a graph where x [None, 5] is fed and z = x @ w."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], "x")
        w = tf1.get_variable("w", initializer=np.ones((5, 4), np.float32))
        make(x, tf.matmul(x, w))
    return g, reading(sources(g), g)


def sums(g):
    return {op.name: op for op in g.get_operations() if op.type == "Sum"}


def test_weighted_moments_sums_are_applied_through_divide_no_nan():
    g, rows = graph_of(lambda x, z: tf.identity(
        z - tf.nn.weighted_moments(z, [0], tf.cast(x[:, :1] > 0, tf.float32),
                                   keepdims=True)[0], "out"))
    found = {name for name, op in sums(g).items() if applied(op, rows)}
    assert {"weighted_moments/weighted_input_sum", "weighted_moments/sum_of_weights"} <= found


def test_the_data_includes_a_mask_broadcast_to_the_rows_shape_and_an_iterators_rows():
    def make(x, z):
        mask = tf.broadcast_to(tf.cast(x[:, :1] > 0, tf.float32), tf.shape(z))
        tf.reduce_sum(mask, 0, name="count")
        tf.reduce_sum(z, 0, name="total")
        batch = tf1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices(np.ones((8, 3), np.float32)).batch(4)).get_next()
        tf.reduce_mean(batch, 0, name="fed")
    g, _ = graph_of(make)
    found = sums(g)
    assert of_data(found["count"]) and not of_data(found["total"])
    assert of_data(g.get_operation_by_name("fed"))


def test_what_scales_a_sum_on_its_way_to_the_rows():
    """l2_normalize over the batch: nothing (a constant); a masked mean:
    the mask's count; a sum over the rows' count, `sum / n`: that count,
    where nothing but the Sums' ways reads it (None where the program
    reads it besides); a sum over another statistic of what the variables
    compute: None unless that one is exchanged too."""
    def make(x, z):
        mask = tf.cast(x[:, :1] > 0, tf.float32)
        tf.nn.l2_normalize(z, axis=0, name="l2")
        tf.identity(z - tf.reduce_sum(z * mask, 0, name="masked") /
                    tf.reduce_sum(mask, 0, name="count"), "centred")
        n = tf.cast(tf.shape(z)[0], tf.float32, name="rows")
        tf.identity(z - tf.reduce_sum(z, 0, name="by_hand") / n, "by_hand_centred")
        m = tf.cast(tf.shape(z)[0], tf.float32, name="rows_too")
        tf.identity(z - tf.reduce_sum(z, 0, name="shared") / m, "shared_centred")
        tf.identity(m * 3.0, "read_besides")
        tf.identity(z * (tf.reduce_sum(z, 0, name="ratio") /
                         tf.reduce_sum(tf.square(z), 0, name="energy")), "scaled")
    g, rows = graph_of(make)
    found = sums(g)
    assert alone(found["l2/Sum"], rows) == []
    assert [op.name for op in alone(found["masked"], rows)] == ["count"]
    assert [op.name for op in alone(found["by_hand"], rows)] == ["rows"]
    assert alone(found["shared"], rows) is None
    assert alone(found["ratio"], rows) is None
    assert alone(found["ratio"], rows, frozenset({"energy"})) == []


def test_counts_per_class_taken_back_to_the_rows_and_counts_that_meet_them_alone():
    """A count per class gathered at each row's label is applied (a one-hot
    sum, a sum of conditions, a bincount whose length the graph fixes: not
    one that only a minimum bounds, whose length the labels set); a sum of
    a mask meets the rows alone (`l * m / sum(m)`), not as a mean's
    divisor; the rows' count applied to them alone is found (`l / n`,
    `l * (1 / n)`), not one that divides a Sum or that is read besides."""
    def make(x, z):
        label = tf.cast(x[:, 0] > 0, tf.int32)
        mask = tf.cast(x[:, 1] > 0, tf.float32)
        l = tf.reduce_sum(z, 1)
        tf.identity(l / tf.gather(tf.reduce_sum(tf.one_hot(label, 2), 0, name="hot"), label))
        conditions = tf.cast(tf.equal(label[:, None], tf.range(2)[None]), tf.float32)
        tf.identity(l / tf.gather(tf.reduce_sum(conditions, 0, name="met"), label))
        fixed = tf.math.bincount(label, minlength=2, maxlength=2, name="fixed")
        bounded = tf.math.bincount(label, minlength=2, name="bounded")
        tf.identity(l / tf.cast(tf.gather(fixed, label) + tf.gather(bounded, label), tf.float32))
        tf.identity(l * mask / tf.reduce_sum(mask, name="kept"))
        tf.identity(tf.reduce_sum(l * mask) / tf.reduce_sum(mask, name="divisor"))
        tf.identity(l / tf.cast(tf.shape(l)[0], tf.float32, name="per_row"))
        tf.identity(l * (1.0 / tf.cast(tf.shape(l)[0], tf.float32, name="inverse")))
        tf.identity(tf.reduce_sum(l) / tf.cast(tf.shape(l)[0], tf.float32, name="of_sum"))
        besides = tf.cast(tf.shape(l)[0], tf.float32, name="besides")
        tf.identity(l / besides)
        tf.identity(besides * 2.0, "read")
    g, rows = graph_of(make)
    found = sums(g)
    assert applied(found["hot"], rows) and applied(found["met"], rows)
    assert applied(found["kept"], rows) and not applied(found["divisor"], rows)
    bincounts = {op.name.split("/")[0]: op for op in g.get_operations()
                 if op.type == "DenseBincount"}
    assert fixed_bincount(bincounts["fixed"], rows) and applied(bincounts["fixed"], rows)
    assert not fixed_bincount(bincounts["bounded"], rows)
    assert sorted(op.name for op in counts_applied(g, rows)) == ["inverse", "per_row"]
