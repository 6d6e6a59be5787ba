"""Flat buffers: the packing helpers build what TensorFlow runs as slices and
concatenations of flat tensors, and the pass's fusion buffers and buckets
are built from them (their equivalence is in test_fusion_buffers.py and
test_buckets.py)."""
import numpy as np
import tensorflow as tf

from parallax_ng.config import BucketsConfig
from parallax_ng.graph import emit
from passkit import context, op_counts, run_passes
from transforms.aggregate import AggregatePass
from transforms.flat_buffers import concat, elements, flat_slice
from transforms.replicate import ReplicatePass


def run_nodes(nodes, fetch):
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.extend(nodes)
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        return sess.run(fetch)


def test_slices_and_concatenations_of_flat_tensors():
    nodes = [emit.const("flat", np.arange(10, dtype=np.float32), tf.float32),
             emit.const("axis", 0, tf.int32)]
    assert flat_slice(nodes, "whole", "flat", 0, 10, tf.float32, "", whole=True) == "flat"
    a = flat_slice(nodes, "a", "flat", 2, 3, tf.float32, "")
    b = flat_slice(nodes, "b", "flat", 7, 2, tf.float32, "")
    nodes += [concat("ab", [a, b], "axis", tf.float32, ""),
              concat("only", [a], "axis", tf.float32, "")]
    assert nodes[-1].op == "Identity" and nodes[-2].op == "ConcatV2"
    ab, only = run_nodes(nodes, ["ab:0", "only:0"])
    np.testing.assert_array_equal(ab, [2, 3, 4, 7, 8])
    np.testing.assert_array_equal(only, [2, 3, 4])


def test_one_bucket_is_one_packed_all_reduce_per_replica():
    """`buckets.mode: single`: every dense variable in one bucket, packed on
    each replica's device (one ConcatV2 of `elements` per variable), one
    all-reduce, split back."""
    ctx = context(n=2, run_option="allreduce", buckets=BucketsConfig(mode="single"))
    variables = ctx.plan.buckets[0].variables
    assert len(ctx.plan.buckets) == 1 and len(variables) > 1
    ir = run_passes(ctx, ReplicatePass(), AggregatePass())
    counts = op_counts(ir, "parallax/bucket_0/")
    assert counts["CollectiveReduce"] == 2 and counts["ConcatV2"] == 2
    packed = [n for n in ir.nodes if n.name.startswith("parallax/bucket_0/") and
              n.op == "ConcatV2"]
    assert all(len(n.input) == len(variables) + 1 for n in packed)
    assert sum(elements(ctx.tg, v) for v in variables) > len(variables)
