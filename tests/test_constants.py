"""graph/constants.py: values the graph fixes before any data flows, the
static size of a later axis read from a tensor's shape among them."""
import tensorflow as tf

from parallax_ng.graph.constants import (SOURCE_TYPES, constant_value, other_axis_size,
                                         static_size)
from parallax_ng.graph.rows import reading

tf1 = tf.compat.v1


def test_a_feature_count_read_from_the_shape_is_a_constant():
    g = tf.Graph()
    with g.as_default():
        y = tf1.placeholder(tf.float32, [None, 3], "y")
        z = tf1.placeholder(tf.float32, [None, None], "z")
        features = tf.shape(y)[1]
        plus_one = tf.cast(features, tf.float32) + 1.0
        rows = tf.shape(y)[0]
        open_width = tf.shape(z)[-1]
        folded = tf.constant(2.0) * 3.0
    count = len(g.get_operations())
    assert constant_value(features) == 3 and constant_value(plus_one) == 4.0
    assert constant_value(folded) == 6.0
    assert constant_value(rows) is None and constant_value(open_width) is None
    assert static_size(features.op) == 3 and static_size(rows.op) is None
    assert len(g.get_operations()) == count     # (computed in a graph of its own)
    axes = reading(["y", "z"], g).axis
    assert other_axis_size(features.op, axes) and other_axis_size(open_width.op, axes)
    assert not other_axis_size(rows.op, axes) and not other_axis_size(plus_one.op, axes)
    assert "Placeholder" in SOURCE_TYPES and "IteratorGetNext" in SOURCE_TYPES


def test_a_value_read_from_data_or_state_is_none():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], "x")
        v = tf1.get_variable("v", initializer=2.0)
        assert constant_value(tf.reduce_sum(x)) is None
        assert constant_value(v * 2.0) is None
        assert constant_value(tf.random.uniform([])) is None
