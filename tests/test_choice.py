"""The plan whose links carry a step fastest (parallax_ng/planning/choice.py): hybrid
and auto in a job with servers weigh whole plans; a dense-heavy model with
one server apart goes to the ring, a small one on one machine to the
servers; every worker chooses alike."""
import pytest
import tensorflow as tf

import parallax_ng as pn
from parallax_ng.cluster import ClusterInfo
from parallax_ng.planning.plan import Candidate
from test_traffic import BATCH, CLASSES, ROWS, WIDTH, classifier

tf1 = tf.compat.v1

NET = {"bandwidth": 1.25e7, "latency": 1e-4}      # 100 Mb/s


def resources(workers=2, per_host=False, loopback=False):
    hosts = [{"address": "127.0.0.1" if loopback else f"10.0.0.{10 + i}:{4000 + i}",
              "devices": ["cpu:0"]} for i in range(workers)]
    ps = "per_host" if per_host else ["127.0.0.1" if loopback else f"10.0.0.{10 + workers}:5000"]
    return {"hosts": hosts, "ps": ps}


def methods(plan):
    return {v: vp.method for v, vp in plan.variables.items()}


def test_one_server_apart_sends_a_dense_heavy_model_round_the_ring():
    plan = pn.transform_plan(classifier(), resources(4), {"network": NET})
    assert methods(plan)["out/w"] == "allreduce"
    labels = [c.label for c in plan.choice if "factors" not in c.label]
    assert len(labels) == 6 and labels[0].startswith("dense allreduce")
    fused = next(c for c in plan.choice if c.label == "dense bfb, sparse ps")
    won = plan.choice[0]
    assert won.chosen and not fused.chosen
    assert fused.end == "10.0.0.14 (ps 0)" and won.end.startswith("10.0.0.1")
    assert fused.link_seconds > 2 * won.link_seconds    # N D at the server, 2(N-1)/N D
    text = plan.format()
    assert "plans weighed by their busiest link (network 0.1 Gb/s" in text
    assert f"chosen: {won.label}: " in text and "the bytes on the busiest link decide" in text


def test_one_machine_with_a_configured_network_is_decided_by_its_rounds_of_messages():
    """One machine has no network link, and a configured network says
    nothing of its loopback: bytes are free, and the plan with the fewest
    rounds of messages wins. With the configured latency beta a round of
    collectives over 2 replicas costs a = 2 beta, a server round trip
    r = 2 beta: the step on the servers alone has two round trips, the
    ring with all-gather two rounds, the ring beside the servers one
    round, two round trips and one more for its second run. Of equal
    times, the one that moves fewer bytes between tasks wins."""
    plan = pn.transform_plan(classifier(), resources(2, loopback=True), {"network": NET})
    assert all(c.link_seconds == 0 and c.end == "" for c in plan.choice)
    by = {c.label: c for c in plan.choice}
    beta = NET["latency"]
    assert by["dense ps, sparse ps"].fixed_seconds == pytest.approx(4 * beta)
    assert by["dense allreduce, sparse allgather"].fixed_seconds == pytest.approx(4 * beta)
    assert by["dense allreduce, sparse ps"].fixed_seconds == pytest.approx(10 * beta)
    assert by["dense ps, sparse ps"].total > by["dense allreduce, sparse allgather"].total
    assert plan.choice[0].label == "dense allreduce, sparse allgather"
    assert "fewer bytes over all links" in plan.format()


def test_a_measured_machine_charges_the_bytes_between_its_tasks():
    """Where the job's workers ran the all-reduce benchmark on one host,
    the bytes between a host's tasks cost its CPU at the rate they moved
    there together (N B): one server's twice-the-ring bytes lose to the
    ring even when its rounds cost less."""
    from parallax_ng.planning import planner, traffic
    from parallax_ng.planning.costfit import Fit
    from parallax_ng.planning.profile import Profile
    fit = Fit(a=5e-4, b=1e-8, points=((1e4, 5e-4 + 1e-4), (1e6, 5e-4 + 1e-2)))
    layout = traffic.Layout.local(2, 1)
    net = planner.network(pn.Config(), Profile(1, allreduce=fit, round_trip=2e-4), 2, layout)
    assert net.bandwidth == pytest.approx(1e8) and net.loopback == pytest.approx(2e8)
    assert "between the tasks of a host" in net.describe()
    apart = planner.network(pn.Config(), Profile(1, allreduce=fit, round_trip=2e-4), 2,
                            traffic.Layout(("10.0.0.1", "10.0.0.2"), ("10.0.0.3",)))
    assert apart.loopback is None
    g = classifier()
    plans = {}
    for dense, sparse in (("allreduce", "allgather"), ("ps", "ps")):
        config = pn.Config(run_option="hybrid", dense_method=dense, sparse_method=sparse)
        plans[dense] = pn.transform_plan(g, resources(2, loopback=True), config)
    ring = traffic.predict(plans["allreduce"], layout, net)
    whole = traffic.predict(plans["ps"], layout, net)
    assert ring.end == whole.end == "127.0.0.1"
    assert ring.nbytes == pytest.approx(sum(b for *_, b, _ in traffic.flows(plans["allreduce"])))
    assert whole.link_seconds == pytest.approx(whole.nbytes / 2e8)
    assert whole.nbytes > 1.5 * ring.nbytes and whole.seconds > ring.seconds
    assert whole.fixed_seconds < ring.fixed_seconds
    from parallax_ng.planning import choice
    chosen = choice.best(list(plans.items()), layout, net, {})
    assert [(c.label, c.end, c.chosen) for c in chosen.choice] == [
        ("allreduce", "127.0.0.1 loopback", True), ("ps", "127.0.0.1 loopback", False)]
    assert chosen.choice[1].sent == chosen.choice[1].received == whole.nbytes


def test_a_server_beside_every_worker_evens_the_servers_out():
    """Per-host servers: fusion buffers cross each host's link with the
    ring's bytes, whole variables on servers pile on one host."""
    plan = pn.transform_plan(classifier(), resources(4, per_host=True), {"network": NET})
    by = {c.label: c for c in plan.choice}
    ring, fused = by["dense allreduce, sparse ps"], by["dense bfb, sparse ps"]
    whole = by["dense ps, sparse ps"]
    assert abs(fused.link_seconds - ring.link_seconds) < 0.05 * ring.link_seconds
    assert whole.link_seconds > 1.5 * fused.link_seconds
    assert not whole.chosen


def test_every_worker_chooses_alike_and_the_choice_is_not_a_decision_by_itself():
    res = resources(2)
    hosts = tuple(h["address"] for h in res["hosts"])
    plans = []
    for task in (0, 1):
        info = ClusterInfo(hosts, tuple(res["ps"]), "worker", task, (("CPU", 0),))
        _, ctx, _ = pn.transform(classifier(), config={"network": NET}, cluster_info=info)
        plans.append(ctx.plan)
    assert methods(plans[0]) == methods(plans[1])
    assert [c.label for c in plans[0].choice if c.chosen] == \
        [c.label for c in plans[1].choice if c.chosen]
    assert plans[0].decisions().choice == ()


def test_a_method_the_config_sets_is_not_weighed():
    for config in ({"dense_method": "bfb"}, {"run_option": "ps"},
                   {"run_option": "allreduce"}):
        plan = pn.transform_plan(classifier(), resources(2), {"network": NET, **config})
        assert plan.choice == ()
    plan = pn.transform_plan(classifier(), resources(2),
                             {"network": NET, "sparse_method": "ps"})
    assert {c.label.split(", ")[-1] for c in plan.choice} == {"sparse ps"}
    assert isinstance(plan.choice[0], Candidate)


def test_auto_weighs_each_dense_method_with_four_ways_for_the_sparse_ones():
    plan = pn.transform_plan(classifier(), resources(4), {"run_option": "auto",
                                                          "network": NET})
    ways = {c.label.split(", sparse ")[1] for c in plan.choice}
    assert ways <= {"EmbRace's costs", "on the servers", "by collectives", "by all-gather"}
    assert "on the servers" in ways and len(plan.choice) >= 6
    assert methods(plan)["out/w"] == "allreduce"


def with_bias():
    """An embedding and a [ROWS] bias read by the same ids (as a sampled
    softmax's weights and bias are), then a dense layer."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [BATCH, 8], name="ids")
        label = tf1.placeholder(tf.int64, [BATCH], name="label")
        h = tf.reduce_mean(tf.nn.embedding_lookup(tf1.get_variable("emb", [ROWS, WIDTH]), ids),
                           axis=1)
        shift = tf.reduce_mean(tf.gather(tf1.get_variable("bias", [ROWS]), ids), axis=1,
                               keepdims=True)
        logits = tf.matmul(h, tf1.get_variable("out/w", [WIDTH, CLASSES])) + shift
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=label, logits=logits))
        tf1.train.AdagradOptimizer(0.1).minimize(loss)
    return g


def test_auto_weighs_every_table_by_all_gather_beside_embraces_costs():
    """EmbRace's per-variable costs price each table alone: at 1 Gb/s with
    2 replicas the embedding's rows go by all-gather, but the small bias
    costs a dense all-reduce fewer messages (2 against 3) and goes whole.
    Beside the embedding's all-gather those messages cost the step
    nothing more (its rounds are the all-gather's), and the whole bias is
    more bytes than its rows: the plan with every table by all-gather is
    weighed too, and ranks ahead."""
    gbit = {"bandwidth": 1.25e8, "latency": 1e-4}
    plan = pn.transform_plan(with_bias(), resources(2), {"run_option": "auto",
                                                         "network": gbit})
    by = {c.label: c for c in plan.choice}
    embrace = by["dense allreduce, sparse EmbRace's costs"]
    gathered = by["dense allreduce, sparse by all-gather"]
    assert dict(embrace.methods)["emb"] == "allgather"
    assert dict(embrace.methods)["bias"] == "allreduce"
    assert dict(gathered.methods)["bias"] == "allgather"
    assert gathered.fixed_seconds == pytest.approx(embrace.fixed_seconds)
    assert gathered.total < embrace.total and gathered.seconds < embrace.seconds
    labels = [c.label for c in plan.choice]
    assert labels.index(gathered.label) < labels.index(embrace.label)


def test_auto_weighs_each_dense_method_also_without_factors():
    """A kernel whose factors cost fewer bytes than its own gradient still
    costs the step a round of collectives beside the servers (and a
    session run of its own): auto weighs every dense method alone as well
    as with such kernels by their factors, and on one machine, where bytes
    are free, the plan of servers alone (two round trips) beats the same
    plan with out/w by factors, as hybrid weighs them."""
    config = {"run_option": "auto", "network": NET}
    plan = pn.transform_plan(classifier(), resources(2, loopback=True), config)
    by = {c.label: c for c in plan.choice}
    plain = by["dense ps, sparse on the servers"]
    mixed = by["dense ps or by factors where cheaper, sparse on the servers"]
    assert plain.fixed_seconds == pytest.approx(4 * NET["latency"])
    assert mixed.fixed_seconds > plain.fixed_seconds
    hybrid = pn.transform_plan(classifier(), resources(2, loopback=True), {"network": NET})
    assert plan.choice[0].seconds == pytest.approx(hybrid.choice[0].seconds)


def test_dense_layers_go_by_their_factors_where_those_cost_less_with_their_product():
    """At 100 Mb/s between 2 workers, out/w (64 x 500) by its factors sends
    32 rows of 64 + 500 floats a replica, fewer bytes than the ring's
    2(G-1)/G of its 128 KB, and its product (2 G 32 x 64 x 500
    operations) costs little; hidden/w (16 x 64) moves fewer bytes by the
    ring. At 4 workers the gathered factors outgrow the ring's share."""
    from parallax_ng.methods import factor_bytes
    from parallax_ng.planning import traffic
    plan = pn.transform_plan(classifier(), resources(2), {"network": NET})
    assert methods(plan)["out/w"] == "factors" and methods(plan)["hidden/w"] == "allreduce"
    won = plan.choice[0]
    assert won.chosen and won.label.startswith("dense allreduce but out/w by factors")
    plain = next(c for c in plan.choice if c.label == "dense allreduce, sparse ps")
    assert won.seconds < plain.seconds
    info = plan.variables["out/w"].info
    assert info.factors == (32, 564) and factor_bytes(info) == 32 * 564 * 4
    ring = {what: b for src, dst, b, what in traffic.flows(plan) if src == "worker 0"}
    assert ring["out/w"] == pytest.approx(32 * 564 * 4 + 4 * 32)
    product = traffic.product_seconds(plan, plan_network(plan))
    assert product == pytest.approx(2 * 2 * 32 * 64 * 500 / 2e10)
    assert "out/w by factors" in plan.format()
    four = pn.transform_plan(classifier(), resources(4), {"network": NET})
    assert "factors" not in methods(four).values()


def test_without_servers_hybrid_weighs_the_ring_against_kernels_by_their_factors():
    """No servers: hybrid's candidates are the ring with sparse variables
    by all-gather, and the same with out/w by its factors, which wins at
    100 Mb/s; at 4 workers the ring stays, and a model without kernels is
    not weighed (its plan has no choice)."""
    from parallax_ng.planning import choice
    two = {"hosts": resources(2)["hosts"]}
    plan = pn.transform_plan(classifier(), two, {"network": NET})
    assert [c.label for c in plan.choice] == [
        "dense allreduce but out/w by factors, sparse allgather", "dense allreduce, sparse allgather"]
    assert plan.choice[0].chosen and methods(plan)["out/w"] == "factors"
    assert methods(plan)["hidden/w"] == "allreduce" and methods(plan)["emb"] == "allgather"
    assert "has no parameter server" in " ".join(plan.notes)
    four = pn.transform_plan(classifier(), {"hosts": resources(4)["hosts"]}, {"network": NET})
    assert "factors" not in methods(four).values() and four.choice[0].chosen
    assert not choice.weighs(pn.Config(), 2, (), {k: vp.info for k, vp in plan.variables.items()
                                           if vp.info.sparse})
    assert not choice.weighs(pn.Config(run_option="auto"), 2, (),
                             {k: vp.info for k, vp in plan.variables.items()})


def plan_network(plan):
    from parallax_ng.planning import costmodel
    return costmodel.Network(NET["bandwidth"], NET["latency"])


def test_the_product_of_the_factors_decides_where_bytes_cost_little():
    """With a fast network the product every replica makes of the gathered
    factors costs more than the bytes it saves: a measured MatMul rate
    (worker 0's, shared with the profile) that is slow keeps the ring."""
    from parallax_ng.planning import choice, costmodel
    from parallax_ng.planning.analysis import VariableInfo
    vi = VariableInfo("k", (256, 2000), "float32", 256 * 2000 * 4, False, None, "", 0,
                      (128, 2256))
    slow = costmodel.Network(1.25e7, 1e-4, flops=3e10)
    fast = costmodel.Network(1.25e9, 1e-4, flops=3e10)
    config = pn.Config()
    assert choice.by_factors({"k": vi}, config, "allreduce", slow, 2, 1) == ["k"]
    assert choice.by_factors({"k": vi}, config, "allreduce", fast, 2, 1) == []
    cheap = costmodel.seconds("factors", vi, 2, 1, fast)
    assert cheap == pytest.approx(128 * 2257 * 4 / 1.25e9 + 3e-4 + 2 * 2 * 128 * 512000 / 3e10)
    assert "30 GFLOP/s of MatMul" in fast.describe()
    named = pn.Config(variable_methods={"k": "allreduce"})
    assert choice.by_factors({"k": vi}, named, "allreduce", slow, 2, 1) == []
    unknown = VariableInfo("k", (256, 2000), "float32", 256 * 2000 * 4, False, None, "", 0,
                           (None, 2256))
    assert choice.by_factors({"k": unknown}, config, "allreduce", slow, 2, 1) == []


def test_rows_the_graph_does_not_know_are_not_weighed_until_measured():
    """A batch of unknown size leaves the factors' rows unknown: no
    candidate goes by factors (their bytes would look free), and auto does
    not allow them; a measured step's rows (worker 0's, shared) let them in."""
    from parallax_ng.planning import planner
    from parallax_ng.planning.analysis import analyze
    from parallax_ng.planning.profile import Profile
    from parallax_ng.graph import frontend
    g = classifier_any_batch()
    plan = pn.transform_plan(g, resources(2), {"network": NET})
    assert not any("factors" in c.label for c in plan.choice)
    assert plan.variables["out/w"].info.factors == (None, 564)
    auto = pn.transform_plan(g, resources(2), {"run_option": "auto", "network": NET})
    assert "factors" not in auto.costs["out/w"]
    tg = frontend.load(g)
    info = Profile(1, factor_rows={"out/w": 32, "hidden/w": 32}).apply(analyze(tg), tg)
    assert "factors" in planner.allowed_methods(info["out/w"], "out/w", True, None, None)
    measured = Profile(1, factor_rows={"out/w": 32, "hidden/w": 32}, flops=1e10)
    net = planner.network(pn.Config.from_dict({"network": NET}), measured, 2)
    assert net.flops == 1e10


def classifier_any_batch():
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None, 8], name="ids")
        label = tf1.placeholder(tf.int64, [None], name="label")
        emb = tf1.get_variable("emb", [1000, 16])
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), axis=1)
        h = tf.nn.relu(tf.matmul(h, tf1.get_variable("hidden/w", [16, 64])))
        logits = tf.matmul(h, tf1.get_variable("out/w", [64, 500]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=label, logits=logits))
        tf1.train.AdagradOptimizer(0.1).minimize(loss)
    return g


def test_a_worker_plans_with_the_rows_and_matmul_rate_worker_0_measured():
    """In a job, worker 0's first step gives the factors' rows the graph
    does not know and its MatMul rate (build.measure_job shares them with
    the profile); every worker then weighs the factors alike."""
    from parallax_ng import build
    from parallax_ng.config import load_config
    from parallax_ng.graph import frontend
    res = resources(2)
    hosts = tuple(h["address"] for h in res["hosts"])
    shared = {"order": [], "ready": {}, "rows": {"emb": 40.0},
              "factor_rows": {"out/w": 32, "hidden/w": 32}, "flops": 3e10,
              "allreduce": None, "round_trip": None, "session_run": None}
    chosen = []
    for task in (0, 1):
        info = ClusterInfo(hosts, tuple(res["ps"]), "worker", task, (("CPU", 0),))
        b = build.Build(frontend.load(classifier_any_batch()),
                        build.make(load_config({"network": NET}), None, info), shared)
        assert b.measured.flops == 3e10 and b.measured.factor_rows["out/w"] == 32
        plan = b.plan()
        assert plan.variables["out/w"].info.factors == (32, 564)
        assert "30 GFLOP/s of MatMul" in plan.network
        chosen.append(methods(plan))
    assert chosen[0] == chosen[1] and chosen[0]["out/w"] == "factors"
