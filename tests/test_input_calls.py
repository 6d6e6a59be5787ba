"""parallax_ng/graph/input_calls.py: a TF1 graph's tf.gradients calls with
respect to its inputs, told apart from its training calls by the scope
that holds the gradients the updates read and by its results' batch
rows; noted in a copy of the graph, the user's left as it is; none where
a gradient lies outside every autodiff scope (an accumulator's read), nor
a call of a variable's gradient that the step uses (fast weights). A TF1
graph with FGSM, a penalty on a mean's input gradient (0.06 away before)
and one on a sum's equals one device, 2 replicas, 6 Adam steps, 1e-5,
the fetched gradient too (also under disable_v2_behavior:
tests/test_v1_behavior.py)."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.graph import forms, frontend, input_calls, recorders

tf1 = tf.compat.v1
TOL = 1e-5


def ce(logits, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def data(steps=6):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(steps, 16, 5)).astype("float32"),
            rng.integers(0, 3, (steps, 16)).astype("int32"))


def worst(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


def graph(accumulate=False, fast_weights=False):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], name="x")
        w = tf1.get_variable("w", [5, 1])
        value = tf.reduce_mean(tf.matmul(x, w), name="value")
        if fast_weights:        # meta-learning: a variable stepped on by its own gradient
            fast = w - 0.1 * tf.gradients(value, w)[0]
            loss = tf.reduce_mean(tf.square(tf.matmul(x, fast)), name="loss")
        else:
            gx = tf.gradients(value, x)[0]                       # an input's gradient
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
    [(targets, [seed], rows)] = input_calls.calls(tg)
    assert targets == ["value:0"] and seed == "gradients/grad_ys_0:0"
    assert rows == [("gradients/MatMul_grad/MatMul:0", "x:0")]      # the result has x's rows
    assert tg.graph is not g and not g.get_collection(recorders.INPUT_GRADIENTS)
    assert recorders.input_gradients(tg.graph) == [(targets, [seed])]
    assert [t.name for t in forms.autodiff_losses(tg.graph)] == ["loss:0"]
    assert tg.graph.get_operation_by_name("gradients_1/grad_ys_0").type == "Fill"


def test_calls_that_cannot_be_told_apart_all_count_as_training():
    tg = frontend.load(graph(accumulate=True))
    assert tg.accumulators and input_calls.calls(tg) == []
    assert tg.graph is tg.user_graph
    tg = frontend.load(graph(fast_weights=True))     # a variable's gradient: not an input's
    assert input_calls.calls(tg) == [] and tg.graph is tg.user_graph
    assert [t.name for t in forms.autodiff_losses(tg.graph)] == ["value:0", "loss:0"]


def tf1_graph(case):
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        w1, w2 = tf.compat.v1.get_variable("w1", [5, 8]), tf.compat.v1.get_variable("w2", [8, 3])

        def net(a):
            return tf.matmul(tf.tanh(tf.matmul(a, w1)), w2)
        if case == "wgan-gp":       # interpolates between x and x reversed, read twice
            between = 0.3 * x + 0.7 * tf.reverse(x, [1])
            grad = tf.gradients(tf.reduce_sum(net(between)) + tf.reduce_sum(between * 0.1),
                                [between])[0]
            slopes = tf.sqrt(tf.reduce_sum(tf.square(grad), 1) + 1e-8)
            loss = ce(net(x), y) + 10.0 * tf.reduce_mean(tf.square(slopes - 1.0))
        elif case == "fgsm":
            grad = tf.gradients(ce(net(x), y), x)[0]
            loss = 0.5 * ce(net(x), y) + 0.5 * ce(net(x + 0.1 * tf.sign(grad)), y)
        else:
            value = ce(net(x), y) if case == "mean" else tf.reduce_sum(net(x) * tf.one_hot(y, 3))
            grad = tf.gradients(value, x)[0]
            loss = ce(net(x), y) + 10.0 * tf.reduce_mean(tf.reduce_sum(grad ** 2, 1))
        train = tf.compat.v1.train.AdamOptimizer(0.02).minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    return g, x, y, loss, train, init, [w1, w2], grad


@pytest.mark.parametrize("case", ["fgsm", "mean", "sum", "wgan-gp"])
def test_a_tf1_graph_with_an_inputs_gradient_equals_one_device(case, capsys):
    """tf.gradients(value, x): graph/input_calls.py tells the call apart,
    and its result has the rows of x, so a loss with a penalty on it (a
    gradient norm's mean, WGAN-GP's on interpolates read by several
    layers) is a mean over the batch, not of unknown form (before: "the
    graph does not show whether the loss ... is a mean or a sum")."""
    xs, ys = data()
    out = []
    for parallel in (False, True):
        g, x, y, loss, train, init, ws, grad = tf1_graph(case)
        session = pn.get_runner(g, local(2)) if parallel else tf.compat.v1.Session(graph=g)
        with session:
            session.run(init)
            runs = [session.run([train, loss, grad], {x: a, y: b})[1:] for a, b in zip(xs, ys)]
            out.append(([r[0] for r in runs], session.run(ws), [r[1] for r in runs]))
        if parallel:
            assert not g.get_collection(recorders.INPUT_GRADIENTS)   # the user's graph as it was
            report = next(r.report for r in session.pass_records if r.name == "input_gradients")
            assert report == {"scaled": int(case in ("fgsm", "mean")), "summed": 0}
    assert "does not show whether the loss" not in capsys.readouterr().err
    assert max(abs(a - b) for a, b in zip(*(o[0] for o in out))) < TOL
    assert worst(out[0][1], out[1][1]) < TOL
    assert worst(out[0][2], out[1][2]) < TOL       # the gradient fetched: one device's
