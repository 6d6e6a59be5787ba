"""Parallax's placement rewrites, each a pass with a switch
(config placement_rewrites): local aggregation, update math with its
parameter, lookups on the servers. Read off generated job graphs; a job with
every switch off still equals one device."""
import json

import pytest

from models import embedding_regression
from passkit import cluster_transform
from transforms import pipeline_for

SERVER = "/job:ps/replica:0/task:0/device:CPU:0"
OFF = {"local_aggregation": False, "colocate_updates": False, "lookups_on_servers": False}


def passes(ctx):
    return [p.name for p in pipeline_for(ctx.plan)]


@pytest.mark.parametrize("on", [True, False])
def test_local_aggregation_sums_a_workers_replicas_before_they_leave_it(on):
    g, _ = embedding_regression(4, "adam")
    ir, ctx = cluster_transform(g, worker=1, run_option="ps", devices=2,
                                placement_rewrites={"local_aggregation": on})
    assert ("local_aggregation" in passes(ctx)) == on
    for name in ("parallax/ps/emb/values", "parallax/ps/dense/w/sum"):
        assert ir.node(name).device == (ctx.plan.host if on else SERVER)


@pytest.mark.parametrize("on", [True, False])
def test_update_math_runs_with_its_parameter(on):
    g, _ = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, run_option="ps",
                                placement_rewrites={"colocate_updates": on})
    assert ("colocate_updates" in passes(ctx)) == on
    for name in ("Adam/update_emb/truediv", "clip_by_global_norm/mul_1"):
        assert (ir.node(name).device == SERVER) == on
    # the chief's ops that take the handles are there either way
    assert ir.node("Adam/update_dense/w/ResourceApplyAdam").device == SERVER


@pytest.mark.parametrize("on", [True, False])
def test_a_gather_of_a_whole_read_runs_on_the_server(on):
    from test_coalescing import lookup_graph
    g = lookup_graph("read_then_gather")
    ir, ctx = cluster_transform(g, worker=0, run_option="ps", distinct_lookups=False,
                                placement_rewrites={"lookups_on_servers": on})
    assert ("lookups_on_servers" in passes(ctx)) == on
    assert (ir.node("rows").device == SERVER) == on
    assert ir.node("Read/ReadVariableOp").device == SERVER    # takes the handle


def test_the_plan_says_which_rewrites_are_off():
    g, _ = embedding_regression(4, "adam")
    _, ctx = cluster_transform(g, worker=0, run_option="ps", placement_rewrites=OFF)
    assert "placement rewrites off: local_aggregation, colocate_updates, " \
           "lookups_on_servers" in ctx.plan.format()


def test_a_job_with_every_rewrite_off_equals_one_device(tmp_path):
    """ps, 2 workers x 2 devices, one server: each replica's gradient goes to
    the server, update math on the workers, duplicates not summed."""
    from test_cluster import assert_matches_one_device, run_job
    config = {"placement_rewrites": OFF, "coalesce_rows": False, "distinct_lookups": False}
    done, out, _ = run_job(tmp_path, 2, 2, "10", "--run-option", "ps",
                           "--config", json.dumps(config), servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_matches_one_device(out, 2, 2)
