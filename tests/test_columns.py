"""transforms/columns.py: each replica's part of a table cut by columns,
the exchange that replaces a lookup, whole reads, and other workers'
parts in a job (structure of the rewritten graph; the numbers are in
tests/test_alltoall.py)."""
import tensorflow as tf

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng.pipeline.results import ColumnParts
from passkit import cluster_transform, op_counts


def _shape(nd):
    return tf.TensorShape(nd.attr["shape"].shape).as_list()


def test_in_process_parts_lookups_and_whole_reads():
    g, _ = embedding_regression(4, "adam", dim=5, ema=True)
    ir, ctx, manager = pn.transform(g, local(2), {"run_option": "allreduce",
                                                  "sparse_method": "alltoall"})
    assert "columns" in [p.name for p in manager.passes]
    for state in ("emb", "emb/Adam", "emb/ExponentialMovingAverage"):
        assert _shape(ir.node(state)) == [40, 3]
        assert _shape(ir.node(f"parallax/replica_1/{state}")) == [40, 2]
    # the lookup: every replica's ids gathered, its columns of all of them,
    # one AlltoAll; the gradient: one more
    assert ir.node("embedding_lookup").op == "Identity"
    exchanges = [n for n in ir.nodes if n.op == "CollectiveAllToAllV2"]
    assert len(exchanges) == 2 * 2
    # the gradient's rows are the lookup's distinct ids: its sizes and ids
    # gathered once, in the forward exchange
    assert op_counts(ir)["CollectiveGatherV2"] == 2 * 2
    assert op_counts(ir, "parallax/alltoall/emb/")["CollectiveGatherV2"] == 0
    assert {n.device for n in exchanges} == set(ctx.plan.devices)
    # a fetch of the table reads both parts, each on its device
    read = ir.node("emb/Read/ReadVariableOp")
    assert read.op == "ConcatV2"
    parts = [ir.node(i) for i in read.input[:2]]
    assert [p.device for p in parts] == list(ctx.plan.devices)
    assert ctx.result(ColumnParts).handles["emb"] == ("emb", "parallax/replica_1/emb")
    assert not ctx.result(ColumnParts).gather


def test_a_worker_reaches_the_other_workers_parts_by_shared_name():
    g, _ = embedding_regression(4, "sgd", dim=6)
    ir, ctx = cluster_transform(g, 1, servers=0, run_option="allreduce", devices=2,
                                sparse_method="alltoall")
    part = ctx.plan.placement["emb"]
    assert [s.size for s in part.shards] == [2, 2, 1, 1]
    assert _shape(ir.node("emb")) == [40, 1]      # job replica 2 holds column 4
    assert _shape(ir.node("parallax/replica_1/emb")) == [40, 1]
    handles = ctx.result(ColumnParts).handles["emb"]
    assert handles[2:] == ("emb", "parallax/replica_1/emb")
    remote = [ir.node(h) for h in handles[:2]]
    assert [r.attr["shared_name"].s for r in remote] == [b"emb", b"parallax/replica_1/emb"]
    assert [r.device for r in remote] == ["/job:worker/replica:0/task:0/device:CPU:0",
                                          "/job:worker/replica:0/task:0/device:CPU:1"]
    assert [_shape(r) for r in remote] == [[40, 2], [40, 2]]
    # the training step never touches a part of worker 0: only reads for a
    # fetch or a checkpoint (no consumers) join them
    step = ir.ancestors(["GradientDescent"])
    assert not step & set(handles[:2])
    users = {c for h in handles[:2] for c in ir.node_consumers.get(h, ())}
    assert users and all(ir.node(u).op == "ReadVariableOp" for u in users)
    assert op_counts(ir)["CollectiveAllToAllV2"] == 2 * 2


def test_each_row_sent_gathers_the_gradients_ids_itself():
    g, _ = embedding_regression(4, "sgd")
    ir, _, _ = pn.transform(g, local(2), {"run_option": "allreduce", "sparse_method": "alltoall",
                                          "coalesce_rows": False})
    assert op_counts(ir, "parallax/alltoall/emb/")["CollectiveGatherV2"] == 2 * 2
