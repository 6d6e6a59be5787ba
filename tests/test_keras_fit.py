"""Keras `model.fit` data-parallel (`pn.parallelize`): N replicas with the
global batch equal one device, every weight, optimizer variable and epoch
log, 1e-5; callbacks and validation see the trained weights."""
import keras            # Keras 3 by name, whatever TF_USE_LEGACY_KERAS says
import numpy as np
import pytest

import parallax_ng as pn
from parallax_ng import keras_fit
from models import local
import forked
from test_tf2 import check_equal, tf_keras_dense
from task_env import TASK_PATH

SAMPLES, BATCH = 80, 16          # 5 steps an epoch


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(SAMPLES, 1))).astype(np.float32)
    return x, y


def make():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1)])


def twins(optimizer=lambda: keras.optimizers.Adam(0.01)):
    keras.utils.set_random_seed(0)      # seeded weights: a run is the next one
    a, b = make(), make()
    b.set_weights(a.get_weights())
    for m in (a, b):
        m.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    return a, b


def check(parallel, single):
    check_equal((parallel, parallel.optimizer), (single, single.optimizer))


def lib_twins(lib, seed, optimizer):
    """Two equal seeded Dense models of `lib` ("keras" or "tf_keras"), each
    compiled with `optimizer(lib's optimizers module)`, mse and mae; the
    first parallelized on 2 replicas."""
    import importlib
    k = importlib.import_module(lib)

    def make():
        k.utils.set_random_seed(seed)
        model = k.Sequential([k.Input((5,)), k.layers.Dense(8, activation="relu"),
                              k.layers.Dense(1)])
        model.compile(optimizer=optimizer(k.optimizers), loss="mse", metrics=["mae"])
        return model
    parallel, single = make(), make()
    pn.parallelize(parallel, local(2))
    return parallel, single


def test_fit_equals_one_device_with_the_global_batch():
    parallel, single = twins()
    assert pn.parallelize(parallel, local(2)) is parallel
    x, y = data()
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    check(parallel, single)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=0)
    assert parallel._parallax_ng.step.runner.plan.num_replicas == 2
    assert not parallel._parallax_ng.on_model      # every batch on the replicas
    np.testing.assert_allclose(parallel.predict(x, verbose=0), single.predict(x, verbose=0),
                               atol=1e-5)


def test_callbacks_validation_and_a_second_fit_see_the_trained_weights(tmp_path):
    parallel, single = twins()
    pn.parallelize(parallel, local(2))
    x, y = data(1)
    vx, vy = data(2)

    def callbacks(name):
        return [keras.callbacks.LearningRateScheduler(lambda epoch: 0.02 * 0.5 ** epoch),
                keras.callbacks.ModelCheckpoint(str(tmp_path / f"{name}.weights.h5"),
                                                save_weights_only=True)]
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                      validation_data=(vx, vy), callbacks=callbacks("parallel"))
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                    validation_data=(vx, vy), callbacks=callbacks("single"))
    for key in ("loss", "val_loss", "val_mae", "learning_rate"):
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=0,
                                   err_msg=key)
    saved = make()
    saved.load_weights(str(tmp_path / "parallel.weights.h5"))
    for w1, w2 in zip(saved.weights, single.weights):
        np.testing.assert_allclose(np.asarray(w1), np.asarray(w2), atol=1e-5, rtol=0)
    # weights set between fits are what the next fit starts from
    for m in (parallel, single):
        m.set_weights([w * 0.5 for w in single.get_weights()])
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    check(parallel, single)


def classifier_metrics(k):
    """Metrics that are means and metrics that sum (counts, confusion
    matrices), named alike in both models."""
    return ["accuracy", k.metrics.Precision(name="precision"),
            k.metrics.AUC(num_thresholds=20, name="auc"),
            k.metrics.TruePositives(name="tp"), k.metrics.MeanAbsoluteError(name="mae")]


def check_classifier_fit(k, parallel, single):
    """Both models compiled with the classifier's metrics fit alike: every
    epoch's logs, every metric variable (totals and counts as one device
    with the global batch has them), every weight and slot."""
    for m in (parallel, single):
        m.compile(optimizer=k.optimizers.Adam(0.01), loss="binary_crossentropy",
                  metrics=classifier_metrics(k))
    pn.parallelize(parallel, local(2))
    x, y = data(3)
    y = (y > 0).astype(np.float32)
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert sorted(h1.history) == sorted(h2.history)
    assert max(h2.history["tp"]) > 5
    for key in h2.history:
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=1e-6,
                                   err_msg=key)
    for m1, m2 in zip(parallel.metrics, single.metrics):
        for v1, v2 in zip(m1.variables, m2.variables):
            np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), atol=1e-5, rtol=1e-6,
                                       err_msg=v1.name)
    check(parallel, single)


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2),
    lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=3)], ids=["sgd", "adam"])
def test_gradient_accumulation_steps_equal_one_device(optimizer):
    """Keras 3's optimizer adds each step's gradients to accumulators in one
    branch of a cond and updates with them in the other; the gradient the
    cond routes into both is aggregated (before: only one branch's, so the
    update used each replica's own latest gradient, 0.015 off after 2 epochs)."""
    parallel, single = twins(optimizer)
    pn.parallelize(parallel, local(2))
    x, y = data()
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    check(parallel, single)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_an_optimizer_s_moving_average_of_the_weights_equals_one_device(lib):
    """`use_ema` with `ema_overwrite_frequency`: the optimizer keeps a
    moving average of every weight and writes it into the weights every
    3rd step, and fit's end writes it in again (`finalize_variable_values`,
    on the model): weights, averages and logs as one device's."""
    parallel, single = lib_twins(lib, 1, lambda o: o.Adam(
        0.05, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3))
    x, y = data()
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    check(parallel, single)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("lib,l2", [("keras3", 0.0), ("tf_keras", 0.0), ("keras3", 0.05),
                                    ("tf_keras", 0.05)])
def test_a_loss_reduced_by_sum_sums_the_replicas_gradients(lib, l2):
    """`reduction="sum"`: one device's gradient over the global batch is the
    replicas' sum (average_dense auto; it was their mean), and a kernel's
    regularizer, which Keras adds to the loss, is added 1/N in each replica
    (it had made the loss's form unknown: averaged, silently). The weights
    equal one device's, and so do the logged loss (Keras's tracker adds
    `loss x batch size`: each replica's increment is taken N times; it was
    1/N of one device's) and `evaluate`'s (whose graph has no gradients: the
    regularizer is added 1/N in each replica there too)."""
    lib = keras if lib == "keras3" else __import__("tf_keras")
    reg = lib.regularizers.L2(l2) if l2 else None
    make = lambda: lib.Sequential([lib.Input((5,)), lib.layers.Dense(  # noqa: E731
        8, activation="relu", kernel_regularizer=reg), lib.layers.Dense(1)])
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=lib.optimizers.SGD(0.002),
                  loss=lib.losses.MeanSquaredError(reduction="sum"))
    pn.parallelize(parallel, local(2))
    x, y = data()
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for w1, w2 in zip(parallel.get_weights(), single.get_weights()):
        np.testing.assert_allclose(w1, w2, atol=1e-5, rtol=0)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=0, rtol=1e-6)
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=BATCH, verbose=0),
                               single.evaluate(x, y, batch_size=BATCH, verbose=0),
                               atol=0, rtol=1e-6)


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_outputs_reduced_by_sum_and_by_mean_equal_one_device(lib):
    """Two outputs, one loss summed over the batch and one averaged, with
    loss weights and a kernel regularizer: the replicas' gradients are
    summed and the mean divides by N times its count in every replica
    (averaged, the sum's part was 1/N of one device's). Weights, every logged loss (the total and each output's) and
    `evaluate` equal one device's."""
    lib = keras if lib == "keras3" else __import__("tf_keras")

    def make():
        i = lib.Input((5,))
        h = lib.layers.Dense(8, activation="relu",
                             kernel_regularizer=lib.regularizers.L2(0.02))(i)
        return lib.Model(i, [lib.layers.Dense(1, name="a")(h), lib.layers.Dense(2, name="b")(h)])
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=lib.optimizers.Adam(0.01), loss_weights=[1.0, 0.5], loss=[
            lib.losses.MeanSquaredError(reduction="sum"), lib.losses.MeanAbsoluteError()])
    pn.parallelize(parallel, local(2))
    x, y = data()
    ys = [y, np.concatenate([y, -y], 1)]
    h1 = parallel.fit(x, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    h2 = single.fit(x, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for w1, w2 in zip(parallel.get_weights(), single.get_weights()):
        np.testing.assert_allclose(w1, w2, atol=1e-5, rtol=0)
    assert h1.history.keys() == h2.history.keys()
    for key in h2.history:
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=0, rtol=1e-5,
                                   err_msg=key)
    np.testing.assert_allclose(parallel.evaluate(x, ys, batch_size=BATCH, verbose=0),
                               single.evaluate(x, ys, batch_size=BATCH, verbose=0),
                               atol=0, rtol=1e-5)


def _options_case(case):
    """(make model, make compile kwargs, fit kwargs, x, y) of a fit option users
    write; the sample weights put 0 and 8 counted rows on the two replicas."""
    rng = np.random.default_rng(4)
    x, y = data(4)
    if case == "activity-regularizer":      # its captured rate is read by the step only
        return (lambda: keras.Sequential([
            keras.Input((5,)), keras.layers.Dense(8, activation="relu",
                                                  activity_regularizer=keras.regularizers.L1(0.01)),
            keras.layers.Dense(1)]), lambda: dict(optimizer=keras.optimizers.AdamW(0.01),
                                                  loss="mse"), {}, x, y)
    if case == "masked-lstm":
        ids = rng.integers(1, 50, size=(SAMPLES, 7))
        ids[:, 5:] = 0
        return (lambda: keras.Sequential([
            keras.Input((7,), dtype="int32"), keras.layers.Embedding(50, 8, mask_zero=True),
            keras.layers.LSTM(6), keras.layers.Dense(1)]),
                lambda: dict(optimizer=keras.optimizers.Adam(0.01), loss="mse"), {}, ids, y)
    if case == "rmse-loss":         # a function of the batch's mean: of the job's mean
        def rmse(y_true, y_pred):
            return keras.ops.sqrt(keras.ops.mean(keras.ops.square(y_true - y_pred)))
        return (lambda: keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, "relu"),
                                          keras.layers.Dense(1)]),
                lambda: dict(optimizer=keras.optimizers.Adam(0.01), loss=rmse,
                             metrics=["mae"]), {}, x, y)
    if case == "mean-with-sample-weight":
        weights = np.ones(SAMPLES, np.float32)
        weights[:24] = 0.0
        loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
        return make, lambda: dict(optimizer=keras.optimizers.Adam(0.01), loss=loss), \
            dict(sample_weight=weights), x, y
    labels = (y[:, 0] > 0).astype(np.int32)       # class weights, validation split, and
    return (lambda: keras.Sequential([            # two steps in each call of the step
        keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(2, activation="softmax")]),
            lambda: dict(optimizer=keras.optimizers.Adagrad(0.1),
                         loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                         steps_per_execution=2),
            dict(validation_split=0.2, class_weight={0: 1.0, 1: 3.0}), x, labels)


@pytest.mark.parametrize("case", ["activity-regularizer", "masked-lstm", "rmse-loss",
                                  "mean-with-sample-weight", "class-weight-and-more"])
def test_fit_options_users_write_equal_one_device(case):
    make_model, compiled, options, x, y = _options_case(case)
    keras.utils.set_random_seed(1)
    parallel, single = make_model(), make_model()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(**compiled())
    pn.parallelize(parallel, local(2))
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **options)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **options)
    check(parallel, single)
    assert set(h1.history) == set(h2.history)
    for key in h2.history:
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=0,
                                   err_msg=key)


def test_keras3_metrics_that_sum_equal_one_device():
    # seeded: AUC and the 0.5 threshold count a prediction on one side of a
    # bucket edge, so an unseeded start could put one within float noise of it
    keras.utils.set_random_seed(7)
    parallel = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(1, activation="sigmoid")])
    single = keras.models.clone_model(parallel)
    single.set_weights(parallel.get_weights())
    check_classifier_fit(keras, parallel, single)


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_mixed_precision_equals_one_device(lib):
    """The `mixed_float16` policy: float16 layers, the loss scaled by a
    LossScaleOptimizer. The first batch's rows of replica 1 overflow
    float16: every replica skips that step and halves the scale, as one
    device does. The epochs' logs equal one device's (tf_keras's metric
    totals are AutoCastVariables: the reset at each epoch and evaluation
    had missed the replicas' copies, so the second epoch's loss averaged
    both epochs), and so do `evaluate`, the loss scale and the weights,
    to float16's rounding of the gradients' sums (1e-4)."""
    lib = keras if lib == "keras3" else __import__("tf_keras")
    lib.mixed_precision.set_global_policy("mixed_float16")
    try:
        lib.utils.set_random_seed(0)
        make = lambda: lib.Sequential([lib.Input((5,)), lib.layers.Dense(  # noqa: E731
            8, activation="relu"), lib.layers.Dense(1, dtype="float32")])
        parallel, single = make(), make()
        single.set_weights(parallel.get_weights())
        for m in (parallel, single):
            m.compile(optimizer=lib.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        pn.parallelize(parallel, local(2))
    finally:
        lib.mixed_precision.set_global_policy("float32")
    x, y = data()
    y[8:16] *= 1000.0                    # float16 overflows in the first step's gradients
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    scale = "dynamic_scale" if lib is keras else "loss_scale"
    scales = [float(np.array(getattr(m.optimizer, scale))) for m in (parallel, single)]
    assert scales[0] == scales[1] < 2 ** 15          # a step was skipped
    for w1, w2 in zip(parallel.get_weights(), single.get_weights()):
        np.testing.assert_allclose(np.float32(w1), np.float32(w2), atol=1e-4, rtol=0)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=0, rtol=1e-4)
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=BATCH, verbose=0),
                               single.evaluate(x, y, batch_size=BATCH, verbose=0),
                               atol=0, rtol=1e-4)


@pytest.mark.parametrize("optimizer", ["Adam", "Nadam"])
def test_tf_keras_fit_equals_one_device(optimizer):
    """tf_keras's Nadam counts its traces in Python (a step traced twice
    differs in a constant): fit's step is a tf.function, run as its first
    trace, as on one device (it was refused as a Python side effect)."""
    import tf_keras
    parallel, single = tf_keras_dense(), tf_keras_dense()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=getattr(tf_keras.optimizers, optimizer)(0.01, clipvalue=0.5),
                  loss="mse", metrics=["mae"])
    pn.parallelize(parallel, local(2))
    x, y = data(3)
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=0)
    check(parallel, single)


def test_tf_keras_metrics_that_sum_equal_one_device():
    import tf_keras
    tf_keras.utils.set_random_seed(7)                 # as the Keras 3 test
    parallel, single = (tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu",
                                                                   input_shape=(5,)),
                                             tf_keras.layers.Dense(1, activation="sigmoid")])
                        for _ in range(2))
    single.set_weights(parallel.get_weights())
    check_classifier_fit(tf_keras, parallel, single)


def test_a_model_that_is_not_compiled_is_refused():
    with pytest.raises(pn.ConfigError, match="call model.compile"):
        pn.parallelize(make(), local(2))


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_a_stateful_layer_is_refused_naming_it(lib):
    """A stateful RNN keeps a state row per example of a fixed batch from
    batch to batch; fit had failed inside the step (incompatible shapes
    [4,1] and [8,1])."""
    import tf_keras
    k = keras if lib == "keras" else tf_keras
    inp = k.Input(batch_shape=(8, 5, 3))
    model = k.Model(inp, k.layers.Dense(1)(k.layers.LSTM(4, stateful=True, name="memory")(inp)))
    model.compile(optimizer=k.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(pn.ConfigError, match=r"layers \['memory'\] are stateful"):
        pn.parallelize(model, local(2))


def test_a_virtual_batch_size_is_warned_naming_the_layer():
    """tf_keras's virtual batches are strided across the whole batch: 2
    replicas' groups of their own rows were 0.25 off one device, silently."""
    import tf_keras
    model = tf_keras.Sequential([tf_keras.Input((6,)), tf_keras.layers.Dense(8),
                                 tf_keras.layers.BatchNormalization(virtual_batch_size=4,
                                                                    name="ghosts")])
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss="mse")
    with pytest.warns(UserWarning, match=r"layers \['ghosts'\] have a virtual_batch_size"):
        pn.parallelize(model, local(2))


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_moving_statistics_after_a_recurrent_layer_are_synced(lib):
    """An LSTM then BatchNormalization: after one step of 16 rows on 2
    replicas the moving mean is one device's (the mean of equal batches'
    means), on both replicas. Keras 3's LSTM is a while loop whose outputs
    leave through the loop's back edge: the analysis had taken them to be
    equal on every replica, so each replica kept its own moving statistics
    (0.0009 apart after 4 steps), silently."""
    import importlib
    k = importlib.import_module(lib)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 5, 3)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    models = []
    for _ in range(2):
        k.utils.set_random_seed(5)
        model = k.Sequential([k.Input((5, 3)), k.layers.LSTM(4),
                              k.layers.BatchNormalization(name="norm"), k.layers.Dense(1)])
        model.compile(optimizer=k.optimizers.SGD(0.05), loss="mse")
        models.append(model)
    parallel, single = models
    pn.parallelize(parallel, local(2))
    for model in models:
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    want = np.asarray(single.get_layer("norm").moving_mean)
    np.testing.assert_allclose(np.asarray(parallel.get_layer("norm").moving_mean), want,
                               rtol=0, atol=1e-6)
    runner = parallel._parallax_ng.step.runner
    var = next(v for v in runner.ctx.tg.variables if v.endswith("moving_mean"))
    read = var + ("/Read/ReadVariableOp:0" if runner.ctx.tg.ir.node(var).op == "VarHandleOp"
                  else ":0")
    a, b = runner.run(read, per_replica=True)
    np.testing.assert_array_equal(a, b)


def test_fit_stopped_and_started_again_from_its_checkpoint_equals_one_run(tmp_path):
    """`checkpoint.dir`: a program that fits 2 epochs and ends, then is run
    again with `initial_epoch=2` to 4 epochs, restores the step-10
    checkpoint (weights, Adam's slots and iteration count) and ends equal
    to one device fitting 4 epochs in one go, every weight and optimizer
    variable, and the last epochs' losses, 1e-5."""
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tests", "keras_resume_script.py")
    env = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2")
    runs = []
    for name, epochs, initial in (("first", 2, 0), ("again", 4, 2)):
        out = str(tmp_path / name)
        done = forked.run([sys.executable, script, out, str(tmp_path / "ckpt"),
                           str(epochs), str(initial)], env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        runs.append((dict(np.load(out + ".npz")), done.stdout + done.stderr))
    (first, _), (again, log) = runs
    assert "restored step 10 from" in log
    single = make()
    single.set_weights([first[f"start{i}"] for i in range(len(single.weights))])
    single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    x, y = data()
    h = single.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    np.testing.assert_allclose(again["loss"], h.history["loss"][2:], atol=1e-5, rtol=0)
    for i, v in enumerate(single.weights):
        np.testing.assert_allclose(again[f"w{i}"], np.asarray(v), atol=1e-5, rtol=0)
    for i, v in enumerate(single.optimizer.variables):
        np.testing.assert_allclose(again[f"o{i}"], np.asarray(v), atol=1e-5, rtol=0)


def bn_model(lib, conv: bool, synchronized: bool = False):
    lib.utils.set_random_seed(1)
    first = [lib.layers.Conv2D(4, 3, padding="same")] if conv else [lib.layers.Dense(8)]
    model = lib.Sequential([lib.Input((4, 4, 2) if conv else (6,)), *first,
                            lib.layers.BatchNormalization(momentum=0.9, epsilon=1e-3,
                                                          synchronized=synchronized),
                            lib.layers.Activation("relu"), lib.layers.Flatten(),
                            lib.layers.Dense(1)])
    model.compile(optimizer=lib.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def bn_data(conv: bool, rows: int):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(rows, *((4, 4, 2) if conv else (6,)))) * 3 + 1).astype(np.float32)
    return x, rng.normal(size=(rows, 1)).astype(np.float32)


def ghost_batches(model, x, y, batch, parts, bessel):
    """One device training `model` on `batch` rows a step, its
    BatchNormalization normalizing each of `parts` equal slices of the batch
    by the slice's own mean and variance, and its moving statistics moved
    by the slices' average (variances times n/(n-1) with `bessel`, as
    TensorFlow's fused kernel keeps them)."""
    import tensorflow as tf
    first, bn, *rest = model.layers
    n = batch // parts
    for s in range(len(x) // batch):
        xb, yb = x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
        with tf.GradientTape() as tape:
            h = first(xb)
            axes = list(range(len(h.shape) - 1))
            outs, means, variances = [], [], []
            for k in range(parts):
                part = h[k * n:(k + 1) * n]
                mean, variance = tf.nn.moments(part, axes=axes)
                count = int(np.prod(part.shape[:-1]))
                means.append(mean)
                variances.append(variance * count / (count - 1) if bessel else variance)
                outs.append((part - mean) * tf.math.rsqrt(variance + bn.epsilon) * bn.gamma
                            + bn.beta)
            out = tf.concat(outs, 0)
            for layer in rest:
                out = layer(out)
            loss = tf.reduce_mean(tf.square(out - yb))
        variables = model.trainable_variables
        model.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        for stat, got in ((bn.moving_mean, means), (bn.moving_variance, variances)):
            stat.assign(stat * bn.momentum + tf.add_n(got) / parts * (1 - bn.momentum))


@pytest.mark.parametrize("lib, conv, bessel", [("keras", False, False),
                                               ("keras", True, False),
                                               ("tf_keras", False, False),
                                               ("tf_keras", True, True)],
                         ids=["keras3-dense", "keras3-conv", "tf_keras-dense",
                              "tf_keras-conv-fused"])
def test_batchnorm_normalizes_each_replicas_rows_as_ghost_batches_of_one_device(lib, conv,
                                                                                 bessel):
    """As docs/limits.md states: in training each replica normalizes its
    rows by their own statistics (as MultiWorkerMirroredStrategy without
    SyncBatchNorm), and the moving statistics move by the replicas'
    average. 2 replicas with the global batch equal one device whose
    BatchNormalization does that on the batch's two halves ("ghost
    batches"), every weight, moving statistic and slot, 1e-5 after 4 steps
    (tf_keras on 4-d input runs TensorFlow's fused kernel, whose moving
    variance is the unbiased one)."""
    import importlib
    keras_lib = importlib.import_module(lib)
    x, y = bn_data(conv, 64)
    single, parallel = bn_model(keras_lib, conv), bn_model(keras_lib, conv)
    ghost_batches(single, x, y, BATCH, 2, bessel)
    pn.parallelize(parallel, local(2))
    parallel.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    check(parallel, single)
    ops = {op.type for op in parallel._parallax_ng.step._captured.graph.get_operations()}
    assert ("FusedBatchNormV3" in ops) == bessel
    moving = [w for w in parallel.weights if "moving" in getattr(w, "path", w.name)]
    assert len(moving) == 2 and not np.allclose(np.asarray(moving[1]), 1.0)


@pytest.mark.parametrize("run_option", ["default", "ps"])
def test_batchnorm_in_a_two_worker_job_equals_ghost_batches_of_one_device(tmp_path, run_option):
    """The same in a job of 2 workers x 1 device (Keras 3, `model.fit`, 5
    global batches of 16): the moving statistics are averaged across the
    workers; both equal the one-device ghost batches, 1e-5. With `ps` (the
    variables on a server): the offset's gradient, which the backward pass
    goes on from, no longer reads as computed after an update (before:
    refused as a GAN's step would be)."""
    from test_tf2 import run_job
    out, _ = run_job(tmp_path, "--bn", *(["--ps"] if run_option == "ps" else []),
                     servers=int(run_option == "ps"))
    workers = [dict(np.load(f"{out}.{k}.npz")) for k in range(2)]
    single = bn_model(keras, False)
    single.set_weights([workers[0][f"start{i}"] for i in range(len(single.weights))])
    x, y = bn_data(False, 5 * BATCH)
    ghost_batches(single, x, y, BATCH, 2, False)
    for w in workers:
        for i, v in enumerate(single.weights):
            np.testing.assert_allclose(w[f"w{i}"], np.asarray(v), atol=1e-5, rtol=0,
                                       err_msg=v.path)
        for i, v in enumerate(single.optimizer.variables):
            np.testing.assert_allclose(w[f"o{i}"], np.asarray(v), atol=1e-5, rtol=0,
                                       err_msg=v.path)


class Recorder:
    """A callback class of the program's: the first weight after every batch."""
    def __init__(self, lib):
        class Record(lib.callbacks.Callback):
            def on_train_batch_end(inner, batch, logs=None):
                self.seen.append(np.array(inner.model.weights[0]))
        self.seen, self.callback = [], Record()


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_epoch_end"])
def test_what_callbacks_set_after_a_batch_trains_the_next(lib, hook):
    """A callback that sets the learning rate and scales a kernel
    (`assign`) after each batch or epoch: the next batch trains with what
    it set, as on one device, and the epoch's end does not write the
    replicas' values over it. Before, the rate set after an epoch's last
    batch was lost (the weights 5e-4 off after 2 epochs of Adam), and so
    was every kernel scaled (0.63 off)."""
    parallel, single = lib_twins(lib, 3, lambda o: o.Adam(0.05))
    x, y = data(4)
    for model in (parallel, single):
        def set_both(step, logs=None, model=model):
            model.optimizer.learning_rate.assign(0.05 / (step + 2))
            kernel = model.layers[-1].kernel
            kernel.assign(kernel * 0.9)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[__import__(lib).callbacks.LambdaCallback(**{hook: set_both})])
    check(parallel, single)
    assert np.isclose(float(np.asarray(parallel.optimizer.learning_rate)),
                      0.05 / (5 + 1 if hook == "on_train_batch_end" else 3))


def test_swapped_ema_weights_validate_and_training_goes_on_from_the_weights():
    """Keras 3's SwapEMAWeights: the model holds the optimizer's moving
    averages while it validates and after each epoch, and its weights when
    it trains. Each swap is the program's assignment between calls, taken
    in; before, the replicas went on training from the averages pushed for
    validation (0.045 off after 3 epochs)."""
    parallel, single = lib_twins("keras", 5, lambda o: o.Adam(0.05, use_ema=True,
                                                                ema_momentum=0.5))
    x, y = data(6)
    h = [m.fit(x[:64], y[:64], batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
               validation_data=(x[64:], y[64:]),
               callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)])
         for m in (parallel, single)]
    check(parallel, single)
    for key in ("loss", "val_loss", "val_mae"):
        np.testing.assert_allclose(h[0].history[key], h[1].history[key], atol=1e-5, rtol=0)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_batch_level_callbacks_see_each_batchs_weights(tmp_path, lib):
    """A callback of the program's that reads the weights after every
    batch, and ModelCheckpoint saving every 2 batches: they see what one
    device has after that batch (the model is written after every batch
    then, and not when no callback reads weights there); with `batch_sync:
    never` it is written at epoch ends only."""
    import importlib
    k = importlib.import_module(lib)
    parallel, single = bn_model(k, False), bn_model(k, False)
    x, y = bn_data(False, 64)
    (tmp_path / "p").mkdir()
    (tmp_path / "s").mkdir()
    suffix = ".weights.h5" if lib == "keras" else ".h5"
    seen = {}
    for name, model in (("p", parallel), ("s", single)):
        model.layers[1].trainable = False           # no ghost batches: one device's math
        model.compile(optimizer=k.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        if name == "p":
            pn.parallelize(model, local(2))
        record = Recorder(k)
        save = k.callbacks.ModelCheckpoint(str(tmp_path / name / ("b{batch}" + suffix)),
                                           save_weights_only=True, save_freq=2)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[record.callback, save])
        seen[name] = record.seen
    assert len(seen["p"]) == len(seen["s"]) == 4
    for got, want in zip(seen["p"], seen["s"]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert not np.allclose(seen["p"][0], seen["p"][-1])
    for batch in (2, 4):
        p, s = bn_model(k, False), bn_model(k, False)
        p.load_weights(str(tmp_path / "p" / f"b{batch}{suffix}"))
        s.load_weights(str(tmp_path / "s" / f"b{batch}{suffix}"))
        for a, b in zip(p.weights, s.weights):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert not parallel._parallax_ng.callbacks_read       # only during that fit
    never = bn_model(k, False)
    never.layers[1].trainable = False
    never.compile(optimizer=k.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    pn.parallelize(never, local(2), {"batch_sync": "never"})   # epoch ends only
    record = Recorder(k)
    never.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[record.callback])
    assert all(np.array_equal(w, record.seen[0]) for w in record.seen)
    with pytest.raises(pn.ConfigError, match="batch_sync"):
        pn.Config.from_dict({"batch_sync": "sometimes"})
    assert not keras_fit.reads_weights_per_batch(k.callbacks.ModelCheckpoint("m" + suffix))
    assert not keras_fit.reads_weights_per_batch(k.callbacks.TerminateOnNaN())
    assert keras_fit.reads_weights_per_batch(k.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: None))


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_evaluate_and_predict_run_on_the_replicas_and_equal_one_device(lib):
    """`evaluate` and `predict` run each batch on the replicas (the model's
    test_step and predict_step, traced with its train_step): before any
    fit, after one, after `set_weights`; a last batch the 2 replicas do not
    divide runs on the model itself; a dataset of unknown length runs to
    its end. Losses, metrics and predictions equal one device's, 1e-5."""
    parallel, single = lib_twins(lib, 1, lambda optimizers: optimizers.Adam(0.01))
    fit = parallel._parallax_ng
    x, y = data(4)

    def same(how, **kwargs):
        got, want = (getattr(m, how)(**kwargs, batch_size=BATCH, verbose=0)
                     for m in (parallel, single))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=how)

    same("evaluate", x=x, y=y)
    assert fit.step.runner is not None and not fit.on_model      # built by evaluate
    for m in (parallel, single):
        m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    same("evaluate", x=x, y=y)
    same("predict", x=x)
    assert not fit.on_model
    same("evaluate", x=x[:75], y=y[:75])          # 4 batches of 16, then 11 rows
    same("predict", x=x[:75])
    assert fit.on_model == {"test": 1, "predict": 1}
    import tensorflow as tf           # a dataset whose length is unknown: to its end
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)
    got, want = (m.evaluate(unknown.batch(BATCH), verbose=0) for m in (parallel, single))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    got, want = (m.predict(unknown.map(lambda a, b: a).batch(BATCH), verbose=0)
                 for m in (parallel, single))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert fit.on_model == {"test": 1, "predict": 1}
    weights = [w * 0.5 for w in single.get_weights()]
    for m in (parallel, single):
        m.set_weights(weights)
    same("evaluate", x=x, y=y)
    same("predict", x=x)
    check(parallel, single)


def test_a_model_of_strings_fits_and_predicts_as_one_device_with_no_line(capsys):
    """A model that takes strings (Keras's text classifier with its
    TextVectorization inside, multi-hot words): fit, evaluate and predict
    equal one device, 1e-5. Its predictions' rows go through a split into
    words and a count per row, which the graph does not show to be the
    batch's; Keras joins predict's outputs by rows, and so do the replicas,
    with no line (before: "the graph does not show how the replicas' values
    of 'parallax_part_predict/Identity:0' ... make one device's")."""
    import tensorflow as tf
    rng = np.random.default_rng(3)
    words = np.array(["good", "bad", "great", "awful", "plot", "fun", "dull"])
    texts = tf.constant([" ".join(rng.choice(words, 4)) for _ in range(SAMPLES)])[:, None]
    labels = rng.integers(0, 2, SAMPLES).astype(np.float32)
    vectorize = keras.layers.TextVectorization(max_tokens=10, output_mode="multi_hot")
    vectorize.adapt(texts)

    def make():
        keras.utils.set_random_seed(1)
        x = keras.Input((1,), dtype="string")
        h = keras.layers.Dense(4, activation="relu")(vectorize(x))
        model = keras.Model(x, keras.layers.Dense(1, activation="sigmoid")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                      metrics=["accuracy"])
        return model
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    pn.parallelize(parallel, local(2))
    for m in (parallel, single):
        m.fit(texts, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    check(parallel, single)
    np.testing.assert_allclose(parallel.evaluate(texts, labels, batch_size=BATCH, verbose=0),
                               single.evaluate(texts, labels, batch_size=BATCH, verbose=0),
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(parallel.predict(texts, batch_size=BATCH, verbose=0),
                               single.predict(texts, batch_size=BATCH, verbose=0), atol=1e-5)
    assert not parallel._parallax_ng.on_model
    assert "does not show" not in capsys.readouterr().err


def test_a_test_step_that_cannot_be_traced_runs_on_the_model():
    """A model whose test_step writes to a lookup table (a resource the
    capture cannot rebuild, graph/tables.py): fit still runs data-parallel,
    the part is left out (and why is kept), and `evaluate` runs on the model
    itself, as one device does."""
    import tensorflow as tf
    table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, default_value=0.0)

    class Fresh(keras.Sequential):
        def test_step(self, data):
            x, y = data
            key = tf.constant([1], tf.int64)
            table.insert(key, tf.constant([2.0]))
            return self.compute_metrics(x, y, self(x) * tf.reduce_sum(table.lookup(key)))
    parallel, single = (Fresh([keras.Input((5,)), keras.layers.Dense(1)]) for _ in range(2))
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", metrics=["mae"])
    pn.parallelize(parallel, local(2))
    x, y = data(5)
    for m in (parallel, single):
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    fit = parallel._parallax_ng
    assert "changes it (LookupTableInsertV2)" in fit.step._captured.failed["test"]
    assert set(fit.step._captured.parts) == {"predict"}
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=BATCH, verbose=0),
                               single.evaluate(x, y, batch_size=BATCH, verbose=0), atol=1e-5)
    assert fit.on_model["test"] == SAMPLES // BATCH
    check(parallel, single)


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_a_masked_sequence_loss_equals_one_device(lib):
    """Embedding(mask_zero=True) and padded sequences of different lengths:
    Keras weighs each kept token by (tokens / kept tokens) of the batch, a
    count that differs between the replicas' parts; each replica divides
    by the replicas' mean count (were its own: the weights 0.02 off after
    8 steps, the logs too), in `fit` and in `evaluate`. A bidirectional GRU
    (tf_keras's runs its loop time-major: the loss's rows are read through
    it, graph/rows.py) and a Dense layer on each step (tf_keras:
    TimeDistributed). The batches are a dataset's `padded_batch`es, each
    as long as its longest sequence: the step is traced on the dataset's
    element_spec, its length open, as Keras traces it (before, the second
    length failed in the feed)."""
    import tensorflow as tf
    k = keras if lib == "keras3" else __import__("tf_keras")

    def make():
        inp = k.Input((None,), dtype="int32")
        h = k.layers.Embedding(30, 6, mask_zero=True)(inp)
        h = k.layers.Bidirectional(k.layers.GRU(5, return_sequences=True))(h)
        # (Keras 3's TimeDistributed fails on one device where the length is open)
        return k.Model(inp, (k.layers.Dense(3) if lib == "keras3" else
                             k.layers.TimeDistributed(k.layers.Dense(3)))(h))

    rng = np.random.default_rng(0)
    lengths = [int(rng.integers(2, 3 + i // 16 * 2)) for i in range(64)]   # longest: 3 to 9
    x = [rng.integers(1, 30, n).astype("int32") for n in lengths]
    y = [rng.integers(0, 3, n).astype("int32") for n in lengths]

    def batches():        # of a known length: Keras stops without reading past the data
        return tf.data.Dataset.from_generator(
            lambda: zip(x, y), output_signature=(tf.TensorSpec([None], tf.int32),) * 2).apply(
            tf.data.experimental.assert_cardinality(64)).padded_batch(16)
    k.utils.set_random_seed(0)
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=k.optimizers.Adam(0.01), metrics=["sparse_categorical_accuracy"],
                  loss=k.losses.SparseCategoricalCrossentropy(from_logits=True))
    pn.parallelize(parallel, local(2))
    h1, h2 = (m.fit(batches(), epochs=2, verbose=0) for m in (parallel, single))
    assert len({len(b[0][0]) for b in batches()}) == 4
    for key in h2.history:
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=0,
                                   err_msg=key)
    check(parallel, single)
    # evaluate's masked loss shares the count too (before: each replica's own, 0.008 off)
    np.testing.assert_allclose(parallel.evaluate(batches(), verbose=0),
                               single.evaluate(batches(), verbose=0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
@pytest.mark.parametrize("layer", ["conv", "lstm"])
def test_a_summed_loss_through_conv_and_recurrent_layers_equals_one_device(lib, layer):
    """`reduction="sum"`: the replicas' gradients are summed, which the
    analysis reads through a convnet (Conv2D, MaxPooling2D, Flatten) and an
    LSTM's loop over time (graph/rows.py); were they averaged, as when the
    graph did not show the loss's form, the weights ended 0.1 off one
    device after 8 steps. SGD with momentum, every weight within 1e-5."""
    k = keras if lib == "keras3" else __import__("tf_keras")

    def make():
        if layer == "conv":
            inp = k.Input((6, 6, 1))
            h = k.layers.Flatten()(k.layers.MaxPooling2D()(k.layers.Conv2D(3, 3)(inp)))
        else:
            inp = k.Input((5,), dtype="int32")
            h = k.layers.LSTM(6)(k.layers.Embedding(20, 4)(inp))
        return k.Model(inp, k.layers.Dense(4)(h))

    rng = np.random.default_rng(0)
    x = rng.random((64, 6, 6, 1)).astype("float32") if layer == "conv" else \
        rng.integers(0, 20, (64, 5)).astype("int32")
    y = rng.integers(0, 4, 64).astype("int32")
    k.utils.set_random_seed(0)
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=k.optimizers.SGD(0.01, momentum=0.9),
                  loss=k.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"))
    pn.parallelize(parallel, local(2))
    h1 = parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-5)
    check(parallel, single)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_train_on_batch_leaves_the_model_trained_after_each_call(lib):
    """A loop of `train_on_batch` (GAN scripts train so; Keras passes
    (x, y, None) where no sample weight is given): after each call the
    model holds the step's weights and optimizer state, as one device's;
    `test_on_batch` and `predict_on_batch` equal one device, 1e-5."""
    parallel, single = lib_twins(lib, 2, lambda optimizers: optimizers.SGD(0.05, momentum=0.9))
    x, y = data(5)
    for step in range(3):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        got, want = (m.train_on_batch(x[rows], y[rows], return_dict=True)
                     for m in (parallel, single))
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)
        check(parallel, single)            # read right after the call
    weights = [np.asarray(w) * 0.5 for w in single.get_weights()]
    for m in (parallel, single):           # weights set between calls are taken in
        m.set_weights(weights)
        m.train_on_batch(x[:BATCH], y[:BATCH])
    check(parallel, single)
    np.testing.assert_allclose(parallel.test_on_batch(x[:BATCH], y[:BATCH]),
                               single.test_on_batch(x[:BATCH], y[:BATCH]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(parallel.predict_on_batch(x[:BATCH]),
                               single.predict_on_batch(x[:BATCH]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_fine_tuning_compiled_again_equals_one_device(lib):
    """Keras's fine-tuning recipe: train a head over a frozen base, unfreeze
    it and `compile` again with a new optimizer, train on. The second fit
    traces the step anew (it had kept the first optimizer and trainable
    set: 0.036 off); both phases equal one device, 1e-5."""
    import importlib
    k = importlib.import_module(lib)

    def run(parallel):
        k.utils.set_random_seed(3)
        base = k.Sequential([k.Input((5,)), k.layers.Dense(8, activation="relu")])
        model = k.Sequential([base, k.layers.Dense(1)])
        model.build((None, 5))
        base.trainable = False
        model.compile(optimizer=k.optimizers.Adam(0.01), loss="mse")
        if parallel:
            pn.parallelize(model, local(2))
        x, y = data(6)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        frozen = [np.asarray(w) for w in base.weights]
        base.trainable = True
        model.compile(optimizer=k.optimizers.SGD(0.01, momentum=0.5), loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return model, frozen
    (parallel, frozen), (single, _) = run(True), run(False)
    check(parallel, single)
    assert any(np.abs(np.asarray(w) - f).max() > 1e-3 for w, f in zip(single.weights, frozen))


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_a_last_batch_the_replicas_cannot_split_trains_as_one_device(lib):
    """77 rows in batches of 16 end each epoch with 13, which 2 replicas
    cannot split: that batch trains on the model itself with the runner's
    values, which then go back to the runner; weights, optimizer state and
    the epochs' logs equal one device's, 1e-5."""
    parallel, single = lib_twins(lib, 3, lambda optimizers: optimizers.Adam(0.02))
    x, y = data(6)
    h1, h2 = (m.fit(x[:77], y[:77], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
              for m in (parallel, single))
    check(parallel, single)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=0)
    assert parallel._parallax_ng.on_model["train"] == 2


@pytest.mark.parametrize("optimizer,how,run_option", [
    ("legacy.Adam", "fit", "hybrid"), ("legacy.Adagrad", "loop", "allreduce"),
    ("legacy.Adam", "built", "ps"), ("Adam", "backup", "hybrid")])
def test_tf_keras_optimizers_legacy_or_built_before_the_step_equal_one_device(
        tmp_path, optimizer, how, run_option):
    """tf_keras's legacy optimizers (OptimizerV2: `tf.keras.optimizers.legacy`,
    as Horovod's examples use them) on an embedding and dense layers, in
    `fit` and in a `pn.function` loop: their fused kernels take the slots
    by handle, which the traced function does not list as its variables
    (before: refused, "captures resource ... which is not a variable"; `fit`
    failed before that on the optimizer's `variables()` method), and the
    table's moments are written by a scatter-add of the gradient's rows,
    which the analysis follows to the table through its slots, named
    `<optimizer>/<table>/m` (else 0.16 off one device, with no warning). An
    optimizer built before the first step (`built`: its slots made then, by
    the program; `backup`: tf_keras's BackupAndRestore builds it at the
    start of `fit`) was refused as "trains nothing". 6 steps, every weight
    and slot within 1e-5 of one device."""
    import tensorflow as tf
    import tf_keras as k
    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, (48, 4)).astype("int32")
    y = rng.normal(size=(48, 1)).astype("float32")

    def make():
        k.utils.set_random_seed(0)
        model = k.Sequential([k.Input((4,), dtype="int32"), k.layers.Embedding(40, 5),
                              k.layers.Flatten(), k.layers.Dense(6, activation="tanh"),
                              k.layers.Dense(1)])
        kind = getattr(k.optimizers.legacy, optimizer[7:]) if optimizer.startswith("legacy") \
            else getattr(k.optimizers, optimizer)
        opt = kind(0.05)
        model.compile(optimizer=opt, loss="mse")
        if how == "built":
            opt._create_all_weights(model.trainable_variables)
        return model
    parallel, single = make(), make()
    if how == "loop":
        def step_of(model):
            def step(xb, yb):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(xb) - yb))
                grads = tape.gradient(loss, model.trainable_variables)
                model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return step
        steps = pn.function(step_of(parallel), local(2), {"run_option": run_option}), \
            tf.function(step_of(single))
        for i in range(6):
            for step in steps:
                step(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
        steps[0].sync()
    else:
        pn.parallelize(parallel, local(2), {"run_option": run_option})
        for m in (parallel, single):
            backup = [k.callbacks.BackupAndRestore(str(tmp_path / f"b{id(m)}"))] \
                if how == "backup" else []
            m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=backup)

    def every(m):
        made = m.optimizer.variables
        return list(m.weights) + list(made() if callable(made) else made)
    assert len(every(parallel)) == len(every(single)) > len(parallel.weights) + 1
    for a, b in zip(every(parallel), every(single)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0,
                                   err_msg=a.name)


@pytest.mark.parametrize("lib,conv", [("keras3", False), ("tf_keras", False),
                                      ("tf_keras", True)])
def test_batch_norm_synchronized_by_the_config_equals_one_device(lib, conv, capsys):
    """Config `batch_norm: synchronized`: the model's BatchNormalization
    layers in training mode (one inside a nested model, as a pretrained
    base is; tf_keras's fused kernel on images, whose moving variance is
    the unbiased one: before, it was made unfused, whose is not, 7.8e-4
    apart after 8 steps) normalize by the global batch's statistics: every
    weight and moving statistic equals one device's, 1e-5 (per replica,
    the default, they are ghost batches: further apart than that, and a
    line says so)."""
    lib = keras if lib == "keras3" else __import__("tf_keras")

    def make():
        if conv:
            return bn_model(lib, True)
        lib.utils.set_random_seed(3)
        base = lib.Sequential([lib.Input((5,)), lib.layers.Dense(6),
                               lib.layers.BatchNormalization(momentum=0.5)])
        model = lib.Sequential([lib.Input((5,)), base, lib.layers.Activation("relu"),
                                lib.layers.Dense(4), lib.layers.BatchNormalization(),
                                lib.layers.Dense(1)])
        model.compile(optimizer=lib.optimizers.SGD(0.05), loss="mse")
        return model
    x, y = bn_data(True, 64) if conv else data()
    single = make()
    single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for asked, equal in (("synchronized", True), ("per_replica", False)):
        parallel = pn.parallelize(make(), local(2), {"batch_norm": asked})
        parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        worst = max(np.abs(a - b).max() for a, b in zip(parallel.get_weights(),
                                                        single.get_weights()))
        assert bool(worst <= 1e-5) is equal, (asked, worst)
        said = capsys.readouterr().err
        assert ("batch_norm: per_replica, the default" in said) is not equal, said


def test_a_keras3_ctc_model_fits_as_one_device_with_its_loss_read(capsys):
    """keras.io's OCR and speech examples' loss, keras.losses.CTC, on a GRU:
    its per-sequence losses run through a scan that a loop writes into a
    tensor (tests/test_row_loops.py), and `fit` read them as a loss of
    unknown form, with a line. Now read as a mean: no line, and an epoch of
    4 batches on 2 replicas equals one device, every weight and slot, 1e-5."""
    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((10, 4)),
                                  keras.layers.GRU(8, return_sequences=True),
                                  keras.layers.Dense(5, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.CTC())
        return model
    parallel, single = make(), make()
    pn.parallelize(parallel, local(2))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 10, 4)).astype(np.float32)
    y = rng.integers(1, 4, size=(32, 3)).astype(np.int32)
    logs = [m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]
            for m in (parallel, single)]
    assert "does not show whether the loss" not in capsys.readouterr().err
    np.testing.assert_allclose(logs[0], logs[1], atol=1e-5, rtol=0)
    check(parallel, single)


DECAY_JOB = '''
import os, sys
os.environ["TF_USE_LEGACY_KERAS"] = "0"
import numpy as np
import keras
import parallax_ng as pn

rng = np.random.default_rng(0)
ids = rng.integers(0, 40, (96, 3)).astype(np.int32)
y = rng.normal(size=(96, 1)).astype(np.float32)


def make():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(40, 4),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.AdamW(0.05, weight_decay=0.5), loss="mse")
    return model


parallel, single = make(), make()
pn.parallelize(parallel, None, {"run_option": "ps"})
for m in (parallel, single):
    m.fit(ids, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(parallel.weights + parallel.optimizer.variables,
                            single.weights + single.optimizer.variables))
print(f"decayed job: worst {worst:.3g}", flush=True)
'''


def test_decoupled_weight_decay_in_a_job_with_a_server_equals_one_device(tmp_path):
    """Keras 3's AdamW (and Lion, Muon: `weight_decay`) decays each variable
    by `assign` before its update, a write that reads no gradient. In a job
    of 2 workers and a server (run_option ps), the chief ran it at the
    step's start, so worker 1's forward pass read decayed weights now and
    then (a race: 1.75e-5 apart from one device in float64 in half the
    runs, silently). Now it waits for worker 1's push, as the update does:
    12 steps equal one device, every weight and slot, 1e-5, on both."""
    from task_env import run_script_job
    done = run_script_job(tmp_path, DECAY_JOB, servers=1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    worst = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()
             if "decayed job: worst" in line]
    assert len(worst) == 2 and max(worst) < 1e-5, done.stdout[-2000:]


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_a_sequential_model_without_an_input_fits_as_one_device(lib):
    """A Sequential model given no Input, built by its first batch in `fit`:
    tf_keras's `variables` raises until then ("Weights for model ... have
    not yet been created"), which `fit` under pn.parallelize met before its
    first step. The weights are made by the first batch on both (seeded
    alike): 2 epochs equal one device, every weight and slot, 1e-5."""
    import importlib
    k = importlib.import_module(lib)

    def fitted(parallel: bool):
        k.utils.set_random_seed(2)
        model = k.Sequential([k.layers.Dense(8, activation="relu"), k.layers.Dense(1)])
        model.compile(optimizer=k.optimizers.Adam(0.01), loss="mse")
        if parallel:
            pn.parallelize(model, local(2))
        model.fit(*data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return model
    check(fitted(True), fitted(False))


def test_a_hashed_one_hot_feature_fits_as_one_device_with_its_accuracy(capsys):
    """tf_keras's Hashing(output_mode="one_hot") codes each row by a count
    within the row (DenseBincount of a [rows, 1] input). It was taken for a
    count over the batch: the loss was said to mix the examples, and the
    accuracy's total was averaged over the replicas (half of one device's)."""
    import tf_keras as k
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=(SAMPLES, 1)).astype(np.int64)
    num = rng.normal(size=(SAMPLES, 3)).astype(np.float32)
    y = ((num[:, 0] + ids[:, 0] % 2) > 0.5).astype(np.float32)[:, None]

    def make():
        k.utils.set_random_seed(4)
        a, b = k.Input((1,), dtype="int64"), k.Input((3,))
        h = k.layers.Concatenate()([k.layers.Hashing(16, output_mode="one_hot")(a), b])
        model = k.Model([a, b], k.layers.Dense(1, activation="sigmoid")(
            k.layers.Dense(8, activation="relu")(h)))
        model.compile(k.optimizers.Adam(0.02), "binary_crossentropy", metrics=["accuracy"])
        return model
    parallel, single = make(), make()
    pn.parallelize(parallel, local(2))
    h1 = parallel.fit([ids, num], y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit([ids, num], y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert "mixes the batch's examples" not in capsys.readouterr().err
    check(parallel, single)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=0,
                                   err_msg=key)
