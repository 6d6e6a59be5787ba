"""pn.partitioner: large variables as row ranges, one per parameter server."""
import json

import pytest
import tensorflow as tf

import parallax_ng as pn
from models import embedding_regression
from parallax_ng import cluster
from parallax_ng.errors import ConfigError
from passkit import cluster_transform

tf1 = tf.compat.v1


def parts_of(partitioner, shape):
    g = tf.Graph()
    with g.as_default():
        v = tf1.get_variable("v", shape, partitioner=partitioner)
        return [p.shape.as_list() for p in v]


def test_one_row_range_per_server_of_the_job(monkeypatch):
    assert parts_of(pn.partitioner(), [10, 3]) == [[10, 3]]        # no job: one part
    monkeypatch.setenv(cluster.ENV, json.dumps({
        "worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"] * 3,
        "task_type": "worker", "task": 0, "devices": [["CPU", 0]]}))
    assert parts_of(pn.partitioner(), [10, 3]) == [[4, 3], [3, 3], [3, 3]]
    assert parts_of(pn.partitioner(min_rows=5), [10, 3]) == [[5, 3], [5, 3]]
    assert parts_of(pn.partitioner(min_rows=6), [10, 3]) == [[10, 3]]
    assert parts_of(pn.partitioner(parts=2), [10, 3]) == [[5, 3], [5, 3]]
    with pytest.raises(ConfigError, match="positive integer"):
        pn.partitioner(parts=0)


def test_parts_go_to_different_servers():
    g, _ = embedding_regression(4, "adam", partitions=2)
    ir, ctx = cluster_transform(g, worker=0, servers=2)
    servers = {ctx.plan.server("emb/part_0"), ctx.plan.server("emb/part_1")}
    assert len(servers) == 2
    for part in ("emb/part_0", "emb/part_1"):
        assert ctx.plan.variables[part].info.sparse
        assert ir.node(part).device == ctx.plan.server(part)
        assert ir.node(f"{part}/Adam").device == ctx.plan.server(part)
