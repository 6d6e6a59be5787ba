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
    original = tf.GradientTape.gradient
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
