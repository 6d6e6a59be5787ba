"""The all-reduce bucket model and the bucketings: MG-WFBP's merge is the
optimum (checked against every contiguous bucketing), the others are what
their names say."""
import itertools
import random

import pytest

from parallax_ng.planning.buckets import (Cost, Layer, iteration_time, mgwfbp, ready_times,
                                          single, threshold, wfbp)


def every_bucketing(n):
    """All ways to cut n layers (backward order) into consecutive buckets."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        out, bucket = [], [0]
        for i, cut in enumerate(cuts, start=1):
            if cut:
                out.append(bucket)
                bucket = []
            bucket.append(i)
        yield out + [bucket]


def random_profile(rng, n):
    layers = [Layer(f"l{i}", rng.choice([rng.randint(1, 10**4), rng.randint(10**5, 10**7)]),
                    rng.uniform(0, 5e-3)) for i in range(n)]
    return rng.uniform(0, 0.02), layers, Cost(rng.uniform(1e-5, 5e-3), rng.uniform(1e-10, 2e-9))


@pytest.mark.parametrize("seed", range(40))
def test_mgwfbp_is_the_best_contiguous_bucketing(seed):
    rng = random.Random(seed)
    forward, layers, cost = random_profile(rng, rng.randint(1, 12))
    got = iteration_time(forward, layers, mgwfbp(forward, layers, cost), cost)
    best = min(iteration_time(forward, layers, b, cost) for b in every_bucketing(len(layers)))
    assert got == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_the_model_on_a_hand_worked_profile():
    """Two layers (input first): backward runs l1 (ready at 1.0 + 0.5) then
    l0 (at 1.0 + 0.5 + 0.25); a + b*M = 0.1 + M/100."""
    layers = [Layer("l0", 10, 0.25), Layer("l1", 20, 0.5)]
    cost = Cost(0.1, 0.01)
    assert ready_times(1.0, layers) == [1.5, 1.75]
    # wfbp: l1 at 1.5 .. 1.8, l0 at max(1.75, 1.8) .. 2.0
    assert iteration_time(1.0, layers, wfbp(layers), cost) == pytest.approx(2.0)
    # single: both at 1.75 .. 1.75 + 0.1 + 0.3
    assert iteration_time(1.0, layers, single(layers), cost) == pytest.approx(2.15)
    assert mgwfbp(1.0, layers, cost) == [[0], [1]]
    # with a large startup cost one bucket wins
    assert mgwfbp(1.0, layers, Cost(1.0, 0.01)) == [[0, 1]]


def test_fixed_bucketings():
    layers = [Layer(f"l{i}", b, 0.0) for i, b in enumerate([5, 1, 4, 3])]   # backward: 3 4 1 5
    assert wfbp(layers) == [[0], [1], [2], [3]]
    assert single(layers) == [[0, 1, 2, 3]] and single([]) == []
    assert threshold(layers, 5) == [[0, 1], [2, 3]]
    assert threshold(layers, 100) == [[0, 1, 2, 3]]


def test_the_network_form_ring_and_parameter_servers_by_hand():
    """Two layers (input first) l0: 100 bytes, l1: 300 bytes, 1 s backward
    each: l1 ready at 1, l0 at 2. Two nodes, alpha 0.5 s, beta 0.01 s/byte."""
    from parallax_ng.planning.buckets import (Network, fusion_messages, placed_messages,
                                              server_timeline, simulate)
    ring = Network(4, 1e-3, 1e-9).ring()
    assert (ring.a, ring.b) == pytest.approx((6e-3, 1.5e-9), rel=1e-12)
    layers = [Layer("l0", 100, 1.0), Layer("l1", 300, 1.0)]
    net = Network(2, 0.5, 0.01)
    # ps:2: l1 on server 0 (largest first): push 1 .. 1 + 0.5 + 0.01 * 2 * 300,
    # pull until 14; l0 on server 1: 2 .. 4.5 .. 7
    assert placed_messages(layers, 2) == [([0], {0: 300}), ([1], {1: 100})]
    got = simulate(0.0, layers, ["ps:2", "bfb:1", "bfb:2", "mgwfbp"], network=net)
    assert got["ps:2"]["iteration_time"] == pytest.approx(14.0)
    assert got["ps:2"]["buckets"] == [["l1"], ["l0"]]
    # bfb:1: one 400-byte buffer at 2, each phase 0.5 + 0.01 * 800 (the server
    # hears both workers); bfb:2: 200 bytes per server, the worker sends 400
    assert got["bfb:1"]["iteration_time"] == pytest.approx(2 + 2 * 8.5)
    assert got["bfb:2"]["iteration_time"] == pytest.approx(2 + 2 * 4.5)
    assert got["bfb:2"]["buckets"] == [["l1", "l0"]]
    # the ring: a = 2 * 0.5, b = 0.01; mgwfbp = wfbp here: 1 .. 5, 5 .. 7
    assert got["mgwfbp"]["iteration_time"] == pytest.approx(7.0)
    # buffers of 5 bytes over backward sizes 3, 4, 1, 5: a layer may be in two
    split = fusion_messages([Layer(f"l{i}", b, 0.0) for i, b in enumerate([5, 1, 4, 3])], 2, 5)
    assert [(m, sum(s.values())) for m, s in split] == [([0, 1], 5), ([1, 2, 3], 5), ([3], 3)]
    assert server_timeline(0.0, [], [], net) == 0.0


def test_simulate_with_a_network_and_its_errors(tmp_path, capsys):
    """At many nodes the ring's startup cost 2(N-1) alpha makes per-layer
    all-reduces slow; balanced fusion buffers over N servers are not."""
    import json

    from parallax_ng.tools import cli
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"forward_time": 0.01, "layers": [
        {"name": f"l{i}", "bytes": 400000, "backward_time": 1e-3} for i in range(20)]}))
    args = ["simulate", "--profile", str(path), "--nodes", "64", "--alpha", "5e-5",
            "--beta", "8e-10"]
    assert cli.main(args + ["--strategies", "wfbp,single,mgwfbp,bfb:64,ps:64",
                            "--json"]) == 0
    got = {k: v["iteration_time"] for k, v in
           json.loads(capsys.readouterr().out)["strategies"].items()}
    assert got["mgwfbp"] < min(got["wfbp"], got["single"])
    assert got["bfb:64"] < got["wfbp"]
    assert cli.main(args) == 0
    assert "compute share" in capsys.readouterr().out
    for bad, says in ((["--a", "1"], "give --a with --b"),
                      ([], "give the all-reduce cost"),
                      (["--nodes", "0", "--alpha", "1", "--beta", "1"], "--nodes must be"),
                      (["--a", "1", "--b", "1", "--strategies", "bfb:2"], "needs a network"),
                      (["--a", "1", "--b", "1", "--strategies", "ps:x"], "unknown strategy")):
        assert cli.main(["simulate", "--profile", str(path)] + bad) == 2, bad
        assert says in capsys.readouterr().err, bad


def _shipped():
    import importlib.util
    import os
    root = os.path.join(os.path.dirname(__file__), "..")
    spec = importlib.util.spec_from_file_location(
        "model_profiles", os.path.join(root, "benchmarks", "model_profiles.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, os.path.join(root, "profiles")


def test_shipped_profiles_are_the_generators_and_the_models_sizes():
    """profiles/*.json are what benchmarks/model_profiles.py writes; their
    bytes are the models' parameters (ResNet-50 fp32, BERT fp16)."""
    import json
    import os

    import model_shapes
    module, directory = _shipped()
    for name in module.PROFILES:
        with open(os.path.join(directory, name)) as f:
            assert json.load(f) == json.loads(json.dumps(module.profile(name))), name
    params = {"resnet50-k80.json": (model_shapes.resnet50(), 4),
              "bert-base-v100.json": (model_shapes.bert_base(), 2),
              "bert-large-v100.json": (model_shapes.bert_base(24, 1024, 4096), 2)}
    for name, (shapes, width) in params.items():
        layers = module.profile(name)["layers"]
        assert sum(x["bytes"] for x in layers) == model_shapes.parameters(shapes) * width, name


def test_resnet50_at_64_nodes_keeps_the_papers_order():
    """MG-WFBP's simulated 64-node 10 GbE cluster: MG-WFBP faster than WFBP
    and than single (the paper: 1.75x and 1.45x; docs/benchmarks.md has ours)."""
    import json
    import os

    from parallax_ng.planning.buckets import Network, load_profile, simulate
    _, directory = _shipped()
    with open(os.path.join(directory, "resnet50-k80.json")) as f:
        forward, layers = load_profile(json.load(f))
    got = simulate(forward, layers, ["wfbp", "single", "mgwfbp"],
                   network=Network(64, 45.26e-6, 8e-10))
    t = {k: v["iteration_time"] for k, v in got.items()}
    assert t["mgwfbp"] * 1.5 < t["wfbp"] and t["mgwfbp"] * 1.2 < t["single"]


# -- buckets in the plan and the graph ----------------------------------------
import numpy as np  # noqa: E402

import parallax_ng as pn  # noqa: E402
from models import embedding_regression, local, train_both  # noqa: E402


@pytest.mark.parametrize("mode,expected", [("none", 0), ("single", 1), ("threshold", 2)])
def test_the_plan_merges_all_reduced_variables_into_buckets(mode, expected):
    """In backward order out/v and dense/b (8 floats each) reach a 40-byte
    threshold together; dense/w makes the second bucket."""
    g, _ = embedding_regression(4, "adam")
    plan = pn.transform_plan(g, local(2), {"run_option": "allreduce",
                                           "buckets": {"mode": mode, "bytes": 40}})
    assert len(plan.buckets) == expected
    if expected:
        merged = sorted(v for b in plan.buckets for v in b.variables)
        assert merged == ["dense/b", "dense/w", "out/v"]   # the dense ones
    if mode == "threshold":
        assert [b.variables for b in plan.buckets] == [("out/v", "dense/b"), ("dense/w",)]
    ir, _, _ = pn.transform(g, local(2), {"run_option": "allreduce",
                                          "buckets": {"mode": mode, "bytes": 40}})
    reduces = [n for n in ir.nodes if n.op == "CollectiveReduce"]
    assert len(reduces) == 2 * (expected or 3)       # per replica: a bucket or a variable


@pytest.mark.parametrize("mode", ["single", "threshold"])
def test_bucketed_all_reduce_equals_one_device(mode):
    def build(batch):
        return embedding_regression(batch, "adam", clip=True, ema=True)
    config = {"run_option": "allreduce", "buckets": {"mode": mode, "bytes": 40}}
    parallel, single_device, names = train_both(build, 2, 10, local(2), config)
    for name in names:
        for got in parallel[name]:
            assert np.max(np.abs(got - single_device[name])) <= 1e-5, name


def unknown_shape_regression(batch):
    """Two dense layers; the first's weight made with validate_shape=False,
    so the graph does not know its shape."""
    from models import tf1
    g = tf1.Graph()
    with g.as_default():
        rng = np.random.RandomState(3)
        xs, ys = rng.randn(64, 4).astype(np.float32), rng.randn(64, 1).astype(np.float32)
        ds = pn.shard(tf1.data.Dataset.from_tensor_slices((xs, ys))).batch(batch).repeat()
        it = tf1.data.make_initializable_iterator(ds)
        x, y = it.get_next()
        w = tf1.get_variable("w", validate_shape=False, initializer=tf1.placeholder_with_default(
            rng.randn(4, 8).astype(np.float32), None))
        b = tf1.get_variable("b", initializer=np.zeros([8], np.float32))
        v = tf1.get_variable("v", initializer=rng.randn(8, 1).astype(np.float32))
        h = tf1.nn.relu(tf1.matmul(x, tf1.reshape(w, [4, 8])) + b)
        loss = tf1.reduce_mean(tf1.square(tf1.matmul(h, v) - y))
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"init": init, "iterator_init": it.initializer, "train": train}


@pytest.mark.parametrize("config", [{"run_option": "allreduce"},
                                    {"run_option": "hybrid", "dense_method": "bfb"}])
def test_a_variable_of_unknown_shape_is_not_packed_flat(config):
    """Buckets (the default) and fusion buffers pack gradients flat by their
    sizes: a weight whose shape the graph does not know is all-reduced alone,
    or, for fusion buffers, aggregated whole on the server; training equals
    one device with the global batch (Adam, 10 steps, 1e-5). Naming fusion
    buffers for it is refused."""
    g, _ = unknown_shape_regression(4)
    plan = pn.transform_plan(g, local(2), config)
    assert [b.variables for b in plan.buckets] == (
        [("v", "b")] if config["run_option"] == "allreduce" else [])
    assert plan.variables["w"].method == (
        "allreduce" if config["run_option"] == "allreduce" else "ps")
    parallel, single_device, names = train_both(unknown_shape_regression, 2, 10, local(2),
                                                config)
    assert "w" in names
    for name in names:
        for got in parallel[name]:
            assert np.max(np.abs(got - single_device[name])) <= 1e-5, name
    with pytest.raises(pn.ConfigError, match="variable_methods.w' is bfb.*not fully defined"):
        pn.transform_plan(g, local(2), {**config, "variable_methods": {"w": "bfb"}})


def test_a_bad_bucket_mode_names_the_key():
    with pytest.raises(pn.ConfigError, match="buckets.mode"):
        pn.Config.from_dict({"buckets": {"mode": "fastest"}})


@pytest.mark.parametrize("buckets", [{"mode": "single"}, {"mode": "threshold", "bytes": 40},
                                     {"mode": "mgwfbp"}])
def test_a_job_with_buckets_equals_one_device(tmp_path, buckets):
    """2 workers x 2 devices, TensorFlow collectives: one bucket, two
    threshold buckets; mgwfbp with worker 0's first step and the all-reduce
    benchmark that both workers run, both planning the same buckets."""
    import json
    import re

    from test_cluster import assert_matches_one_device, run_job
    done, out, _ = run_job(tmp_path, 2, 2, "10", "--run-option", "allreduce", "--config",
                           json.dumps({"buckets": buckets}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_matches_one_device(out, 2, 2)
    planned = {w: b for w, b in re.findall(r"worker (\d): buckets (.*)", done.stdout)}
    assert set(planned) == {"0", "1"} and planned["0"] == planned["1"], done.stdout[-2000:]


def test_simulate_reads_a_hand_written_profile_and_ranks_the_strategies(tmp_path, capsys):
    """Many small layers and a large startup cost: merging wins, and mgwfbp
    is never slower than any other bucketing."""
    import json

    from parallax_ng.tools import cli
    profile = {"forward_time": 0.01,
               "layers": [{"name": f"l{i}", "bytes": 40000, "backward_time": 1e-4}
                          for i in range(20)]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    assert cli.main(["simulate", "--profile", str(path), "--a", "1e-3", "--b", "1e-9",
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["strategies"]
    assert set(got) == {"wfbp", "single", "threshold:4194304", "mgwfbp"}
    best = got["mgwfbp"]["iteration_time"]
    assert all(best <= r["iteration_time"] + 1e-12 for r in got.values())
    assert got["wfbp"]["iteration_time"] > got["single"]["iteration_time"]
    assert got["wfbp"]["buckets"][0] == ["l19"]           # backward order: output first
    assert cli.main(["simulate", "--profile", str(path), "--a", "1e-3", "--b", "1e-9",
                     "--strategies", "fastest"]) == 2
    assert "unknown strategy 'fastest'" in capsys.readouterr().err
    path.write_text(json.dumps({"layers": [{"name": "x"}]}))
    assert cli.main(["simulate", "--profile", str(path), "--a", "1", "--b", "1"]) == 2
    assert "profile layer 0 lacks ['backward_time', 'bytes']" in capsys.readouterr().err


def test_mgwfbp_buckets_follow_the_measured_ready_times():
    """Without a profile every gradient is ready at once and a startup cost
    merges them all; with gradients ready far apart (and all-reduces cheap
    next to that) each gets its own bucket."""
    from parallax_ng.graph import frontend
    from parallax_ng.planning.analysis import analyze
    from parallax_ng.config import Config
    from parallax_ng.planning.planner import make_plan
    from parallax_ng.planning.profile import Profile
    from passkit import HOST, devices
    g, _ = embedding_regression(4, "adam")
    tg = frontend.load(g)
    config = Config.from_dict({"run_option": "allreduce",
                               "buckets": {"mode": "mgwfbp", "a": 1e-4, "b": 1e-9}})
    plan = make_plan(tg, analyze(tg), config, devices(2), HOST)
    assert len(plan.buckets) == 1
    apart = Profile(1, {}, {"out/v": 0.1, "dense/b": 0.2, "dense/w": 0.3, "emb": 0.4}, 0.05)
    plan = make_plan(tg, analyze(tg), config, devices(2), HOST, order=apart.order,
                     profile=apart)
    assert [b.variables for b in plan.buckets] == [("out/v",), ("dense/b",), ("dense/w",)]


def test_mgwfbp_trains_like_one_device_with_a_given_or_a_measured_cost():
    """In-process the first step is profiled, the buckets planned again from
    it and training goes on in the rebuilt graph: still one device's result.
    Without a and b the profile step also runs the all-reduce benchmark on
    the replicas' devices and the buckets are planned with its fit."""
    with pytest.raises(pn.ConfigError, match="'buckets.a' and 'buckets.b' go together"):
        pn.Config.from_dict({"buckets": {"mode": "mgwfbp", "a": 1e-3}})

    def build(batch):
        return embedding_regression(batch, "adam", clip=True, ema=True)
    for cost in ({"a": 1e-3, "b": 1e-9}, {}):
        config = {"run_option": "allreduce", "buckets": {"mode": "mgwfbp", **cost},
                  "profile": {"replan": "always"}}
        seen = {}
        parallel, single_device, names = train_both(build, 2, 10, local(2), config, seen=seen)
        for name in names:
            for got in parallel[name]:
                assert np.max(np.abs(got - single_device[name])) <= 1e-5, (cost, name)
        assert seen["plan"].buckets, cost
        fit = seen["profile"].allreduce
        assert (fit is None) == bool(cost)
        if fit is not None:      # 4 KB .. 64 KB: the model has less than 4 KB of gradients
            assert [m for m, _ in fit.points] == [4096, 16384, 65536, 262144]
            assert fit.a >= 0 and fit.b >= 0


def test_a_profile_file_plans_the_buckets_and_makes_mgwfbp_the_default(tmp_path):
    """buckets.profile: the ready times and the fit come from the file (the
    same on every worker, nothing measured); mgwfbp is then the default."""
    import json

    from parallax_ng.config import Config
    path = tmp_path / "p.json"
    # input to output: dense/w, dense/b, out/v; far apart, a cheap all-reduce
    path.write_text(json.dumps({"forward_time": 0.05, "layers": [
        {"name": "dense/w", "bytes": 64, "backward_time": 0.1},
        {"name": "dense", "bytes": 8, "backward_time": 0.1, "variables": ["dense/b"]},
        {"name": "out/v", "bytes": 8, "backward_time": 0.1}],
        "allreduce": {"a": 1e-4, "b": 1e-9}}))
    config = Config.from_dict({"run_option": "allreduce", "buckets": {"profile": str(path)}})
    assert config.buckets.mode == "mgwfbp"
    assert Config.from_dict({}).buckets.mode == "threshold"
    g, _ = embedding_regression(4, "adam")
    plan = pn.transform_plan(g, local(2), config)
    assert [b.variables for b in plan.buckets] == [("out/v",), ("dense/b",), ("dense/w",)]
    # a large startup cost given in the config merges them all
    merged = Config.from_dict({"run_option": "allreduce",
                               "buckets": {"profile": str(path), "a": 1.0, "b": 0.0}})
    assert len(pn.transform_plan(g, local(2), merged).buckets) == 1
    with pytest.raises(pn.ConfigError, match="buckets.profile"):
        Config.from_dict({"buckets": {"profile": str(tmp_path / "missing.json")}})
    path.write_text(json.dumps({"forward_time": 0.0, "layers": []}))
    with pytest.raises(pn.ConfigError, match="has no all-reduce fit"):
        pn.transform_plan(g, local(2), config)

    def build(batch):
        return embedding_regression(batch, "adam", clip=True)
    path.write_text(json.dumps({"forward_time": 0.0, "layers": [
        {"name": "dense/w", "bytes": 64, "backward_time": 0.1}],
        "allreduce": {"a": 1.0, "b": 0.0}}))
    seen = {}
    parallel, single_device, names = train_both(
        build, 2, 10, local(2), {"run_option": "allreduce", "buckets": {"profile": str(path)}},
        seen=seen)
    for name in names:
        for got in parallel[name]:
            assert np.max(np.abs(got - single_device[name])) <= 1e-5, name
    assert len(seen["plan"].buckets) == 1 and seen["profile"].allreduce is None


def test_mgwfbp_under_horovod_needs_a_cost_it_is_given():
    """Horovod ranks do not measure: without a, b or a profile file the
    error names the keys (the plan is checked before Horovod is needed)."""
    g, _ = embedding_regression(4, "adam")
    config = {"run_option": "allreduce", "communication": {"backend": "horovod"},
              "buckets": {"mode": "mgwfbp"}}
    with pytest.raises(pn.ConfigError, match="buckets.a and buckets.b, or buckets.profile"):
        pn.transform(g, local(1), config, horovod=(0, 2))
    from parallax_ng import build
    from parallax_ng.config import Config
    from parallax_ng.graph import frontend
    from parallax_ng.resources import load_resources
    given = Config.from_dict({**config, "buckets": {"mode": "mgwfbp", "a": 1.0, "b": 0.0}})
    job = build.make(given, load_resources(local(1)), horovod=(0, 2))
    plan = build.Build(frontend.load(g), job).plan()
    assert len(plan.buckets) == 1
