"""Alltoall (EmbRace 4.1): an embedding cut by columns over the replicas,
rows and gradients exchanged by AlltoAll, equals one device.

After the steps every variable and optimizer slot of every replica (the
table read whole, its parts joined) matches one device with the total
batch within 1e-5 (float32), in-process on 2 and 4 devices and in 2x1 and
2x2 localhost jobs; embedding widths that do not divide by the replica
count included.
"""
import os
import tempfile

import numpy as np
import pytest

import parallax_ng as pn
from models import (embedding_regression, local, read_name, train_both, train_single,
                    variable_names)
from parallax_ng.errors import ConfigError
from test_cluster import assert_matches_one_device, run_job

TOL = 1e-5
CONFIG = {"run_option": "allreduce", "sparse_method": "alltoall"}
EACH_ROW = {"coalesce_rows": False, "distinct_lookups": False}
CASES = [  # replicas, optimizer, model options, more config
    (2, "sgd", {}, {}),
    (2, "adam", {"clip": True, "ema": True, "random_table": True, "dim": 5}, {}),
    (4, "adam", {"clip": True}, {}),
    (4, "adam", {"clip": True}, EACH_ROW),
    (4, "adagrad", {"clip": True, "dim": 6}, {}),
    (2, "momentum", {"ema": True, "clip": True}, EACH_ROW),
    (4, "rmsprop", {"dim": 7}, {}),
]


@pytest.mark.parametrize("n,optimizer,extras,more", CASES, ids=[
    f"{n}-{o}-{'-'.join(e) or 'plain'}{'-each-row' if m else ''}" for n, o, e, m in CASES])
def test_replicas_match_one_device(n, optimizer, extras, more):
    """Each distinct id's row exchanged once and each distinct gradient row
    sent once (the default), or every occurrence (`EACH_ROW`)."""
    seen = {}
    parallel, single, names = train_both(lambda b: embedding_regression(b, optimizer, **extras),
                                         n, 8, config={**CONFIG, **more}, seen=seen)
    plan = seen["plan"]
    assert plan.variables["emb"].method == "alltoall"
    assert plan.variables["emb"].coalesce == plan.distinct_lookups == (not more)
    width = extras.get("dim", 4)
    assert [s.size for s in plan.placement["emb"].shards] == \
        [width // n + (k < width % n) for k in range(n)]
    slots = [v for v in names if v.startswith("emb/")]     # slots, moving averages
    assert all(plan.placement[s] == plan.placement["emb"] for s in slots)
    for name, want in single.items():
        assert len(parallel[name]) == n
        for k, got in enumerate(parallel[name]):
            diff = np.max(np.abs(np.asarray(got) - want))
            assert diff <= TOL, f"{name} on replica {k}: max abs diff {diff}"


def test_the_plan_shows_each_replicas_columns():
    g, _ = embedding_regression(4, "adam", dim=5)
    runner = pn.get_runner(g, local(2), CONFIG)
    text = runner.plan.format()
    runner.close()
    assert "alltoall" in text
    assert "emb: columns 0..2 on /job:localhost/replica:0/task:0/device:CPU:0, 3..4 on " \
           "/job:localhost/replica:0/task:0/device:CPU:1" in text
    d = runner.plan.to_dict()
    assert d["placement"]["emb/Adam"]["kind"] == "columns"
    assert d["variables"]["emb"]["method"] == "alltoall"


@pytest.mark.parametrize("workers,devices", [(2, 1), (2, 2)])
def test_workers_match_one_device(tmp_path, workers, devices):
    """Adam, global-norm clipping, moving averages of every weight: the table
    and its slots cut over every replica of the job."""
    done, out, _ = run_job(tmp_path, workers, devices, "10", "--run-option", "allreduce",
                           "--config", '{"sparse_method": "alltoall"}')
    assert done.returncode == 0, done.stderr[-3000:]
    assert_matches_one_device(out, workers, devices)


def test_config_errors_name_the_variable():
    g, _ = embedding_regression(4)
    with pytest.raises(ConfigError, match="variable_methods.dense/w' is alltoall.*dense"):
        pn.get_runner(g, local(2), {"variable_methods": {"dense/w": "alltoall"}})
    with pytest.raises(ConfigError, match="'sparse_method' has value 'columns'; "
                                          "allowed: auto, allreduce, alltoall, allgather, ps"):
        pn.get_runner(g, local(2), {"sparse_method": "columns"})
    g, _ = embedding_regression(4, dim=3)
    with pytest.raises(ConfigError, match="its 3 columns per replica, but the job has 4"):
        pn.get_runner(g, local(4), {"variable_methods": {"emb": "alltoall"}})
    # sparse_method takes the run option's method where alltoall cannot apply
    assert pn.transform_plan(g, local(4), CONFIG).variables["emb"].method == "allgather"


def test_a_saver_in_the_graph_keeps_alltoall_and_round_trips():
    """A tf.compat.v1.train.Saver built before training (as most TF1 scripts
    do): its restore assigns values of unknown shape (RestoreV2) to the
    table, which each replica takes its columns of; its save writes the
    whole table under its single-device name."""
    import tensorflow as tf
    g, h = embedding_regression(4, "adam", dim=5)
    with g.as_default():
        saver = tf.compat.v1.train.Saver()
    names = variable_names(g)
    reads = [read_name(v, g) for v in names]
    with pn.get_runner(g, local(2), CONFIG) as runner, tempfile.TemporaryDirectory() as tmp:
        assert runner.plan.variables["emb"].method == "alltoall"
        assert runner.plan.unmet() == []
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(3):
            runner.run(h["train"])
        saved = dict(zip(names, runner.run(reads)))
        path = runner.save(saver, os.path.join(tmp, "model"))
        stored = tf.train.load_checkpoint(path)
        for name in ("emb", "emb/Adam", "emb/Adam_1", "dense/w"):
            np.testing.assert_array_equal(stored.get_tensor(name), saved[name], err_msg=name)
        for _ in range(2):
            runner.run(h["train"])
        runner.restore(saver, path)
        for name, copies in zip(names, runner.run(reads, per_replica=True)):
            for got in copies:
                np.testing.assert_array_equal(got, saved[name], err_msg=name)


def test_a_saver_in_a_two_worker_job_keeps_alltoall(tmp_path):
    """Worker 0 saves after 10 steps (the other workers' columns read from
    them, no collectives in that run; worker 1's writes land 0.2 s late, so
    the save waits for them), both train 2 more and restore: every
    replica's variables equal one device after 10 steps."""
    import tensorflow as tf
    path = str(tmp_path / "model")
    done, out, _ = run_job(tmp_path, 2, 1, "10", "--run-option", "allreduce", "--config",
                           '{"sparse_method": "alltoall"}', "--saver", path,
                           "--slow-writes", "0.2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("'emb': 'alltoall'") == 2, done.stdout
    assert_matches_one_device(out, 2, 1)
    single = train_single(*embedding_regression(8, "adam", clip=True, ema=True), 10)
    stored = tf.train.load_checkpoint(path)
    for name in ("emb", "emb/Adam", "emb/ExponentialMovingAverage"):
        assert np.max(np.abs(stored.get_tensor(name) - single[name])) <= TOL, name
