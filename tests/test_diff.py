import parallax_ng as pn
from models import local
from parallax_ng.tools import diff
from passkit import context


def test_diff_reports_each_pass_and_the_traffic():
    from models import embedding_regression
    g, _ = embedding_regression(4, "adam")
    ir, ctx, manager = pn.transform(g, local(2), {"run_option": "hybrid"}, keep_graphs=True)
    assert [name for name, _ in manager.graphs][0] == "input"
    diffs = diff.diff_pipeline(manager.graphs)
    by = {d.name: d for d in diffs}
    assert len(by["replicate"].added) == len(ctx.tg.ir) - len(ctx.unreplicated)
    assert any(n.startswith("parallax/bucket_0/") for n in by["aggregate"].added)
    assert by["aggregate"].rewired and by["place"].replaced
    assert by["shard_inputs"].modified                      # the shard constants
    devices = diff.nodes_per_device(ir)
    assert sum(devices.values()) == len(ir) and len(devices) == 2
    traffic, unknown = diff.boundary_bytes(ir, ctx.tg, batch=4)
    assert sum(traffic.values()) > 0
    coll = diff.collective_bytes(ir, ctx.tg)
    # three dense variables all-reduced over 2 replicas: each sends their size
    dense = sum(ctx.tg.variables[v].nbytes for v in ("dense/w", "dense/b", "out/v"))
    assert coll[ctx.plan.devices[1]] == dense
    text = diff.render_text(diffs, ir, ctx.tg, batch=4)
    assert "replicate" in text and "nodes per device" in text
    # the summary's columns line up, whatever the longest pass name
    table = text.split("\n\n")[0].splitlines()
    assert any(row.startswith("lookups_on_servers ") for row in table)
    assert len({len(row) for row in table}) == 1, table
    # long lists end by saying how many lines they left out
    placed = len(by["place"].replaced)
    assert placed > 10 and f"  @ ... {placed - 10} more" in text
    assert f"== place: {placed} re-placed" in text
    dot = diff.render_dot(ir, diffs, ctx.tg)
    assert dot.startswith("digraph") and "cluster_1" in dot and "parallax/bucket_0" in dot
    page = diff.render_html(diffs, ir, ctx.tg)
    assert "{" not in page.split("<summary>")[1].split("</summary>")[0]   # words, not a dict
    assert page.startswith("<!doctype html>") and "parallax/ps" in page


def test_roles_cover_every_user_node():
    ctx = context(n=2, optimizer="momentum")
    role = diff.roles(ctx.tg)
    assert set(role) == set(ctx.tg.ir.names())
    assert role["emb"] == "variables" and role["IteratorGetNext"] == "input"
    assert role[ctx.tg.gradients["emb"].values.node] == "backward"
    assert role["Momentum/update_emb/ResourceSparseApplyMomentum"] == "update"
    assert role["MatMul"] == "forward"
