"""graph/mean_gradients.py: the autodiff's gradient of a forward Mean over
the batch, found by tf.gradients' names and, in a GradientTape's scope
that holds several Means' gradients, by the count each divides by; its
division by the count, of a shape known at run time or fixed; one of
each in every gradient that reaches the Mean."""
import tensorflow as tf

from parallax_ng.graph.mean_gradients import Autodiff, chains, division, incoming

tf1 = tf.compat.v1


def standardized(z, keep):
    centred = z - tf.reduce_mean(z, 0, keepdims=keep, name="centre")
    return centred / tf.sqrt(tf.reduce_mean(tf.square(centred), 0, keepdims=keep,
                                            name="spread") + 1e-3)


def test_a_means_incoming_gradient_by_tf_gradients_names():
    """Kept dimensions or not (the Mean's gradient reshapes the incoming
    one, or spreads it as it is), the incoming gradient is the one the
    Mean's consumers give it; a Mean no gradient reaches has none."""
    for keep in (False, True):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 5], "x")
            z = tf.matmul(x, tf1.get_variable("w", [5, 4]))
            h = standardized(z, keep)
            unused = tf.reduce_mean(z, 0, name="unused")
            tf1.gradients(tf.reduce_mean(tf.square(h)), tf1.trainable_variables())
        index = Autodiff(g)
        for name in ("centre", "spread"):
            mean = g.get_operation_by_name(name)
            (chain,) = chains(index.of(mean, mean.inputs[0]))
            assert chain[2].name.startswith(f"gradients/{name}_grad/")
            (grad,) = incoming(index, mean)
            assert not grad.name.startswith(f"gradients/{name}_grad/")
            assert grad.shape.as_list() == mean.outputs[0].shape.as_list()
        assert incoming(index, unused.op) is None


def test_a_tapes_means_are_told_apart_by_their_counts():
    """In a traced step's tape every top-level op's gradient is under one
    scope: each Mean's is the one whose divisor reads its input's shape."""
    w = tf.Variable(tf.ones((5, 4)))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(standardized(tf.matmul(x, w), False))
        return tape.gradient(loss, w)
    g = step.get_concrete_function(tf.TensorSpec([None, 5])).graph
    index = Autodiff(g)
    means = [op for op in g.get_operations() if op.type == "Mean"]
    assert len(means) == 2 and len(chains(index.of(means[0], means[0].inputs[0]))) == 2
    found = [incoming(index, m)[0] for m in means]
    assert found[0] is not found[1]
    for mean, grad in zip(means, found):
        assert grad.shape.as_list() == mean.outputs[0].shape.as_list()


def test_a_means_division_by_its_count_where_the_shape_is_known_or_not():
    """With rows known at run time the division's count reads the input's
    shape; with a static batch tf.gradients divides by a constant and reads
    no input of the Mean: found by its name (before, not found)."""
    for rows in (None, 8):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [rows, 5], "x")
            e = tf.matmul(x, tf1.get_variable("w", [5, 1]))
            mean = tf.reduce_mean(tf.abs(e), name="average")
            tf1.gradients(tf.reduce_sum(tf.square(e)) + mean, tf1.trainable_variables())
        (found,) = division(Autodiff(g), mean.op)
        assert found.type == "RealDiv" and found.name.startswith("gradients/average_grad/")
        count = tf.get_static_value(found.inputs[1])
        assert (count is None) if rows is None else count == rows


def test_a_mean_two_losses_are_differentiated_through_has_a_gradient_in_each():
    """A Mean two tf.gradients calls reach (a GAN's discriminator on the
    generated rows, in its loss and the generator's): its incoming
    gradient and division in each, shapes known or not (before, two
    found in one search: neither taken)."""
    for rows in (None, 8):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [rows, 5], "x")
            w, v = tf1.get_variable("w", [5, 4]), tf1.get_variable("v", [4, 1])
            h = tf.matmul(standardized(tf.matmul(x, w), False), v)
            tf1.gradients(tf.reduce_mean(tf.square(h)), [w])
            tf1.gradients(tf.reduce_mean(tf.abs(h)), [w, v])
        index = Autodiff(g)
        for name in ("centre", "spread"):
            mean = g.get_operation_by_name(name)
            found, divided = incoming(index, mean), division(index, mean)
            assert [t.name.split("/")[0] for t in found] == ["gradients", "gradients_1"]
            assert [d.name.split("/")[0] for d in divided] == ["gradients", "gradients_1"]
            assert all(t.shape.as_list() == mean.outputs[0].shape.as_list() for t in found)
