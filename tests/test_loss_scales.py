"""Mixed precision's dynamic loss scale on N replicas
(transforms/loss_scales.py): the replicas skip a step, and halve the scale,
exactly where one device with the global batch does, so they train alike.

Before, each replica's float16 backward pass held N times one device's
values per row and overflowed at a scale N times lower: with Keras's
default scale (32768) and plain data the replicas skipped the first step,
one device the third, and the weights ended 0.17 apart.

Tolerance: float16 rounds each replica's sum over its own rows where one
device rounds the sum over the global batch (2^-11 relative a sum), and
the steps carry that on: measured up to 9e-5 after 6 steps of SGD with
momentum; bound 5e-4 (float32 training of the same models: 1e-6)."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.graph import frontend
from transforms.loss_scales import scale_reads

tf1 = tf.compat.v1
STEPS, BATCH, TOL = 6, 32, 5e-4


def library(name):
    import importlib
    return importlib.import_module(name)


def embedding_model(k):
    """An embedding, a LayerNormalization and dense layers, float16 but the
    output (as Keras's mixed precision guide builds them)."""
    k.utils.set_random_seed(3)
    model = k.Sequential([k.Input((8,), dtype="int32"), k.layers.Embedding(100, 16),
                          k.layers.LayerNormalization(), k.layers.Flatten(),
                          k.layers.Dense(32, activation="tanh"),
                          k.layers.Dense(1, dtype="float32")])
    return model


def batches(scale=1.0):
    rng = np.random.RandomState(0)
    x = rng.randint(0, 100, (10 * BATCH, 8)).astype(np.int32)
    y = (rng.randn(10 * BATCH, 1) * scale).astype(np.float32)
    return x.reshape(10, BATCH, 8), y.reshape(10, BATCH, 1)


def the_scale(k, optimizer) -> float:
    return float(np.array(optimizer.dynamic_scale if k.__name__ == "keras"
                          else optimizer.loss_scale))


def twins(k, build):
    """(parallel, single): `build(k)` twice under the mixed_float16 policy,
    the second with the first's weights."""
    k.mixed_precision.set_global_policy("mixed_float16")
    try:
        parallel, single = build(k), build(k)
    finally:
        k.mixed_precision.set_global_policy("float32")
    single.set_weights(parallel.get_weights())
    return parallel, single


def check_weights(parallel, single):
    for v, a, b in zip(single.weights, parallel.get_weights(), single.get_weights()):
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=TOL, rtol=0,
                                   err_msg=v.name)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_fit_skips_the_steps_one_device_skips(lib):
    """`model.fit` with the default loss scale and targets of unit scale:
    one device skips the third step (the scale halves to 16384), and so do
    the replicas, after every step."""
    k = library(lib)
    parallel, single = twins(k, embedding_model)
    for m in (parallel, single):
        m.compile(optimizer=k.optimizers.SGD(0.01, momentum=0.9), loss="mse")
    pn.parallelize(parallel, local(2))
    x, y = batches()
    scales = []
    for s in range(STEPS):
        for m in (parallel, single):
            m.fit(x[s], y[s], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        scales.append([the_scale(k, m.optimizer) for m in (parallel, single)])
    assert [a for a, _ in scales] == [b for _, b in scales], scales
    assert scales[-1][1] < 32768.0                  # one device skipped a step
    check_weights(parallel, single)


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_a_custom_loop_with_a_loss_scale_optimizer_equals_one_device(lib):
    """A `pn.function` step that scales its loss and unscales its gradients
    by the optimizer's own calls: Keras 3's `scale_loss` (the unscale in
    `apply`), tf_keras's `get_scaled_loss` and `get_unscaled_gradients`."""
    k = library(lib)
    parallel, single = twins(k, embedding_model)
    mse = k.losses.MeanSquaredError()

    def step_of(model):
        optimizer = k.mixed_precision.LossScaleOptimizer(k.optimizers.SGD(0.01, momentum=0.9))

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = mse(y, model(x, training=True))
                scaled = optimizer.scale_loss(loss) if lib == "keras" else \
                    optimizer.get_scaled_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            if lib == "keras":
                optimizer.apply(grads, model.trainable_variables)
            else:
                optimizer.apply_gradients(zip(optimizer.get_unscaled_gradients(grads),
                                              model.trainable_variables))
            return loss
        return step, optimizer

    (fn, p_opt), (ref_fn, s_opt) = step_of(parallel), step_of(single)
    step, ref = pn.function(fn, local(2)), tf.function(ref_fn)
    x, y = batches()
    for s in range(STEPS):
        np.testing.assert_allclose(step(x[s], y[s]), ref(x[s], y[s]).numpy(), rtol=1e-3)
    step.sync()
    assert the_scale(k, p_opt) == the_scale(k, s_opt) < 32768.0
    check_weights(parallel, single)


def tf1_program(targets: float):
    """A hand-cast float16 TF1 graph trained by tf.compat.v1's
    MixedPrecisionLossScaleOptimizer with a dynamic scale."""
    rng = np.random.RandomState(0)
    xs = rng.randn(STEPS * BATCH, 6).astype(np.float32)
    ys = (rng.randn(STEPS * BATCH, 1) * targets).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 6], "x")
        y = tf1.placeholder(tf.float32, [None, 1], "y")
        w1 = tf1.get_variable("w1", [6, 16], initializer=tf1.glorot_uniform_initializer(seed=1))
        w2 = tf1.get_variable("w2", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=2))
        h = tf.tanh(tf.matmul(tf.cast(x, tf.float16), tf.cast(w1, tf.float16)))
        loss = tf.reduce_mean(tf.square(tf.cast(tf.matmul(h, tf.cast(w2, tf.float16)),
                                                tf.float32) - y))
        optimizer = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
            tf1.train.MomentumOptimizer(0.01, 0.9), "dynamic")
        train = optimizer.minimize(loss)
        init = tf1.global_variables_initializer()
    feeds = [{x: xs[s * BATCH:(s + 1) * BATCH], y: ys[s * BATCH:(s + 1) * BATCH]}
             for s in range(STEPS)]
    return graph, train, init, feeds


def variables(graph, *names) -> list:
    """`graph`'s variables of `names` (resource or reference variables, as
    the behavior the process runs with makes them)."""
    by_name = {v.op.name: v for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)}
    return [by_name[n] for n in names]


@pytest.mark.parametrize("replicas,config", [(2, None), (4, None), (2, {"run_option": "ps"}),
                                             (2, {"dense_method": "bfb"})])
def test_a_tf1_step_skips_where_one_device_overflows_its_sum_over_the_batch(replicas, config):
    """Targets 30 times larger: one device's float16 sums over the batch (a
    weight's gradient) overflow at scales where each replica's sum over its
    own rows does not; the replicas read infinity there too (their mean
    times N at float16's limit), so every step's scale is one device's.
    By all-reduce (2 and 4 replicas), on a parameter server (`ps`: the
    update there) and by fusion buffers."""
    graph, train, init, feeds = tf1_program(30.0)
    names = ["w1", "w2", "w1/Momentum", "w2/Momentum"]
    with pn.get_runner(graph, local(replicas), config) as runner:
        runner.run(init)
        start = runner.run(variables(graph, "w1", "w2"))
        got = []
        for feed in feeds:
            runner.run(train, feed)
            got.append(float(runner.run(variables(graph, "current_loss_scale")[0])))
        trained = runner.run(variables(graph, *names))
        report = {r.name: r.report for r in runner.pass_records}["loss_scales"]
        for op in runner.program.graph.get_operations():   # each on its reader's device
            if op.name.startswith("parallax/loss_scales/") and op.type != "Const":
                assert op.device and all(c.device == op.device for c in op.outputs[0].consumers()
                                         if not c.name.startswith("parallax/")), op.name
    graph, train, init, feeds = tf1_program(30.0)
    with tf1.Session(graph=graph) as sess:
        sess.run(init)                                  # seeded: the replicas' start
        for a, b in zip(start, sess.run(variables(graph, "w1", "w2"))):
            np.testing.assert_array_equal(a, b)
        want = []
        for feed in feeds:
            sess.run(train, feed)
            want.append(float(sess.run(variables(graph, "current_loss_scale")[0])))
        wanted = sess.run(variables(graph, *names))
    assert got == want and want[-1] < 32768.0, (got, want)
    for name, a, b in zip(names, trained, wanted):     # 1e-3 of the largest value: float16's
        assert np.max(np.abs(a - b)) <= 1e-3 * np.max(np.abs(b)), name   # 2 ulps (measured 2.4e-4)
    assert report == {"scales": ["current_loss_scale"], "in_loops": [], "totals": ["w1", "w2"]}


def test_the_scale_is_found_by_its_uses_and_a_loss_weight_is_not_one():
    """The scale's reads that scale the loss, its gradient and the unscale
    are found, not those that update the scale; a non-trained variable
    that weighs the loss (no unscale reads it) is no scale."""
    graph, *_ = tf1_program(1.0)
    found = scale_reads(frontend.load(graph))
    assert list(found) == ["current_loss_scale"]
    readers = {consumer for _, (consumer, _) in found["current_loss_scale"]}
    ops = {graph.get_operation_by_name(c).type for c in readers}
    assert ops <= {"Mul", "RealDiv"} and any(c.startswith("gradients/") for c in readers)
    assert not any("cond" in c for c in readers)          # the scale's own update
    weighted = tf.Graph()
    with weighted.as_default():
        x = tf1.placeholder(tf.float32, [None, 3])
        w = tf1.get_variable("w", [3, 1])
        weight = tf1.get_variable("weight", [], initializer=tf1.constant_initializer(0.5),
                                  trainable=False)
        loss = weight * tf.reduce_mean(tf.square(tf.matmul(x, w)))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert scale_reads(frontend.load(weighted)) == {}


JOB = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
import parallax_ng as pn
from test_loss_scales import tf1_program, variables
graph, train, init, feeds = tf1_program(30.0)
with pn.get_runner(graph) as runner:
    plan = runner.plan
    runner.run(init)
    half = slice(plan.worker * 16, (plan.worker + 1) * 16)   # the worker's rows
    scales = []
    for feed in feeds:
        runner.run(train, {{k: v[half] for k, v in feed.items()}})
        scales.append(float(runner.run(variables(graph, "current_loss_scale")[0])))
    values = runner.run(variables(graph, "w1", "w2"))
np.savez({out!r} + f".{{plan.worker}}.npz", scales=scales, w1=values[0], w2=values[1])
"""


def test_a_two_worker_job_skips_the_steps_one_device_skips(tmp_path):
    """The same TF1 program in a job of 2 workers x 1 device (collective
    all-reduce): N is the job's replicas, not the worker's; both workers'
    scales after every step and weights are one device's."""
    import os
    from task_env import run_script_job
    out = str(tmp_path / "trained")
    done = run_script_job(tmp_path, JOB.format(tests=os.path.dirname(__file__), out=out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    graph, train, init, feeds = tf1_program(30.0)
    with tf1.Session(graph=graph) as sess:
        sess.run(init)
        want = []
        for feed in feeds:
            sess.run(train, feed)
            want.append(float(sess.run(variables(graph, "current_loss_scale")[0])))
        wanted = sess.run(variables(graph, "w1", "w2"))
    for k in range(2):
        got = np.load(f"{out}.{k}.npz")
        assert list(got["scales"]) == want and want[-1] < 32768.0, (list(got["scales"]), want)
        for name, b in zip(("w1", "w2"), wanted):
            assert np.max(np.abs(got[name] - b)) <= 1e-3 * np.max(np.abs(b)), name
