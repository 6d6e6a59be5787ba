"""transforms/part_writes.py and Executor.wait_for_parts: in a job, each
replica counts its writes to its parts of tables cut by columns, and a
worker that reads other workers' parts first waits for their counts."""
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng.pipeline.results import PartsWritten
from parallax_ng.runtime.executor import Executor
from passkit import cluster_transform
from test_cluster import assert_matches_one_device, run_job
from transforms.part_writes import MEET, SCOPE, START

ALLTOALL = dict(servers=0, run_option="allreduce", sparse_method="alltoall")


@pytest.mark.parametrize("optimizer,last", [
    ("adam", "Adam/update_emb/AssignSubVariableOp"),
    ("adagrad", "Adagrad/update_emb/ResourceSparseApplyAdagrad")])
def test_each_last_write_of_a_part_is_counted_on_its_replica(optimizer, last):
    """The table's update (after its slots' writes) and each initializer, on
    both local replicas: the write is kept as `<name>/write`, and `<name>`
    waits for it and for the add to the replica's count. Writes that
    another write follows (Adam's slots) are left alone. Every worker's
    graph reads the four job replicas' counts on their devices; the
    restore's meeting has the same instance key on both."""
    g, _ = embedding_regression(4, optimizer)
    keys = []
    for worker in (0, 1):
        ir, ctx = cluster_transform(g, worker=worker, devices=2, **ALLTOALL)
        writes = sorted(n.name[:-len("/write")] for n in ir.nodes if n.name.endswith("/write"))
        initializers = {"emb/Assign"} | {f"emb/{s}/Assign" for s in
                                         (["Adam", "Adam_1"] if optimizer == "adam"
                                          else ["Adagrad"])}
        assert writes == sorted(w for name in initializers | {last}
                                for w in (name, f"parallax/replica_1/{name}"))
        for name in writes:
            k = int(name.startswith("parallax/replica_1/"))
            nd = ir.node(name)
            assert nd.op == "NoOp" and list(nd.input) == [f"^{name}/write", f"^{name}/counted"]
            counted = ir.node(f"{name}/counted")
            assert counted.op == "AssignAddVariableOp" and counted.device == nd.device
            assert list(counted.input) == [f"{SCOPE}/count_{2 * worker + k}",
                                           f"{SCOPE}/one_{k}", f"^{name}/write"]
        if optimizer == "adam":
            assert ir.node("Adam/update_emb/ResourceScatterAdd").op == "ResourceScatterAdd"
        written = ctx.result(PartsWritten)
        assert written.mine == 2 * worker and written.start == START
        assert written.counts == tuple(f"{SCOPE}/read_{j}" for j in range(4))
        assert [ir.node(f"{SCOPE}/count_{j}").device[-5:] for j in range(4)] == \
            ["CPU:0", "CPU:1"] * 2
        assert {ir.node(f"{SCOPE}/count_{j}").device.split("/")[3] for j in range(4)} == \
            {"task:0", "task:1"}
        assert written.reads == ({"emb", "emb/Adam", "emb/Adam_1"} if optimizer == "adam"
                                 else {"emb", "emb/Adagrad"})
        assert ir.node(MEET).op == "NoOp" and len(ir.node(MEET).input) == 2
        keys.append(ir.node(f"{MEET}/replica_0").attr["instance_key"].i)
    assert keys[0] == keys[1]


def test_one_process_and_servers_alone_count_nothing():
    """One worker's run ends after all its replicas' writes already; a job
    without a table cut by columns has none to count."""
    g, _ = embedding_regression(4, "adam")
    ir, ctx, _ = pn.transform(g, local(2), {"sparse_method": "alltoall"})
    assert ctx.plan.variables["emb"].method == "alltoall"
    assert ctx.result(PartsWritten) is None and not any(n.name.startswith(SCOPE)
                                                         for n in ir.nodes)
    ir, ctx = cluster_transform(g, worker=0, servers=1, run_option="hybrid")
    assert ctx.result(PartsWritten) is None


def counts_graph():
    """Three replicas' counts in one session: this worker's is the first."""
    g = tf.Graph()
    with g.as_default():
        counts = [tf.Variable(0, dtype=tf.int64, name=f"count_{j}") for j in range(3)]
        reads = tuple(tf.identity(c.read_value(), name=f"read_{j}").op.name
                      for j, c in enumerate(counts))
        init = tf.compat.v1.variables_initializer(counts[:2])   # replica 2 not yet up
    return g, counts, reads, init


def test_a_worker_waits_until_no_count_is_below_its_own():
    """Replica 1 behind, replica 2 not started (an uninitialized count is
    0): the wait times out naming the first one behind; once both catch up
    (from another thread, as other workers would), it returns."""
    g, counts, reads, init = counts_graph()
    written = PartsWritten(reads, 0, "", frozenset(), "")
    with g.as_default(), tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        counts[0].load(3, sess)
        counts[1].load(2, sess)
        quick = Executor(g, tf.compat.v1.RunOptions(timeout_in_ms=300), written=written)
        with pytest.raises(tf.errors.DeadlineExceededError,
                           match=r"replica 1 of the job .* \(2 writes against this worker's 3\)"):
            quick.wait_for_parts(sess)
        later = [counts[1].assign(3), counts[2].initializer, counts[2].assign(4)]

        def catch_up():
            time.sleep(0.2)
            sess.run(later[0])
            sess.run(later[1])
            sess.run(later[2])
        helper = threading.Thread(target=catch_up)
        helper.start()
        start = time.monotonic()
        Executor(g, tf.compat.v1.RunOptions(timeout_in_ms=10000),
                 written=written).wait_for_parts(sess)
        waited = time.monotonic() - start
        helper.join()
        assert 0.15 < waited < 5
        assert np.array_equal(sess.run([f"{r}:0" for r in reads]), [3, 3, 4])


def test_a_worker_whose_writes_land_late_is_waited_for(tmp_path):
    """Worker 1 takes 0.4 s longer for its learning rate each step, so its
    writes to its columns land long after the step's exchange: worker 0's
    reads after the last step (every replica's variables, the table whole
    from both workers' columns) still see them, and equal one device."""
    done, out, _ = run_job(tmp_path, 2, 1, "4", "--run-option", "allreduce",
                           "--config", '{"sparse_method": "alltoall"}', "--slow-writes", "0.4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "alltoall not used" not in done.stderr, done.stderr[-3000:]
    assert_matches_one_device(out, 2, 1, steps=4)
