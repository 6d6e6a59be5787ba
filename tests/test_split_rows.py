"""Row ranges of a large sparse variable on several servers, read off the
generated graphs (the multi-process run is in test_cluster.py)."""
import tensorflow as tf

from models import embedding_regression
from passkit import cluster_transform
from parallax_ng import frontend
from parallax_ng.plan import splittable

PS = [f"/job:ps/replica:0/task:{j}/device:CPU:0" for j in range(2)]


def test_the_embedding_and_its_slots_are_cut_into_one_range_per_server():
    g, _ = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, servers=2)
    split = ctx.plan.row_split
    assert set(split) == {"emb", "emb/Adam", "emb/Adam_1"}
    assert split["emb"] == ((PS[0], 0, 20), (PS[1], 20, 20))
    for var in split:
        for k in range(2):
            node = ir.node(f"{var}/part_{k}")
            assert node.op == "VarHandleOp" and node.device == PS[k]
            assert tf.TensorShape(node.attr["shape"].shape).as_list() == [20, 4]
    # the forward lookup gathers on each server and stitches the rows back
    gathers = [n for n in ir.nodes if n.op == "ResourceGather"
               and n.name.startswith("parallax/split_rows/embedding_lookup/")]
    assert sorted((n.input[0], n.device) for n in gathers) == [
        ("emb/part_0", PS[0]), ("emb/part_1", PS[1])]
    assert ir.node("embedding_lookup").op == "Identity"
    # the slots' scatter-adds run once per range, on that range's server
    adds = [n for n in ir.nodes if n.op == "ResourceScatterAdd"]
    assert sorted((n.input[0], n.device) for n in adds) == [
        ("emb/Adam/part_0", PS[0]), ("emb/Adam/part_1", PS[1]),
        ("emb/Adam_1/part_0", PS[0]), ("emb/Adam_1/part_1", PS[1])]
    assert ir.node("Adam/update_emb/ResourceScatterAdd").op == "NoOp"
    # reading the whole variable concatenates the ranges under the old name
    assert ir.node("emb/Read/ReadVariableOp").op == "ConcatV2"
    assert "row ranges: emb -> " in ctx.plan.format()
    tf.graph_util.import_graph_def(ir.graph_def, name="")   # TensorFlow accepts it


def test_small_variables_and_single_servers_stay_whole():
    g, _ = embedding_regression(4, "adam", clip=True)
    _, ctx = cluster_transform(g, worker=0, servers=1)
    assert ctx.plan.row_split == {}
    _, ctx = cluster_transform(g, worker=0, servers=2, run_option="allreduce")
    assert ctx.plan.row_split == {}


def test_a_variable_read_inside_a_function_call_is_not_split():
    """An EMA initializer reads the embedding inside a cond (an If op's
    branch): the plan keeps that variable whole instead of guessing."""
    g, _ = embedding_regression(4, "adam", ema=True)
    tg = frontend.load(g)
    assert splittable(tg, "emb") is None
    # deciding reads the user's NodeDefs and never adds to them
    for name in ("emb/Read/ReadVariableOp", "emb/Assign", "emb/IsInitialized/VarIsInitializedOp"):
        assert "batch_dims" not in tg.ir.node(name).attr, name
    _, ctx = cluster_transform(g, worker=0, servers=2)
    assert ctx.plan.row_split == {}
    g, _ = embedding_regression(4, "adam", ema=False)
    assert splittable(frontend.load(g), "emb") == ["emb", "emb/Adam", "emb/Adam_1"]
