"""TF2 custom training loops (`pn.function`): N replicas with a global batch
equal one device with it, every variable and optimizer slot, 1e-5 after 10
steps; Keras 3 and tf_keras models and optimizers; an embedding stays sparse."""
import json
import os
import warnings

import keras            # Keras 3 by name (tf.keras follows TF_USE_LEGACY_KERAS, which
import numpy as np      # the other tests set; the job's script sets it to 0 itself)
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from task_env import TASK_PATH

STEPS, BATCH = 10, 8


def data(seed=0, vocab=None):
    rng = np.random.default_rng(seed)
    if vocab:
        x = rng.integers(0, vocab, size=(STEPS, BATCH, 3)).astype(np.int32)
    else:
        x = rng.normal(size=(STEPS, BATCH, 5)).astype(np.float32)
    y = rng.normal(size=(STEPS, BATCH, 1)).astype(np.float32)
    return x, y


def step_of(model, optimizer, loss_fn=None):
    def train_step(x, y):
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = tf.reduce_mean(tf.square(pred - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return train_step


def keras3_dense():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1)])


def keras3_embedding(vocab):
    return keras.Sequential([keras.Input((3,), dtype="int32"),
                             keras.layers.Embedding(vocab, 4),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def twins(make, make_optimizer):
    """Two models with the same weights, each with its own optimizer; the
    weights seeded, so a run is the next one (an unseeded init in CI had a
    conv net's loss at 2.4 and 2.2e-5 off at atol 1e-5)."""
    keras.utils.set_random_seed(0)
    a, b = make(), make()
    b.set_weights(a.get_weights())
    return (a, make_optimizer()), (b, make_optimizer())


def check_equal(parallel, single, rtol=0.0):
    (pm, po), (sm, so) = parallel, single
    for w1, w2 in zip(pm.weights, sm.weights):
        np.testing.assert_allclose(np.asarray(w1), np.asarray(w2), atol=1e-5, rtol=rtol,
                                   err_msg=getattr(w1, "path", w1.name))
    assert len(po.variables) == len(so.variables) > 2      # the same slots, in order
    for v1, v2 in zip(po.variables, so.variables):
        name = getattr(v1, "path", v1.name)
        assert np.shape(v1) == np.shape(v2), name
        np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), atol=1e-5, rtol=rtol,
                                   err_msg=name)


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.Adam(0.01, clipnorm=1.0),
    lambda: keras.optimizers.SGD(0.05, momentum=0.9),
], ids=["adam-clipnorm", "sgd-momentum"])
def test_keras3_custom_loop_equals_one_device(make_optimizer):
    parallel, single = twins(keras3_dense, make_optimizer)
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    x, y = data()
    losses = []
    for k in range(STEPS):
        losses.append(step(x[k], y[k]))
        want = ref(x[k], y[k])
        np.testing.assert_allclose(losses[-1], want.numpy(), atol=1e-5, rtol=0)
    step.sync()
    check_equal(parallel, single)
    assert step.runner.plan.num_replicas == 2 and step.on_program == 0    # all on the replicas


def stepped(step_of, make=keras3_dense,
            make_optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9)):
    """(`step_of`'s step on 2 replicas, its tf.function on one device, the
    two twin (model, optimizer) pairs they train)."""
    parallel, single = twins(make, make_optimizer)
    return pn.function(step_of(*parallel), local(2)), tf.function(step_of(*single)), \
        parallel, single


LOSSES = {
    "reduce_sum": lambda per: tf.reduce_sum(per),
    "over the global batch": lambda per: tf.nn.compute_average_loss(per,
                                                                    global_batch_size=BATCH),
    "compute_average_loss": lambda per: tf.nn.compute_average_loss(per),
}


def keras3_gru():
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
                             keras.layers.GRU(5), keras.layers.Dense(4)])


@pytest.mark.parametrize("model_kind", ["dense", "gru"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_loss_that_sums_over_the_batch_sums_the_replicas_gradients(loss, model_kind):
    """One device's gradient of a sum over its batch (tf.reduce_sum, or a
    sum over the global batch size as tf.distribute scripts write it) is the
    sum of the replicas' (average_dense/average_sparse auto: the tapes'
    targets say which loss; before, they were averaged: steps half as
    long), through dense layers and through a GRU's loop over time to a
    sparse cross-entropy (read by graph/rows.py; before, such a loss was
    averaged, its fetched loss half one device's). The step checks its input and prints
    (tf.debugging, tf.print: string constants, which traced twice are the
    same)."""
    def step_of(model, optimizer):
        def train_step(x, y):
            tf.debugging.assert_all_finite(tf.cast(x, tf.float32), "the batch holds a NaN")
            with tf.GradientTape() as tape:
                out = model(x, training=True)
                per = keras.losses.sparse_categorical_crossentropy(   # labels by class id
                    y, out, from_logits=True) if model_kind == "gru" else \
                    tf.reduce_sum(tf.square(out - y), axis=1)
                value = LOSSES[loss](per)
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            tf.print("loss", value, output_stream="file:///dev/null")
            return value
        return train_step
    parallel, single = twins(keras3_gru if model_kind == "gru" else keras3_dense,
                             lambda: keras.optimizers.SGD(0.01, momentum=0.9))
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    x, y = data(vocab=10 if model_kind == "gru" else None)
    if model_kind == "gru":
        y = np.random.default_rng(1).integers(0, 4, size=(STEPS, BATCH)).astype(np.int32)
    for k in range(STEPS):
        np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]).numpy(), atol=1e-5,
                                   rtol=1e-6)
    step.sync()
    check_equal(parallel, single)


@pytest.mark.parametrize("sizes", [False, True], ids=["count", "sizes"])
@pytest.mark.parametrize("loss", ["reduce_mean", "reduce_sum"])
def test_gradients_accumulated_over_micro_batches_equal_one_device(loss, sizes, capsys):
    """A step that splits its batch into micro-batches (tf.split into a
    count of parts, or by equal sizes it computes from the batch's), takes
    one tape's gradient of each part's loss and applies their mean: each
    part's rows are examples of the batch (graph/rows.py `parts`), so a
    sum's gradients are summed over the replicas and the returned loss is
    their sum (before: averaged, with a line that the form was not shown;
    0.12 apart after 5 steps, the loss half one device's)."""
    parts = 2

    def split(t):
        return tf.split(t, [tf.shape(t)[0] // parts] * parts if sizes else parts)

    def step_of(model, optimizer):
        def train_step(x, y):
            total = [tf.zeros_like(v) for v in model.trainable_variables]
            value = 0.0
            for xm, ym in zip(split(x), split(y)):
                with tf.GradientTape() as tape:
                    part = getattr(tf, loss)(tf.square(model(xm, training=True) - ym))
                grads = tape.gradient(part, model.trainable_variables)
                total = [t + g / parts for t, g in zip(total, grads)]
                value += part / parts
            optimizer.apply_gradients(zip(total, model.trainable_variables))
            return value
        return train_step
    step, ref, parallel, single = stepped(step_of)
    x, y = data()
    for k in range(STEPS):
        np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]).numpy(), rtol=1e-6)
    step.sync()
    check_equal(parallel, single)
    assert "parallax_ng:" not in capsys.readouterr().err    # no line: the forms are shown


def test_a_step_that_returns_nothing_still_shows_its_loss():
    """A step that does not return its loss: the gradients do not need the
    loss's value (its shape is static), so the trace's graph had dropped it
    and with it what says the loss sums over the batch: the gradients were
    averaged (0.063 off one device after 5 steps). The tapes' targets are
    kept."""
    def step_of(model, optimizer):
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(x, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return train_step
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.SGD(0.01, momentum=0.9))
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    x, y = data()
    for k in range(5):
        step(x[k], y[k])
        ref(x[k], y[k])
    step.sync()
    assert not step.runner.plan.average_dense
    check_equal(parallel, single)


@pytest.mark.parametrize("activity", [False, True], ids=["kernel", "kernel and activity"])
def test_the_guides_summed_loss_plus_a_regularizer_equals_one_device(activity):
    """TensorFlow's custom-loop guide: `compute_average_loss(per,
    global_batch_size=B) + scale_regularization_loss(model.losses)`. The
    gradients are summed and each replica adds 1/N of the regularizer (it
    was averaged with the data's part: 1/N of one device's), Adam, loss
    and every variable and slot, 1e-5. With an activity regularizer too
    (Keras divides it by the rows: a mean in the regularizers' sum), the
    kernel's is added once there as well (before: N times, silently)."""
    def step_of(model, optimizer):
        def train_step(x, y):
            with tf.GradientTape() as tape:
                per = tf.reduce_sum(tf.square(model(x, training=True) - y), axis=1)
                value = tf.nn.compute_average_loss(per, global_batch_size=BATCH) + \
                    tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return value
        return train_step
    make = lambda: keras.Sequential([  # noqa: E731
        keras.Input((5,)), keras.layers.Dense(
            8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05),
            activity_regularizer=keras.regularizers.L2(0.01) if activity else None),
        keras.layers.Dense(1)])
    parallel, single = twins(make, lambda: keras.optimizers.Adam(0.02))
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    x, y = data()
    for k in range(STEPS):
        np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]).numpy(), atol=1e-5,
                                   rtol=1e-6)
    step.sync()
    check_equal(parallel, single)


def test_a_penalty_under_a_tape_of_its_own_beside_a_summed_loss_equals_one_device():
    """A persistent tape's two gradients: of the data's loss, summed
    (`compute_average_loss(..., global_batch_size=B)`), and of a weight
    penalty that reads no data, added before the update. The gradients are
    summed and each replica adds 1/N of the penalty's (it was averaged: the
    data's part 1/N of one device's, with a line about the losses), SGD with
    momentum, every variable and slot, 1e-5, and no line."""
    def step_of(model, optimizer):
        def train_step(x, y):
            with tf.GradientTape(persistent=True) as tape:
                per = tf.reduce_sum(tf.square(model(x, training=True) - y), axis=1)
                value = tf.nn.compute_average_loss(per, global_batch_size=BATCH)
                penalty = 0.05 * tf.add_n([tf.nn.l2_loss(v) for v in model.trainable_variables])
            grads = [a + b for a, b in zip(tape.gradient(value, model.trainable_variables),
                                           tape.gradient(penalty, model.trainable_variables))]
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return value
        return train_step
    step, ref, parallel, single = stepped(step_of)
    x, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(STEPS):
            np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]).numpy(), atol=1e-5,
                                       rtol=1e-6)
    step.sync()
    assert not step.runner.plan.average_dense
    check_equal(parallel, single)


def test_a_save_between_calls_writes_what_the_replicas_trained(tmp_path):
    """With the weights written back only at `step.sync()` (a large model's,
    or `batch_sync: never`), a tf.train.Checkpoint and a Keras
    `save_weights` made between calls hold the trained values (they held
    the program's older ones, silently); a learning rate the program set
    before the save is kept and trains the next call."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    step = pn.function(step_of(*parallel), local(2), {"batch_sync": "never"})
    ref = tf.function(step_of(*single))
    x, y = data()
    for k in range(3):
        step(x[k], y[k])
        ref(x[k], y[k])
    model, optimizer = parallel
    for opt in (optimizer, single[1]):
        opt.learning_rate.assign(0.01)
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    model.save_weights(str(tmp_path / "model.weights.h5"))
    check_equal(parallel, single)
    for k in range(3, STEPS):
        step(x[k], y[k])
        ref(x[k], y[k])
    step.sync()
    check_equal(parallel, single)
    saved, _ = twins(keras3_dense, lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    tf.train.Checkpoint(model=saved[0]).restore(path).expect_partial()
    again, _ = twins(keras3_dense, lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    again[0].load_weights(str(tmp_path / "model.weights.h5"))
    single_then, _ = twins(keras3_dense, lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    ref_then = tf.function(step_of(*single_then))
    for k in range(3):
        ref_then(x[k], y[k])
    for restored in (saved[0], again[0]):
        for got, want in zip(restored.weights, single_then[0].weights):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch_sync", ["auto", "never"])
@pytest.mark.parametrize("restore", ["checkpoint, model only", "checkpoint", "load_weights",
                                     "set_weights"])
def test_a_restore_between_calls_reaches_the_replicas(tmp_path, restore, batch_sync):
    """A program that rolls back to an earlier checkpoint between calls (a
    tf.train.Checkpoint's restore, of the model alone or with the
    optimizer, Keras's load_weights, a model's set_weights) trains on from
    the restored values,
    as one device does; the optimizer's slots a restore leaves are the ones
    the replicas trained (before: the next call went on from the replicas'
    values, 0.098 apart after one more step, silently)."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.Adam(0.05))
    step = pn.function(step_of(*parallel), local(2), {"batch_sync": batch_sync})
    ref = tf.function(step_of(*single))
    x, y = data()
    saved = []
    for model, optimizer in (parallel, single):
        held = tf.train.Checkpoint(model=model) if restore == "checkpoint, model only" \
            else tf.train.Checkpoint(model=model, optimizer=optimizer)
        saved.append((held, tmp_path / f"{len(saved)}"))
    kept = {}
    for k in range(STEPS):
        step(x[k], y[k])
        ref(x[k], y[k])
        for (held, path), (model, _) in zip(saved, (parallel, single)):
            if restore == "set_weights" and k in (1, 3):
                if k == 1:
                    step.sync()
                    kept[path] = model.get_weights()
                else:
                    model.set_weights(kept[path])
            elif k == 1 and restore == "load_weights":
                model.save_weights(str(path) + ".weights.h5")
            elif k == 1:
                held.write(str(path))
            elif k == 3 and restore == "load_weights":
                model.load_weights(str(path) + ".weights.h5")
            elif k == 3:
                held.read(str(path))
    step.sync()
    check_equal(parallel, single)


def test_a_keras3_embedding_stays_sparse_and_equals_one_device():
    vocab = 50
    parallel, single = twins(lambda: keras3_embedding(vocab),
                             lambda: keras.optimizers.Adam(0.01))
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    x, y = data(1, vocab)
    for k in range(STEPS):
        step(x[k], y[k])
        ref(x[k], y[k])
    table = [vp for name, vp in step.runner.plan.variables.items() if "embedding" in name]
    assert len(table) == 1 and table[0].info.sparse
    step.sync()
    check_equal(parallel, single)


def tf_keras_dense():
    import tf_keras
    return tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu", input_shape=(5,)),
                                tf_keras.layers.Dense(1)])


def test_tf_keras_custom_loop_equals_one_device():
    import tf_keras
    parallel, single = twins(tf_keras_dense, lambda: tf_keras.optimizers.Adam(0.01))
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    x, y = data(2)
    for k in range(STEPS):
        step(x[k], y[k])
        ref(x[k], y[k])
    step.sync()
    check_equal(parallel, single)


def test_a_scalar_argument_goes_whole_to_every_replica():
    """A learning rate passed each call as a scalar tensor (before: "argument
    leaf 2 of the step is a scalar", refused), and a Python flag, traced
    as a constant as tf.function traces it, by position (the trace) and by
    keyword; a
    Python value other than the traced one is refused by name (one
    device's tf.function would trace again), a default left out included
    (before: `scale=2.0` after calls without it ran the step traced with
    1.0, silently)."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.SGD(0.1, momentum=0.9))

    def step_of_rate(model, optimizer):
        def train_step(x, y, rate, train, scale=1.0):
            optimizer.learning_rate.assign(rate)
            with tf.GradientTape() as tape:
                pred = model(x, training=train)
                loss = tf.reduce_mean(tf.square(pred - y)) * (scale if train else 2.0)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss, rate
        return train_step
    step = pn.function(step_of_rate(*parallel), local(2))
    ref = tf.function(step_of_rate(*single))
    x, y = data(3)
    for k in range(STEPS):
        rate = tf.constant(0.1 / (k + 1))
        got = step(x[k], y[k], rate, True) if k == 0 else step(x[k], y[k], rate=rate, train=True)
        want = ref(x[k], y[k], rate, True)
        np.testing.assert_allclose(got, [w.numpy() for w in want], rtol=0, atol=1e-5)
    step.sync()
    check_equal(parallel, single)
    with pytest.raises(pn.ConfigError, match="argument leaf 3 of the step was the Python value "
                       "True when the step was traced and is now False"):
        step(x[0], y[0], tf.constant(0.1), train=False)
    with pytest.raises(pn.ConfigError, match="argument leaf 4 of the step was the Python value "
                       "1.0 when the step was traced and is now 2.0"):
        step(x[0], y[0], tf.constant(0.1), True, scale=2.0)
    with pytest.raises(pn.ConfigError, match="do not fit its parameters"):
        step(x[0], y[0], tf.constant(0.1), True, extra=1)


def accumulating_step_of(model, optimizer):
    """Gradient accumulation within a step: two tapes over the even and the
    odd rows, their gradients summed into zeros and halved."""
    def train_step(x, y):
        grads = [tf.zeros_like(v) for v in model.trainable_variables]
        total = 0.0
        for part in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x[part::2], training=True)
                                                - y[part::2]))
            grads = [a + b / 2 for a, b in zip(grads, tape.gradient(
                loss, model.trainable_variables))]
            total += loss / 2
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return total
    return train_step


@pytest.mark.parametrize("keras_kind", ["keras3", "tf_keras"])
def test_gradients_accumulated_within_a_step_equal_one_device(keras_kind):
    """Before, only the second tape's gradients were aggregated (the nearer
    to the update), the first stayed each replica's: Adam's slots and
    weights 0.035 off after 6 steps."""
    if keras_kind == "keras3":
        parallel, single = twins(keras3_dense, lambda: keras.optimizers.Adam(0.01))
    else:
        import tf_keras
        parallel, single = twins(tf_keras_dense, lambda: tf_keras.optimizers.Adam(0.01))
    step = pn.function(accumulating_step_of(*parallel), local(2))
    ref = tf.function(accumulating_step_of(*single))
    x, y = data(3)
    for k in range(STEPS):
        np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]).numpy(), atol=1e-5,
                                   rtol=1e-6)
    step.sync()
    check_equal(parallel, single)


def test_a_captured_array_is_a_constant_and_outputs_keep_their_structure():
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.SGD(0.1))
    weights = np.array([[2.0]], np.float32)            # captured by the step: a constant

    def train_step(model, optimizer):
        def fn(x, y):
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                loss = tf.reduce_mean(tf.square(pred - y) * weights)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return {"loss": loss, "pred": pred}
        return fn
    step = pn.function(train_step(*parallel), local(2))
    ref = tf.function(train_step(*single))
    x, y = data(4)
    for k in range(3):
        got, want = step(x[k], y[k]), ref(x[k], y[k])
        assert set(got) == {"loss", "pred"} and got["pred"].shape == (BATCH, 1)
        np.testing.assert_allclose(got["pred"], want["pred"].numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(got["loss"], want["loss"].numpy(), atol=1e-5, rtol=0)


def test_a_step_that_leaves_an_argument_and_captures_unread_equals_one_device():
    """An argument the step does not read (a note beside the batch), and a
    constant and a variable it captures only in a branch its outputs do not
    need, are left out of the captured graph (were: "Attempted to map
    inputs that were not found in graph_def")."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    scale, unused = np.float32(0.5), tf.Variable(3.0)

    def train_step(model, optimizer):
        def fn(x, y, note):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            tf.identity(unused * scale)        # read by nothing the step runs
            return loss
        return fn
    step = pn.function(train_step(*parallel), local(2))
    ref = tf.function(train_step(*single))
    x, y = data(5)
    notes = np.zeros((BATCH,), np.float32)
    for k in range(3):
        np.testing.assert_allclose(step(x[k], y[k], notes), ref(x[k], y[k], notes).numpy(),
                                   atol=1e-5, rtol=0)
    step.sync()
    check_equal(parallel, single)


def test_a_last_batch_the_replicas_cannot_split_runs_the_step_as_one_device():
    """A loop over 77 rows in batches of 16 ends with 13, which 2 replicas
    cannot split: the step runs on the program's variables with the
    runner's values, which go back to the runner; a learning rate set
    before that call is taken in; the next epoch goes on from there.
    Weights and Adam's slots equal one device's, 1e-5."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.Adam(0.02))
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(77, 5)).astype(np.float32), rng.normal(size=(77, 1)).astype(np.float32)
    for epoch in range(2):
        for start in range(0, 77, 16):
            if start == 64:
                for opt in (parallel[1], single[1]):
                    opt.learning_rate = 0.01 * (epoch + 1)
            rows = slice(start, start + 16)
            np.testing.assert_allclose(step(x[rows], y[rows]), ref(x[rows], y[rows]).numpy(),
                                       atol=1e-5, rtol=0)
    assert step.on_program == 2
    step.sync()
    check_equal(parallel, single)


def test_per_replica_outputs_and_bad_calls():
    parallel, _ = twins(keras3_dense, lambda: keras.optimizers.Adam(0.01))
    step = pn.function(step_of(*parallel), local(2))
    x, y = data(3)
    losses = step(x[0], y[0], per_replica=True)
    assert len(losses) == 2
    with pytest.raises(pn.FetchError, match="does not split evenly over the job.s 2 replicas"):
        step(x[1][:3], y[1][:3], per_replica=True)     # a batch they cannot split
    with pytest.raises(pn.ConfigError, match="traced with 2 batch tensors"):
        step(x[1])
    with pytest.raises(pn.ConfigError, match="not a int"):
        pn.function(3)
    train = step_of(*parallel)

    def returns_nothing(x, y):
        train(x, y)
    quiet = pn.function(returns_nothing, local(2))
    assert quiet(x[2], y[2]) is None


def test_a_tensor_of_the_global_batchs_rows_the_step_makes_is_named_where_a_run_fails():
    """A step that makes a tensor of a constant batch size, the global
    batch's (`tf.zeros((BATCH, 1))`, as an RNN's first state is made in
    TensorFlow's seq2seq tutorial): each replica's rows do not meet it,
    and the run's shape error names it and says what to use. Before:
    TensorFlow's bare "Incompatible shapes: [4,1] vs. [8,1]"."""
    model, optimizer = keras3_dense(), keras.optimizers.SGD(0.1)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) + tf.zeros((BATCH, 1), name="start") - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss
    x, y = data(4)
    with pytest.raises(pn.GraphError, match=r"Incompatible shapes.*the step makes 'start' "
                                            rf"\[{BATCH}, 1\] with the global batch's {BATCH} "
                                            rf"rows, and each of the 2 replicas gets {BATCH // 2}"
                                            r" rows .*tf.shape\(x\)\[0\]"):
        pn.function(step, local(2))(x[0], y[0])


def test_outputs_combine_as_one_device_s_and_an_unknown_one_is_named_by_its_key(capsys):
    """A step's outputs over its batch: a sum, a max, a count and a
    standard deviation equal one device's; an index among the rows
    (tf.argmax over the batch, which stopped the build with an IndexError)
    has no rule and is named by its key in the step's return value."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.Adam(0.01))

    def outputs(model, optimizer):
        train = step_of(model, optimizer)

        def step(x, y):
            err = tf.square(model(x) - y)
            return {"loss": train(x, y), "sum": tf.reduce_sum(err), "max": tf.reduce_max(err),
                    "count": tf.shape(x)[0], "std": tf.math.reduce_std(err),
                    "hardest": tf.argmax(tf.reshape(err, [-1]))}
        return step
    step, ref = pn.function(outputs(*parallel), local(2)), tf.function(outputs(*single))
    x, y = data(7)
    for k in range(3):
        got, want = step(x[k], y[k]), ref(x[k], y[k])
        for key in ("loss", "sum", "max", "count", "std"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    said = capsys.readouterr().err
    assert "values of the step's output 'hardest' (tensor " in said and "ArgMax)" in said
    assert "per_replica=True" in said and "output 'max'" not in said


@pytest.mark.parametrize("how", ["loop", "fit"])
def test_a_two_worker_job_equals_one_device(tmp_path, how):
    """2 workers x 1 device, each called with the global batch (8 rows, 4
    each), by a custom loop (`pn.function`) or `model.fit`
    (`pn.parallelize`); their starting weights differ (unseeded) and worker
    0's are broadcast; both end equal to one device with the global batch
    after 5 steps, every weight and optimizer variable, 1e-5. After `fit`,
    `evaluate` (on the replicas but its last batch, which 2 do not divide;
    its metrics an R-squared, whose batch mean the workers exchange) and
    `predict` (on the model: each worker holds only its rows) equal one
    device's; a second `model.compile` is refused."""
    out, done = run_job(tmp_path, *(["--fit"] if how == "fit" else []))
    assert "worker 1 of 2: done" in done.stdout
    assert "differs from worker 0's" not in done.stderr     # called alike
    check_job(out, how)
    worker = dict(np.load(f"{out}.0.npz"))
    if how == "fit":
        check_saved(tmp_path, worker)
    else:   # the program's own saves on both workers, one path (tf2_job_script.py):
        # before, HDF5's lock, and the checkpoints' shared `<prefix>_temp/`,
        # ended the job
        saved = keras3_dense()
        saved.load_weights(tmp_path / "loop.weights.h5")
        for i, w in enumerate(saved.weights):
            np.testing.assert_array_equal(np.asarray(w), worker[f"w{i}"])
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
        restored = keras3_dense()
        tf.train.Checkpoint(model=restored).restore(
            tf.train.latest_checkpoint(str(tmp_path / "ckpts"))).expect_partial()
        for i, w in enumerate(restored.weights):
            np.testing.assert_array_equal(np.asarray(w), worker[f"w{i}"])
        assert tf.train.latest_checkpoint(str(tmp_path / "ckpts")).endswith("ckpt-5")


def check_saved(folder, worker):
    """What both workers of the `fit` job saved at the same paths, as a
    one-device script does (a ModelCheckpoint and `model.save`: before,
    the second writer met HDF5's lock and the job ended; a
    BackupAndRestore: the workers raced to make its directory): whole
    files with the trained weights, no temporary file left, and a backup
    directory for each worker."""
    from test_state_sync import r_squared
    saved = keras.models.load_model(folder / "fit.keras", {"r_squared": r_squared})
    for i, w in enumerate(saved.weights):
        np.testing.assert_array_equal(np.asarray(w), worker[f"w{i}"])
    assert (folder / "fit.weights.h5").is_file()
    assert (folder / "backup").is_dir() and (folder / "backup.worker-1").is_dir()
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


def run_job(tmp_path, *flags, servers=0):
    """tf2_job_script.py (5 steps, `flags`) as a job of 2 workers x 1 device
    and `servers` parameter servers on 127.0.0.1: (its OUT prefix, the
    finished process)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "resources.yaml"
    path.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2 +
                    (f"ps: {['127.0.0.1'] * servers}\n" if servers else ""))
    out = str(tmp_path / "vars")
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", os.path.join(root, "tests",
                                                                 "tf2_job_script.py"),
         "-r", str(path), "--", out, "5", *flags], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done


def check_job(out, how):
    """tf2_job_script.py's two workers (OUT.<worker>.npz) against one device
    with the global batch, from worker 0's starting weights."""
    workers = [dict(np.load(f"{out}.{k}.npz")) for k in range(2)]
    model, optimizer = keras3_dense(), keras.optimizers.Adam(0.01)
    model.set_weights([workers[0][f"start{i}"] for i in range(len(model.weights))])
    assert not all(np.array_equal(workers[0][f"start{i}"], workers[1][f"start{i}"])
                   for i in range(len(model.weights)))
    ref = tf.function(step_of(model, optimizer))
    x, y = data()
    for k in range(5):
        ref(x[k], y[k])
    for w in workers:
        for i, v in enumerate(model.weights):
            np.testing.assert_allclose(w[f"w{i}"], np.asarray(v), atol=1e-5, rtol=0)
        for i, v in enumerate(optimizer.variables):
            np.testing.assert_allclose(w[f"o{i}"], np.asarray(v), atol=1e-5, rtol=0)
    if how == "fit":        # evaluate on the replicas, predict on the model
        from test_state_sync import r_squared
        model.compile(loss="mse", metrics=["mae", r_squared])
        want = model.evaluate(x.reshape(-1, 5)[:43], y.reshape(-1, 1)[:43], batch_size=8,
                              verbose=0)
        predicted = model.predict(x.reshape(-1, 5)[:43], batch_size=8, verbose=0)
        for w in workers:
            np.testing.assert_allclose(w["evaluated"], want, atol=1e-5, rtol=0)
            np.testing.assert_allclose(w["predicted"], predicted, atol=1e-5, rtol=0)
            assert json.loads(str(w["on_model"])) == {"test": 1, "predict": 6}
            assert "model.compile after training began in a job" in str(w["recompiled"])


def test_slots_made_before_the_capture_still_belong_to_their_variables():
    """An optimizer that trained eagerly first: its slots exist before the
    step is traced (their owners come from Keras's slot names)."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.Adam(0.01))
    x, y = data(5)
    for model, opt in (parallel, single):
        tf.function(step_of(model, opt))(x[0], y[0])        # one eager step each
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    for k in range(1, 4):
        step(x[k], y[k])
        ref(x[k], y[k])
    step.sync()
    check_equal(parallel, single)
    slots = [v for name, v in step.runner.program.tg.variables.items()
             if name.endswith(("_momentum", "_velocity"))]
    assert len(slots) == 8 and all(v.owner is not None for v in slots)


def conv_functional():
    inputs = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    h = keras.layers.LayerNormalization()(h)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(h))
    return keras.Model(inputs, outputs)


class Attention(keras.Model):
    """A Model subclass: self-attention over a short sequence, then a head."""

    def __init__(self):
        super().__init__()
        # no biases: a key bias shifts every logit of a query alike, so its
        # gradient is 0 but for rounding, which Adam-like updates amplify
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4,
                                                         use_bias=False)
        self.norm = keras.layers.LayerNormalization()
        self.head = keras.layers.Dense(1)

    def call(self, x, training=False):
        h = self.norm(x + self.attention(x, x, training=training))
        return self.head(keras.ops.mean(h, axis=1))


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01),
    lambda: keras.optimizers.Adagrad(0.1),
    lambda: keras.optimizers.RMSprop(0.01),
    lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
], ids=["adamw", "adagrad", "rmsprop", "adam-global-clipnorm"])
@pytest.mark.parametrize("model_kind", ["conv-functional", "attention-subclass"])
def test_keras3_layers_and_optimizers_equal_one_device(make_optimizer, model_kind):
    rng = np.random.default_rng(7)
    if model_kind == "conv-functional":
        make, x = conv_functional, 0.2 * rng.normal(size=(STEPS, BATCH, 6, 6, 1))
    else:
        def make():
            model = Attention()
            model(np.zeros((1, 4, 8), np.float32))        # built: its weights exist
            return model
        x = rng.normal(size=(STEPS, BATCH, 4, 8))
    x, y = x.astype(np.float32), rng.normal(size=(STEPS, BATCH, 1)).astype(np.float32)
    parallel, single = twins(make, make_optimizer)
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    for k in range(STEPS):
        np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]).numpy(), atol=1e-5,
                                   rtol=0)
    step.sync()
    # 1e-5 absolute, and relative where values are large: Adagrad's and
    # RMSprop's accumulators reach 17 here, where float32 values are 2e-6 apart
    check_equal(parallel, single, rtol=1e-5)


@pytest.mark.parametrize("mode", ["distinct", "identical"])
def test_keras3_dropout_draws_per_replica(mode):
    """Keras 3's Dropout draws from a stateless op seeded by a variable: under
    `random: distinct` (the default) replica 1 reads the seed XORed with its
    mask, and replica 0 draws what one device draws for its rows, step after
    step (the seed generator's counter advances once per step on both);
    under `random: identical` every replica draws replica 0's mask."""
    def make():
        return keras.Sequential([keras.Input((16,)), keras.layers.Dropout(0.5, seed=3),
                                 keras.layers.Dense(1)])

    def fn_of(model, optimizer):
        def fn(x, y):
            with tf.GradientTape() as tape:
                h = model.layers[0](x, training=True)
                loss = tf.reduce_mean(model.layers[1](h) - y)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return tf.cast(h > 0, tf.float32)
        return fn
    parallel, single = twins(make, lambda: keras.optimizers.SGD(0.0))
    step = pn.function(fn_of(*parallel), local(2), {"random": mode})
    ref = tf.function(fn_of(*single))
    x, y = np.ones((8, 16), np.float32), np.zeros((8, 1), np.float32)
    for _ in range(3):
        a, b = step(x, y, per_replica=True)
        one = ref(x, y).numpy()
        np.testing.assert_array_equal(a, one[:4])
        if mode == "identical":
            np.testing.assert_array_equal(a, b)
        else:
            assert (a != b).mean() > 0.3 and 0.35 < b.mean() < 0.65


class TableUses(keras.Model):
    """One embedding table used as real models use it: read at two ids per
    row (`two`: the tape concatenates the lookups' rows), tied to an output
    projection (`tied`: a dense gradient), or read at positions (`positions`:
    the same ids on every replica, each row summed over the batch)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.emb = keras.layers.Embedding(50, 4)
        self.pos = keras.layers.Embedding(3, 4)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        a, b = self.emb(x[:, 0]), self.emb(x[:, 1])
        h = a * b
        if self.kind == "tied":
            h = h + keras.ops.matmul(a, keras.ops.transpose(self.emb.embeddings))[:, :4]
        if self.kind == "positions":
            h = keras.ops.mean(self.emb(x) + self.pos(keras.ops.arange(3)), axis=1)
        return self.out(h)


@pytest.mark.parametrize("kind, run_option, sparse", [
    ("two", "ps", True), ("two", "allreduce", True), ("tied", "hybrid", False),
    ("positions", "hybrid", True), ("positions", "allreduce", True), ("positions", "ps", True),
])
def test_a_table_read_twice_tied_or_at_positions_equals_one_device(kind, run_option, sparse):
    """Under Adam, whose Keras 3 update squares an IndexedSlices' values row
    by row: the tape's sums outside its scope (a ConcatV2 of two lookups'
    rows, an AddN with a dense part) are the gradient, and rows alike on
    every replica are summed row for row, not concatenated."""
    def make():
        model = TableUses(kind)
        model(np.zeros((1, 3), np.int32))
        return model
    parallel, single = twins(make, lambda: keras.optimizers.Adam(0.01))
    step = pn.function(step_of(*parallel), local(2), {"run_option": run_option})
    ref = tf.function(step_of(*single))
    rng = np.random.default_rng(3)
    x = rng.integers(0, 50, (STEPS, BATCH, 3)).astype(np.int32)
    y = rng.normal(size=(STEPS, BATCH, 1)).astype(np.float32)
    for k in range(STEPS):
        step(x[k], y[k])
        ref(x[k], y[k])
    step.sync()
    check_equal(parallel, single)
    tg = step.runner.ctx.tg
    table, = (v for v in tg.gradients if tuple(tg.variables[v].shape) == (50, 4))
    assert step.runner.plan.variables[table].info.sparse == sparse
    assert [tuple(tg.variables[v].shape) for v in tg.rows_alike] == \
        ([(3, 4)] if kind == "positions" else [])


@pytest.mark.parametrize("name", ["Adagrad", "Adadelta", "Nadam", "Adamax", "Lion", "Ftrl",
                                  "Lamb", "Adafactor", "Muon"])
def test_more_keras3_optimizers_on_an_embedding_equal_one_device(name):
    """Keras 3's other optimizers on a sparse gradient, with an embedding
    and a dense layer. Adagrad and Adadelta divide the rows by a dense
    tensor in a tf.cond, which the gradient's rows enter through a Switch
    named after them (not autodiff: rules.is_autodiff_use); Adafactor's
    factored moments take means of the squared rows (they were refused
    before the rows' analysis was known to cover them)."""
    parallel, single = twins(lambda: keras3_embedding(30),
                             lambda: getattr(keras.optimizers, name)(0.01))
    step = pn.function(step_of(*parallel), local(2))
    ref = tf.function(step_of(*single))
    x, y = data(vocab=30)
    for k in range(STEPS):
        step(x[k], y[k])
        ref(x[k], y[k])
    step.sync()
    check_equal(parallel, single, rtol=1e-5)
    assert any(vp.info.sparse for vp in step.runner.plan.variables.values())


class RowSGD(keras.optimizers.Optimizer):
    """A program's own optimizer whose update of an embedding's rows is not
    linear in them: each occurrence of an id changes the row by its own
    value times (1 + 5|value|), so rows summed before the update would
    differ from one device's."""

    def update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        if isinstance(gradient, tf.IndexedSlices):
            values = gradient.values * lr * (1.0 + 5.0 * tf.abs(gradient.values))
            variable.scatter_sub(tf.IndexedSlices(values, gradient.indices))
        else:
            variable.assign_sub(gradient * lr * (1.0 + 5.0 * tf.abs(gradient)))


@pytest.mark.parametrize("config", [{"run_option": "hybrid"}, {"run_option": "allreduce"},
                                    {"run_option": "ps"}, {"sparse_method": "alltoall"}],
                         ids=["hybrid", "allreduce", "ps", "alltoall"])
def test_a_programs_own_optimizer_on_an_embeddings_rows_equals_one_device(config):
    """An id read several times in a batch (a vocabulary of 6): the rows
    reach the update one by one, as on one device, 1e-5."""
    parallel, single = twins(lambda: keras3_embedding(6), lambda: RowSGD(learning_rate=0.05))
    step = pn.function(step_of(*parallel), local(2), config)
    ref = tf.function(step_of(*single))
    x, y = data(vocab=6)
    for k in range(4):
        np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]).numpy(), atol=1e-5, rtol=0)
    step.sync()
    for w1, w2 in zip(parallel[0].weights, single[0].weights):
        np.testing.assert_allclose(np.asarray(w1), np.asarray(w2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_a_stateful_rnn_built_for_a_replicas_rows_equals_one_device(lib):
    """A stateful LSTM keeps a state row per example from batch to batch:
    built for one replica's part of the global batch (4 of 8 rows), each
    replica keeps its own examples' state, and 4 steps equal one device's
    model built for 8 rows (1e-5); sync() gives the model replica 0's rows.
    Before, tf_keras's state was averaged across the replicas, silently."""
    import tf_keras
    k = keras if lib == "keras" else tf_keras
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(4, 8, 5, 3)).astype(np.float32)
    ys = rng.normal(size=(4, 8, 1)).astype(np.float32)
    weights = None
    models = []
    for rows in (4, 8):
        inp = k.Input(batch_shape=(rows, 5, 3))
        model = k.Model(inp, k.layers.Dense(1)(k.layers.LSTM(4, stateful=True)(inp)))
        if weights is None:
            weights = model.get_weights()
        model.set_weights(weights)
        step = step_of(model, k.optimizers.SGD(0.1))
        step = pn.function(step, local(2)) if rows == 4 else tf.function(step)
        losses = [float(step(x, y)) for x, y in zip(xs, ys)]
        if rows == 4:
            step.sync()
        models.append((model, losses))
    (parallel, got), (single, want) = models
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for a, b in zip(parallel.trainable_weights, single.trainable_weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    states = [(np.asarray(a), np.asarray(b))
              for a, b in zip(parallel.layers[1].states, single.layers[1].states)]
    assert len(states) == 2
    for a, b in states:        # replica 0 took the first 4 rows of every batch
        np.testing.assert_allclose(a, b[:4], rtol=0, atol=1e-5)


def test_a_recurrent_models_predictions_come_back_from_every_replica():
    """A Keras 3 LSTM is a while loop whose outputs leave through its back
    edge; the step's predictions came back as replica 0's 4 rows of 8 (the
    analysis took them to be equal on every replica). Now all 8, each
    replica's rows as one device computes them before the update, their
    sum and their largest value one device's too."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(1)])
    x = np.random.default_rng(0).normal(size=(8, 5, 3)).astype(np.float32)
    want = model.predict(x, verbose=0)
    optimizer = keras.optimizers.SGD(0.1)

    def step(x, y):
        with tf.GradientTape() as tape:
            pred = model(x)
            loss = tf.reduce_mean(tf.square(pred - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return pred, tf.reduce_sum(pred), tf.reduce_max(pred)
    got = pn.function(step, local(2))(x, np.ones((8, 1), np.float32))
    # the sum and the largest value had been the replicas' means (the loss's
    # form did not reach through the loop's back edge; a max had no rule)
    for a, b in zip(got, (want, want.sum(), want.max())):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_stateful_rnn_built_for_the_global_batch_is_refused_naming_its_state():
    """tf_keras's LSTM built for the global batch (8 rows) while each
    replica takes 4: a shape error inside the step before."""
    import tf_keras
    inp = tf_keras.Input(batch_shape=(8, 5, 3))
    model = tf_keras.Model(inp, tf_keras.layers.Dense(1)(
        tf_keras.layers.LSTM(4, stateful=True, name="memory")(inp)))
    with pytest.raises(pn.ConfigError, match=r"'memory/Variable(_1)?' keeps a row per example "
                                             r"of a batch of 8.*build the model for 4 rows"):
        pn.function(step_of(model, tf_keras.optimizers.SGD(0.1)), local(2))(
            np.ones((8, 5, 3), np.float32), np.ones((8, 1), np.float32))


def test_bad_steps_are_refused_naming_the_problem():
    x, y = data()
    model, optimizer = keras3_dense(), keras.optimizers.SGD(0.1)

    def no_update(x, y):
        return tf.reduce_mean(model(x) - y)

    def new_variable(x, y):
        v = tf.Variable(1.0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) * v - y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    calls = []

    def side_effect(x, y):
        calls.append(1)
        return step_of(model, optimizer)(x, y) * len(calls)
    def updates_in_a_loop(x, y):     # it had waited in the step until the timeout
        for _ in tf.range(2):
            step_of(model, optimizer)(x, y)
        return tf.constant(0.0)

    def accumulates_in_a_loop(x, y):     # it waited in its first run for ever
        grads = [tf.zeros_like(v) for v in model.trainable_variables]
        for _ in tf.range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = [a + b for a, b in zip(grads, tape.gradient(loss,
                                                                model.trainable_variables))]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    def per_example(x, y):      # DP-SGD's gradients: a jacobian of the variables
        with tf.GradientTape() as tape:
            losses = tf.square(model(x) - y)[:, 0]
        grads = [tf.reduce_mean(j, 0) for j in tape.jacobian(losses, model.trainable_variables)]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return tf.reduce_mean(losses)
    def clipped_per_example(mapped):
        def step(x, y):         # DP-SGD's gradients: tape.gradient per example in a loop
            def one(xy):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.square(model(xy[0][None]) - xy[1][None]))
                return [tf.clip_by_norm(g, 1.0)
                        for g in tape.gradient(loss, model.trainable_variables)]
            per = mapped(one, (x, y))
            optimizer.apply_gradients(zip([tf.reduce_mean(g, 0) for g in per],
                                          model.trainable_variables))
            return tf.constant(0.0)
        return step
    def static_rows(x, y):      # the batch's size from its static shape: None here
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x) - y)) / x.shape[0]
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss
    for fn, error, match in [
            # before: TensorFlow's "None values not supported", not naming the cause
            (static_rows, pn.GraphError, r"(?s)first dimension unknown.*None values not "
             r"supported.*tf.shape\(x\)\[0\], not x.shape\[0\] or len\(x\)"),
            (per_example, pn.GraphError, "from tape.jacobian of .*per-example"),
            # before: "adds its gradients into variables [...] and applies none"
            (clipped_per_example(tf.vectorized_map), pn.GraphError,
             "gradients of 'loop_body/.*inside tf.vectorized_map or tf.map_fn"),
            (clipped_per_example(lambda f, xy: tf.map_fn(
                f, xy, fn_output_signature=[v.dtype for v in model.trainable_variables])),
             pn.GraphError, "gradients of 'map/while/.*inside tf.vectorized_map or tf.map_fn"),
            (updates_in_a_loop, pn.GraphError, "is updated, or its gradient taken, inside a "
             "loop.*loop in Python"),
            (accumulates_in_a_loop, pn.GraphError, "its gradient taken, inside a loop "
             r"\('while/body.*gradient_tape.*unrolled in the step"),
            (no_update, pn.GraphError, "'no_update' trains nothing.*apply_gradients"),
            (new_variable, pn.GraphError, "makes variables on every call"),
            (side_effect, pn.GraphError, "built another graph when traced a second time")]:
        with pytest.raises(error, match=match):
            pn.function(fn, local(2))(x[0], y[0])
    with pytest.raises(pn.GraphError, match="if the program runs the step as a tf.function"):
        pn.function(side_effect, local(2))(x[0], y[0])
    step = pn.function(step_of(model, optimizer), local(2))
    with pytest.raises(pn.FetchError, match="global batch of 7 rows.*2 replicas"):
        step(x[0][:7], y[0][:7], per_replica=True)
    batches = tf.data.Dataset.from_tensor_slices((x[0], y[0])).batch(4)
    for given in (batches, iter(batches)):       # the TF2 strategies' habit
        with pytest.raises(pn.GraphError, match="is a .*, not a tensor or array: a step takes "
                                                "one global batch; iterate outside it"):
            pn.function(lambda it: step_of(model, optimizer)(*next(iter(it))), local(2))(given)


def test_a_tf_function_runs_its_first_trace_as_on_one_device():
    """A tf.function step whose Python code counts its traces: one device
    runs its first trace on every call (the count frozen at 1), and so do
    the replicas; the same Python function given bare is refused (above)."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.SGD(0.1, momentum=0.9))

    def counted(model, optimizer):
        calls = []

        @tf.function
        def step(x, y):
            calls.append(1)
            return step_of(model, optimizer)(x, y) * float(len(calls))
        return step
    step, ref = pn.function(counted(*parallel), local(2)), counted(*single)
    x, y = data()
    for k in range(STEPS):
        np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]), rtol=1e-6)
    step.sync()
    check_equal(parallel, single)


def custom_loop(lib, step_wrapper):
    """keras.io's training loop from scratch: a metric updated in the step
    and read with result() at each epoch's end, then reset; a validation
    pass of the program's own tf.function over the model. Returns what the
    loop logs, the model (not synced after the loop) and the step."""
    keras_lib = keras if lib == "keras3" else __import__("tf_keras")
    keras_lib.utils.set_random_seed(0)
    model = keras_lib.Sequential([keras_lib.Input((5,)), keras_lib.layers.Dense(8, "relu"),
                                  keras_lib.layers.Dense(3)])
    optimizer = keras_lib.optimizers.SGD(0.1)
    loss_fn = keras_lib.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_acc, val_acc = (keras_lib.metrics.SparseCategoricalAccuracy() for _ in range(2))

    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        train_acc.update_state(y, logits)
        return loss

    @tf.function
    def test_step(x, y):
        val_acc.update_state(y, model(x, training=False))
    step = step_wrapper(train_step)
    x, _ = data()
    y = np.random.default_rng(1).integers(0, 3, (STEPS, BATCH))
    log = []
    for epoch in range(2):
        log += [float(step(x[k], y[k])) for k in range(epoch * 4, epoch * 4 + 4)]
        log.append(float(train_acc.result()))
        train_acc.reset_state()
        for k in (8, 9):
            test_step(x[k], y[k])
        log.append(float(val_acc.result()))
        val_acc.reset_state()
    return log, model, step


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_a_custom_loop_reads_its_metrics_and_model_between_calls(lib, monkeypatch, capsys):
    """The program's variables follow the runner after each call (batch_sync
    auto, a model this small): the epoch's accuracy read from the metric and
    a validation pass over the model equal one device's, and so do the
    weights without a sync. Before, the metric read 0.0 and the validation
    ran on the first weights (0.12 off one device at the end). Above
    tf2.FOLLOWED bytes only the untrained state follows (said once); the
    weights come at step.sync()."""
    import parallax_ng.tf2 as tf2_module
    want, single, _ = custom_loop(lib, tf.function)
    got, parallel, _ = custom_loop(lib, lambda fn: pn.function(fn, local(2)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for a, b in zip(parallel.get_weights(), single.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    monkeypatch.setattr(tf2_module, "FOLLOWED", 0)
    got, parallel, step = custom_loop(lib, lambda fn: pn.function(fn, local(2)))
    assert "the program's get the trained weights at step.sync()" in capsys.readouterr().err
    assert got[4] == want[4] and got[10] == want[10]        # the training accuracy
    assert any(np.abs(a - b).max() > 1e-3 for a, b in zip(parallel.get_weights(),
                                                          single.get_weights()))
    step.sync()
    for a, b in zip(parallel.get_weights(), single.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _two_steps(wrap):
    """A GAN's discriminator and generator steps as two functions, called
    in turn; each reads the model the other trains."""
    keras.utils.set_random_seed(0)
    gen = keras.Sequential([keras.Input((3,)), keras.layers.Dense(6, activation="relu"),
                            keras.layers.Dense(4)])
    disc = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                             keras.layers.Dense(1)])
    opt_g, opt_d = keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def d_step(x, z):
        with tf.GradientTape() as tape:
            real, fake = disc(x), disc(gen(z))
            loss = bce(tf.ones_like(real), real) + bce(tf.zeros_like(fake), fake)
        grads = tape.gradient(loss, disc.trainable_variables)
        opt_d.apply_gradients(zip(grads, disc.trainable_variables))
        return loss

    def g_step(z):
        with tf.GradientTape() as tape:
            fake = disc(gen(z))
            loss = bce(tf.ones_like(fake), fake)
        opt_g.apply_gradients(zip(tape.gradient(loss, gen.trainable_variables),
                                  gen.trainable_variables))
        return loss
    steps = wrap(d_step), wrap(g_step)
    x, _ = data(4)
    z = np.random.default_rng(5).normal(size=(STEPS, BATCH, 3)).astype(np.float32)
    losses = [float(f(*a)) for k in range(4) for f, a in zip(steps, ((x[k][:, :4], z[k]),
                                                                      (z[k],)))]
    return losses, steps, (gen, disc)


def test_two_steps_each_reading_what_the_other_trains_equal_one_device(monkeypatch):
    """With models above tf2.FOLLOWED bytes the weights a step trains come
    back to the program at sync() only, but those another step reads come
    back after each call, and a step built later starts from the others'
    values (before, the generator's step ran on the first discriminator:
    a loss 3.5 off one device's)."""
    import parallax_ng.tf2 as tf2_module
    want, _, single = _two_steps(tf.function)
    monkeypatch.setattr(tf2_module, "FOLLOWED", 0)
    got, steps, parallel = _two_steps(lambda fn: pn.function(fn, local(2)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for step in steps:
        step.sync()
    for ours, theirs in zip(parallel, single):
        for a, b in zip(ours.get_weights(), theirs.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _shared_weights(wrap, fit=False):
    """A step that trains the whole model with Adam and one that fine-tunes
    its last layer (by the same Adam: its slots and counter are shared too;
    with `fit`, by SGD between `fit` epochs that train the model), called
    in turn: each trains weights the other trains."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    adam = keras.optimizers.Adam(0.02)
    head_optimizer = keras.optimizers.SGD(0.05, momentum=0.9) if fit else adam

    def loss_of(x, y):
        return tf.reduce_mean(tf.square(model(x, training=True) - y))

    def train(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        adam.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                 model.trainable_variables))
        return loss

    def head(x, y):
        variables = model.layers[-1].trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        head_optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    x, y = data(6)
    if fit:
        model.compile(adam, "mse")
        if wrap is not tf.function:
            pn.parallelize(model, local(2))
        steps = (wrap(head),)
        losses = []
        for epoch in range(2):
            losses += model.fit(x[:4].reshape(-1, 5), y[:4].reshape(-1, 1), batch_size=BATCH,
                                epochs=1, shuffle=False, verbose=0).history["loss"]
            losses += [float(steps[0](x[k], y[k])) for k in range(4, 7)]
    else:
        steps = wrap(train), wrap(head)
        losses = [float(f(x[k], y[k])) for k in range(6) for f in steps]
    return losses, steps, (model, head_optimizer, adam)


@pytest.mark.parametrize("case", ["two-steps", "two-steps-synced-at-sync", "fit-and-a-step"])
def test_steps_that_train_the_same_weights_take_in_each_others_training(case, monkeypatch):
    """Two pn.function steps, or a `fit` and a step, that train the same
    weights: each takes in what the other trained at its next call, as on
    one device (before, each trained on from its own replicas' values:
    losses 0.15 apart for two steps, 0.084 for a fit and a step).
    "synced-at-sync": above FOLLOWED bytes, where the trained weights
    come back to the program at sync() only, save those another step
    trains or reads."""
    import parallax_ng.tf2 as tf2_module
    fit = case == "fit-and-a-step"
    want, _, single = _shared_weights(tf.function, fit)
    if case == "two-steps-synced-at-sync":
        monkeypatch.setattr(tf2_module, "FOLLOWED", 0)
    got, steps, parallel = _shared_weights(lambda fn: pn.function(fn, local(2)), fit)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for step in steps:
        step.sync()
    check_equal(parallel[:2], single[:2])
    for a, b in zip(parallel[2].variables, single[2].variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_an_embedding_reads_its_rows_not_the_whole_table():
    """Keras 3's Embedding gathers from a read of the whole table; the
    capture makes it a ResourceGather of the variable (a whole read that
    the step's update outlives copies the table every step)."""
    from parallax_ng.graph.tracing import capture
    model, optimizer = keras3_embedding(30), keras.optimizers.Adam(0.01)
    ids, y = data(vocab=30)
    cap = capture(step_of(model, optimizer), (ids[0], y[0]))
    ops = cap.graph.get_operations()
    gathers = [op for op in ops if op.type == "ResourceGather"]
    assert len(gathers) == 1 and gathers[0].inputs[0].op.type == "VarHandleOp"
    assert not [op for op in ops if op.type == "GatherV2" and
                op.inputs[0].op.type == "ReadVariableOp" and
                tuple(op.inputs[0].shape) == (30, 4)]


def sparse_bags(seed, vocab, rows=BATCH):
    """A batch of bags of ids as a tf.SparseTensor: `rows` rows of 0 to 3 ids
    each (a row with none among them), and a target per row."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, size=rows)
    counts[1] = 0
    indices = np.array([(r, k) for r in range(rows) for k in range(counts[r])], np.int64)
    ids = rng.integers(0, vocab, size=len(indices)).astype(np.int64)
    bags = tf.SparseTensor(indices, ids, [rows, 3])
    return bags, rng.normal(size=(rows, 1)).astype(np.float32)


def bag_model(vocab):
    """A table read by bags of ids (mean of each row's rows) and a Keras 3
    head; Adagrad (the table's gradient stays sparse)."""
    table = tf.Variable(np.random.default_rng(7).normal(size=(vocab, 4)).astype(np.float32),
                        name="bag_table")
    head = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adagrad(0.1)

    def train_step(bags, y):
        with tf.GradientTape() as tape:
            mean = tf.nn.safe_embedding_lookup_sparse(table, bags, combiner="mean")
            loss = tf.reduce_mean(tf.square(head(mean, training=True) - y))
        weights = [table] + head.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return loss
    return train_step, table, head, optimizer


def test_a_sparse_tensor_argument_is_split_by_its_rows():
    """A step taking a tf.SparseTensor batch (bags of ids of 0 to 3 per
    row): each of 2 replicas gets its rows' entries, so 10 steps equal one
    device with the global batch (table, head and Adagrad's accumulators,
    1e-5); the table's gradient stays sparse; a dense batch where the step
    was traced with a SparseTensor is refused by name."""
    vocab = 40
    fn, table, head, optimizer = bag_model(vocab)
    ref_fn, ref_table, ref_head, ref_optimizer = bag_model(vocab)
    ref_head.set_weights(head.get_weights())
    step, ref = pn.function(fn, local(2)), tf.function(ref_fn)
    for k in range(STEPS):
        bags, y = sparse_bags(k, vocab)
        np.testing.assert_allclose(step(bags, y), ref(bags, y).numpy(), atol=1e-5, rtol=0)
    plan = step.runner.plan.variables
    assert plan["bag_table"].info.sparse, plan
    step.sync()
    np.testing.assert_allclose(table.numpy(), ref_table.numpy(), atol=1e-5, rtol=0)
    for got, want in zip(head.weights + optimizer.variables,
                         ref_head.weights + ref_optimizer.variables):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0,
                                   err_msg=getattr(got, "path", got.name))
    with pytest.raises(pn.ConfigError, match="leaf 0 of the step was traced as a SparseTensor"):
        step(np.zeros((BATCH, 3), np.int64), y)
    bags, y = sparse_bags(0, vocab, rows=7)        # rows the replicas cannot split:
    np.testing.assert_allclose(step(bags, y), ref(bags, y).numpy(), atol=1e-5, rtol=0)
    assert step.on_program == 1                     # the step ran on the program's variables
    step.sync()
    np.testing.assert_allclose(table.numpy(), ref_table.numpy(), atol=1e-5, rtol=0)
    with pytest.raises(pn.FetchError, match="leaf 0 .* 7 rows"):
        step(bags, y, per_replica=True)


@pytest.mark.parametrize("flags", [["--sparse"], ["--sparse", "--ragged"]],
                         ids=["sparse", "ragged"])
def test_a_sparse_tensor_argument_in_a_two_worker_job(tmp_path, flags):
    """2 workers x 1 device, each called with the global SparseTensor batch
    (8 rows), or the same rows as a RaggedTensor the step makes sparse:
    each takes its 4 rows' entries (numbered from 0), and after 5 steps
    both equal one device with the global batch from worker 0's head
    (table, head and Adagrad's accumulators, 1e-5)."""
    out, done = run_job(tmp_path, *flags)
    assert "worker 1 of 2: done" in done.stdout
    workers = [dict(np.load(f"{out}.{k}.npz")) for k in range(2)]
    fn, table, head, optimizer = bag_model(40)
    head.set_weights([workers[0][f"start{i}"] for i in range(len(head.weights))])
    ref = tf.function(fn)
    for k in range(5):
        ref(*sparse_bags(k, 40))
    for w in workers:
        assert "allgather" in str(w["plan"])
        np.testing.assert_allclose(w["table"], table.numpy(), atol=1e-5, rtol=0)
        for i, v in enumerate(head.weights):
            np.testing.assert_allclose(w[f"w{i}"], np.asarray(v), atol=1e-5, rtol=0)
        for i, v in enumerate(optimizer.variables):
            np.testing.assert_allclose(w[f"o{i}"], np.asarray(v), atol=1e-5, rtol=0)


def test_model_fit_on_sparse_inputs_equals_one_device():
    """Keras 3 `model.fit` on a tf.SparseTensor input (keras.Input(sparse=True)),
    2 replicas: every weight and Adam variable within 1e-5 of one device
    after 2 epochs of 8 batches, and the epochs' losses equal (Keras counts
    a batch's examples from the SparseTensor's dense shape: each replica's
    rows, summed over the replicas)."""
    rng = np.random.default_rng(0)
    dense = (rng.random((64, 10)) < 0.2) * rng.normal(size=(64, 10))
    x = tf.sparse.from_dense(dense.astype(np.float32))
    y = rng.normal(size=(64, 1)).astype(np.float32)

    def make():
        m = keras.Sequential([keras.Input((10,), sparse=True),
                              keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return m
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    pn.parallelize(parallel, local(2))
    got = parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    want = single.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], atol=1e-5, rtol=0)
    check_equal((parallel, parallel.optimizer), (single, single.optimizer))


V1_SCRIPT = """
import tensorflow as tf
tf.compat.v1.disable_v2_behavior()
import tf_keras
import parallax_ng as pn
model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(3,))])
model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1), loss="mse")
for call in (lambda: pn.parallelize(model, {resources}), lambda: pn.function(lambda x: x)):
    try:
        call()
    except pn.ConfigError as e:
        print("refused:", e)
"""


def test_tf2_entries_refuse_a_program_without_tf2_behavior(tmp_path):
    """Under tf.compat.v1.disable_v2_behavior() tf_keras's `fit` runs its v1
    graph loop, which pn.parallelize would never reach (it had trained on
    one device, silently): both TF2 entries say so and point to the TF1
    path. Inside a graph's as_default() likewise."""
    import sys

    import forked
    script = tmp_path / "v1.py"
    script.write_text(V1_SCRIPT.format(resources=local(2)))
    done = forked.run([sys.executable, str(script)], env=dict(
        forked.ENV, TF_USE_LEGACY_KERAS="1"), timeout=300)
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert done.returncode == 0 and len(refused) == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert all("needs TF2 behavior" in line and "pn.get_runner" in line for line in refused)
    with tf.Graph().as_default():
        with pytest.raises(pn.ConfigError, match="pn.function needs TF2 behavior.*as_default"):
            pn.function(step_of(keras3_dense(), keras.optimizers.SGD(0.1)), local(2))


def test_values_the_program_sets_between_calls_are_taken_in():
    """A custom loop that sets its learning rate per epoch
    (`optimizer.learning_rate = ...`), a variable the step reads, and resets a
    metric after reading it (`sync`, then `reset_state`): each call sees them,
    as one device does (they had been ignored: 0.011 off); a rate set before
    a `sync` is not written over by it, and a kernel assigned after one is
    taken in (before: 0.34 off); weights the program sets otherwise go in
    by `push`. Weights, optimizer and metric equal one device's, 1e-5."""
    parallel, single = twins(keras3_dense, lambda: keras.optimizers.SGD(0.1, momentum=0.5))
    x, y = data(7)
    seen = []
    for (model, optimizer), make in ((parallel, lambda f: pn.function(f, local(2))),
                                     (single, tf.function)):
        scale, mae = tf.Variable(1.0, trainable=False), keras.metrics.MeanAbsoluteError()

        def train_step(x, y):
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                loss = scale * tf.reduce_mean(tf.square(pred - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            mae.update_state(y, pred)
            return loss
        step = make(train_step)
        results = []
        for epoch in range(3):
            scale.assign(1.0 + epoch)
            for k in range(3):
                step(x[3 * epoch + k], y[3 * epoch + k])
            optimizer.learning_rate = 0.1 * 0.5 ** (epoch + 1)    # not written over by sync
            if hasattr(step, "sync"):
                step.sync()
            results.append(float(mae.result()))
            mae.reset_state()
            kernel = model.layers[-1].kernel          # after a sync: taken in
            kernel.assign(kernel * 0.9)
        model.set_weights([np.asarray(w) * 0.9 for w in model.weights])   # taken in
        step(x[9], y[9])
        if hasattr(step, "sync"):
            step.sync()
        seen.append(results + [float(mae.result())])
    check_equal(parallel, single)
    np.testing.assert_allclose(seen[0], seen[1], atol=1e-5, rtol=0)


OTHER_BATCHES = """
import os, sys
os.environ["TF_USE_LEGACY_KERAS"] = "0"
import keras, numpy as np, tensorflow as tf
import parallax_ng as pn
from parallax_ng.cluster import from_env
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.1)

def train(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables))
step = pn.function(train)
rng = np.random.default_rng(from_env().task)        # an unseeded shuffle's draw
x = rng.normal(size=(8, 3)).astype("float32")
step(x, x[:, :1])
print("trained", flush=True)
"""


def test_workers_called_with_other_first_batches_are_warned(tmp_path):
    """A job whose workers are called with other global batches (each
    worker's data drawn on its own: an unseeded shuffle) trains, each
    worker on its rows of its own batch, and worker 1 says so, naming the
    arguments (runtime/serving.py same_batches; before: nothing). The fit
    and loop jobs above, called alike, say nothing."""
    import subprocess
    import sys
    script = tmp_path / "other.py"
    script.write_text(OTHER_BATCHES)
    path = tmp_path / "resources.yaml"
    path.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2)
    done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
                           str(path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0 and done.stdout.count("trained") == 2, done.stderr[-3000:]
    said = [ln for ln in done.stderr.splitlines() if "differs from worker 0's" in ln]
    assert len(said) == 1 and said[0].startswith("[worker 1]"), done.stderr[-3000:]
    assert "(argument leaf 0, argument leaf 1)" in said[0]
