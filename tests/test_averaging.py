"""Averaging (parallax_ng/graph/averaging.py): the replicas' gradients are
averaged or summed as the losses a graph differentiates ask, the config's
keys win, and a loss no one rule makes exact is named in a warning."""
import pytest
import tensorflow as tf

from parallax_ng.graph import averaging
from parallax_ng.graph.mixing import bent_gradient

tf1 = tf.compat.v1


class _Asked:
    average_dense = average_sparse = "auto"


@pytest.mark.parametrize("loss,batch,want,note", [
    ("sum", None, False, ""),
    ("mean", None, True, ""),
    ("sum/8", 8, True, ""),                 # over a replica's batch (the Dataset.batch size)
    ("sum/16", 8, False, ""),               # over the global batch: the replicas' sum
    ("sum/8", None, True, "scales the sum by a number"),   # fed: the size is not shown
    ("per example", None, False, ""),       # tf.gradients of a vector sums it
    ("sum+mean", None, False, ""),          # the Mean over N times its count, summed
    ("sum+losses", None, False, ""),        # a mean over a count: over N times it, summed
    ("sum+mean", 8, False, ""),
    ("sum+(mean+losses)", 8, False, ""),    # a Mean beside a count's mean: both so
    ("sum+sum*(1/rows)", None, False, ""),  # the rows N times, summed
    ("sum+sqrt(mean)", None, True, "adds a sum over the batch"),    # no rule gives one device's
    ("sum+sum/8", 8, False, ""),            # over a static size: N times it, summed
    ("sum/8+mean", None, True, "scales the sum by a number"),  # taken as a mean, as alone
    ("sum/16+mean", 8, False, ""),          # shown not to be one: a sum, the Mean widened
    ("hidden", None, True, "does not show whether the loss"),  # by an op it cannot read
    ("hardest half", None, True, "mixes the batch's examples ('TopKV2'"),
    ("per time step", None, False, ""),     # a [batch, 1] loss's columns summed one by one
    ("l2_loss", None, False, ""),           # tf.nn.l2_loss: half a sum of squares
    ("l2_loss/8", 8, True, ""),
    ("sum, penalty apart", None, False, ""),    # a loss of the weights alone: neither
    ("mean, penalty apart", None, True, ""),
    ("mean*rows", None, False, ""),         # a mean times the rows counted: a sum (no line)
    ("sum*(1/rows)", None, True, ""),       # a sum times one over them: a mean (no line)
])
@pytest.mark.parametrize("bare", [False, True], ids=["minimize", "tf.gradients"])
def test_gradients_are_averaged_or_summed_by_the_loss(loss, batch, want, note, bare):
    """By `minimize`, or by a bare tf.gradients call (whose seed reaches the
    terms of a sum of scalars, for which the autodiff makes no op: read as
    the sum they make; before, "sum+losses" was averaged as two losses)."""
    g = tf.Graph()
    with g.as_default():
        if batch:
            ds = tf.data.Dataset.from_tensors(tf.zeros([3])).repeat(64).batch(batch)
            x = tf1.data.make_one_shot_iterator(ds).get_next()
        else:
            x = tf1.placeholder(tf.float32, [None, 3])
        e = tf.square(tf.matmul(x, tf1.get_variable("w", [3, 1])))
        tf1.get_variable_scope().reuse_variables()
        value = {"sum": tf.reduce_sum(e), "mean": tf.reduce_mean(e),
                 "sum/8": tf.reduce_sum(e) / 8.0, "sum/16": tf.reduce_sum(e) / 16.0,
                 "per example": e[:, 0], "sum+mean": tf.reduce_sum(e) + tf.reduce_mean(e),
                 "sum+losses": tf.reduce_sum(e) + tf1.losses.absolute_difference(e, e * e),
                 "sum+(mean+losses)": tf.reduce_sum(e) + (
                     tf.reduce_mean(e) + tf1.losses.absolute_difference(e, e * e)),
                 "sum/8+mean": tf.reduce_sum(e) / 8.0 + tf.reduce_mean(e),
                 "sum+sum/8": tf.reduce_sum(e) + tf.reduce_sum(e) / 8.0,
                 "sum+sqrt(mean)": tf.reduce_sum(e) + tf.sqrt(tf.reduce_mean(e)),
                 "sum+sum*(1/rows)": tf.reduce_sum(e) + tf.reduce_sum(e) * (
                     1.0 / tf.cast(tf.shape(x)[0], tf.float32)),
                 "sum/16+mean": tf.reduce_sum(e) / 16.0 + 2.0 * tf.reduce_mean(e),
                 "hidden": tf.reduce_sum(tf.py_function(tf.identity, [e], tf.float32)),
                 "hardest half": tf.reduce_mean(tf.math.top_k(e[:, 0], tf.shape(e)[0] // 2)[0]),
                 "per time step": tf.reduce_mean(tf.reduce_sum(e, 0)),
                 "l2_loss": tf.nn.l2_loss(e), "l2_loss/8": tf.nn.l2_loss(e) / 8.0,
                 "sum, penalty apart": tf.reduce_sum(e),
                 "mean, penalty apart": tf.reduce_mean(e),
                 "mean*rows": tf.reduce_mean(e) * tf.cast(tf.shape(x)[0], tf.float32),
                 "sum*(1/rows)": tf.reduce_sum(e) * (1.0 / tf.cast(tf.shape(x)[0],
                                                                   tf.float32))}[loss]
        w, descent = tf1.get_variable("w", [3, 1]), tf1.train.GradientDescentOptimizer(0.1)
        if bare or "apart" in loss:
            grad = tf.gradients(value, w)[0]
            if "apart" in loss:
                grad += tf.gradients(0.1 * tf.nn.l2_loss(w), w)[0]
            descent.apply_gradients([(grad, w)])
        else:
            descent.minimize(value)
    dense, sparse, said = averaging.averages(_Asked(), g)
    assert dense is sparse is want
    assert note in said and bool(said) == bool(note)
    asked = _Asked()
    asked.average_dense = True
    assert averaging.averages(asked, g)[:2] == (True, want)      # what the config says wins


@tf.custom_gradient
def _clipped(x):
    return tf.identity(x), lambda dy: tf.clip_by_value(dy, -0.01, 0.01)


@tf.custom_gradient
def _halved(x):
    return tf.identity(x), lambda dy: -0.5 * dy + tf.sign(x) * 0.0


@pytest.mark.parametrize("through,reduce,warned", [
    (_clipped, tf.reduce_mean, True),      # a clip of each replica's N-times gradient
    (_clipped, tf.reduce_sum, False),      # summed: each replica's is one device's
    (_halved, tf.reduce_mean, False),      # linear in what it receives (sign of x, not dy)
    ("sign->identity", tf.reduce_mean, False),
    # a NaN test of a max of dy orders the recomputation after dy: not a bend
    (tf.recompute_grad(tf.tanh), tf.reduce_mean, False),
])
def test_a_custom_gradient_not_linear_in_what_it_receives_is_named(through, reduce, warned):
    """Before, a clip by value in a tf.custom_gradient trained 0.014 off one
    device after 4 steps, without a word."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3])
        h = tf.matmul(x, tf1.get_variable("w", [3, 2]))
        if through == "sign->identity":
            with g.gradient_override_map({"Sign": "Identity"}):
                h = tf.sign(h) + h
        else:
            h = through(h)
        tf1.train.GradientDescentOptimizer(0.1).minimize(reduce(tf.square(h)))
    said = averaging.averages(_Asked(), g)[2]
    assert ("is not linear in the gradient it receives" in said) is warned, said
    if warned:
        assert "('gradients/IdentityN_grad/clip_by_value/Minimum': Minimum)" in said


@pytest.mark.parametrize("through,warned", [(_clipped, True), (_halved, False),
                                            ("recompute", False)])
def test_a_traced_step_s_custom_gradient_is_read_too(through, warned):
    """In a traced TF2 step the custom function's ops are outside the
    autodiff's scope: found as ops between its gradients that no loss
    reads. A gradient penalty (the norm of a gradient, read by the loss,
    per example) is not one."""
    import numpy as np

    from parallax_ng.graph.tracing import capture
    w = tf.Variable(tf.ones([3, 2]))

    def step(x):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                h = tf.matmul(x, w)
            penalty = tf.reduce_mean(tf.square(tf.norm(inner.gradient(h, x), axis=1) - 1.0))
            if through == "recompute":
                h = tf.recompute_grad(lambda a: tf.nn.relu(tf.matmul(a, w)))(x)
            else:
                h = through(h)
            loss = tf.reduce_mean(tf.square(h)) + penalty
        w.assign_sub(0.1 * outer.gradient(loss, w))
        return loss
    bent = bent_gradient(capture(step, (np.ones((4, 3), np.float32),)).graph)
    assert bent == ("clip_by_value/Minimum", "Minimum") if warned else bent is None


@pytest.mark.parametrize("rows", ["fixed", "the batch's"])
def test_a_loss_of_rows_drawn_in_a_fixed_number_is_named(rows):
    """A GAN's generator loss over `tf.random.normal([BATCH_SIZE, d])`
    (TensorFlow's DCGAN tutorial): it reads no data, and every replica
    draws BATCH_SIZE rows; the line says so and how to draw a replica's
    part (before: "does not show whether the loss is a mean or a sum").
    Drawn as many as the batch's rows, it says nothing."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3])
        n = 16 if rows == "fixed" else tf.shape(x)[0]
        fake = tf.matmul(tf.random.normal(tf.stack([n, 3])), tf1.get_variable("g", [3, 3]))
        d = tf1.get_variable("d", [3, 1])
        generator = tf.reduce_mean(tf.nn.softplus(-tf.matmul(fake, d)))
        tf1.train.GradientDescentOptimizer(0.1).minimize(generator, var_list=[g.get_collection(
            tf1.GraphKeys.TRAINABLE_VARIABLES)[0]])
        tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.nn.softplus(tf.matmul(fake, d)) + tf.nn.softplus(-x @ d)),
            var_list=[d])
    said = averaging.averages(_Asked(), g)[2]
    if rows == "fixed":
        assert "'Mean:0' reads no data but 16 rows that 'random_normal/RandomStandardNormal'" \
            " draws" in said and "tf.shape(batch)[0]" in said, said
    else:
        assert said == ""
