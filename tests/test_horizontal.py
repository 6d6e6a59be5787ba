"""Horizontal scheduling (EmbRace 4.2.1): dense updates applied a step
later, one all-reduce per layer in the order the forward reads them, equal
one device.

Every variable and optimizer slot of every replica matches one device with
the total batch within 1e-5 (float32) after the steps (the last step's
pending updates applied before the read), in-process on 2 and 4 devices
(with all-reduce buckets planned for the others, and with the table by
alltoall with prefetch), and in 2x1 and 2x2 localhost jobs.
"""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import embedding_regression, local, read_name, train_both
from parallax_ng.errors import ConfigError
from test_cluster import assert_matches_one_device, run_job

TOL = 1e-5
CONFIG = {"run_option": "allreduce", "horizontal_scheduling": True}
CASES = [  # replicas, optimizer, model options, more config
    (2, "sgd", {}, {}),
    (2, "adam", {"ema": True}, {}),
    (4, "momentum", {}, {"buckets": {"mode": "single"}}),
    (4, "rmsprop", {}, {}),
    (4, "adam", {"ema": True, "dim": 5}, {"sparse_method": "alltoall", "prefetch": True}),
]


@pytest.mark.parametrize("n,optimizer,extras,more", CASES, ids=[
    f"{n}-{o}-{'-'.join(e) or 'plain'}{'-' + '-'.join(m) if m else ''}"
    for n, o, e, m in CASES])
def test_replicas_match_one_device(n, optimizer, extras, more):
    seen = {}
    parallel, single, _ = train_both(lambda b: embedding_regression(b, optimizer, **extras),
                                     n, 8, config={**CONFIG, **more}, seen=seen)
    assert seen["plan"].blocks == (("dense/w", "dense/b"), ("out/v",))
    for name, want in single.items():
        for k, got in enumerate(parallel[name]):
            diff = np.max(np.abs(np.asarray(got) - want))
            assert diff <= TOL, f"{name} on replica {k}: max abs diff {diff}"


@pytest.fixture
def v1_variables():
    tf.compat.v1.disable_resource_variables()
    yield
    tf.compat.v1.enable_resource_variables()


def test_reference_variables_keep_a_copy_of_the_step_counters(v1_variables):
    """Adam's update of a reference variable reads its step counters through
    reads that alias their buffers, which the step's end changes in place:
    the kept scalars are copies."""
    parallel, single, _ = train_both(lambda b: embedding_regression(b, "adam"), 2, 6,
                                     config=CONFIG)
    for name, want in single.items():
        for got in parallel[name]:
            assert np.max(np.abs(np.asarray(got) - want)) <= TOL, name


def test_a_read_between_steps_sees_every_update():
    g, h = embedding_regression(4, "adam", ema=True)
    g1, h1 = embedding_regression(8, "adam", ema=True)
    names = ["dense/w", "dense/w/Adam_1", "out/v/ExponentialMovingAverage"]
    with pn.get_runner(g, local(2), CONFIG) as runner, tf.compat.v1.Session(graph=g1) as sess:
        runner.run([h["init"], h["iterator_init"]])
        sess.run([h1["init"], h1["iterator_init"]])
        for _ in range(3):
            runner.run(h["train"])
            sess.run(h1["train"])
            for var in names:
                got, want = runner.run(read_name(var, g)), sess.run(read_name(var, g1))
                assert np.max(np.abs(got - want)) <= TOL, var


def test_the_plan_orders_blocks_by_the_forward_and_says_what_cannot_wait():
    g, _ = embedding_regression(4, "adam")
    plan = pn.transform_plan(g, local(2), CONFIG)
    assert plan.blocks == (("dense/w", "dense/b"), ("out/v",))
    assert "horizontal scheduling (updates a step later, blocks all-reduced in forward " \
           "order): dense/w, dense/b; out/v" in plan.format()
    assert plan.buckets == () or all("dense/w" not in b.variables for b in plan.buckets)
    g, _ = embedding_regression(4, "adam", clip=True)
    plan = pn.transform_plan(g, local(2), CONFIG)
    assert plan.blocks == ()
    assert "global norm reads its gradient" in plan.variables["dense/w"].note
    with pytest.raises(ConfigError, match="'horizontal_scheduling' must be true or false"):
        pn.transform_plan(g, local(2), {**CONFIG, "horizontal_scheduling": 1})


@pytest.mark.parametrize("workers,devices", [(2, 1), (2, 2)])
def test_workers_match_one_device(tmp_path, workers, devices):
    done, out, _ = run_job(tmp_path, workers, devices, "10", "--run-option", "allreduce",
                           "--no-clip", "--config", '{"horizontal_scheduling": true}')
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker 1: blocks [['dense/w', 'dense/b'], ['out/v']]" in done.stdout
    assert_matches_one_device(out, workers, devices, clip=False)


def test_a_split_job_step_keeps_its_updates_in_the_step():
    """With servers beside collectives a job step runs as two session runs
    (no session run mixes them): no schedule that spans steps, and a note."""
    from parallax_ng.graph import frontend
    from parallax_ng.planning.analysis import analyze
    from parallax_ng.config import Config
    from parallax_ng.planning.planner import make_plan
    tg = frontend.load(embedding_regression(4, "adam")[0])
    worker = "/job:worker/replica:0/task:0/device:CPU:0"
    plan = make_plan(tg, analyze(tg), Config(run_option="hybrid", dense_method="allreduce",
                                             horizontal_scheduling=True), [worker], worker,
                     num_workers=2, worker=0, servers=["/job:ps/replica:0/task:0/device:CPU:0"])
    assert plan.schedule.split and plan.blocks == ()
    assert "runs them in two session runs" in plan.variables["dense/w"].note
