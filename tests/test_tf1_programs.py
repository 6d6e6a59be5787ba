"""Training programs as tf.compat.v1 scripts write them, beyond one
`minimize` run per step: a GAN (two optimizers over disjoint var_lists,
their train ops run in turn, each run taking its own batch; the noise from
an iterator of its own; or one train
op, the generator's loss read after the discriminator's update), wide & deep
(FTRL for the wide part and Adagrad for the deep part, grouped into one
train op), two models with their own iterators, tables and train ops,
run in turn, fine-tuning (a frozen layer left out of var_list, a
`trainable=False` table, a `stop_gradient`), evaluation runs of the
loss alone between training steps, a recurrent layer written as a loop
over time and a convnet, each with a loss summed over the batch (the
loop in both of TF1's forms). 2 replicas against one device with the
global batch: every variable and slot within 1e-5 after the schedule, and
every fetched loss (averaged over the replicas) within 1e-5 of one
device's, in each run option."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local, read_name, train_both, variable_names

tf1 = tf.compat.v1
TOL = 1e-5
# and relative to the value: an Adagrad accumulator of a summed loss reaches
# 32, where float32's spacing is 3.8e-6 and the CPU's matmul order differs
RTOL = 1e-6
N_EX = 384
REPLICAS = 2


def dataset(batch):
    rng = np.random.RandomState(11)
    real = (rng.randn(N_EX, 4) * [1.0, 0.5, 2.0, 0.3] + [0.5, -1.0, 0.0, 2.0]).astype(np.float32)
    noise = rng.randn(N_EX, 3).astype(np.float32)
    ids = rng.randint(0, 40, size=(N_EX, 3)).astype(np.int64)
    label = (rng.rand(N_EX) > 0.5).astype(np.float32)
    ds = pn.shard(tf.data.Dataset.from_tensor_slices((real, noise, ids, label)))
    return tf1.data.make_one_shot_iterator(ds.batch(batch).repeat()).get_next()


def dense(x, units, name, act=None, seed=0, trainable=True):
    rng = np.random.RandomState(seed)
    k = rng.randn(int(x.shape[-1]), units).astype(np.float32) * 0.4
    with tf1.variable_scope(name):
        kernel = tf1.get_variable("kernel", initializer=k, trainable=trainable)
        bias = tf1.get_variable("bias", initializer=np.zeros(units, np.float32),
                                trainable=trainable)
    y = tf.matmul(x, kernel) + bias
    return act(y) if act else y


def generator(z):
    with tf1.variable_scope("gen", reuse=tf1.AUTO_REUSE):
        return dense(dense(z, 8, "h", tf.nn.relu, 1), 4, "out", seed=2)


def discriminator(x):
    with tf1.variable_scope("disc", reuse=tf1.AUTO_REUSE):
        return dense(dense(x, 8, "h", tf.nn.leaky_relu, 3), 1, "out", seed=4)


def gan(batch):
    """A GAN: the discriminator's and the generator's Adam (beta1 0.5)
    over their own scopes' variables; a step runs `d_train`, then
    `g_train` (which counts the global step)."""
    g = tf.Graph()
    with g.as_default():
        real, noise, _, _ = dataset(batch)

        fake = generator(noise)
        d_real, d_fake = discriminator(real), discriminator(fake)
        bce = tf1.losses.sigmoid_cross_entropy
        d_loss = bce(tf.ones_like(d_real), d_real) + bce(tf.zeros_like(d_fake), d_fake)
        g_loss = bce(tf.ones_like(d_fake), d_fake)
        step = tf1.train.get_or_create_global_step()
        d_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "disc")
        g_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "gen")
        d_train = tf1.train.AdamOptimizer(0.02, beta1=0.5).minimize(d_loss, var_list=d_vars)
        g_train = tf1.train.AdamOptimizer(0.02, beta1=0.5).minimize(
            g_loss, var_list=g_vars, global_step=step)
        init = tf1.global_variables_initializer()
    schedule = [[("d_train", "d_loss")], [("g_train", "g_loss")]]
    return g, dict(d_train=d_train, g_train=g_train, d_loss=d_loss, g_loss=g_loss,
                   init=init), schedule


def gan_apart(batch):
    """The GAN with the generator's noise from an iterator of its own:
    `g_train` reads no real batch. (Its gradients and the
    discriminator's once travelled in one bucket, so either train op
    computed both and `g_train` took a real batch, skipping it.)"""
    g = tf.Graph()
    with g.as_default():
        real, _, _, _ = dataset(batch)
        _, noise, _, _ = dataset(batch)
        d_real, d_fake = discriminator(real), discriminator(generator(noise))
        bce = tf1.losses.sigmoid_cross_entropy
        d_loss = bce(tf.ones_like(d_real), d_real) + bce(tf.zeros_like(d_fake), d_fake)
        g_loss = bce(tf.ones_like(d_fake), d_fake)
        d_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "disc")
        g_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "gen")
        d_train = tf1.train.AdamOptimizer(0.02, beta1=0.5).minimize(d_loss, var_list=d_vars)
        g_train = tf1.train.AdamOptimizer(0.02, beta1=0.5).minimize(g_loss, var_list=g_vars)
        init = tf1.global_variables_initializer()
    schedule = [[("d_train", "d_loss")], [("g_train", "g_loss")]]
    return g, dict(d_train=d_train, g_train=g_train, d_loss=d_loss, g_loss=g_loss,
                   init=init), schedule


def two_tables(batch):
    """Two models, each with its own iterator, two embedding tables (sparse
    rows), optimizer, global-norm clipping and train op, run in turn.
    (Their all-gathered rows once travelled together, and a profiled step
    read both models' ids: either run took the other's batch.)"""
    g = tf.Graph()
    with g.as_default():
        rng, fetches = np.random.RandomState(4), {}
        for k, opt in enumerate((tf1.train.AdamOptimizer(0.02), tf1.train.AdagradOptimizer(0.1))):
            real, _, ids, label = dataset(batch)
            tables = [tf1.get_variable(f"emb{k}_{j}", initializer=rng.randn(40, 4).astype(
                np.float32)) for j in range(2)]
            rows = tf.reduce_sum(tf1.nn.embedding_lookup(tables[0], ids) *
                                 tf1.nn.embedding_lookup(tables[1], ids), 1)
            out = tf.squeeze(dense(tf.concat([rows, real], 1), 1, f"out{k}", seed=k), 1)
            loss = tf.reduce_mean(tf.square(out - label))
            trained = tables + tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, f"out{k}")
            grads, _ = tf.clip_by_global_norm(tf.gradients(loss, trained), 1.0)
            fetches.update({f"train{k}": opt.apply_gradients(zip(grads, trained)),
                            f"loss{k}": loss})
        init = tf1.global_variables_initializer()
    return g, dict(init=init, **fetches), [[("train0", "loss0")], [("train1", "loss1")]]


def gan_one_op(batch):
    """The GAN in one train op: the generator's loss built under a control
    dependency on the discriminator's update, so it reads the updated
    discriminator (the second stage of the step)."""
    g = tf.Graph()
    with g.as_default():
        real, noise, _, _ = dataset(batch)

        bce = tf1.losses.sigmoid_cross_entropy
        d_real, d_fake = discriminator(real), discriminator(generator(noise))
        d_loss = bce(tf.ones_like(d_real), d_real) + bce(tf.zeros_like(d_fake), d_fake)
        d_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "disc")
        g_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "gen")
        d_train = tf1.train.MomentumOptimizer(0.05, 0.5).minimize(d_loss, var_list=d_vars)
        with tf.control_dependencies([d_train]):
            d_after = discriminator(generator(noise))
            g_loss = bce(tf.ones_like(d_after), d_after)
        g_train = tf1.train.MomentumOptimizer(0.05, 0.5).minimize(
            g_loss, var_list=g_vars, global_step=tf1.train.get_or_create_global_step())
        init = tf1.global_variables_initializer()
    return g, dict(train=g_train, loss=g_loss, init=init), [[("train", "loss")]]


def wide_deep(batch):
    """Wide & deep: a linear weight per id (FTRL, sparse) beside an
    embedding and two dense layers (Adagrad), one train op grouping both
    updates and the global step's increment."""
    g = tf.Graph()
    with g.as_default():
        real, _, ids, label = dataset(batch)
        rng = np.random.RandomState(6)
        wide_w = tf1.get_variable("wide/w", initializer=np.zeros((40, 1), np.float32))
        wide = tf.reduce_sum(tf1.nn.embedding_lookup(wide_w, ids), [1, 2])
        emb = tf1.get_variable("deep/emb", initializer=rng.randn(40, 5).astype(np.float32))
        rows = tf.reduce_mean(tf1.nn.embedding_lookup(emb, ids), 1)
        with tf1.variable_scope("deep"):
            h = dense(tf.concat([rows, real], 1), 6, "h", tf.nn.relu, 7)
            deep = tf.squeeze(dense(h, 1, "out", seed=8), 1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=label,
                                                                      logits=wide + deep))
        step = tf1.train.get_or_create_global_step()
        wide_vars = [wide_w]
        deep_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "deep")
        grads = tf.gradients(loss, wide_vars + deep_vars)
        ftrl = tf1.train.FtrlOptimizer(0.1, l1_regularization_strength=0.001)
        adagrad = tf1.train.AdagradOptimizer(0.05)
        train = tf.group(ftrl.apply_gradients(zip(grads[:1], wide_vars)),
                         adagrad.apply_gradients(zip(grads[1:], deep_vars)),
                         tf1.assign_add(step, 1))
        init = tf1.global_variables_initializer()
    return g, dict(train=train, loss=loss, init=init), [[("train", "loss")]]


def fine_tune(batch):
    """Fine-tuning: a pretrained table that does not train (trainable=False),
    a first layer left out of var_list, a second layer read through
    stop_gradient on one path; momentum for what trains. Every third
    step, an evaluation run of the loss alone (it takes a batch, as one
    device's would)."""
    g = tf.Graph()
    with g.as_default():
        real, _, ids, label = dataset(batch)
        rng = np.random.RandomState(9)
        table = tf1.get_variable("pretrained", initializer=rng.randn(40, 4).astype(np.float32),
                                 trainable=False)
        rows = tf.reduce_mean(tf1.nn.embedding_lookup(table, ids), 1)
        frozen = dense(tf.concat([rows, real], 1), 6, "frozen", tf.nn.tanh, 10)
        head = dense(frozen, 6, "head", tf.nn.relu, 11)
        out = dense(head + tf.stop_gradient(head) * 0.5, 1, "out", seed=12)
        loss = tf.reduce_mean(tf.square(tf.squeeze(out, 1) - label))
        var_list = [v for v in tf1.trainable_variables() if not v.op.name.startswith("frozen")]
        train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(
            loss, var_list=var_list, global_step=tf1.train.get_or_create_global_step())
        init = tf1.global_variables_initializer()
    schedule = [[("train", "loss")], [("train", "loss")], [(None, "loss")]]
    return g, dict(train=train, loss=loss, init=init), schedule


def rnn_sum(batch, frames=False, time_major=False):
    """A recurrent layer written as dynamic_rnn writes it (time-major: a
    while loop reads each step's rows from a TensorArray and writes the
    state to another, stacked and transposed back) over an embedding, a
    projection by tensordot, and a loss summed over the batch and time
    (the replicas' gradients are summed). `frames`: the loop built with
    v1 control flow (Enter/Merge/Switch/Exit, as under
    `disable_v2_behavior`), else a functional While. `time_major`: the
    outputs stay time-major ([time, batch]) and the loss sums each time
    step's losses over the batch, then averages over time (still a sum
    over the batch)."""
    if frames:
        tf1.disable_control_flow_v2()
    try:
        g = tf.Graph()
        with g.as_default():
            _, _, ids, _ = dataset(batch)
            rng = np.random.RandomState(5)
            table = tf1.get_variable("emb", initializer=rng.randn(40, 4).astype(np.float32))
            w, u, out_w = (tf1.get_variable(n, initializer=rng.randn(*s).astype(np.float32)
                                            * 0.4) for n, s in (("w", (4, 6)), ("u", (6, 6)),
                                                                ("out", (6, 5))))
            x = tf.nn.embedding_lookup(table, ids)                # (batch, 3, 4)
            steps = tf.TensorArray(tf.float32, size=3).unstack(tf.transpose(x, [1, 0, 2]))

            def body(t, h, out):
                h = tf.tanh(tf.matmul(steps.read(t), w) + tf.matmul(h, u))
                return t + 1, h, out.write(t, h)
            _, _, out = tf1.while_loop(lambda t, *_: t < 3, body, [
                tf.constant(0), tf.zeros([tf.shape(x)[0], 6]), tf.TensorArray(tf.float32, 3)])
            if time_major:
                loss = tf.reduce_mean(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=tf.transpose(ids % 5), logits=tf.tensordot(out.stack(), out_w, 1)),
                    1))
            else:
                logits = tf.tensordot(tf.transpose(out.stack(), [1, 0, 2]), out_w, 1)
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=ids % 5, logits=logits))
            train = tf1.train.AdagradOptimizer(0.05).minimize(loss)
            init = tf1.global_variables_initializer()
    finally:
        if frames:
            tf1.enable_control_flow_v2()
    return g, dict(train=train, loss=loss, init=init), [[("train", "loss")]]


def cnn_sum(batch):
    """A small convnet (conv2d, max-pool, flattened, a dense head) whose
    loss sums over the batch (the replicas' gradients are summed), trained
    with momentum."""
    g = tf.Graph()
    with g.as_default():
        real, _, _, label = dataset(batch)
        rng = np.random.RandomState(6)
        kernel = tf1.get_variable("conv", initializer=rng.randn(2, 2, 1, 3).astype(np.float32))
        img = tf.nn.relu(tf.nn.conv2d(tf.reshape(real, [-1, 2, 2, 1]), kernel, 1, "SAME"))
        flat = tf.reshape(tf.nn.max_pool2d(img, 2, 1, "SAME"), [-1, 12])
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(label, tf.int32), logits=dense(flat, 2, "head", seed=7)))
        train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, dict(train=train, loss=loss, init=init), [[("train", "loss")]]


def run_schedule(run, h, schedule, rounds):
    """`rounds` times over the schedule: each entry one run of its train op
    (or none) with its loss; returns the losses fetched."""
    losses = []
    for _ in range(rounds):
        for entry in schedule:
            for train, loss in entry:
                fetches = [h[loss]] + ([h[train]] if train else [])
                losses.append(float(run(fetches)[0]))
    return losses


PROGRAMS = {"gan": gan, "gan-apart": gan_apart, "two-tables": two_tables,
            "gan-one-op": gan_one_op, "wide-deep": wide_deep,
            "fine-tune": fine_tune, "rnn-sum": rnn_sum,
            "rnn-sum-frames": lambda batch: rnn_sum(batch, frames=True),
            "rnn-sum-time-major": lambda batch: rnn_sum(batch, time_major=True),
            "cnn-sum": cnn_sum}
CASES = [(p, r) for p in PROGRAMS for r in ("hybrid", "allreduce", "ps")]


@pytest.mark.parametrize("program,run_option", CASES, ids=["-".join(c) for c in CASES])
def test_replicas_equal_one_device(program, run_option):
    equal_one_device(program, {"run_option": run_option})


def test_two_train_ops_updates_wait_for_no_later_run():
    """Horizontal scheduling defers an update to the next step's run; with
    two train ops that run is the other's, which reads the variables
    first: the plan says so and updates in the run (before, the generator
    read the discriminator before its update: 0.08 apart, silently)."""
    plan = equal_one_device("gan", {"run_option": "allreduce", "horizontal_scheduling": True})
    assert not plan.blocks and "the graph's train ops update apart" in plan.format()


JOB = """import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
import parallax_ng as pn
from models import read_name, variable_names
from test_tf1_programs import PROGRAMS, run_schedule
out, program, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
g, h, schedule = PROGRAMS[program](4)
reads = [read_name(v, g) for v in variable_names(g)]
with pn.get_runner(g, None, config) as runner:
    runner.run(h["init"])
    start = runner.run(reads)
    run_schedule(runner.run, h, schedule, 4)
    np.savez(out + "." + str(runner.plan.worker) + ".npz", *start, *runner.run(reads))
"""


@pytest.mark.parametrize("program,config", [
    ("gan-apart", {"run_option": "ps"}),
    ("two-tables", {"run_option": "hybrid", "dense_method": "bfb"})], ids=["ps", "bfb"])
def test_two_train_ops_in_a_job_with_a_server_equal_one_device(tmp_path, program, config):
    """2 workers and a server: each train op's push, take and barrier are
    its own (a push waited for the other train op's reads of the server's
    variables, reading its batch: 0.05 and 0.08 apart, silently): every worker's
    variables and slots equal one device's from worker 0's start."""
    import json
    import os
    from task_env import run_script_job
    tests = os.path.dirname(os.path.abspath(__file__))
    out = str(tmp_path / "vars")
    done = run_script_job(tmp_path, JOB.format(tests=tests), servers=1,
                          args=(out, program, json.dumps(config)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    g1, h1, schedule = PROGRAMS[program](8)
    names = variable_names(g1)
    workers = [np.load(f"{out}.{k}.npz") for k in range(2)]
    with tf1.Session(graph=g1) as sess:
        sess.run(h1["init"])
        load_values(sess, g1, {n: workers[0][f"arr_{i}"] for i, n in enumerate(names)})
        run_schedule(sess.run, h1, schedule, 4)
        single = sess.run([read_name(v, g1) for v in names])
    for w in workers:
        for i, n in enumerate(names):
            assert np.max(np.abs(w[f"arr_{len(names) + i}"] - single[i])) <= TOL, n


def equal_one_device(program, config):
    """`program` on REPLICAS replicas with `config` equals one device (every
    fetched loss, variable and slot); returns the plan."""
    build, rounds = PROGRAMS[program], 4
    g, h, schedule = build(4)
    names = variable_names(g)
    reads = [read_name(v, g) for v in names]
    with pn.get_runner(g, local(REPLICAS), config) as runner:
        runner.run(h["init"])
        start = runner.run(reads)
        losses = run_schedule(runner.run, h, schedule, rounds)
        parallel = dict(zip(names, runner.run(reads, per_replica=True)))
        plan = runner.plan
    g1, h1, _ = build(4 * REPLICAS)
    with tf1.Session(graph=g1) as sess:
        sess.run(h1["init"])
        load_values(sess, g1, dict(zip(names, start)))
        single_losses = run_schedule(sess.run, h1, schedule, rounds)
        single = dict(zip(names, sess.run(reads)))
    np.testing.assert_allclose(losses, single_losses, rtol=0, atol=TOL)
    worst = sorted(((float(np.max(np.abs(np.asarray(got) - single[n]) - RTOL * np.abs(single[n]))),
                     n, k) for n in names for k, got in enumerate(parallel[n])), reverse=True)
    assert worst[0][0] <= TOL, worst[:4]
    if program == "fine-tune":     # what does not train kept its starting value
        for n in ("pretrained", "frozen/kernel"):
            np.testing.assert_array_equal(single[n], start[names.index(n)])
    return plan


def test_two_train_ops_that_train_one_variable_are_refused_naming_it():
    """Multi-task training that runs two train ops in turn over a shared
    layer: the replicas aggregate one gradient per variable, so the build
    refuses it, naming the shared variable and its two updates."""
    g = tf.Graph()
    with g.as_default():
        real, _, _, label = dataset(4)
        shared = dense(real, 6, "shared", tf.nn.relu, 13)
        loss_a = tf.reduce_mean(tf.square(dense(shared, 1, "a", seed=14)[:, 0] - label))
        loss_b = tf.reduce_mean(tf.square(dense(shared, 1, "b", seed=15)[:, 0] - 1.0))
        tf1.train.AdamOptimizer(0.01).minimize(loss_a)
        tf1.train.AdamOptimizer(0.01).minimize(loss_b)
    with pytest.raises(pn.GraphError) as caught:
        pn.get_runner(g, local(REPLICAS), {"run_option": "allreduce"})
    assert "updates variable 'shared/kernel' 2 times" in str(caught.value), caught.value
    assert "two train ops that both train it" in str(caught.value)


def towers(reduce):
    """A multi-tower script's step on one device: the batch split into two
    towers by tf.split, each tower's loss (`reduce` of its squared errors)
    differentiated by compute_gradients, the towers' gradients averaged
    and applied (Momentum); float64."""
    def build(batch):
        g = tf.Graph()
        with g.as_default():
            rng = np.random.RandomState(0)
            x, y = rng.randn(128, 4), rng.randn(128, 1)
            ds = pn.shard(tf.data.Dataset.from_tensor_slices((x, y)))
            xb, yb = tf1.data.make_one_shot_iterator(ds.batch(batch).repeat()).get_next()
            w = tf1.get_variable("w", initializer=rng.randn(4, 1))
            opt = tf1.train.MomentumOptimizer(0.01, 0.9)
            grads = [opt.compute_gradients(reduce(tf.square(tf.matmul(xt, w) - yt)), [w])[0][0]
                     for xt, yt in zip(tf.split(xb, 2), tf.split(yb, 2))]
            train = opt.apply_gradients([(tf.add_n(grads) / 2, w)])
            init = tf1.global_variables_initializer()
        return g, {"init": init, "train": train}
    return build


@pytest.mark.parametrize("run_option", ["allreduce", "ps"])
@pytest.mark.parametrize("reduce", ["reduce_mean", "reduce_sum"])
def test_towers_of_a_split_batch_equal_one_device(reduce, run_option):
    """Each tower's rows are examples of the batch (graph/rows.py `parts`):
    a summed tower loss's gradients are summed over the replicas (before:
    averaged, with a line that the form was not shown; 8.3 apart after 5
    steps), a mean's averaged; 1e-12."""
    parallel, single, names = train_both(towers(getattr(tf, reduce)), REPLICAS, 5,
                                         config={"run_option": run_option}, batch=8)
    for name in names:
        for got in parallel[name]:
            np.testing.assert_allclose(got, single[name], atol=1e-12, rtol=0, err_msg=name)


@pytest.mark.parametrize("reduce", ["reduce_mean", "reduce_sum"])
def test_towers_of_a_fed_batch_equal_one_device(reduce):
    """The towers over fed placeholders: their rows are only split by
    position, so every replica is fed the whole batch (graph/batch.py) and
    a tower is one device's tower, not micro-batches of a replica's rows;
    the gradients stay averaged (graph/batch.py `split_as_parts`; read as
    micro-batches, the sum was 1.1 apart after 5 steps); 1e-12."""
    def build():
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float64, [None, 4], name="x")
            y = tf1.placeholder(tf.float64, [None, 1], name="y")
            w = tf1.get_variable("w", initializer=np.random.RandomState(0).randn(4, 1))
            opt = tf1.train.MomentumOptimizer(0.01, 0.9)
            grads = [opt.compute_gradients(getattr(tf, reduce)(tf.square(xt @ w - yt)), [w])[0][0]
                     for xt, yt in zip(tf.split(x, 2), tf.split(y, 2))]
            opt.apply_gradients([(tf.add_n(grads) / 2, w)], name="train")
            tf1.global_variables_initializer()
        return g
    rng = np.random.RandomState(1)
    feeds = [{"x:0": rng.randn(16, 4), "y:0": rng.randn(16, 1)} for _ in range(5)]
    with pn.get_runner(build(), local(REPLICAS), {"run_option": "allreduce"}) as runner:
        runner.run("init")
        for feed in feeds:
            runner.run("train", feed)
        parallel = runner.run("w/Read/ReadVariableOp:0", per_replica=True)
    with tf1.Session(graph=build()) as sess:
        sess.run("init")
        for feed in feeds:
            sess.run("train", feed)
        single = sess.run("w/Read/ReadVariableOp:0")
    for got in parallel:
        np.testing.assert_allclose(got, single, atol=1e-12, rtol=0)
