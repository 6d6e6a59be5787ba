"""Sharded variables: row ranges of a large sparse variable on several
servers, read off the generated graphs (the multi-process run is in
test_cluster.py)."""
import numpy as np
import tensorflow as tf
from models import embedding_regression
from passkit import cluster_transform

from parallax_ng.graph import frontend
from parallax_ng.planning.placement import Shard, Sharded
from parallax_ng.planning.planner import shardable

PS = [f"/job:ps/replica:0/task:{j}/device:CPU:0" for j in range(2)]


def test_the_embedding_and_its_slots_are_cut_into_one_range_per_server():
    g, _ = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, servers=2, distinct_lookups=False)
    split = ctx.plan.sharded()
    assert set(split) == {"emb", "emb/Adam", "emb/Adam_1"}
    assert split["emb"] == Sharded(0, (Shard(PS[0], 0, 20), Shard(PS[1], 20, 20)))
    for var in split:
        for k in range(2):
            node = ir.node(f"{var}/part_{k}")
            assert node.op == "VarHandleOp" and node.device == PS[k]
            assert tf.TensorShape(node.attr["shape"].shape).as_list() == [20, 4]
    # the forward lookup gathers on each server and stitches the rows back
    # (test_lookups.py: the same from each distinct id)
    gathers = [n for n in ir.nodes if n.op == "ResourceGather"
               and n.name.startswith("parallax/shard_variables/embedding_lookup/")]
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
    assert f"emb: sharded rows 0..19 on {PS[0]}, rows 20..39 on {PS[1]}" in ctx.plan.format()
    tf.graph_util.import_graph_def(ir.graph_def, name="")   # TensorFlow accepts it


def test_a_measured_sample_of_rows_touched_cuts_the_ranges_where_it_splits_evenly():
    """What worker 0's first steps touched (planning/profile.py) sets the
    cut: rows 0..9 touched three times as often as the rest."""
    from parallax_ng.planning.planner import balance
    tg = frontend.load(embedding_regression(4, "adam")[0])
    touched = sorted([r for r in range(10) for _ in range(3)] + list(range(10, 40)))
    placement = balance(tg, ["emb", "dense/w"], PS, ["emb"], {"emb": touched})
    assert placement["emb"] == Sharded(0, (Shard(PS[0], 0, 10), Shard(PS[1], 10, 30)))
    assert placement["emb/Adam"] == placement["emb"]
    assert balance(tg, ["emb"], PS, ["emb"])["emb"] == Sharded.even(0, 40, PS)


def test_the_plan_cuts_by_the_rows_touched_only_when_the_config_asks():
    """The same measured sample: even ranges by default (the gradient goes
    through the first range's server either way), the measured cut under
    ps_placement rows_touched."""
    from dataclasses import replace

    from parallax_ng.config import load_config
    from parallax_ng.planning.analysis import analyze
    from parallax_ng.planning.planner import make_plan
    tg = frontend.load(embedding_regression(4, "adam")[0])
    info = analyze(tg)
    info["emb"] = replace(info["emb"], touched=tuple(
        sorted([r for r in range(10) for _ in range(3)] + list(range(10, 40)))))
    cuts = {}

    def plan_of(how, info):
        return make_plan(tg, info, load_config({"run_option": "ps", "ps_placement": how}),
                         ["/job:worker/replica:0/task:0/device:CPU:0"], "/job:worker/task:0",
                         num_workers=2, servers=PS)
    for how in ("greedy", "rows_touched"):
        plan = plan_of(how, info)
        cuts[how] = [(s.start, s.size) for s in plan.sharded()["emb"].shards]
        assert "rows_touched" not in " ".join(plan.unmet())
    assert cuts == {"greedy": [(0, 20), (20, 20)], "rows_touched": [(0, 10), (10, 30)]}
    # asked for, but nothing measured (fed placeholders, profile.steps 0): said so
    unmeasured = plan_of("rows_touched", analyze(tg))
    assert unmeasured.sharded()["emb"] == Sharded.even(0, 40, PS)
    assert "emb: ps_placement rows_touched: even row ranges, no step measured" in \
        unmeasured.unmet()


def test_small_variables_and_single_servers_stay_whole():
    g, _ = embedding_regression(4, "adam", clip=True)
    _, ctx = cluster_transform(g, worker=0, servers=1)
    assert ctx.plan.sharded() == {}
    _, ctx = cluster_transform(g, worker=0, servers=2, run_option="allreduce")
    assert ctx.plan.sharded() == {}


def test_a_variable_read_inside_a_function_call_is_not_split():
    """An EMA initializer reads the embedding inside a cond (an If op's
    branch): the plan keeps that variable whole instead of guessing."""
    g, _ = embedding_regression(4, "adam", ema=True)
    tg = frontend.load(g)
    assert shardable(tg, "emb", 0) is None
    # deciding reads the user's NodeDefs and never adds to them
    for name in ("emb/Read/ReadVariableOp", "emb/Assign", "emb/IsInitialized/VarIsInitializedOp"):
        assert "batch_dims" not in tg.ir.node(name).attr, name
    _, ctx = cluster_transform(g, worker=0, servers=2)
    assert ctx.plan.sharded() == {}
    g, _ = embedding_regression(4, "adam", ema=False)
    assert shardable(frontend.load(g), "emb", 0) == ["emb", "emb/Adam", "emb/Adam_1"]


LOCAL = [f"/job:localhost/replica:0/task:0/device:CPU:{k}" for k in range(3)]


def sharded_runner(graph, config):
    """A runner on 3 local devices whose plan shards dense/w by elements
    (10, 35 and 27 of its 72) and the embedding by rows (7, 20, 13 of 40),
    each with its Adam slots, one shard per device."""
    from dataclasses import replace

    from models import local

    import parallax_ng as pn
    from parallax_ng.resources import session_config
    from parallax_ng.runtime.program import transformed
    from parallax_ng.runtime.runner import Runner
    plan = pn.transform_plan(graph, local(3), config)
    flat = Sharded(None, (Shard(LOCAL[0], 0, 10), Shard(LOCAL[1], 10, 35),
                          Shard(LOCAL[2], 45, 27)))
    rows = Sharded(0, (Shard(LOCAL[0], 0, 7), Shard(LOCAL[1], 7, 20), Shard(LOCAL[2], 27, 13)))
    placement = dict(plan.placement)
    for var, p in (("dense/w", flat), ("emb", rows)):
        for state in shardable(frontend.load(graph), var, p.axis):
            placement[state] = p
    ir, ctx, manager = pn.transform(graph, local(3), config,
                                    plan=replace(plan, placement=placement))
    config = pn.load_config(config)
    return Runner(transformed(ir, ctx, config, manager.records), config,
                  session_config([("CPU", k) for k in range(3)]))


def test_sharded_placement_over_three_devices_at_uneven_offsets_equals_one_device():
    from models import read_name, train_single, variable_names
    config = {"run_option": "hybrid", "variable_methods": {"dense/w": "ps"}}
    g, h = embedding_regression(4, "adam", clip=True)
    with sharded_runner(g, config) as runner:
        assert set(runner.plan.sharded()) == {"dense/w", "dense/w/Adam", "dense/w/Adam_1",
                                              "emb", "emb/Adam", "emb/Adam_1"}
        graph = runner.graph.as_graph_def()
        parts = {n.name: n.device for n in graph.node if "/part_" in n.name
                 and n.op == "VarHandleOp"}
        assert parts["dense/w/part_1"] == LOCAL[1] and parts["emb/Adam/part_2"] == LOCAL[2]
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(10):
            runner.run(h["train"])
        names = variable_names(g)
        got = dict(zip(names, runner.run([read_name(v, g) for v in names])))
    single = train_single(*embedding_regression(12, "adam", clip=True), 10)
    assert set(got) == set(single)
    for name, want in single.items():
        assert np.max(np.abs(got[name] - want)) <= 1e-5, name


def test_a_sharded_variable_saves_and_restores_whole(tmp_path):
    g, h = embedding_regression(4, "adam")
    with g.as_default():
        saver = tf.compat.v1.train.Saver()
    config = {"run_option": "hybrid", "variable_methods": {"dense/w": "ps"}}
    with sharded_runner(g, config) as runner:
        runner.run([h["init"], h["iterator_init"]])
        runner.run(h["train"])
        path = runner.save(saver, str(tmp_path / "ckpt"))
        saved = runner.run(["dense/w/Read/ReadVariableOp:0", "emb/Read/ReadVariableOp:0"])
        runner.run(h["train"])
        runner.restore(saver, path)
        back = runner.run(["dense/w/Read/ReadVariableOp:0", "emb/Read/ReadVariableOp:0"])
    for a, b in zip(saved, back):
        np.testing.assert_array_equal(a, b)
    reader = tf.train.load_checkpoint(path)        # a plain, whole checkpoint
    np.testing.assert_array_equal(reader.get_tensor("dense/w"), saved[0])
