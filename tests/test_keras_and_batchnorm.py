"""Models written with tf_keras layers and tf.compat.v1.layers (Keras 2 API).

tf_keras optimizers (OptimizerV2) route gradients through an IdentityN; batch
normalization writes moving statistics from each replica's own batch.
"""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local, read_name, train_both

import tf_keras  # noqa: E402  the test extra installs it
tf1 = tf.compat.v1


def keras_mlp(batch):
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(0)
        x_all, y_all = rng.randn(64, 3).astype(np.float32), rng.randn(64, 1).astype(np.float32)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((x_all, y_all))).batch(batch).repeat()
        x, y = tf1.data.make_one_shot_iterator(ds).get_next()
        model = tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu"),
                                     tf_keras.layers.Dense(1)])
        loss = tf.reduce_mean(tf.square(model(x) - y))
        train = tf_keras.optimizers.legacy.Adam(0.01).get_updates(loss, model.trainable_variables)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "loss": loss, "init": init}


def bn_model(batch, momentum=0.9):
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(3)
        x_all = (rng.randn(128, 6) * 3 + 1).astype(np.float32)
        y_all = rng.randn(128, 1).astype(np.float32)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((x_all, y_all))).batch(batch).repeat()
        it = tf1.data.make_initializable_iterator(ds)
        x, y = it.get_next()
        h = tf1.layers.dense(x, 8)
        h = tf1.layers.batch_normalization(h, training=True, momentum=momentum)
        pred = tf1.layers.dense(tf.nn.relu(h), 1)
        loss = tf.reduce_mean(tf.square(pred - y))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "loss": loss, "init": init, "iterator_init": it.initializer}


@pytest.mark.parametrize("run_option", ["hybrid", "ps"])
def test_tf_keras_model_matches_one_device(run_option):
    parallel, single, names = train_both(keras_mlp, 2, 10, config={"run_option": run_option})
    for name in names:
        for k, got in enumerate(parallel[name]):
            assert np.max(np.abs(got - single[name])) <= 1e-5, (name, k)


def test_batchnorm_moving_mean_after_one_step_matches_one_device():
    """Step 1: moving mean = single device's (mean of equal-size batch means)."""
    parallel, single, _ = train_both(bn_model, 2, 1)
    mean = "batch_normalization/moving_mean"
    for got in parallel[mean]:
        assert np.max(np.abs(got - single[mean])) <= 1e-5
    # The moving variance averages per-replica batch variances, which leaves out
    # the spread between replica means (law of total variance): never above
    # the single-device value.
    var = "batch_normalization/moving_variance"
    for got in parallel[var]:
        assert np.all(got <= single[var] + 1e-6)


def test_batchnorm_trains_and_replicas_stay_identical():
    g, h = bn_model(8)
    with pn.get_runner(g, local(2)) as runner:
        runner.run([h["init"], h["iterator_init"]])
        losses = [runner.run([h["train"], h["loss"]])[1] for _ in range(60)]
        names = [v.op.name for v in g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)]
        copies = runner.run([read_name(n, g) for n in names], per_replica=True)
    assert np.mean(losses[-10:]) < np.mean(losses[:10])
    for name, (a, b) in zip(names, copies):
        assert np.array_equal(a, b), f"replicas of {name} drifted apart"
