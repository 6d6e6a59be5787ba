"""Distinct lookups: a worker of a job gathers each distinct row of a
server's variable once per step and expands the rows locally."""
import pytest
import tensorflow as tf

from models import embedding_regression
from passkit import cluster_transform
from test_coalescing import TABLE, lookup_graph

tf1 = tf.compat.v1


def lookup_nodes(ir, name="embedding_lookup"):
    scope = f"parallax/lookups/{name}"
    return {n.name.removeprefix(scope + "/"): n for n in ir.nodes
            if n.name.startswith(scope + "/")}


@pytest.mark.parametrize("devices", [1, 2])
def test_one_gather_of_distinct_ids_on_the_server_and_each_replica_expands(devices):
    g, _ = embedding_regression(4, "adam")
    ir, ctx = cluster_transform(g, worker=1, servers=1, devices=devices)
    added = lookup_nodes(ir)
    unique, rows = added["unique"], added["rows"]
    assert unique.device == ctx.plan.host and rows.device == ctx.plan.server("emb")
    assert rows.op == "ResourceGather" and rows.input[:2] == ["emb", unique.name]
    assert "_class" not in rows.attr
    assert added["local"].input == [rows.name] and added["local"].device == ctx.plan.host
    for k in range(devices):
        lookup = ir.node(ctx.replica_name(k, "embedding_lookup"))
        assert lookup.op == "GatherV2" and lookup.device == ctx.plan.devices[k]
        assert lookup.input[:2] == [added["local"].name, added[f"at_{k}"].name]
    # the gradient still reads the replica's own ids
    assert sum(n.op == "ResourceGather" for n in ir.nodes) == 1


def test_a_reference_variables_lookup_runs_on_the_server_and_is_made_distinct():
    tf1.disable_resource_variables()
    try:
        g = lookup_graph("reference")
    finally:
        tf1.enable_resource_variables()
    ir, ctx = cluster_transform(g, worker=0, servers=1, run_option="ps")
    rows = lookup_nodes(ir, "rows")["rows"]
    assert rows.op == "GatherV2" and rows.device == ctx.plan.server("emb")
    assert ir.node(rows.input[0]).device == ctx.plan.server("emb")   # emb/read


def test_the_switch_leaves_the_gathers_on_the_server():
    g, _ = embedding_regression(4, "adam")
    ir, ctx = cluster_transform(g, worker=0, servers=1, distinct_lookups=False)
    assert not lookup_nodes(ir) and not ctx.plan.distinct_lookups
    assert ir.node("embedding_lookup").device == ctx.plan.server("emb")


def test_sharded_rows_are_gathered_by_range_from_the_distinct_ids():
    g, _ = embedding_regression(4, "adam")
    ir, ctx = cluster_transform(g, worker=1, servers=2, devices=2)
    parts = [n for n in ir.nodes if n.op == "ResourceGather"]
    assert sorted(p.input[0] for p in parts) == ["emb/part_0", "emb/part_1"]
    assert all("parallax/lookups/embedding_lookup/rows" in p.name for p in parts)
    assert lookup_nodes(ir)["rows"].device == ctx.plan.host


def test_in_process_plans_keep_lookups_as_they_are():
    from passkit import context
    ctx = context(2, "adam")
    assert not ctx.plan.distinct_lookups


@pytest.mark.parametrize("kind", ["resource", "reference", "read_then_gather"])
def test_each_replica_gets_exactly_its_rows(kind):
    """The rewritten lookups, run: replicas with overlapping ids (and ids
    repeated within a replica) each get table[ids], shaped like their ids."""
    import numpy as np

    import parallax_ng as pn
    from parallax_ng.graph import frontend
    from parallax_ng.planning.analysis import analyze
    from parallax_ng.config import Config
    from parallax_ng.planning.planner import make_plan
    from passkit import HOST, devices

    if kind == "reference":
        tf1.disable_resource_variables()
    try:
        g = lookup_graph(kind)
    finally:
        tf1.enable_resource_variables()
    tg = frontend.load(g)
    server = HOST.replace("CPU:0", "CPU:2")
    plan = make_plan(tg, analyze(tg), Config(run_option="ps"), devices(2), HOST,
                     servers=[server])
    assert plan.distinct_lookups and plan.server("emb") == server
    ir, ctx, _ = pn.transform(g, plan=plan)
    assert lookup_nodes(ir, "rows")
    ids = [np.array([[1, 2, 1], [9, 1, 0]]), np.array([[2, 2, 7]])]
    with tf.Graph().as_default() as out:
        tf.graph_util.import_graph_def(ir.graph_def, name="")
        config = tf1.ConfigProto(device_count={"CPU": 3})
        with tf1.Session(graph=out, config=config) as sess:
            sess.run("init")
            feed = {f"{ctx.replica_name(k, 'ids')}:0": ids[k] for k in range(2)}
            got = sess.run([f"{ctx.replica_name(k, 'rows')}:0" for k in range(2)], feed)
    for k in range(2):
        np.testing.assert_array_equal(got[k], TABLE[ids[k]])
