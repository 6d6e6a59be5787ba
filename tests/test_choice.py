"""The plan whose links carry a step fastest (parallax_ng/planning/choice.py): hybrid
and auto in a job with servers weigh whole plans; a dense-heavy model with
one server apart goes to the ring, a small one on one machine to the
servers; every worker chooses alike."""
import pytest

import parallax_ng as pn
from parallax_ng.cluster import ClusterInfo
from parallax_ng.planning.plan import Candidate
from test_traffic import classifier

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
    labels = [c.label for c in plan.choice]
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
    assert [c.label.split(", ")[1] for c in plan.choice] == ["sparse ps"] * 3
    assert isinstance(plan.choice[0], Candidate)


def test_auto_weighs_each_dense_method_with_three_ways_for_the_sparse_ones():
    plan = pn.transform_plan(classifier(), resources(4), {"run_option": "auto",
                                                          "network": NET})
    ways = {c.label.split(", sparse ")[1] for c in plan.choice}
    assert ways <= {"EmbRace's costs", "on the servers", "by collectives"}
    assert "on the servers" in ways and len(plan.choice) >= 6
    assert methods(plan)["out/w"] == "allreduce"
