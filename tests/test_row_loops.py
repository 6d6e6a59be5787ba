"""The batch's axis through loops, calls and lists
(parallax_ng/graph/row_loops.py): loops over time in TF1's two forms of
control flow (v1 frames and functional While ops), tf.scan, a tf_keras GRU
called in a tf.compat.v1 graph (a function call holding a While), and
Keras 3's CTC loss (a scan that fills an Empty tensor by TensorScatterAdd
in a loop, under a custom gradient); and the losses read through them."""
import pytest
import tensorflow as tf

from parallax_ng.graph import forms
from test_rows import DATA, axis, inputs

tf1 = tf.compat.v1


def recurrent(x, form):
    """A recurrent layer over x (batch, time, features), time-major inside as
    dynamic_rnn runs it; its output (batch, time, 5)."""
    w, u = tf.ones((4, 5)) * 0.1, tf.ones((5, 5)) * 0.1
    steps = tf.transpose(x, [1, 0, 2])
    h0 = tf.zeros([tf.shape(x)[0], 5])
    if form == "scan":
        out = tf.scan(lambda h, xt: tf.tanh(tf.matmul(xt, w) + tf.matmul(h, u)), steps, h0)
        return tf.transpose(out, [1, 0, 2])
    ta = tf.TensorArray(tf.float32, size=7).unstack(steps)

    def body(t, h, out):
        h = tf.tanh(tf.matmul(ta.read(t), w) + tf.matmul(h, u))
        return t + 1, h, out.write(t, h)
    _, _, out = tf1.while_loop(lambda t, *_: t < 7, body,
                               [tf.constant(0), h0, tf.TensorArray(tf.float32, 7)])
    return tf.transpose(out.stack(), [1, 0, 2])


@pytest.fixture(params=["functional", "frames", "scan"])
def loop_form(request):
    if request.param == "frames":
        tf1.disable_control_flow_v2()
    yield request.param
    tf1.enable_control_flow_v2()


def test_a_loop_over_time_keeps_the_batch_and_its_losses_read(loop_form):
    with tf.Graph().as_default() as g:
        x, y = inputs()
        out = recurrent(x, loop_form)
        kinds = {op.type for op in g.get_operations()}
        assert ("Enter" in kinds) == (loop_form == "frames")
        assert ("While" in kinds or "StatelessWhile" in kinds) == (loop_form != "frames")
        logits = tf.tensordot(out, tf.ones((5, 3)), 1)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        assert axis(out) == 0 and axis(logits) == 0 and axis(ce) == 0
        assert axis(out[:, -1]) == 0 and axis(tf.reduce_sum(out, 1)) == 0
        assert forms.loss_form(tf.reduce_sum(ce), DATA, None).kind == "sum"
        assert forms.loss_form(tf1.losses.sparse_softmax_cross_entropy(y, logits), DATA,
                               None).kind == "mean"
        # a loop that adds the batch's rows up is not read as keeping them
        total = tf1.while_loop(lambda i, s: i < 3, lambda i, s: (i + 1, s + tf.reduce_sum(
            x[:, i], 0)), [tf.constant(0), tf.zeros(4)])[1]
        assert axis(total) is None
        # nor one whose body moves the batch's axis (each step transposes)
        square = tf.zeros([tf.shape(x)[0], tf.shape(x)[0]])
        swapped = tf1.while_loop(lambda i, s: i < 2, lambda i, s: (i + 1, tf.transpose(s)),
                                 [tf.constant(0), square])[1]
        assert axis(square) == 0 and axis(swapped) is None


def test_a_tf_keras_gru_and_a_function_called_in_a_graph():
    """tf_keras's GRU in a tf.compat.v1 graph (a functional While over a
    TensorList), and a tf.function called there (a call whose body is read
    with the caller's tensors); the outputs and losses over them are read."""
    import tf_keras
    with tf.Graph().as_default() as g:
        x, y = inputs()
        out = tf_keras.layers.GRU(5, return_sequences=True)(x)
        last = tf_keras.layers.GRU(5)(x)
        assert "While" in {op.type for op in g.get_operations()}
        assert axis(out) == 0 and axis(last) == 0
        called = tf.function(lambda a, b: (tf.transpose(tf.tanh(a), [1, 0, 2]), b * 2.0))(
            x, tf.ones((3,)))
        assert called[0].op.type.endswith("PartitionedCall")
        assert axis(called[0]) == 1 and axis(called[1]) is None
        assert forms.loss_form(tf.reduce_sum(tf.square(out)), DATA, None).kind == "sum"
        assert forms.loss_form(tf.reduce_mean(last), DATA, None).kind == "mean"


def test_keras3_ctc_loss_is_a_loss_per_sequence():
    """keras.ops.ctc_loss on TensorFlow runs a dense CTC as a scan whose
    states a loop puts into an Empty tensor, time-major ([time, batch,
    states]), by TensorScatterAdd: its losses are the batch's rows, so
    their mean reads as a mean (it was a loss of unknown form, warned in
    every keras.io OCR example's `fit`)."""
    import keras        # Keras 3 by name
    with tf.Graph().as_default() as g:
        x, y = inputs()
        n = tf.shape(x)[0]
        per = keras.ops.ctc_loss(y[:, :3], tf.nn.softmax(x), tf.fill([n], 3), tf.fill([n], 7),
                                 mask_index=0)
        assert "TensorScatterAdd" in {op.type for op in g.get_operations()}
        assert axis(per) == 0
        assert forms.loss_form(tf.reduce_mean(per), DATA, None).kind == "mean"
        assert forms.loss_form(tf.reduce_sum(per), DATA, None).kind == "sum"


def test_tf_nn_ctc_loss_reads_through_a_body_that_calls_a_function_by_name():
    """tf.nn.ctc_loss with dense labels runs While loops whose bodies are
    wrappers calling another function of the library by name: the body is
    read with the library's functions (before: "Op type not registered
    'body_...'", a RuntimeError out of get_runner), its losses are the
    batch's rows, and 3 steps of 2 replicas equal one device with the
    global batch (1e-6)."""
    import numpy as np

    from models import fed_both, read_name
    with tf.Graph().as_default():
        x, y = inputs()
        n = tf.shape(x)[0]
        per = tf.nn.ctc_loss(y[:, :3], x, tf.fill([n], 3), tf.fill([n], 7),
                             logits_time_major=False, blank_index=0)
        assert axis(per) == 0
        assert forms.loss_form(tf.reduce_mean(per), DATA, None).kind == "mean"
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(3, 8, 7, 4)).astype(np.float32)
    ys = rng.integers(1, 4, size=(3, 8, 7)).astype(np.int32)

    def build():
        g = tf.Graph()
        with g.as_default():
            x, y = inputs()
            w = tf1.get_variable("w", initializer=np.eye(4, dtype=np.float32))
            logits = tf.einsum("btf,fc->btc", x, w)
            n = tf.shape(x)[0]
            loss = tf.reduce_mean(tf.nn.ctc_loss(y[:, :3], logits, tf.fill([n], 3),
                                                 tf.fill([n], 7), logits_time_major=False,
                                                 blank_index=0))
            tf1.train.AdamOptimizer(0.1).minimize(loss, name="train")
        return g, read_name("w", g)
    got, want = fed_both(build, {"run_option": "allreduce"},
                         [{"x:0": xs[k], "y:0": ys[k]} for k in range(3)])
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
