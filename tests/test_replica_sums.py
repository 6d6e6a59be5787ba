"""Sums across replicas that the program asks for (graph/replica_sums.py):
synchronized batch normalization normalizes every replica's rows by the
global batch's statistics, so N replicas equal one device with the global
batch exactly, every weight, moving statistic and slot, 1e-5: Keras 3 and
tf_keras `fit`, and a TF1 graph of tf_keras layers. Jobs:
tests/test_keras_examples.py."""
import importlib

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from parallax_ng.graph import replica_sums
from models import local, train_both
from test_keras_fit import BATCH, bn_data, bn_model, check

tf1 = tf.compat.v1


def test_points_are_the_programs_all_reduces_not_the_optimizers_nor_other_custom_gradients():
    import keras
    layer = keras.layers.BatchNormalization(synchronized=True)
    dense = keras.layers.Dense(3)
    optimizer = keras.optimizers.SGD(0.1)

    @tf.custom_gradient
    def clipped(x):                 # an identity whose gradient is the program's own
        return x, lambda dy: tf.clip_by_value(dy, -1.0, 1.0)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = layer(clipped(dense(x)), training=True)
            mean = tf.distribute.get_replica_context().all_reduce("mean", tf.reduce_mean(h))
            loss = tf.reduce_sum(h) + mean
        variables = dense.trainable_variables + layer.trainable_variables
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return grads

    concrete = step.get_concrete_function(tf.TensorSpec((4, 2)))
    g = concrete.graph
    everything = replica_sums.points(g, set())
    # the optimizer's all-reduce of the 4 gradients: one, named by them
    optimizers = [n for n, _ in everything if n.startswith(optimizer.name)]
    assert len(optimizers) == 4
    grads = {op.inputs[k].name for op in g.get_operations()
             for k in range(4) if op.name == optimizers[0].split(":")[0]}
    found = replica_sums.points(g, grads)
    assert not set(optimizers) & {n for n, _ in found}
    # the layer's count, sum and sum of squares, their gradients' sums (the
    # constant count has none), the program's mean and its gradient's
    assert sum("batch_normalization" in n for n, _ in found) == 3
    assert [mean for _, mean in found].count(True) == 2
    assert len(found) == 3 + 2 + 2
    assert not any(op.type == "IdentityN" and n.startswith(op.name + ":")
                   for op in g.get_operations() if "clip" in str(op.node_def.attr)
                   for n, _ in found)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_synchronized_batchnorm_in_fit_equals_one_device_with_the_global_batch(lib):
    """`BatchNormalization(synchronized=True)` after a convolution: each
    replica's statistics are the global batch's, so unlike the default
    (ghost batches, tests/test_keras_fit.py) 2 replicas equal one device
    training on the whole batch, 4 steps. Before, the layer's all-reduces
    were each replica's own rows, silently: 0.16 off in the kernel."""
    k = importlib.import_module(lib)
    x, y = bn_data(True, 64)
    # one device's layer synchronized too: tf_keras's unsynchronized one on
    # images runs the fused kernel, whose moving variance is the unbiased one
    parallel, single = (bn_model(k, True, synchronized=True) for _ in range(2))
    pn.parallelize(parallel, local(2))
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    check(parallel, single)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=1e-5, rtol=0)
    moving = [w for w in parallel.weights if "moving" in getattr(w, "path", w.name)]
    assert len(moving) == 2 and not np.allclose(np.asarray(moving[1]), 1.0)


def tf1_sync_bn(batch):
    """A TF1 graph of tf_keras layers, a synchronized BatchNormalization
    between them, trained by tf.compat.v1's momentum optimizer."""
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        x_all, y_all = bn_data(False, 64)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((x_all, y_all))).batch(batch).repeat()
        x, y = tf1.data.make_one_shot_iterator(ds).get_next()
        tf1.set_random_seed(2)
        bn = tf_keras.layers.BatchNormalization(momentum=0.9, synchronized=True)
        h = bn(tf_keras.layers.Dense(8)(x), training=True)
        loss = tf.reduce_mean(tf.square(tf_keras.layers.Dense(1)(tf.nn.relu(h)) - y))
        with tf.control_dependencies(bn.updates):
            train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "loss": loss, "init": init}


def test_synchronized_batchnorm_in_a_tf1_graph_equals_one_device():
    parallel, single, names = train_both(tf1_sync_bn, 2, 4, batch=8)
    assert any("moving_variance" in n for n in names)
    for name in names:
        for got in parallel[name]:
            np.testing.assert_allclose(got, single[name], atol=1e-5, rtol=0, err_msg=name)
