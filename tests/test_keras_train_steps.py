"""Keras 3 models that override `train_step`, as Keras's guide
"Customizing what happens in fit()" and its GAN example write them, under
`pn.parallelize` and `model.fit`: 2 replicas with the global batch equal
one device, every weight, every optimizer's variables and every epoch log
(1e-5), where the step is deterministic; a GAN whose noise comes from
`keras.random` trains."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import parallax_ng as pn
from models import local

SAMPLES, BATCH, LATENT = 64, 16, 3        # 4 steps an epoch


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(SAMPLES, 1))).astype(np.float32)
    return x, y


class ComputeLossModel(keras.Model):
    """The guide's first form: `compute_loss`, `optimizer.apply`, the
    compiled metrics updated by hand."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OwnMetricsModel(keras.Model):
    """The guide's lower-level form: its own loss function, a loss tracker
    and an MAE metric listed by `metrics`, `compile` given only an
    optimizer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = keras.losses.MeanSquaredError()
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def regression(cls):
    inputs = keras.Input((5,))
    hidden = layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, layers.Dense(1)(hidden))


class GAN(keras.Model):
    """Keras's GAN example: a discriminator and a generator, each with its
    own optimizer given to `compile`, trained in turn in one `train_step`
    on a batch of real rows. `random_noise`: the example's
    `keras.random.normal` latents; otherwise they come with the batch (fit's
    `y`), so that a step is deterministic."""

    def __init__(self, random_noise=False):
        super().__init__()
        self.discriminator = keras.Sequential([keras.Input((4,)), layers.Dense(8),
                                               layers.LeakyReLU(0.2), layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((LATENT,)), layers.Dense(8),
                                           layers.LeakyReLU(0.2), layers.Dense(4)])
        self.random_noise = random_noise
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def latents(self, data, k):
        if self.random_noise:           # data: the real rows alone, as in the example
            return keras.random.normal((ops.shape(data)[0], LATENT), seed=self.seed_generator)
        return data[1][:, k * LATENT:(k + 1) * LATENT]

    def train_step(self, data):
        real = data if self.random_noise else data[0]
        batch_size = ops.shape(real)[0]
        generated = self.generator(self.latents(data, 0))
        combined = ops.concatenate([generated, real], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        misleading = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(misleading, self.discriminator(self.generator(
                self.latents(data, 1))))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def gan_data(seed=0):
    rng = np.random.default_rng(seed)
    real = (rng.normal(size=(SAMPLES, 4)) * 0.5 + 1.0).astype(np.float32)
    noise = rng.normal(size=(SAMPLES, 2 * LATENT)).astype(np.float32)
    return real, noise


def compile_gan(model):
    model.compile(d_optimizer=keras.optimizers.Adam(0.003, beta_1=0.5),
                  g_optimizer=keras.optimizers.Adam(0.003, beta_1=0.5),
                  loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))


def assert_equal_values(parallel, single, what):
    assert len(parallel) == len(single) > 0, what
    for a, b in zip(parallel, single):
        name = getattr(a, "path", a.name)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0,
                                   err_msg=f"{what}: {name}")


def fit_both(parallel, single, x, y, optimizers=("d_optimizer", "g_optimizer")):
    """Two epochs of each: equal history, weights and `optimizers`'
    variables."""
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_history(h1, h2)
    assert_equal_values(parallel.weights, single.weights, "weights")
    for name in optimizers:
        assert_equal_values(getattr(parallel, name).variables, getattr(single, name).variables,
                            name)


def assert_history(h1, h2):
    assert set(h1.history) == set(h2.history)
    for key in h2.history:
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=0,
                                   err_msg=key)


@pytest.mark.parametrize("cls", [ComputeLossModel, OwnMetricsModel],
                         ids=["compute-loss", "own-metrics"])
@pytest.mark.parametrize("config", [None, {"run_option": "ps"}], ids=["hybrid", "ps"])
def test_an_overridden_train_step_equals_one_device(cls, config):
    keras.utils.set_random_seed(0)
    parallel, single = regression(cls), regression(cls)
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        if cls is ComputeLossModel:
            m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        else:
            m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    pn.parallelize(parallel, local(2), config)
    fit_both(parallel, single, *data(), optimizers=("optimizer",))


@pytest.mark.parametrize("config", [None, {"run_option": "allreduce"}, {"run_option": "ps"},
                                    {"run_option": "allreduce", "buckets": {"mode": "single"}}],
                         ids=["hybrid", "allreduce", "ps", "one-bucket"])
def test_a_gan_with_two_optimizers_equals_one_device(config):
    keras.utils.set_random_seed(0)
    parallel, single = GAN(), GAN()
    real, noise = gan_data()
    for m in (parallel, single):
        m.generator.build((None, LATENT))
        m.discriminator.build((None, 4))
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        compile_gan(m)
    pn.parallelize(parallel, local(2), config)
    fit_both(parallel, single, real, noise)


def test_a_gan_with_random_latents_trains():
    keras.utils.set_random_seed(0)
    model = GAN(random_noise=True)
    compile_gan(model)
    pn.parallelize(model, local(2))
    real, _ = gan_data()
    before = [np.asarray(w).copy() for w in model.generator.weights]
    history = model.fit(real, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    assert all(np.all(np.isfinite(history.history[k])) for k in ("d_loss", "g_loss"))
    moved = [float(np.max(np.abs(np.asarray(w) - b)))
             for w, b in zip(model.generator.weights, before)]
    assert min(moved) > 0, moved
    assert model.d_optimizer.iterations.numpy() == model.g_optimizer.iterations.numpy() == 12


def gan_job(tmp_path, config, *flags):
    """tests/gan_job_script.py as a job of 2 workers and a server
    (`parallax-ng run`), 5 global batches of 8: the finished process and
    each worker's saved arrays (none if it failed)."""
    import json
    import os
    import subprocess
    import sys
    from task_env import TASK_PATH
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "resources.yaml"
    path.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2 +
                    "ps: [127.0.0.1]\n")
    out = str(tmp_path / "vars")
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", os.path.join(root, "tests",
         "gan_job_script.py"), "-r", str(path), "--", out, "5", json.dumps(config), *flags],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    if done.returncode:
        return done, []
    return done, [dict(np.load(f"{out}.{k}.npz")) for k in range(2)]


@pytest.mark.parametrize("config, methods, wgan", [
    ({"run_option": "hybrid", "dense_method": "bfb"}, {"bfb"}, False),
    ({}, {"bfb", "allreduce"}, False),
    ({"run_option": "hybrid", "dense_method": "bfb"}, {"bfb"}, True),
], ids=["fusion-buffers", "default", "wgan-gp-fusion-buffers"])
def test_a_gan_in_a_two_worker_job_with_a_server_equals_one_device(tmp_path, config, methods,
                                                                  wgan):
    """Every worker's weights, both optimizers' variables and history
    (its metrics; the WGAN logs the losses it returns, a worker's part's)
    equal one device's from worker 0's starting weights; the default plan
    keeps no variable on the server (below)."""
    import json
    done, workers = gan_job(tmp_path, config, *(["--wgan"] if wgan else []))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    used = set(json.loads(str(workers[0]["methods"])).values())
    assert len(used) == 1 and used <= methods, used
    single = WGAN() if wgan else GAN()
    single.set_weights([workers[0][f"start{i}"] for i in range(len(single.weights))])
    (compile_wgan if wgan else compile_gan)(single)
    real, noise = wgan_data() if wgan else gan_data()
    history = single.fit(real[:40], noise[:40], batch_size=8, epochs=1, shuffle=False,
                         verbose=0)
    optimizers = single.d_optimizer.variables + single.g_optimizer.variables
    for w in workers:
        for key, want in history.history.items():
            if wgan:        # returned tensors, not metrics: each worker logs its part's value
                continue    # (docs/jobs.md), as Keras's first replica's under MWMS
            np.testing.assert_allclose(json.loads(str(w["history"]))[key], want, atol=1e-5,
                                       rtol=0, err_msg=key)
        for i, v in enumerate(single.weights):
            np.testing.assert_allclose(w[f"w{i}"], np.asarray(v), atol=1e-5, rtol=0,
                                       err_msg=v.path)
        for i, v in enumerate(optimizers):
            np.testing.assert_allclose(w[f"o{i}"], np.asarray(v), atol=1e-5, rtol=0,
                                       err_msg=v.path)


def test_a_gan_job_refuses_variables_on_servers_naming_them(tmp_path):
    """A job's workers push their gradients once per server and step, after
    every read of the servers' variables; a step that reads the
    discriminator again after updating it cannot: refused by name, with
    what to use instead (in-process, `ps` keeps them on the host and is
    exact, above)."""
    done, _ = gan_job(tmp_path, {"run_option": "ps"})
    assert done.returncode != 0
    assert "from variables it updated earlier in the same step" in done.stderr, \
        done.stderr[-3000:]
    assert "use run_option allreduce" in done.stderr


D_STEPS = 3


class WGAN(keras.Model):
    """Keras's WGAN-GP example: the critic trained `d_steps` times a step
    (the example's 3; each time through the generator), with a gradient
    penalty (the norm of the critic's gradient at points between real and
    generated rows, from a tape inside the tape), then the generator; `bn`:
    the generator with BatchNormalization, as in the example, whose moving
    statistics every pass through it writes. The latents and the penalty's
    mixing weights come with the batch (fit's `y`), so that a step is
    deterministic."""

    def __init__(self, bn=False, d_steps=1):
        super().__init__()
        self.d_steps = d_steps
        self.discriminator = keras.Sequential([keras.Input((4,)), layers.Dense(8),
                                               layers.LeakyReLU(0.2), layers.Dense(1)])
        self.generator = keras.Sequential(
            [keras.Input((LATENT,)), layers.Dense(8)] +
            ([layers.BatchNormalization()] if bn else []) +
            [layers.LeakyReLU(0.2), layers.Dense(4)])

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def gradient_penalty(self, real, fake, alpha):
        interpolated = real + alpha * (fake - real)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1]) + 1e-12)
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, data):
        real, extra = data
        for i in range(self.d_steps):
            latents = extra[:, i * LATENT:(i + 1) * LATENT]
            alpha = extra[:, -D_STEPS + i:][:, :1]
            with tf.GradientTape() as tape:
                fake = self.generator(latents, training=True)
                d_cost = tf.reduce_mean(self.discriminator(fake, training=True)) - \
                    tf.reduce_mean(self.discriminator(real, training=True))
                d_loss = d_cost + 10.0 * self.gradient_penalty(real, fake, alpha)
            grads = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_variables))
        latents = extra[:, D_STEPS * LATENT:(D_STEPS + 1) * LATENT]
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.discriminator(self.generator(latents, training=True),
                                                        training=True))
        grads = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def wgan_data(seed=0):
    rng = np.random.default_rng(seed)
    real = (rng.normal(size=(SAMPLES, 4)) * 0.5 + 1.0).astype(np.float32)
    extra = np.concatenate([rng.normal(size=(SAMPLES, (D_STEPS + 1) * LATENT)),
                            rng.uniform(size=(SAMPLES, D_STEPS))], 1).astype(np.float32)
    return real, extra


def compile_wgan(model):
    model.compile(d_optimizer=keras.optimizers.Adam(0.002, beta_1=0.5, beta_2=0.9),
                  g_optimizer=keras.optimizers.Adam(0.002, beta_1=0.5, beta_2=0.9))


@pytest.mark.parametrize("config", [None, {"run_option": "allreduce"}, {"run_option": "ps"}],
                         ids=["hybrid", "allreduce", "ps"])
def test_a_wgan_with_a_gradient_penalty_equals_one_device(config):
    """The critic once a step, its loss with the gradient penalty (a
    second derivative: the gradient of the norm of a gradient)."""
    keras.utils.set_random_seed(0)
    parallel, single = WGAN(), WGAN()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        compile_wgan(m)
    pn.parallelize(parallel, local(2), config)
    fit_both(parallel, single, *wgan_data())


def test_a_critic_trained_several_times_a_step_is_refused_naming_it():
    """The example's 3 critic updates a step: a step aggregates one
    gradient per variable, so the error names the variable, how many times
    the step updates it, and what to do instead."""
    model = WGAN(d_steps=D_STEPS)
    compile_wgan(model)
    pn.parallelize(model, local(2))
    real, extra = wgan_data()
    with pytest.raises(pn.errors.GraphError) as caught:
        model.fit(real, extra, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    text = str(caught.value)
    kernel = model.discriminator.layers[0].kernel.path
    assert f"graph updates variable '{kernel}' {D_STEPS} times" in text, text
    assert "a critic trained several times a step" in text
    assert "run one step per update" in text


def test_a_wgan_whose_generator_has_batchnorm_trains():
    """Each pass through the generator writes its moving statistics (twice
    a step: in the critic's pass and in the generator's), each synced
    across the replicas where it is written: the step builds (one sync of
    both would wait for the generator's pass, which waits for the critic's
    update, which waits for the first pass's sync) and trains."""
    keras.utils.set_random_seed(0)
    model = WGAN(bn=True)
    compile_wgan(model)
    pn.parallelize(model, local(2))
    real, extra = wgan_data()
    before = {v.path: np.asarray(v).copy() for v in model.generator.weights}
    history = model.fit(real, extra, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert all(np.all(np.isfinite(history.history[k])) for k in ("d_loss", "g_loss"))
    moved = {v.path: float(np.max(np.abs(np.asarray(v) - before[v.path])))
             for v in model.generator.weights}
    assert len(moved) == 8 and min(moved.values()) > 0, moved


def test_a_tf_keras_train_step_as_its_guide_writes_it_equals_one_device():
    """tf_keras (Keras 2): the guide's overridden `train_step` with
    `compiled_loss` (and the layers' regularization losses),
    `optimizer.minimize(..., tape=tape)` and `compiled_metrics`."""
    import tf_keras

    class Guide(tf_keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compiled_loss(y, y_pred, regularization_losses=self.losses)
            self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
            self.compiled_metrics.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    def make():
        inputs = tf_keras.Input((5,))
        hidden = tf_keras.layers.Dense(8, activation="relu",
                                       kernel_regularizer=tf_keras.regularizers.l2(0.01))(inputs)
        return Guide(inputs, tf_keras.layers.Dense(1)(hidden))

    tf_keras.utils.set_random_seed(0)
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=tf_keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    pn.parallelize(parallel, local(2))
    fit_both(parallel, single, *data(), optimizers=("optimizer",))


def test_a_tf_keras_train_step_returning_its_loss_logs_as_one_device():
    """A tf_keras `train_step` that returns its loss tensor (no metric):
    one device's fit logs the last batch's value, until validation builds
    the compiled loss, whose tracker then gives the epoch's `loss` (0.0:
    nothing updates it). The data-parallel step's test step, traced with
    it, built the compiled loss at once: every epoch logged 0.0."""
    import tf_keras

    class Returns(tf_keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
            return {"loss": loss}

    def make():
        tf_keras.utils.set_random_seed(0)
        inputs = tf_keras.Input((5,))
        model = Returns(inputs, tf_keras.layers.Dense(1)(inputs))
        model.compile(optimizer=tf_keras.optimizers.Adam(0.01))
        return model
    x, y = data()
    parallel, single = make(), make()
    pn.parallelize(parallel, local(2))
    for kwargs in ({}, {"validation_data": (x[:32], y[:32])}):
        logs = [m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                      **kwargs).history for m in (parallel, single)]
        assert logs[0].keys() == logs[1].keys()
        for key in logs[1]:
            np.testing.assert_allclose(logs[0][key], logs[1][key], rtol=0, atol=1e-5)
        assert logs[1]["loss"][0] > 0.1
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(parallel.get_weights(), single.get_weights())) < 1e-5


def test_a_gan_as_a_custom_loop_step_equals_one_device():
    """The same GAN step written as a function for `pn.function`: two
    optimizers, the generator's gradient through the updated discriminator."""
    keras.utils.set_random_seed(0)
    parallel, single = GAN(), GAN()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        compile_gan(m)
    step = pn.function(lambda real, noise: parallel.train_step((real, noise)), local(2))
    want = tf.function(lambda real, noise: single.train_step((real, noise)))
    real, noise = gan_data()
    for k in range(4):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        got, expected = step(real[rows], noise[rows]), want(real[rows], noise[rows])
        for key in ("d_loss", "g_loss"):
            np.testing.assert_allclose(np.asarray(got[key]), np.asarray(expected[key]),
                                       atol=1e-5, rtol=0, err_msg=key)
    step.sync()
    assert_equal_values(parallel.weights, single.weights, "weights")
    for name in ("d_optimizer", "g_optimizer"):
        assert_equal_values(getattr(parallel, name).variables, getattr(single, name).variables,
                            name)
