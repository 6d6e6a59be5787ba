"""Coalesced rows: a sparse gradient leaves a worker with each distinct row
once, where every use of it sums rows anyway."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import embedding_regression, local, train_both
from parallax_ng.graph import frontend
from parallax_ng.planning.coalescing import coalescing, lookups

tf1 = tf.compat.v1


def job(workers: int, servers: int) -> dict:
    return {"hosts": [{"address": "127.0.0.1", "devices": ["cpu:0"]}] * workers,
            "ps": ["127.0.0.1"] * servers}


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])
def test_optimizer_uses_sum_rows_and_the_global_norm_is_named(optimizer):
    g, _ = embedding_regression(4, optimizer, clip=True)
    assert coalescing(frontend.load(g), "emb") == ("global_norm/L2Loss",)
    g, _ = embedding_regression(4, optimizer)
    assert coalescing(frontend.load(g), "emb") == ()


def test_a_use_that_sees_single_rows_keeps_them():
    """A histogram-like use (the sum of squared values) of the raw rows, and
    an L2Loss of scaled rows, would change if duplicates were summed."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        emb = tf1.get_variable("emb", [10, 2])
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids))
        opt = tf1.train.GradientDescentOptimizer(0.1)
        (grad, var), = opt.compute_gradients(loss)
        tf.reduce_sum(tf.square(grad.values), name="rows_squared")
        opt.apply_gradients([(grad, var)])
    tg = frontend.load(g)
    assert coalescing(tg, "emb") is None
    assert not pn.transform_plan(g, local(2)).variables["emb"].coalesce
    g2 = tf.Graph()
    with g2.as_default():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        emb = tf1.get_variable("emb", [10, 2])
        opt = tf1.train.GradientDescentOptimizer(0.1)
        (grad, var), = opt.compute_gradients(tf.reduce_sum(tf.nn.embedding_lookup(emb, ids)))
        tf.nn.l2_loss(grad.values * 2.0, name="scaled_norm")
        opt.apply_gradients([(grad, var)])
    assert coalescing(frontend.load(g2), "emb") is None


def test_the_plan_coalesces_sparse_rows_and_can_be_told_not_to():
    g, _ = embedding_regression(4, "adam", clip=True)
    plan = pn.transform_plan(g, local(2))
    assert plan.variables["emb"].coalesce
    assert "each distinct row sent once (duplicates summed first): emb" in plan.format()
    assert not pn.transform_plan(g, local(2), {"coalesce_rows": False}).variables["emb"].coalesce
    gathered = pn.transform_plan(g, local(2), {"run_option": "allreduce"}).variables["emb"]
    assert gathered.method == "allgather" and gathered.coalesce
    assert not pn.transform_plan(g, local(2)).variables["dense/w"].coalesce


def test_each_replica_gathers_its_distinct_rows_and_the_norm_is_summed():
    from passkit import context, run_passes
    from transforms import AggregatePass, ReplicatePass
    ctx = context(2, "adam", graph=embedding_regression(4, "adam", clip=True)[0],
                  run_option="allreduce")
    ir = run_passes(ctx, ReplicatePass(), AggregatePass())
    scope = "parallax/allgather/emb"
    for k in range(2):
        assert ir.node(f"{scope}/replica_{k}/rows/coalesced").op == "UnsortedSegmentSum"
    norm = ir.node("global_norm/L2Loss")
    assert norm.op == "CollectiveReduce" or any(
        i.startswith(f"{scope}/norm") for i in ir.node("global_norm/stack").input)


def test_a_worker_pushes_distinct_rows_and_its_part_of_the_norm():
    g, _ = embedding_regression(4, "adam", clip=True)
    plan = pn.transform_plan(g, job(2, 1), {"dense_method": "bfb"})   # one run per step
    from dataclasses import replace
    ir, _, _ = pn.transform(g, plan=replace(plan, worker=1))
    push = ir.node("parallax/server_sync/push_0")
    assert {"parallax/ps/emb/coalesced", "parallax/ps/emb/distinct",
            "parallax/ps/emb/norm"} <= set(push.input)
    assert ir.node("parallax/ps/emb/coalesced").op == "UnsortedSegmentSum"
    # the other workers need the job's norm (it clips their dense gradients), not its rows
    take = ir.node("parallax/server_sync/result_0/take")
    assert len(take.attr["component_types"].list.type) == 1


@pytest.mark.parametrize("run_option", ["hybrid", "ps", "allreduce"])
def test_coalesced_in_process_equals_one_device_and_the_uncoalesced_run(run_option):
    """Ids that repeat within and across replicas, global-norm clipping:
    coalesced and uncoalesced runs both within 1e-5 of one device."""
    def build(batch):
        return embedding_regression(batch, "adagrad", clip=True, ema=True)
    for coalesce in (True, False):
        config = {"run_option": run_option, "coalesce_rows": coalesce}
        parallel, single, names = train_both(build, 2, 10, local(2), config, batch=8)
        for name in names:
            for got in parallel[name]:
                assert np.max(np.abs(got - single[name])) <= 1e-5, (coalesce, name)


TABLE = np.arange(20, dtype=np.float32).reshape(10, 2)


def lookup_graph(kind: str):
    """ids -> rows of a [10, 2] table, read as `kind` says, -> SGD."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None, 3], name="ids")
        emb = tf1.get_variable("emb", initializer=TABLE, use_resource=kind != "reference")
        if kind == "read_then_gather":
            rows = tf.gather(emb.read_value(), ids, name="rows")
        elif kind == "axis_1":
            rows = tf.gather(emb.read_value(), [0, 1], axis=1, name="rows")
        else:
            rows = tf.nn.embedding_lookup(emb, ids, name="rows")
        loss = tf.reduce_sum(rows)
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        tf1.global_variables_initializer()
    return g


@pytest.mark.parametrize("kind,op,via", [("resource", "ResourceGather", 0),
                                         ("reference", "GatherV2", 1),
                                         ("read_then_gather", "GatherV2", 2)])
def test_lookups_are_gathers_of_the_handle_or_of_a_whole_read(kind, op, via):
    tg = frontend.load(lookup_graph(kind))
    found = lookups(tg, "emb")
    assert [tg.ir.node(lk.op).op for lk in found] == [op]
    assert len(found[0].via) == via


def test_a_gather_along_another_axis_is_no_lookup():
    assert lookups(frontend.load(lookup_graph("axis_1")), "emb") == ()


@pytest.mark.parametrize("coalesce", [True, False])
def test_allgather_with_a_different_row_count_every_step_equals_one_device(coalesce):
    """TensorFlow fixes a collective's shape at its first run; the rows an
    all-gather moves change every step here (batches of 4, 8, 2 examples,
    and coalescing makes them data-dependent besides)."""
    def build():
        g = tf.Graph()
        with g.as_default():
            ids = tf1.placeholder(tf.int32, [None, 3], name="ids")
            y = tf1.placeholder(tf.float32, [None], name="y")
            emb = tf1.get_variable("emb", initializer=TABLE)
            pred = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids), [1, 2])
            loss = tf.reduce_mean(tf.square(pred - y))
            train = tf1.train.AdagradOptimizer(0.1).minimize(loss)
            init = tf1.global_variables_initializer()
        return g, train, init, emb
    rng = np.random.RandomState(3)
    feeds = [(rng.randint(0, 10, size=(b, 3)), rng.randn(b).astype(np.float32))
             for b in (4, 8, 2, 8)]
    g, train, init, emb = build()
    config = {"run_option": "allreduce", "coalesce_rows": coalesce}
    with pn.get_runner(g, local(2), config) as runner:
        assert runner.plan.variables["emb"].method == "allgather"
        runner.run(init)
        for ids, y in feeds:
            runner.run(train, {"ids:0": ids, "y:0": y})
        got = runner.run(emb, per_replica=True)
    g1, train1, init1, emb1 = build()
    with tf1.Session(graph=g1) as sess:
        sess.run(init1)
        for ids, y in feeds:
            sess.run(train1, {"ids:0": ids, "y:0": y})
        want = sess.run(emb1)
    for value in got:
        assert np.max(np.abs(value - want)) <= 1e-5
