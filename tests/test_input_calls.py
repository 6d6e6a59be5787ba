"""parallax_ng/graph/input_calls.py: a TF1 graph's tf.gradients calls with
respect to its inputs, told apart from its training calls by the scope
that holds the gradients the updates read; noted in a copy of the graph,
the user's left as it is; none where a gradient lies outside every
autodiff scope (an accumulator's read)."""
import tensorflow as tf

from parallax_ng.graph import forms, frontend, input_calls, recorders

tf1 = tf.compat.v1


def graph(accumulate=False):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], name="x")
        w = tf1.get_variable("w", [5, 1])
        value = tf.reduce_mean(tf.matmul(x, w), name="value")
        gx = tf.gradients(value, x)[0]                           # an input's gradient
        loss = tf.reduce_mean(tf.square(tf.matmul(x + tf.sign(gx), w)), name="loss")
        opt = tf1.train.GradientDescentOptimizer(0.1)
        if accumulate:
            acc = tf1.get_variable("acc", [5, 1], trainable=False)
            add = acc.assign_add(tf.gradients(loss, w)[0])
            with tf.control_dependencies([add]):
                opt.apply_gradients([(acc.read_value(), w)])
        else:
            opt.minimize(loss)
    return g


def test_the_call_of_an_input_is_noted_in_a_copy_and_is_no_loss():
    g = graph()
    assert [t.name for t in forms.autodiff_losses(g)] == ["value:0", "loss:0"]
    tg = frontend.load(g)
    [(targets, [seed], [])] = input_calls.calls(tg)
    assert targets == ["value:0"] and seed == "gradients/grad_ys_0:0"
    assert tg.graph is not g and not g.get_collection(recorders.INPUT_GRADIENTS)
    assert recorders.input_gradients(tg.graph) == [(targets, [seed])]
    assert [t.name for t in forms.autodiff_losses(tg.graph)] == ["loss:0"]
    assert tg.graph.get_operation_by_name("gradients_1/grad_ys_0").type == "Fill"


def test_calls_that_cannot_be_told_apart_all_count_as_training():
    tg = frontend.load(graph(accumulate=True))
    assert tg.accumulators and input_calls.calls(tg) == []
    assert tg.graph is tg.user_graph
