"""Sparse gradients all-gathered (parallax_ng/comm/gathers.py): rows and ids
in one gather of words, the row counts of several gradients in one gather,
and the result one device's."""
import numpy as np
import tensorflow as tf

import parallax_ng as pn
from models import embedding_regression, local, train_both


def test_an_all_gathered_gradient_crosses_in_one_gather_of_words():
    """allreduce's sparse variable (the embedding): per replica one gather of
    its sizes and one of its rows and ids as int32 words; a float16 row of
    odd width cannot be words, and goes as values and ids apart."""
    for dtype, dim, gathers in ((tf.float32, 4, 2), (tf.float16, 3, 3)):
        g, _ = embedding_regression(4, "sgd", dtype=dtype, dim=dim)
        ir, _, _ = pn.transform(g, local(2), {"run_option": "allreduce"})
        mine = [n for n in ir.nodes if n.op == "CollectiveGatherV2" and
                n.name.startswith("parallax/allgather/emb/replica_0/")]
        assert len(mine) == gathers, (dtype, [n.name for n in mine])
        if gathers == 2:
            assert sorted(tf.as_dtype(n.attr["T"].type).name for n in mine) == ["int32"] * 2


def test_the_row_counts_of_several_gradients_cross_in_one_gather():
    """An embedding in two row ranges, both all-gathered: one gather of
    both parts' row counts per replica, then one gather of words per part;
    training (Adam, clipping by the global norm, 10 steps) equals one
    device with the global batch within 1e-5."""
    def build(batch):
        return embedding_regression(batch, "adam", clip=True, partitions=2)
    config = {"run_option": "allreduce"}
    ir, _, _ = pn.transform(build(4)[0], local(2), config)
    gathers = sorted(n.name for n in ir.nodes if n.op == "CollectiveGatherV2")
    counts = [n for n in gathers if n.startswith("parallax/allgather/counts/")]
    assert len(counts) == 2 and all("/replica_" in n for n in counts), gathers
    parts = [n for n in gathers if n not in counts]
    assert len(parts) == 2 * 2, gathers             # per part and replica: its words
    parallel, single_device, names = train_both(build, 2, 10, local(2), config)
    assert {"emb/part_0", "emb/part_1"} <= set(names)
    for name in names:
        for got in parallel[name]:
            assert np.max(np.abs(got - single_device[name])) <= 1e-5, name
