"""How layer-by-layer execution cuts a model's forward pass (parallax_ng/l2l/layers.py),
and the graphs it refuses, with the op named."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from parallax_ng.graph import frontend
from parallax_ng.l2l import layers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import transformer_stack  # noqa: E402

tf1 = tf.compat.v1
REGEX = r"encoder/layer_(\d+)/"


def _example(n=3):
    args = transformer_stack.arguments(["--layers", str(n), "--dim", "8", "--ffn", "16",
                                        "--batch", "4", "--seq", "4"])
    return transformer_stack.build(args)


def test_transformer_stack_cut_into_pre_layers_post():
    g, _, loss, _ = _example(3)
    lay = layers.split(frontend.load(g), REGEX)
    assert lay.loss == loss.name
    assert [s.name for s in lay.segments] == ["pre", "layer_0", "layer_1", "layer_2", "post"]
    pre, first, *_, last, post = lay.segments
    if g.get_operation_by_name("embedding").type == "VarHandleOp":
        assert pre.handles == ["embedding"] and not pre.weights   # gathered on the host
    else:       # a reference variable (disable_v2_behavior): gathered from its read
        assert list(pre.weights) == ["embedding"] and not pre.handles
    assert pre.inputs == ["IteratorGetNext:0"]
    assert sorted(first.weights) == sorted(
        f"encoder/layer_0/{n}" for n in ("q", "k", "v", "o", "ffn/w1", "ffn/b1", "ffn/w2",
                                         "norm_1/gain", "norm_1/bias", "norm_2/gain",
                                         "norm_2/bias"))
    # one tensor crosses each layer boundary; the labels go to the head
    assert first.inputs == pre.outputs and len(first.outputs) == 1
    assert post.inputs == last.outputs + ["IteratorGetNext:1"]
    assert sorted(post.weights) == ["final_norm/bias", "final_norm/gain", "head/w"]
    for seg in lay.segments:        # no op before one it reads
        pos = lay.segments.index(seg)
        for name in seg.ops:
            for t in g.get_operation_by_name(name).inputs:
                assert lay.segment_of.get(t.op.name, 0) <= pos


def _mlp(build_layer=None, loss_shape="scalar"):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        h = x
        for i in range(2):
            with tf1.variable_scope(f"block_{i}"):
                h = tf.tanh(tf.matmul(h, tf1.get_variable("w", [4, 4])))
                if build_layer:
                    h = build_layer(h)
        per_example = tf.reduce_sum(h * h, 1)
        loss = tf.reduce_mean(per_example, name="loss") if loss_shape == "scalar" else \
            per_example
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return g, loss, train


def test_loss_found_for_static_and_dynamic_shapes_and_by_name():
    g, loss, _ = _mlp()
    assert layers.find_loss(g) is loss                # scalar: a constant shape
    g, loss, _ = _mlp(loss_shape="vector")
    assert layers.find_loss(g) is loss                # [None]: Shape(loss)
    assert layers.find_loss(g, loss.op.name) is loss
    with pytest.raises(pn.GraphError, match="'l2l.loss' names 'nope'"):
        layers.find_loss(g, "nope")


def test_two_gradient_calls_need_the_loss_named():
    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("block_0/w", [2])
        a, b = tf.reduce_sum(w * w, name="a"), tf.reduce_sum(w, name="b")
        tf1.train.GradientDescentOptimizer(0.1).minimize(a)
        tf1.train.GradientDescentOptimizer(0.1).minimize(b)
    with pytest.raises(pn.GraphError, match="a:0, b:0.*'l2l.loss'"):
        layers.find_loss(g)
    assert layers.find_loss(g, "b").name == "b:0"


def test_regex_that_matches_no_variable_or_captures_no_number():
    g, _, _ = _mlp()
    tg = frontend.load(g)
    with pytest.raises(pn.GraphError, match="matches no variable.*block_0/w"):
        layers.split(tg, r"encoder/layer_(\d+)/")
    with pytest.raises(pn.GraphError, match="captured 'block'"):
        layers.split(tg, r"(block)_\d+/")
    lay = layers.split(tg, r"block_(\d+)/")
    assert [s.name for s in lay.segments] == ["layer_0", "layer_1", "post"]


def test_keras_default_names_number_the_first_layer_zero():
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        h = x
        for _ in range(3):
            h = tf_keras.layers.Dense(4, activation="tanh")(h)       # dense, dense_1, dense_2
        loss = tf.reduce_mean(tf.square(h))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    lay = layers.split(frontend.load(g), r"^dense(?:_(\d+))?/")
    assert [s.name for s in lay.segments] == ["layer_0", "layer_1", "layer_2", "post"]
    assert all(n.startswith("dense/") for n in lay.segments[0].weights)


def test_random_ops_it_cannot_redraw_are_refused_with_the_op_named():
    g, _, _ = _mlp(lambda h: h + tf.random.shuffle(h))
    with pytest.raises(pn.GraphError, match=r"block_0/RandomShuffle.*draws random.*"
                                            r"RandomUniform"):
        layers.split(frontend.load(g), r"block_(\d+)/")


def test_dropout_and_noise_are_listed_by_name():
    def noisy(h):
        h = tf.nn.dropout(h, rate=0.5) + tf.random.truncated_normal(tf.shape(h))
        return h + tf.random.normal(tf.shape(h)) * tf.cast(
            tf.random.uniform([], 0, 3, tf.int32), tf.float32)
    g, _, _ = _mlp(noisy)
    lay = layers.split(frontend.load(g), r"block_(\d+)/")
    drawn = sorted(op.name for op in g.get_operations()
                   if op.type in layers.STATELESS and "Initializer" not in op.name)
    assert lay.random == drawn
    assert {g.get_operation_by_name(n).type for n in drawn} == set(layers.STATELESS)
    assert [lay.segment_of[n] for n in drawn] == [int(n[len("block_")]) for n in drawn]


def test_v1_control_flow_in_a_layer_is_refused():
    from tensorflow.python.ops import control_flow_util
    was_v2 = control_flow_util.ENABLE_CONTROL_FLOW_V2     # v1 under disable_v2_behavior
    tf1.disable_control_flow_v2()
    try:
        g, _, _ = _mlp(lambda h: tf1.cond(tf.reduce_sum(h) > 0, lambda: h * 2.0, lambda: h))
    finally:
        if was_v2:          # the process's as it was, for the tests after this one
            tf1.enable_control_flow_v2()
    with pytest.raises(pn.GraphError, match=r"\(Switch\).*enable_control_flow_v2"):
        layers.split(frontend.load(g), r"block_(\d+)/")


def test_updates_that_read_the_forward_are_refused():
    """A moving average of a batch statistic, updated with the training op."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        with tf1.variable_scope("block_0"):
            h = tf.matmul(x, tf1.get_variable("w", [4, 4]))
            moving = tf1.get_variable("moving_mean", [4], trainable=False,
                                      initializer=tf1.zeros_initializer())
            mean = tf.reduce_mean(h, 0)
        update = tf1.assign(moving, 0.9 * moving + 0.1 * mean)
        loss = tf.reduce_mean(h * h)
        with tf.control_dependencies([update]):
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(pn.GraphError, match="'block_0/Mean' \\(Mean\\) reads 'block_0/MatMul'"):
        pn.get_runner(g, {"hosts": [{"devices": ["cpu:1"]}]},
                      {"l2l": {"layers": r"block_(\d+)/"}})
    del train


def test_constants_are_copied_where_used_not_cut():
    g, _, _ = _mlp(lambda h: h * tf.constant(np.float32(0.5)))
    lay = layers.split(frontend.load(g), r"block_(\d+)/")
    assert all(not lay.segments[1].inputs[i].startswith("block_0/Const")
               for i in range(len(lay.segments[1].inputs)))
    assert any(name.endswith("Const") for name in lay.free)
