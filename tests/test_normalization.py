"""Batch normalization by the global batch's statistics (config `batch_norm:
synchronized`) in graphs and `pn.function` steps, and the line that says
where it is per replica (graph/normalization.py): 2 replicas against one
device with the global batch, every variable and optimizer slot, 1e-5."""
import contextlib
import json

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local, train_both
from parallax_ng.graph import normalization
from parallax_ng.graph.forms import sources
from test_tf2 import step_of

tf1 = tf.compat.v1
PER_REPLICA = "normalizes each replica's rows by their own mean and variance"


def tf1_bn(batch, fused=None, layer_norm=False, flag=False):
    """tf.compat.v1.layers (tf_keras underneath) with batch normalization
    in training on dense features, or on images (fused by default); with
    `flag`, the images' layer told training by a placeholder with default
    True (a tf.cond: its kernels inside the branches)."""
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(3)
        images = fused not in (None, "identity")
        x_all = (rng.randn(64, 4, 4, 2) if images else rng.randn(64, 6) * 3 + 1)
        y_all = rng.randn(64, 1).astype(np.float32)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((x_all.astype(np.float32), y_all)))
        x, y = tf1.data.make_one_shot_iterator(ds.batch(batch).repeat()).get_next()
        tf1.set_random_seed(1)
        if images:
            h = tf1.layers.conv2d(x, 3, 3, padding="same")
            training = tf1.placeholder_with_default(True, [], name="training") if flag else True
            h = tf_keras.layers.BatchNormalization(momentum=0.8, fused=fused)(h,
                                                                            training=training)
            h = tf1.layers.flatten(tf.nn.relu(h))
        else:
            h = tf1.layers.dense(x, 8)
            h = tf.identity(h) if fused == "identity" else h
            h = tf1.layers.batch_normalization(h, training=True, momentum=0.9)
        if layer_norm:
            mean, var = tf.nn.moments(h, [-1], keepdims=True)
            h = (h - mean) * tf.math.rsqrt(var + 1e-3)
        loss = tf.reduce_mean(tf.square(tf1.layers.dense(tf.nn.relu(h), 1) - y))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "loss": loss, "init": init}


def worst(parallel, single, names):
    return max(float(np.max(np.abs(got - single[n]))) for n in names for got in parallel[n])


@pytest.mark.parametrize("fused", [None, False, True, "identity"])
def test_synchronized_statistics_in_a_tf1_graph_equal_one_device(fused, capsys):
    """tf.compat.v1.layers.batch_normalization on features (also of a
    tf.identity, which the gradient reads through: its statistics' input
    is the Identity's output), tf_keras's
    unfused one on images and its fused kernel (lowered), trained 5 steps
    by momentum: every weight, slot and moving statistic equals one
    device's; per replica (the default) they are ghost batches, further
    off than that, and a line says so."""
    build = lambda b: tf1_bn(b, fused)           # noqa: E731
    parallel, single, names = train_both(build, 2, 5, config={"batch_norm": "synchronized"})
    assert any("moving_variance" in n for n in names) and any("Momentum" in n for n in names)
    assert worst(parallel, single, names) <= 1e-5
    assert PER_REPLICA not in capsys.readouterr().err
    plan = pn.transform_plan(build(8)[0], local(2), {"batch_norm": "synchronized"})
    assert "batch normalization by the global batch's statistics: " \
        f"{4 + (fused is True)} tensors exchanged per step" in plan.format()
    parallel, single, names = train_both(build, 2, 5)
    assert worst(parallel, single, names) > 1e-3
    said = capsys.readouterr().err
    assert PER_REPLICA in said and "batch_norm: per_replica, the default" in said, said


def gan_bn(batch):
    """A TF1 GAN whose discriminator normalizes its hidden layer
    (tf.compat.v1.layers.batch_normalization): its call on the generated
    rows is differentiated by both losses, so its statistics have a
    gradient in each train op. The moving statistics follow the call on
    the real rows (both calls' updates would race on one device)."""
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(4)
        arrays = (rng.randn(64, 3) * 2 + 1, rng.randn(64, 2))
        ds = pn.shard(tf.data.Dataset.from_tensor_slices(tuple(a.astype(np.float32)
                                                                for a in arrays)))
        real, noise = tf1.data.make_one_shot_iterator(ds.batch(batch).repeat()).get_next()
        init = tf1.constant_initializer

        def disc(x):
            with tf1.variable_scope("disc", reuse=tf1.AUTO_REUSE):
                h = tf1.layers.dense(x, 6, use_bias=False,    # (its gradient is 0: Adam's
                                     kernel_initializer=init(rng.randn(3, 6) * 0.5))  # noise)
                h = tf.nn.leaky_relu(tf1.layers.batch_normalization(h, training=True))
                return tf1.layers.dense(h, 1, kernel_initializer=init(rng.randn(6, 1)))
        with tf1.variable_scope("gen"):
            fake = tf1.layers.dense(noise, 3, tf.nn.tanh, kernel_initializer=init(
                rng.randn(2, 3)))
        d_real, d_fake = disc(real), disc(fake)
        bce = tf1.losses.sigmoid_cross_entropy
        d_loss = bce(tf.ones_like(d_real), d_real) + bce(tf.zeros_like(d_fake), d_fake)
        g_loss = bce(tf.ones_like(d_fake), d_fake)
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "disc/")):
            d_train = tf1.train.AdamOptimizer(0.05, beta1=0.5).minimize(
                d_loss, var_list=tf1.trainable_variables("disc"))
        g_train = tf1.train.AdamOptimizer(0.05, beta1=0.5).minimize(
            g_loss, var_list=tf1.trainable_variables("gen"))
        init = tf1.global_variables_initializer()
    return g, {"train": d_train, "g_train": g_train, "init": init,
               "d_loss": d_loss, "g_loss": g_loss}


@pytest.mark.parametrize("run_option", ["allreduce", "ps"])
def test_statistics_two_train_ops_differentiate_are_synchronized(run_option, capsys):
    """The GAN's two train ops run in turn, 4 rounds: every weight, slot
    and moving statistic, and each fetched loss, equals one device's. (The
    generated rows' statistics were left per replica, named, as a
    gradient of them was found in each train op.)"""
    def rounds(run, h):
        return [run([h["train"], h["d_loss"]])[1] for _ in range(1)] + [
            x for _ in range(4) for x in (run([h["g_train"], h["g_loss"]])[1],
                                          run([h["train"], h["d_loss"]])[1])]
    g, h = gan_bn(8)
    variables = g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
    names = [v.op.name for v in variables]
    with pn.get_runner(g, local(2), {"batch_norm": "synchronized",
                                     "run_option": run_option}) as runner:
        runner.run(h["init"])
        losses = rounds(runner.run, h)
        parallel = dict(zip(names, runner.run(variables, per_replica=True)))
    g1, h1 = gan_bn(16)
    with tf1.Session(graph=g1) as sess:
        sess.run(h1["init"])
        single_losses = rounds(sess.run, h1)
        single = dict(zip(names, sess.run(g1.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES))))
    assert any("moving_variance" in n for n in names) and any("Adam_1" in n for n in names)
    np.testing.assert_allclose(losses, single_losses, rtol=0, atol=1e-5)
    assert worst(parallel, single, names) <= 1e-5
    assert "batch_norm: synchronized notwithstanding" not in capsys.readouterr().err


def keras_updates(batch):
    """A tf_keras model in a TF1 graph trained by a legacy optimizer's
    get_updates (its gradients under `SGD/gradients/gradients/`), the
    batch normalization's updates grouped in."""
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(0)
        xs = (rng.randn(64, 5) * 2 + 1).astype(np.float32)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((xs, rng.randn(64, 1).astype(
            np.float32))))
        x, y = tf1.data.make_one_shot_iterator(ds.batch(batch).repeat()).get_next()
        tf1.set_random_seed(0)
        bn = tf_keras.layers.BatchNormalization()
        model = tf_keras.Sequential([tf_keras.layers.Dense(8, use_bias=False), bn,
                                     tf_keras.layers.Dense(1)])
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        updates = tf_keras.optimizers.legacy.SGD(0.05).get_updates(loss,
                                                                  model.trainable_variables)
        train = tf.group(updates + bn.updates)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "loss": loss, "init": init}


def test_a_keras_optimizers_gradients_under_its_scope_are_found():
    parallel, single, names = train_both(keras_updates, 2, 5,
                                         config={"batch_norm": "synchronized"})
    assert any("moving_mean" in n for n in names)
    assert worst(parallel, single, names) <= 1e-5


def test_what_is_found_and_layer_norm_is_not_batch_norm():
    """A fused kernel in training is found as such; moments over the
    features (a layer norm) are no batch normalization, neither found nor
    exchanged."""
    g, _ = tf1_bn(8, fused=True)
    moments, fused, other = normalization.found(g, sources(g))
    assert moments == [] and fused == ["batch_normalization/FusedBatchNormV3"] and other == []
    g, _ = tf1_bn(8, layer_norm=True)
    moments, fused, other = normalization.found(g, sources(g))
    assert [m.layer for m in moments] == ["batch_normalization"] and fused == other == []
    assert all(m.complete() for m in moments)
    assert len(normalization.points(moments)) == 4      # two statistics, two gradients


def keras_bn(lib, images):
    first = [lib.layers.Reshape((2, 2, 1)), lib.layers.Conv2D(3, 2, padding="same",
                                                             use_bias=False)] \
        if images else [lib.layers.Dense(8, use_bias=False)]
    return lib.Sequential([lib.Input((4,)), *first,
                           lib.layers.BatchNormalization(momentum=0.7),
                           lib.layers.Activation("relu"), lib.layers.Flatten(),
                           lib.layers.Dense(1)])


class _Called:
    """A model called in a nested tf.function (XLA-compiled or not)."""

    def __init__(self, model, jit: bool):
        self.trainable_variables = model.trainable_variables
        self.forward = tf.function(lambda x: model(x, training=True), jit_compile=jit)

    def __call__(self, x, training):
        return self.forward(x)


@pytest.mark.parametrize("legacy,images,nested", [
    ("0", False, ""), ("1", False, ""), ("0", True, ""), ("1", True, ""),
    ("0", False, "function"), ("1", True, "function"), ("1", True, "jit"), ("0", True, "jit")])
def test_synchronized_statistics_in_a_pn_function_step_equal_one_device(legacy, images, nested,
                                                                      capsys, monkeypatch):
    """A GradientTape step of a Keras 3 or tf_keras model with a
    BatchNormalization on features or images (its moments found in the
    tape's gradient by their form; tf_keras's fused kernel on images,
    which moves the moving statistics inside the op, lowered), the model
    called in the step or in a tf.function of its own (inlined: its
    gradient's ops are named for the call's, not the forward ops'): 8
    steps on 2 replicas equal one device, weights, moving statistics and
    Adam's slots. (No bias before the normalization: its gradient would be
    rounding noise, which Adam scales up to steps of its rate.)"""
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy)
    import keras
    import tf_keras
    lib = tf_keras if legacy == "1" else keras
    lib.utils.set_random_seed(0)
    models = [keras_bn(lib, images) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    optimizers = [lib.optimizers.Adam(0.01) for _ in models]

    called = [_Called(m, nested == "jit") if nested else m for m in models]
    step = pn.function(step_of(called[0], optimizers[0]), local(2),
                       {"batch_norm": "synchronized"})
    ref = tf.function(step_of(called[1], optimizers[1]))
    rng = np.random.default_rng(1)
    for _ in range(8):
        x = (rng.normal(size=(8, 4)) * 2 + 1).astype(np.float32)
        y = rng.normal(size=(8, 1)).astype(np.float32)
        np.testing.assert_allclose(step(x, y), ref(x, y).numpy(), atol=1e-5, rtol=0)
    step.sync()
    for a, b in zip(models[0].weights + list(optimizers[0].variables),
                    models[1].weights + list(optimizers[1].variables)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0,
                                   err_msg=getattr(a, "path", a.name))
    assert PER_REPLICA not in capsys.readouterr().err


@pytest.mark.parametrize("call", ["nested", "both"])
def test_a_model_called_twice_each_call_synchronized(call, capsys):
    """A Keras 3 model called on two batches (a siamese pair), each call in
    a nested tf.function, or one there and one in the step: each call's
    statistics and their gradients are found and exchanged apart (the
    gradients of the two calls share their names past the calls' scopes;
    each is the one whose ops read its call's input). 4 steps on 2
    replicas equal one device, every weight, moving statistic and slot."""
    import keras
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, 2, 16, 4)).astype(np.float32) * [[[[1.0]], [[3.0]]]]
    ys = rng.normal(size=(4, 16, 1)).astype(np.float32)

    def make():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, use_bias=False),
                                  keras.layers.BatchNormalization(momentum=0.7),
                                  keras.layers.Dense(1)])
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        nested = tf.function(lambda x: model(x, training=True))
        second = nested if call == "nested" else (lambda x: model(x, training=True))

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(nested(x[:, 0]) * second(x[:, 1]) - y))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            return loss
        return model, opt, step
    (ma, oa, sa), (mb, ob, sb) = make(), make()
    parallel = pn.function(sa, local(2), {"batch_norm": "synchronized"})
    single = tf.function(sb)
    for x, y in zip(xs, ys):
        parallel(np.ascontiguousarray(x.transpose(1, 0, 2)), y)
        single(np.ascontiguousarray(x.transpose(1, 0, 2)), y)
    parallel.sync()
    for a, b in zip(ma.weights + list(oa.variables), mb.weights + list(ob.variables)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0,
                                   err_msg=a.path)
    assert PER_REPLICA not in capsys.readouterr().err


@pytest.mark.parametrize("run_option,bn,v1,dense,sparse", [
    ("hybrid", "moments", False, "auto", "auto"), ("allreduce", "moments", False, "auto", "auto"),
    ("hybrid", "fused", False, "auto", "auto"), ("hybrid", "keras", False, "auto", "auto"),
    ("ps", "keras", True, "auto", "auto"), ("hybrid", "keras", True, "allreduce", "auto"),
    ("hybrid", "keras", False, "allreduce", "allgather"),
    ("hybrid", "own", False, "auto", "auto"), ("allreduce", "weighted", False, "auto", "auto")])
def test_a_job_with_synchronized_statistics_equals_one_device(tmp_path, run_option, bn, v1,
                                                              dense, sparse):
    """tests/cluster_script.py --bn: 2 workers (and a server under hybrid,
    where the statistics, and a lowered kernel's row count, are summed
    with the dense gradients on it), the embedding regression's features
    batch-normalized by tf.nn.moments or the fused kernel (the embedding's
    gradient passes through the statistics), Adam with clipping and moving
    averages, 8 steps: every variable equals one device's. "keras":
    tf_keras's fused layer told training by a placeholder, fed False at
    every third step (its kernels in a tf.cond's branches, which the
    workers skip alike: a server's sum in a skipped branch waits for
    nobody). Under `disable_v2_behavior()` (v1, where the layer reads its
    moving statistics inside the cond's branches) with every variable on
    the server: worker 1's push of its gradients waited on those reads, in
    the branch not taken too, and never ran, so worker 0 waited for it until
    the timeout; it waits on the Merges where the branches end. With the
    dense gradients by the ring and the embedding on the server (a step of
    two session runs), the statistics in the branch are summed on the
    server too: a collective there had the job refused. With nothing else
    on the server (the ring and allgather), the servers stop before the
    first step and the branch's sums are collectives: they were server
    sums, and the job failed ("Cleanup ..." or a closed queue). "own": the
    features standardized by hand (means over the batch, no tf.nn.moments),
    exchanged on the server too. "weighted": tf.nn.weighted_moments over
    the rows a mask keeps (sums, and the mask's count, all-reduced)."""
    from models import embedding_regression, train_single
    from test_cluster import load, run_job
    config = {"batch_norm": "synchronized"} | ({"sparse_method": sparse} if sparse != "auto"
                                                else {})
    done, out, _ = run_job(tmp_path, 2, 1, "8", "--run-option", run_option, "--bn", bn,
                           "--config", json.dumps(config), *["--v1"] * v1,
                           "--dense-method", dense,
                           servers=int(run_option != "allreduce"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert PER_REPLICA not in done.stderr
    idle = "the plan puts nothing on the parameter servers" in done.stderr
    assert idle or sparse != "allgather", done.stderr[-3000:]
    assert ("2 session run(s) at once per step" in done.stdout + done.stderr) == (
        dense == "allreduce" and not idle)
    g, h = embedding_regression(8, "adam", clip=True, ema=True, bn=bn)
    single = train_single(g, h, 8, lambda step: {h["training"]: step % 3 != 2}
                          if h["training"] else None)
    parallel = load(out, 2)
    assert set(parallel) == set(single)
    for name, copies in parallel.items():
        for got in copies:
            np.testing.assert_allclose(got, single[name], atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_synchronized_statistics_under_a_training_tensor_equal_one_device(control_flow):
    """tests/test_cond_lowering.py's graph: the batch normalization takes
    a `training` placeholder (its moving statistics written under a
    tf.cond, v1's Switch/Merge or an If lowered), Adam, 5 fed steps: the
    losses and every variable equal one device's, and inference (training
    False) runs. (No bias before the normalization: keras_bn says why.)"""
    from test_branches import lowered_conds
    from test_cond_lowering import XS, bn_graph, train
    flow = lowered_conds() if control_flow == "v1" else contextlib.nullcontext()
    graphs = []
    for _ in range(2):
        with flow if not graphs else contextlib.nullcontext():
            graphs.append(bn_graph(bias=False))
    (g, t), (g1, t1) = graphs
    with tf1.Session(graph=g1) as sess:
        want = train(sess.run, t1)
        want_vars = {v.op.name: sess.run(v) for v in g1.get_collection("variables")}
    with pn.get_runner(g, local(2), {"batch_norm": "synchronized"}) as runner:
        got = train(runner.run, t)
        for v in g.get_collection("variables"):
            for copy in runner.run(v, per_replica=True):
                np.testing.assert_allclose(copy, want_vars[v.op.name], atol=1e-5, rtol=0,
                                           err_msg=v.op.name)
        out = runner.run(t["out"], {t["x"]: XS[0], t["training"]: False})
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert out.shape == (16, 1)


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_a_fused_kernel_under_a_training_tensor_is_synchronized(control_flow, capsys):
    """tf_keras's fused layer told training by a placeholder: its kernels
    run in a tf.cond's branches (v1's Switch/Merge, or an If the front end
    lowers, whose gradient If reads the kernel's reserve spaces through
    Optionals), which every replica takes alike. Momentum, 5 steps: every
    weight, slot and moving statistic equals one device's (1e-5), with no
    line; the branch skipped (training False) runs."""
    from test_branches import lowered_conds
    flow = lowered_conds() if control_flow == "v1" else contextlib.nullcontext()
    with flow:
        graphs = [tf1_bn(b, fused=True, flag=True) for b in (4, 8)]
    parallel, single, names = train_both(lambda b: graphs[b // 8], 2, 5,
                                         config={"batch_norm": "synchronized"})
    assert any("moving_variance" in n for n in names)
    assert worst(parallel, single, names) <= 1e-5
    assert PER_REPLICA not in capsys.readouterr().err
    g, h = graphs[0]
    with pn.get_runner(g, local(2), {"batch_norm": "synchronized"}) as runner:
        runner.run(h["init"])
        frozen = runner.run([h["train"], h["loss"]], {"training:0": False})[1]
        runner.run(h["train"])
    assert np.isfinite(frozen)


@pytest.mark.parametrize("synchronized", [True, False])
def test_statistics_replicas_could_skip_are_named_not_exchanged(synchronized, capsys):
    """A fused kernel inside a v1 while loop, and a script's own moments
    inside a v1 tf.cond on the data's mean (a replica could skip what the
    others exchange, and leave them waiting) stay per replica, and the
    lines say so, the fused one with the way out; the step runs. With
    the default batch_norm too, both lines say that synchronized would
    not reach them (before, the default's line said it would make them
    the global batch's)."""
    from test_branches import lowered_conds
    g = tf.Graph()
    with g.as_default(), lowered_conds():
        x = tf1.placeholder(tf.float32, [None, 4, 4, 2], name="x")
        scale = tf1.get_variable("scale", initializer=np.ones([2], np.float32))

        def layer(i, h):
            y, _, _ = tf1.nn.fused_batch_norm(h, scale, tf.zeros([2]), is_training=True)
            return i + 1, y
        _, h = tf1.while_loop(lambda i, h: i < 2, layer, [tf.constant(0), x])

        def normalized():
            with tf1.variable_scope("own"):
                mean, var = tf.nn.moments(h, [0, 1, 2])
                return (h - mean) * tf.math.rsqrt(var + 1e-3)
        h = tf1.cond(tf.reduce_mean(x) > 0, normalized, lambda: h)
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(h)))
        init = tf1.global_variables_initializer()
    config = {"batch_norm": "synchronized"} if synchronized else {}
    with pn.get_runner(g, local(2), config) as runner:
        runner.run(init)
        runner.run(train, {x: np.ones((4, 4, 4, 2), np.float32)})
    said = capsys.readouterr().err
    assert "fused batch normalization ['while/FusedBatchNormV3'] normalizes each " \
        "replica's rows by their own mean and variance, batch_norm: synchronized " \
        "notwithstanding: it runs inside a while loop" in said, said
    assert "fused=False makes it the global batch's" in said
    assert "(batch_norm: per_replica, the default)" not in said, said
    assert "['cond/own'] normalizes each replica's rows by their own mean and variance, " \
        "batch_norm: synchronized notwithstanding: its statistics are computed inside a " \
        "while loop or a tf.cond whose predicate each replica computes from its own data" \
        in said, said


@pytest.mark.parametrize("synchronized", [False, True])
def test_a_programs_own_mean_over_the_batch_applied_to_its_rows_is_named(synchronized, capsys):
    """Statistics not of tf.nn.moments' form of what the variables compute
    (a centring by the batch's mean without a StopGradient, and its
    largest value scaling it): each replica takes its own rows', named in
    a line, but for the mean under batch_norm: synchronized, which is
    exchanged with its gradient; a loss's mean over the batch, a layer norm's over
    the features and a metric's are not; a reward's baseline (the data's
    alone) is the job's, exchanged (transforms/extremes.py: before, named
    with the others)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        reward = tf1.placeholder(tf.float32, [None], name="reward")
        h = tf1.layers.dense(x, 3)
        h = h - tf.reduce_mean(h, 0, name="centre")
        h = h / tf.reduce_max(tf.abs(h), 0, name="largest")
        h = (h - tf.reduce_mean(h, -1, keepdims=True)) * 2.0            # over the features
        advantage = reward - tf.reduce_mean(reward, name="baseline")
        loss = tf.reduce_mean(tf.reduce_sum(tf.square(h), 1) * advantage, name="loss")
        tf1.metrics.mean(tf.reduce_mean(h, 0))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    _, _, other = normalization.found(g, sources(g))
    assert other == ["centre", "largest"]
    assert [op.name for op in normalization.data_statistics(g, sources(g))] == ["baseline"]
    pn.get_runner(g, local(2), {"batch_norm": "synchronized"} if synchronized else {}).close()
    said = capsys.readouterr().err
    named = "['largest']" if synchronized else "['centre', 'largest']"    # (a mean: exchanged)
    assert f"statistics over the batch's axis {named} are applied to the batch's rows" in said, \
        said


SUMS = ("l2 over the batch", "masked mean", "weighted moments", "weighted by the data",
        "over the rows' count")


def sums(kind, z, x):
    """`z` normalized by sums over the batch: tf.nn.l2_normalize over its
    axis, a mean over the rows a mask keeps (the mask's sum a count),
    tf.nn.weighted_moments (its quotients by tf.math.divide_no_nan), a mean
    weighted by the data (their sum a statistic of the data), a mean and
    an unbiased variance by hand over the rows' count (`sum / n`, `/ (n -
    1)`: one n, the job's sum of the replicas')."""
    mask = tf.cast(x[:, :1] > 0, tf.float32)
    if kind == "l2 over the batch":
        return 4.0 * tf.nn.l2_normalize(z, axis=0)
    if kind == "masked mean":
        return z - tf.reduce_sum(z * mask, 0) / (tf.reduce_sum(mask, 0) + 1e-3)
    if kind == "weighted moments":
        mean, variance = tf.nn.weighted_moments(z, [0], mask, keepdims=True)
        return (z - mean) / tf.sqrt(variance + 1e-3)
    if kind == "over the rows' count":
        n = tf.cast(tf.shape(z)[0], tf.float32)
        mean = tf.reduce_sum(z, 0, keepdims=True) / n
        variance = tf.reduce_sum(tf.square(z - mean), 0, keepdims=True) / (n - 1.0)
        return (z - mean) / tf.sqrt(variance + 1e-3)
    weights = tf.square(x[:, :1]) + 0.1
    return z - tf.reduce_sum(z * weights, 0) / tf.reduce_sum(weights, 0)


def own_statistics(kind, batch):
    """A program's own normalization over the batch, trained by Adam: a
    standardization by hand (`(z - mean) / std`, means kept as [1, d] or
    [d], tf.math.reduce_std), Barlow Twins (the cross-correlation of two
    views' standardized embeddings over the batch, its diagonal pulled to
    1 and the rest to 0) and VICReg (a hinge on each feature's deviation
    over the batch, and its covariance off the diagonal)."""
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(5)
        xs = rng.randn(64, 5).astype(np.float32)
        data = (xs, xs + 0.2 * rng.randn(64, 5).astype(np.float32), rng.randint(0, 3, 64))
        ds = pn.shard(tf.data.Dataset.from_tensor_slices(data))
        x, x2, y = tf1.data.make_one_shot_iterator(ds.batch(batch).repeat()).get_next()
        w = tf1.get_variable("w", initializer=(np.arange(20).reshape(5, 4) / 20 - 0.3).astype(
            np.float32))
        out = tf1.get_variable("out", initializer=np.linspace(-1, 1, 12, dtype=np.float32)
                               .reshape(4, 3))
        z1, z2 = tf.matmul(x, w), tf.matmul(x2, w)
        n = tf.cast(tf.shape(z1)[0], tf.float32)
        keep = kind == "kept dimensions"

        def standardized(z):
            centred = z - tf.reduce_mean(z, 0, keepdims=keep)
            return centred / tf.sqrt(tf.reduce_mean(tf.square(centred), 0, keepdims=keep) + 1e-3)
        if kind == "barlow twins":
            c = tf.matmul(standardized(z1), standardized(z2), transpose_a=True) / n
            diagonal = tf.linalg.diag_part(c)
            loss = tf.reduce_sum(tf.square(1.0 - diagonal)) + 0.05 * (
                tf.reduce_sum(tf.square(c)) - tf.reduce_sum(tf.square(diagonal)))
        elif kind == "vicreg":
            centred = z1 - tf.reduce_mean(z1, 0)
            covariance = tf.matmul(centred, centred, transpose_a=True) / n
            loss = tf.reduce_mean(tf.square(z1 - z2)) + tf.reduce_mean(tf.nn.relu(
                1.0 - tf.sqrt(tf.math.reduce_variance(z1, 0) + 1e-4))) + 0.1 * tf.reduce_sum(
                tf.square(covariance * (1.0 - tf.eye(4))))
        elif kind in SUMS:
            h = sums(kind, z1, x)
        else:
            h = (z1 - tf.reduce_mean(z1, 0)) / (tf.math.reduce_std(z1, 0) + 1e-3) \
                if kind == "reduce_std" else standardized(z1)
        if kind not in ("barlow twins", "vicreg"):
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(tf.nn.relu(h), out)))
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "loss": loss, "init": init}


@pytest.mark.parametrize("kind", ["by hand", "kept dimensions", "reduce_std", "barlow twins",
                                  "vicreg", *SUMS])
def test_a_programs_own_normalization_is_the_global_batchs_synchronized(kind, capsys):
    """Under batch_norm: synchronized its means over the batch are the
    job's, forward and backward, as tf.nn.moments' are, and its sums
    (`sums`) the job's sums both ways, with the data's sums that divide
    them: every weight and Adam slot equals one device's after 4 steps
    (1e-5), with no line (before: named, 0.1 apart; Barlow Twins' and
    VICReg's 0.45 and 0.06; the sums 0.05 to 1, weighted_moments and the
    masked mean silently). By default each replica standardizes its own
    rows, and a line says so."""
    build = lambda b: own_statistics(kind, b)     # noqa: E731
    parallel, single, names = train_both(build, 2, 4, config={"batch_norm": "synchronized"})
    assert {"w", "w/Adam", "w/Adam_1"} <= set(names)
    assert worst(parallel, single, names) <= 1e-5
    said = capsys.readouterr().err
    assert "parallax_ng:" not in said, said
    parallel, single, names = train_both(build, 2, 4)
    assert worst(parallel, single, names) > 1e-4
    said = capsys.readouterr().err
    assert "statistics over the batch's axis" in said and "batch_norm: synchronized makes " \
        "means and sums over the batch the global batch's" in said, said


def test_a_weighted_means_total_weight_stays_with_its_sum_by_default():
    """By default a mean weighted by the data (`sum(z * w) / sum(w)`) is
    each replica's: the total weight, a statistic of the data alone, stays
    the replica's as the weighted sum does (before: it was made the job's
    alone, so each replica's mean was half its own, and the loss 0.1 from
    what the line said). The first step's loss on 2 replicas is the mean
    of one device's on each half of the batch."""
    def build():
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 5], "x")
            y = tf1.placeholder(tf.int32, [None], "y")
            w = tf1.get_variable("w", initializer=np.linspace(-1, 1, 20, dtype=np.float32)
                                 .reshape(5, 4))
            out = tf1.get_variable("out", initializer=np.linspace(-1, 1, 12, dtype=np.float32)
                                   .reshape(4, 3))
            z = tf.matmul(x, w)
            h = sums("weighted by the data", z, x)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(tf.nn.relu(h), out)))
            tf1.train.AdamOptimizer(0.05).minimize(loss)
            init = tf1.global_variables_initializer()
        return g, x, y, loss, init
    rng = np.random.RandomState(3)
    xs, ys = rng.randn(8, 5).astype(np.float32), rng.randint(0, 3, 8)
    g, x, y, loss, init = build()
    with pn.get_runner(g, local(2)) as runner:
        runner.run(init)
        got = runner.run(loss, {x: xs, y: ys})
    g1, x1, y1, loss1, init1 = build()
    with tf1.Session(graph=g1) as sess:
        sess.run(init1)
        halves = [sess.run(loss1, {x1: xs[4 * k:4 * k + 4], y1: ys[4 * k:4 * k + 4]})
                  for k in range(2)]
        whole = sess.run(loss1, {x1: xs, y1: ys})
    assert abs(got - np.mean(halves)) <= 1e-6 and abs(got - whole) > 1e-4


@pytest.mark.parametrize("by", ["means", "the rows' count"])
@pytest.mark.parametrize("legacy", ["0", "1"])
def test_barlow_twins_in_a_pn_function_step_equal_one_device_synchronized(legacy, by, capsys,
                                                                          monkeypatch):
    """Barlow Twins in a GradientTape step (a Keras 3 or tf_keras Dense, no
    bias: its gradient would be rounding noise that Adam scales up): the
    tape's scope holds every Mean's gradient, each told by the count it
    divides by (its Mean's input's); 4 steps on 2 replicas equal one
    device, weights and Adam's slots (1e-5), with no line (before: named,
    0.33 apart). Standardized by Sums over the rows' count (`sum / n`,
    `/ (n - 1)`): the mean's Sum's gradient is the one spread over its
    input's shape, not the variance's, whose shape reads n through the
    mean (before: both taken for it, and the Sum named, 0.18 apart)."""
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy)
    import keras
    import tf_keras
    lib = tf_keras if legacy == "1" else keras

    def standardized(z):
        if by == "the rows' count":
            n = tf.cast(tf.shape(z)[0], tf.float32)
            centred = z - tf.reduce_sum(z, 0) / n
            return centred / tf.sqrt(tf.reduce_sum(tf.square(centred), 0) / (n - 1.0) + 1e-3)
        centred = z - tf.reduce_mean(z, 0)
        return centred / tf.sqrt(tf.reduce_mean(tf.square(centred), 0) + 1e-3)

    def make():
        lib.utils.set_random_seed(1)
        dense, optimizer = lib.layers.Dense(4, use_bias=False), lib.optimizers.Adam(0.05)
        dense.build((None, 5))

        def step(x, x2):
            with tf.GradientTape() as tape:
                c = tf.matmul(standardized(dense(x)), standardized(dense(x2)),
                              transpose_a=True) / tf.cast(tf.shape(x)[0], tf.float32)
                diagonal = tf.linalg.diag_part(c)
                loss = tf.reduce_sum(tf.square(1.0 - diagonal)) + 0.05 * (
                    tf.reduce_sum(tf.square(c)) - tf.reduce_sum(tf.square(diagonal)))
            grads = tape.gradient(loss, dense.trainable_variables)
            optimizer.apply_gradients(zip(grads, dense.trainable_variables))
            return loss
        return dense, optimizer, step
    (dense, optimizer, fn), (dense1, optimizer1, fn1) = make(), make()
    step = pn.function(fn, local(2), {"batch_norm": "synchronized"})
    ref = tf.function(fn1)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x = rng.normal(size=(8, 5)).astype(np.float32)
        x2 = x + 0.2 * rng.normal(size=x.shape).astype(np.float32)
        np.testing.assert_allclose(step(x, x2), ref(x, x2).numpy(), atol=1e-5, rtol=0)
    step.sync()
    for a, b in zip(dense.weights + list(optimizer.variables),
                    dense1.weights + list(optimizer1.variables)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert "parallax_ng:" not in capsys.readouterr().err


@pytest.mark.parametrize("batch_norm", ["per_replica", "synchronized"])
def test_keras3_masked_batch_normalization(batch_norm, capsys, monkeypatch):
    """Keras 3's BatchNormalization given a mask (after an Embedding with
    mask_zero) computes its statistics from sums over the rows the mask
    keeps (the mask broadcast to the rows' shape, its sum the count), not
    tf.nn.moments. Under synchronized the sums are the job's, forward and
    backward, the count with them: 3 steps of a pn.function step on 2
    replicas equal one device, weights, moving statistics and slots
    (1e-5), with no line (before: named, 0.03 apart). By default each
    replica's, and a line names them."""
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0")
    import keras

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                  keras.layers.Embedding(10, 4, mask_zero=True),
                                  keras.layers.BatchNormalization(),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        return model, keras.optimizers.Adam(0.05)
    (model, optimizer), (model1, optimizer1) = make(), make()
    step = pn.function(step_of(model, optimizer), local(2), {"batch_norm": batch_norm})
    ref = tf.function(step_of(model1, optimizer1))
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = rng.integers(1, 10, (8, 3)).astype(np.int32)
        ids[:, 1:] *= rng.random((8, 2)) < 0.5          # padding
        y = rng.normal(size=(8, 1)).astype(np.float32)
        step(ids, y)
        ref(ids, y)
    step.sync()
    worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        model.weights + list(optimizer.variables), model1.weights + list(optimizer1.variables)))
    said = capsys.readouterr().err
    if batch_norm == "synchronized":
        assert worst <= 1e-5 and "parallax_ng:" not in said, (worst, said)
    else:
        assert worst > 1e-4 and "statistics over the batch's axis" in said and \
            "batch_normalization" in said, (worst, said)


@pytest.mark.parametrize("batch_norm", ["per_replica", "synchronized"])
def test_tf_keras_layer_normalizations_fused_kernel_is_no_batch_normalization(batch_norm,
                                                                             capsys):
    """tf_keras's LayerNormalization computes its statistics with
    FusedBatchNormV3 on its input reshaped to [1, rows, features, 1]
    (NCHW): a statistic per row, over the features. No line names it as
    batch normalization (before: "normalizes each replica's rows by
    their own mean and variance ... not equal") nor the loss as of
    unknown form (graph/rows.py follows the rows through the reshapes),
    and `fit` equals one device either way."""
    import tf_keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=(64,)).astype(np.int32)    # a loss that reads the logits' rows

    def make():
        model = tf_keras.Sequential([
            tf_keras.Input((6, 5)), tf_keras.layers.Dense(8),
            tf_keras.layers.LayerNormalization(), tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(3)])
        model.compile(tf_keras.optimizers.Adam(0.01),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    fit_equal(tf_keras, make, x, y, {"batch_norm": batch_norm})
    said = capsys.readouterr().err
    assert "normaliz" not in said and "FusedBatchNormV3" not in said, said
    assert "does not show whether the loss" not in said, said     # its rows are followed


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_a_loss_that_ignores_a_class_is_not_named_a_normalization(lib, capsys):
    """A sparse cross-entropy with `ignore_class`: tf_keras weighs the valid
    tokens by all over their count, a sum of the mask over the batch (a
    count the data sets, shared as a masked mean's), not a statistic of
    the rows' values. `fit` equals one device (the replicas' valid counts
    differ), and no line names the count a normalization of the
    program's own (before, under tf_keras: "means over the batch's axis
    ['sparse_categorical_crossentropy/Sum'] ... not equal")."""
    import importlib
    k = importlib.import_module(lib)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 30, size=(64, 7)).astype(np.int32)
    labels = rng.integers(0, 4, size=(64, 7)).astype(np.int32)
    labels[:32] *= rng.random((32, 7)) < 0.3      # replica 0's part: mostly ignored

    def make():
        model = k.Sequential([k.Input((7,), dtype="int32"), k.layers.Embedding(30, 6),
                              k.layers.Dense(4)])
        model.compile(k.optimizers.Adam(0.05), k.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=0))
        return model
    fit_equal(k, make, ids, labels, {})
    said = capsys.readouterr().err
    assert "statistics over the batch's axis" not in said, said


def test_an_optimizers_means_over_an_embeddings_rows_are_not_named_a_normalization(capsys):
    """Keras 3's Adafactor factors a 2-D slot by its rows' and columns'
    means; on an embedding, whose update reads its slots at the gradient's
    rows (the batch's ids), the column means are over those rows. That is
    the update's math on the job's aggregated gradient, not a statistic of
    a replica's rows: no line (before: "means over the batch's axis
    ['adafactor/Sum'] ... not equal"), and `fit` equals one device."""
    import keras
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(64, 3)).astype(np.int32)
    y = rng.normal(size=(64, 1)).astype(np.float32)

    def make():
        model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(50, 4),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adafactor(0.01), "mse")
        return model
    fit_equal(keras, make, ids, y, {})
    said = capsys.readouterr().err
    assert "statistics over the batch's axis" not in said, said


def fit_equal(k, make, x, y, config):
    """Two equal seeded models of Keras module `k` fitted 2 epochs with
    batch 16, one on 2 replicas with `config`: every weight, optimizer
    variable and epoch loss equal, 1e-5. Returns (parallel, single)."""
    from test_tf2 import check_equal
    k.utils.set_random_seed(0)
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    pn.parallelize(parallel, local(2), config)
    h1, h2 = (m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
              for m in (parallel, single))
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=1e-5, rtol=0)
    check_equal((parallel, parallel.optimizer), (single, single.optimizer))
    return parallel, single


def recurrent_cell_model(norm):
    """tf_keras: an RNN over a cell that normalizes its Dense output with
    `norm` (a layer class), and a classifier."""
    import tf_keras
    layers = tf_keras.layers

    class Cell(layers.Layer):
        state_size = output_size = 5

        def build(self, shape):
            self.dense, self.norm = layers.Dense(5), norm()

        def call(self, x, states, training=None):
            h = self.norm(self.dense(tf.concat([x, states[0]], -1)), training=training)
            return h, [h]
    model = tf_keras.Sequential([tf_keras.Input((6, 4)), layers.RNN(Cell()), layers.Dense(3)])
    model.compile(tf_keras.optimizers.Adam(0.01),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def cell_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 6, 4)).astype(np.float32), rng.integers(0, 3, 64)


def test_a_layer_normalization_in_a_recurrent_cell_equals_one_device_synchronized(capsys):
    """tf_keras's LayerNormalization (a fused kernel on [1, rows, features,
    1]) inside an RNN cell, under `batch_norm: synchronized`: the traced
    step's loop is a v1 loop imported without loop contexts; the kernel
    stays fused there (graph/fused_norm.py finds the loop from its
    Enters). Before: lowered with constants outside the loop's frame, and
    the step failed ("has inputs from different frames")."""
    import tf_keras
    x, y = cell_data()
    models = fit_equal(tf_keras, lambda: recurrent_cell_model(
        tf_keras.layers.LayerNormalization), x, y, {"batch_norm": "synchronized",
                                                     "communication": {"timeout_seconds": 60}})
    parallel, single = (m.evaluate(x, y, batch_size=16, verbose=0) for m in models)
    assert abs(parallel - single) < 1e-5
    assert "does not show whether the loss" not in capsys.readouterr().err


@pytest.mark.parametrize("batch_norm", ["per_replica", "synchronized"])
def test_batch_normalization_in_a_recurrent_cell_is_named_and_trains(batch_norm):
    """tf_keras's BatchNormalization inside an RNN cell: its moving
    statistics (and, synchronized, its sums) are computed every turn of
    the loop, where an exchange (once a step) cannot follow. A warning
    names them, each replica keeps its own, and `fit` trains. Before:
    the exchange inside the loop waited until the run's timeout (5
    minutes, then DeadlineExceededError), either way."""
    import tf_keras
    x, y = cell_data()
    model = recurrent_cell_model(tf_keras.layers.BatchNormalization)
    pn.parallelize(model, local(2), {"batch_norm": batch_norm,
                                     "communication": {"timeout_seconds": 60}})
    said = r"moving_mean.* are written inside a tf.while_loop's body" if \
        batch_norm == "per_replica" else r"values .*moments.* that the replicas would exchange"
    with pytest.warns(UserWarning, match=said):
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
