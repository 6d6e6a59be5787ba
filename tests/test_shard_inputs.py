import tensorflow as tf

from models import embedding_regression
from passkit import context
from transforms.replicate import ReplicatePass
from transforms.shard_inputs import ShardInputsPass


def value(ir, name):
    return int(tf.make_ndarray(ir.node(name).attr["value"].tensor))


def test_each_replica_reads_its_own_shard():
    ctx = context(n=3)
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    out, report = ShardInputsPass().run(ir, ctx)
    assert report["constants"] == 6
    for k in range(3):
        prefix = "" if k == 0 else f"parallax/replica_{k}/"
        assert value(out, prefix + "parallax_shard/num_shards") == 3
        assert value(out, prefix + "parallax_shard/index") == k
    assert value(ir, "parallax_shard/index") == 0   # input untouched


def test_worker_offset_for_multi_worker_jobs():
    ctx = context(n=2)
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    out, _ = ShardInputsPass(num_shards=6, offset=4).run(ir, ctx)
    assert value(out, "parallax/replica_1/parallax_shard/index") == 5
    assert value(out, "parallax_shard/num_shards") == 6


def test_one_shot_iterators_get_private_dataset_functions():
    g, _ = embedding_regression(4, "sgd", one_shot=True)
    ctx = context(n=2, graph=g)
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    out, report = ShardInputsPass().run(ir, ctx)
    assert report["function_copies"] == 2
    its = [n for n in out.nodes if n.op == "OneShotIterator"]
    names = {n.attr["dataset_factory"].func.name for n in its}
    assert len(names) == 2
    funcs = {f.signature.name: f for f in out.library.function}
    for fname in names:
        consts = {n.name: tf.make_ndarray(n.attr["value"].tensor)
                  for n in funcs[fname].node_def if n.name.startswith("parallax_shard")}
        assert int(consts["parallax_shard/num_shards"]) == 2
        assert int(consts["parallax_shard/index"]) == int(fname.split("_of_")[0][-1])


def test_graph_without_shard_is_reported():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        w = tf.compat.v1.get_variable("w", [2, 1])
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.matmul(x, w)))
    ctx = context(n=2, graph=g)
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    out, report = ShardInputsPass().run(ir, ctx)
    assert "no pn.shard()" in report["warning"]
    assert [n.SerializeToString() for n in out.nodes] == [n.SerializeToString() for n in ir.nodes]
