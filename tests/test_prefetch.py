"""Prefetch (EmbRace 4.2.2, vertical scheduling): a table cut by columns
(`alltoall`) whose gradient rows the next batch reads are exchanged and
applied first, the rest while the next step runs, equals one device.

Every variable and optimizer slot of every replica (the table read whole,
its parts joined, after the pending rows are applied) matches one device
with the total batch within 1e-5 (float32), in-process on 2 and 4 devices
and in 2x1 and 2x2 localhost jobs: SGD, Adagrad, Momentum, RMSProp and
Adam (whose delayed rows take their own step's bias corrections), moving
averages of the table, global-norm clipping (the delayed rows take their
step's clip scale), widths that do not divide by the replica count.
"""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import OPTIMIZERS, embedding_regression, local, read_name, train_both
from parallax_ng.errors import ConfigError
from test_cluster import assert_matches_one_device, run_job

TOL = 1e-5
CONFIG = {"run_option": "allreduce", "sparse_method": "alltoall", "prefetch": True}
CASES = [  # replicas, optimizer, model options
    (2, "sgd", {}),
    (2, "adam", {"ema": True, "random_table": True, "dim": 5, "clip": True}),
    (4, "adam", {"ema": True}),
    (4, "adagrad", {"dim": 6, "clip": True}),
    (2, "momentum", {"ema": True}),
    (4, "rmsprop", {"dim": 7}),
]


@pytest.mark.parametrize("n,optimizer,extras", CASES, ids=[
    f"{n}-{o}-{'-'.join(e) or 'plain'}" for n, o, e in CASES])
def test_replicas_match_one_device(n, optimizer, extras):
    seen = {}
    parallel, single, _ = train_both(lambda b: embedding_regression(b, optimizer, **extras),
                                     n, 8, config=CONFIG, seen=seen)
    assert seen["plan"].variables["emb"].prefetch
    for name, want in single.items():
        for k, got in enumerate(parallel[name]):
            diff = np.max(np.abs(np.asarray(got) - want))
            assert diff <= TOL, f"{name} on replica {k}: max abs diff {diff}"


def two_tables(batch, optimizer="adam"):
    """An input table looked up by int32 ids and an output table by int64
    ids (as a sampled softmax's weights are), each its own pending step."""
    tf1 = tf.compat.v1
    rng = np.random.RandomState(3)
    ids = rng.randint(0, 40, size=(64, 3)).astype(np.int32)
    out = rng.randint(0, 30, size=(64, 2)).astype(np.int64)
    y = rng.randn(64).astype(np.float32)
    g = tf.Graph()
    with g.as_default():
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((ids, out, y))).batch(batch).repeat()
        it = tf1.data.make_initializable_iterator(ds)
        a, b, t = it.get_next()
        emb = tf1.get_variable("emb", initializer=rng.randn(40, 5).astype(np.float32))
        soft = tf1.get_variable("soft", initializer=rng.randn(30, 5).astype(np.float32))
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, a), 1)
        w = tf.nn.embedding_lookup(soft, b)
        pred = tf.reduce_sum(w * h[:, None, :], [1, 2])
        loss = tf.reduce_mean(tf.square(pred - t))
        train = OPTIMIZERS[optimizer]().minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        init = tf1.global_variables_initializer()
    return g, {"train": train, "init": init, "iterator_init": it.initializer}


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_two_tables_each_wait_apart(optimizer):
    seen = {}
    parallel, single, _ = train_both(lambda b: two_tables(b, optimizer), 2, 6, config=CONFIG,
                                     seen=seen)
    assert seen["plan"].variables["emb"].prefetch and seen["plan"].variables["soft"].prefetch
    for name, want in single.items():
        for k, got in enumerate(parallel[name]):
            assert np.max(np.abs(np.asarray(got) - want)) <= TOL, f"{name} on replica {k}"


def test_a_read_between_steps_sees_every_update():
    """A run that is not a training step applies the pending rows first: the
    table read after each step is the one-device table of that step."""
    g, h = embedding_regression(4, "adam", ema=True)
    g1, h1 = embedding_regression(8, "adam", ema=True)
    with pn.get_runner(g, local(2), CONFIG) as runner, tf.compat.v1.Session(graph=g1) as sess:
        runner.run([h["init"], h["iterator_init"]])
        sess.run([h1["init"], h1["iterator_init"]])
        for _ in range(4):
            runner.run(h["train"])
            sess.run(h1["train"])
            for var in ("emb", "emb/Adam", "emb/ExponentialMovingAverage"):
                got = runner.run(read_name(var, g))
                want = sess.run(read_name(var, g1))
                assert np.max(np.abs(got - want)) <= TOL, var


def test_the_plan_says_where_prefetch_applies():
    """On with alltoall (clipping too); off, with the reason, where rows are
    not summed before they leave a replica or the method is not alltoall."""
    g, _ = embedding_regression(4, "adam", clip=True)
    text = pn.transform_plan(g, local(2), CONFIG).format()
    assert "prefetch (gradient rows the next batch reads sent first" in text
    plan = pn.transform_plan(g, local(2), {**CONFIG, "coalesce_rows": False})
    assert not plan.variables["emb"].prefetch
    assert plan.variables["emb"].note == \
        "no prefetch: it needs coalesce_rows and distinct_lookups"
    plan = pn.transform_plan(g, local(2), {**CONFIG, "sparse_method": "allgather"})
    assert plan.variables["emb"].note == "no prefetch: it applies to alltoall, not allgather"


@pytest.mark.parametrize("workers,devices", [(2, 1), (2, 2)])
def test_workers_match_one_device(tmp_path, workers, devices):
    """Adam, global-norm clipping, moving averages of every weight, the
    table cut over every replica of the job, its update split over steps."""
    done, out, _ = run_job(tmp_path, workers, devices, "10", "--run-option", "allreduce",
                           "--config", '{"sparse_method": "alltoall", "prefetch": true}')
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker 1: prefetch ['emb']" in done.stdout
    assert_matches_one_device(out, workers, devices)


def test_prefetch_must_be_true_or_false():
    g, _ = embedding_regression(4)
    with pytest.raises(ConfigError, match="config key 'prefetch' must be true or false"):
        pn.get_runner(g, local(2), {**CONFIG, "prefetch": "yes"})
