"""transforms/part_writes.py: in a job, a run that writes a part of a table
cut by columns ends only once every worker's replicas have written theirs."""
import pytest

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng.pipeline.results import ColumnParts
from passkit import cluster_transform
from test_cluster import assert_matches_one_device, run_job
from transforms.part_writes import MEET, SCOPE

ALLTOALL = dict(servers=0, run_option="allreduce", sparse_method="alltoall")


def reduces(ir):
    return {n.name: n for n in ir.nodes
            if n.name.startswith(SCOPE) and n.op == "CollectiveReduce"}


@pytest.mark.parametrize("optimizer,last", [
    ("adam", "Adam/update_emb/AssignSubVariableOp"),
    ("adagrad", "Adagrad/update_emb/ResourceSparseApplyAdagrad")])
def test_each_last_write_of_a_part_waits_for_every_replica(optimizer, last):
    """The table's update (after its slots' writes) and each initializer, on
    both local replicas: the write is kept as `<name>/write`, and `<name>`
    waits for it and for an all-reduce that waits for it too. Writes that
    another write follows (Adam's slots) are left alone. Both workers'
    graphs give the same write the same instance key."""
    g, _ = embedding_regression(4, optimizer)
    keys = []
    for worker in (0, 1):
        ir, ctx = cluster_transform(g, worker=worker, devices=2, **ALLTOALL)
        met = reduces(ir)
        writes = sorted(n.name[:-len("/write")] for n in ir.nodes if n.name.endswith("/write"))
        initializers = {"emb/Assign"} | {f"emb/{s}/Assign" for s in
                                         (["Adam", "Adam_1"] if optimizer == "adam"
                                          else ["Adagrad"])}
        assert writes == sorted(w for name in initializers | {last}
                                for w in (name, f"parallax/replica_1/{name}"))
        for name in writes:
            nd = ir.node(name)
            assert nd.op == "NoOp" and nd.input[0] == f"^{name}/write"
            reduce = ir.node(nd.input[1][1:])
            assert reduce.op == "CollectiveReduce" and reduce.device == nd.device
            one = ir.node(reduce.input[0])
            assert one.op == "Const" and list(one.input) == [f"^{name}/write"]
            assert reduce.attr["group_size"].i == 4
        if optimizer == "adam":
            assert ir.node("Adam/update_emb/ResourceScatterAdd").op == "ResourceScatterAdd"
        assert ctx.result(ColumnParts).meet == MEET
        assert ir.node(MEET).op == "NoOp" and len(ir.node(MEET).input) == 2
        keys.append(sorted((name, n.attr["instance_key"].i) for name, n in met.items()))
    assert keys[0] == keys[1] and len({k for _, k in keys[0]}) == len(keys[0]) // 2


def test_one_process_and_servers_alone_add_nothing():
    """One worker's run ends after all its replicas' writes already; a job
    without a table cut by columns has none."""
    g, _ = embedding_regression(4, "adam")
    ir, ctx, _ = pn.transform(g, local(2), {"sparse_method": "alltoall"})
    assert ctx.plan.variables["emb"].method == "alltoall"
    assert not reduces(ir) and ctx.result(ColumnParts).meet is None
    ir, ctx = cluster_transform(g, worker=0, servers=1, run_option="hybrid")
    assert not reduces(ir) and ctx.result(ColumnParts) is None


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
