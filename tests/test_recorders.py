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
