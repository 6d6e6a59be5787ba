"""Rows as they leave a replica (transforms/replica_rows.py): duplicates
summed in first-appearance order, and the global norm's shares of several
all-gathered variables summed in one all-reduce."""
import numpy as np
import tensorflow as tf

import parallax_ng as pn
from models import embedding_regression, local
from transforms.replica_rows import coalesce


def test_coalesce_sums_duplicate_rows_in_the_order_ids_first_appear():
    g = tf.Graph()
    with g.as_default():
        tf.constant(np.arange(10, dtype=np.float32).reshape(5, 2), name="values")
        tf.constant([7, 3, 7, 9, 3], tf.int64, name="ids")
    graph_def = g.as_graph_def()
    graph_def.node.extend(coalesce("c", "values", "ids", tf.float32, tf.int64, ""))
    with tf.Graph().as_default() as run, tf.compat.v1.Session(graph=run) as sess:
        tf.graph_util.import_graph_def(graph_def, name="")
        rows, ids = sess.run(["c/coalesced:0", "c/distinct:0"])
    np.testing.assert_array_equal(ids, [7, 3, 9])
    np.testing.assert_array_equal(rows, [[0 + 4, 1 + 5], [2 + 8, 3 + 9], [6, 7]])


def test_the_norm_shares_of_several_gathered_variables_are_summed_in_one_all_reduce():
    """An embedding in two row ranges, all-gathered and clipped by the
    global norm: per replica one all-reduce of both parts' shares (a vector
    of two), none per part; the clipped training equals one device (the
    equivalence is test_gathers')."""
    g, _ = embedding_regression(4, "adam", clip=True, partitions=2)
    ir, _, _ = pn.transform(g, local(2), {"run_option": "allreduce"})
    reduces = sorted(n.name for n in ir.nodes if n.op == "CollectiveReduce")
    norms = [n for n in reduces if "/norm" in n]
    assert norms == [f"parallax/allgather/norms_float32/sum/replica_{k}" for k in range(2)], \
        reduces
    packed = ir.node("parallax/allgather/norms_float32/replica_0/shares")
    assert packed.op == "Pack" and len(packed.input) == 2
