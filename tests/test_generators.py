"""tf.random.Generator's draws (graph/generators.py): replicas draw their own
numbers, replica 0 the user's stream, the state advances alike on every
replica; tf_keras's random image layers train under `fit`."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.errors import GraphError

tf1 = tf.compat.v1
ROWS, FEATURES = 4, 8


def noisy_model(seed=5, alg="philox"):
    """A generator's uniform noise per row times the data; the noise fetched."""
    g = tf.Graph()
    with g.as_default():
        gen = tf.random.Generator.from_seed(seed, alg=alg)
        x = tf1.placeholder(tf.float32, [None, FEATURES], name="x")
        noise = tf.identity(gen.uniform([tf.shape(x)[0], FEATURES]), name="noise")
        w = tf1.get_variable("w", [FEATURES, 1])
        loss = tf.reduce_mean(tf.matmul(x * noise, w), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf.identity(gen.state, name="state")
        tf1.global_variables_initializer()
    return g


def draws(config, n=2, steps=2):
    ones = np.ones([ROWS * n, FEATURES], np.float32)
    with pn.get_runner(noisy_model(), local(n), config) as runner:
        runner.run("init")
        start = runner.run("state:0")
        out = [runner.run(["noise:0", "train"], {"x:0": ones}, per_replica=True)[0]
               for _ in range(steps)]
        return out, start, runner.run("state:0")


@pytest.mark.parametrize("run_option", ["allreduce", "ps"])
def test_replicas_draw_their_own_numbers_and_replica_0_the_user_s(run_option):
    (a, b), start, end = draws({"run_option": run_option})
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(b[0], b[1])
    assert not np.array_equal(a[0], b[0]) and not np.array_equal(a[1], b[1])   # each step new
    with tf1.Session(graph=noisy_model()) as sess:      # one device's first draw, its rows
        sess.run("init")
        one = sess.run("noise:0", {"x:0": np.ones([ROWS, FEATURES], np.float32)})
    np.testing.assert_array_equal(a[0], one)
    # every step advances the counter's high word once: the replicas' copies alike
    np.testing.assert_array_equal(end - start, [0, 2, 0])
    (c, d), _, _ = draws({"run_option": run_option})          # deterministic
    np.testing.assert_array_equal(np.concatenate(c), np.concatenate(a))
    np.testing.assert_array_equal(np.concatenate(d), np.concatenate(b))


def test_a_run_restored_from_its_checkpoint_draws_what_the_uninterrupted_one_does(tmp_path):
    """The generator's state is a variable the checkpoint holds: a run
    stopped after 2 steps and restored draws at step 3 what a run of 3
    steps draws."""
    ones = np.ones([ROWS * 2, FEATURES], np.float32)

    def steps(n, config):
        with pn.get_runner(noisy_model(), local(2), config) as runner:
            runner.run("init")
            return [runner.run(["noise:0", "train"], {"x:0": ones})[0] for _ in range(n)]
    whole = steps(3, {"run_option": "allreduce"})
    saved = {"run_option": "allreduce", "checkpoint": {"dir": str(tmp_path), "every_steps": 1}}
    steps(2, saved)
    np.testing.assert_array_equal(steps(1, saved)[0], whole[2])


def test_state_written_from_a_draw_stays_one_value_on_every_replica():
    """A draw differs between replicas, so a variable written from it is
    synced (the replicas' mean) like one written from their data."""
    g = tf.Graph()
    with g.as_default():
        gen = tf.random.Generator.from_seed(5)
        x = tf1.placeholder(tf.float32, [None, FEATURES], name="x")
        stat = tf1.get_variable("stat", [], trainable=False, initializer=tf1.zeros_initializer())
        w = tf1.get_variable("w", [FEATURES, 1])
        loss = tf.reduce_mean(tf.matmul(x, w))
        with tf.control_dependencies([stat.assign(tf.reduce_mean(gen.uniform([3])))]):
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
        runner.run(init)
        runner.run(train, {x: np.ones([2 * ROWS, FEATURES], np.float32)})
        first, second = runner.run(stat, per_replica=True)
    assert first == second and 0 < first < 1


def test_identical_streams_draw_alike_on_every_replica():
    (a, _), _, _ = draws({"run_option": "allreduce", "random": "identical"})
    np.testing.assert_array_equal(a[0], a[1])


def test_a_generator_of_another_algorithm_is_refused_by_name():
    with pytest.raises(GraphError, match="RngReadAndSkip.*Philox"):
        pn.get_runner(noisy_model(alg="threefry"), local(2), {"run_option": "allreduce"})


def test_tf_keras_random_image_layers_train_under_fit(capsys):
    """tf_keras's RandomFlip, RandomRotation and RandomCrop draw from
    generators (RandomCrop under a tf.cond on the images' height and width,
    which every replica shares): fit runs with no warning about the loss,
    and the layers' states advance by whole steps' draws (RandomCrop's
    offsets, of a fixed shape, by TensorFlow's own advance of the low word)."""
    import tf_keras
    layers = tf_keras.layers
    rng = np.random.RandomState(0)
    x, y = rng.rand(32, 10, 10, 3).astype(np.float32), rng.randint(0, 3, 32)
    tf_keras.utils.set_random_seed(1)
    augment = [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1),
               layers.RandomCrop(8, 8)]
    model = tf_keras.Sequential([tf_keras.Input((10, 10, 3)), *augment,
                                 layers.Conv2D(4, 3), layers.GlobalAveragePooling2D(),
                                 layers.Dense(3)])
    model.compile(tf_keras.optimizers.SGD(0.01),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    states = [layer._random_generator._generator.state for layer in augment]
    start = [s.numpy() for s in states]
    pn.parallelize(model, local(2), {"run_option": "allreduce"})
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    said = capsys.readouterr().err          # the plan's notes (and none on the loss's form)
    assert "is a mean or a sum" not in said, said
    assert np.all(np.isfinite(history.history["loss"]))
    for s, before in zip(states, start):        # 4 steps, each its draws: of the batch's
        low, high, key = s.numpy() - before     # shape by the high word, of a fixed one
        assert key == 0 and low + high > 0 and low % 4 == high % 4 == 0   # as TensorFlow does


@pytest.mark.parametrize("draw", ["tf.random", "keras.random", "tf.random.Generator"])
def test_a_tf2_steps_gradient_noise_equals_one_device(draw, monkeypatch):
    """Keras 3 model, a TF2 step that adds noise to the tape's gradients,
    drawn by a seeded tf.random op, by keras.random from a SeedGenerator
    (a stateless draw), or by a tf.random.Generator (whose state advances
    by TensorFlow's own step for a draw of a fixed shape): 4 steps of 2
    replicas equal one device, weights 1e-6, and so does the generator's
    state (before: the replicas' noises were averaged, 0.019 apart). Here,
    not in test_randomness.py: that suite runs again under
    disable_v2_behavior (tests/test_v1_behavior.py), and this needs TF2."""
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0")    # for this test only: a later
    import keras                                        # test's subprocess inherits it

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
                                  keras.layers.Dense(1)])
        seeds, gen = keras.random.SeedGenerator(5), tf.random.Generator.from_seed(3)
        noise = {"tf.random": lambda s: tf.random.normal(s, stddev=0.05),
                 "keras.random": lambda s: keras.random.normal(s, stddev=0.05, seed=seeds),
                 "tf.random.Generator": lambda s: gen.normal(s, stddev=0.05)}[draw]
        opt = keras.optimizers.SGD(0.1)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip([g + noise(g.shape) for g in grads],
                                    model.trainable_variables))
            return loss
        return model, gen, step
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(4, 16, 3)), rng.normal(size=(4, 16, 1))
    out = []
    for parallel in (True, False):
        model, gen, step = build()
        step = pn.function(step, local(2)) if parallel else tf.function(step)
        losses = [float(step(x.astype(np.float32), y.astype(np.float32)))
                  for x, y in zip(xs, ys)]
        if parallel:
            step.sync()
        out.append((losses, [np.asarray(v) for v in model.weights], gen.state.numpy()))
    (losses, weights, state), (want_losses, want_weights, want_state) = out
    np.testing.assert_allclose(losses, want_losses, atol=1e-6, rtol=0)
    for a, b in zip(weights, want_weights):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    if draw == "tf.random.Generator":
        np.testing.assert_array_equal(state, want_state)
