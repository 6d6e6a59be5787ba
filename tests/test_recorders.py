"""What a step's Python code does while traced (parallax_ng/graph/recorders.py):
the tensors its tapes differentiate, the slots Keras optimizers make and
for which variable; each patch undone after its block, errors included."""
import keras
import pytest
import tensorflow as tf

from parallax_ng.graph import recorders


def test_tape_targets_are_the_traced_tensors_a_tape_differentiates():
    w = tf.Variable(tf.ones([3, 1]))

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w), name="the_loss")
        return tape.gradient(loss, [w])
    original, jacobian = tf.GradientTape.gradient, tf.GradientTape.batch_jacobian
    with recorders.tape_targets() as targets:
        concrete = tf.function(step).get_concrete_function(tf.TensorSpec([None, 3]))
        step(tf.ones([2, 3]))                   # an eager call: nothing to record
    assert targets == ["the_loss:0"]
    with recorders.tape_targets() as targets:   # tf.recompute_grad's own tape is seeded
        block = tf.recompute_grad(lambda a: tf.nn.relu(tf.matmul(a, w), name="recomputed"))

        def checkpointed(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(block(x), name="the_loss")
            return tape.gradient(loss, [w])
        tf.function(checkpointed).get_concrete_function(tf.TensorSpec([None, 3]))
    assert targets == ["the_loss:0"]
    assert concrete.graph.get_tensor_by_name("the_loss:0") is not None
    assert tf.GradientTape.gradient is original
    with pytest.raises(RuntimeError), recorders.tape_targets():
        raise RuntimeError("a failed trace")
    assert tf.GradientTape.gradient is original
    assert tf.GradientTape.batch_jacobian is jacobian


def test_slots_belong_to_the_variable_they_were_made_for():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam()
    with recorders.slots_recorded() as owners:
        optimizer.build(model.trainable_variables)
    kernel = recorders.tf_variable(model.trainable_variables[0])
    slots = [s for s, v in owners.items() if v is kernel]
    assert len(slots) == 2                      # Adam's two moments
    base = recorders.optimizer_classes()[0]
    assert "recording" not in base.add_variable_from_reference.__qualname__


def test_slots_made_before_a_trace_belong_to_their_variable_by_name():
    """An optimizer built before the step: its slots' owners by the names
    Keras 3 (`<optimizer>/<path with _>_<slot>`), tf_keras
    (`<slot>/<variable>`) and its legacy optimizers
    (`<optimizer>/<variable>/<slot>`) give them."""
    import tf_keras
    k3 = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    k2 = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    k2b = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(5)])
    made = []
    for opt, model in ((keras.optimizers.Adam(), k3), (tf_keras.optimizers.Adam(), k2)):
        opt.build(model.trainable_variables)
        made.append((opt.variables, model))
    legacy = tf_keras.optimizers.legacy.Adam()
    legacy._create_all_weights(k2b.trainable_variables)
    made.append((legacy.variables(), k2b))
    for slots, model in made:
        variables = [recorders.tf_variable(v) for v in list(model.trainable_variables) +
                     list(slots)]
        owners = recorders.owners_by_name(variables)
        kernel, bias = (recorders.tf_variable(v) for v in model.trainable_variables)
        assert sorted(owners[recorders.tf_variable(s).ref()].name
                      for s in slots if len(s.shape)) == \
            sorted([bias.name] * 2 + [kernel.name] * 2), [s.name for s in slots]
    handle = recorders.tf_variable(k2b.trainable_variables[0]).handle
    assert recorders.unread_variables({id(handle)}) == \
        {id(handle): recorders.tf_variable(k2b.trainable_variables[0])}
    assert recorders.unread_variables(set()) == {}


@pytest.mark.parametrize("config", [{}, {"run_option": "ps"}], ids=["allreduce", "ps"])
def test_a_custom_gradient_s_gradient_of_a_variable_is_found(config):
    """A `tf.custom_gradient` that reads a variable and returns its gradient
    (`variables=`): in a trace its function's ops are outside the tape's
    scope, so the build found no gradient of that variable and averaged
    its Adam slots as state, with a line (0.45 apart after 5 steps). The
    tape's result now passes through an Identity in the tape's scope."""
    import warnings

    import numpy as np
    from models import local

    import parallax_ng as pn
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(5, 16, 4)), rng.normal(size=(5, 16, 1))

    def make():
        r = np.random.default_rng(1)
        w1, w2 = tf.Variable(r.normal(size=(4, 6))), tf.Variable(r.normal(size=(6, 1)))
        scale = tf.Variable(1.5, dtype=tf.float64)

        @tf.custom_gradient
        def scaled_sign(h):         # straight through, by a trained scale
            def grad(dy, variables=None):
                return dy * scale, [tf.reduce_sum(dy * tf.sign(h))]
            return tf.sign(h) * scale, grad
        opt = keras.optimizers.Adam(0.05)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(scaled_sign(x @ w1) @ w2 - y))
            weights = [w1, w2, scale]
            opt.apply_gradients(zip(tape.gradient(loss, weights), weights))
            return loss
        return [w1, w2, scale], opt, step
    (wa, oa, sa), (wb, ob, sb) = make(), make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel = pn.function(sa, local(2), config)
        for x, y in zip(xs, ys):
            parallel(x, y), sb(x, y)        # one device eagerly
    parallel.sync()
    for a, b in zip(wa + oa.variables, wb + ob.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-12, rtol=0)
