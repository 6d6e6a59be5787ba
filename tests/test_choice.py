"""The plan whose links carry a step fastest (parallax_ng/choice.py): hybrid
and auto in a job with servers weigh whole plans; a dense-heavy model with
one server apart goes to the ring, a small one on one machine to the
servers; every worker chooses alike."""
import pytest

import parallax_ng as pn
from parallax_ng.cluster import ClusterInfo
from parallax_ng.plan import Candidate
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


def test_a_small_model_on_one_machine_is_decided_by_its_rounds_of_messages():
    """One machine has no link: bytes are free, and the plan with the
    fewest rounds of messages wins. With the configured latency beta a
    round of collectives over 2 replicas costs a = 2 beta, a server round
    trip r = 2 beta: the step on the servers alone has two round trips,
    the ring with all-gather two rounds, the ring beside the servers one
    round, two round trips and one more for its second run."""
    plan = pn.transform_plan(classifier(), resources(2, loopback=True), {"network": NET})
    assert all(c.link_seconds == 0 and c.end == "" for c in plan.choice)
    by = {c.label: c for c in plan.choice}
    beta = NET["latency"]
    assert by["dense ps, sparse ps"].fixed_seconds == pytest.approx(4 * beta)
    assert by["dense allreduce, sparse allgather"].fixed_seconds == pytest.approx(4 * beta)
    assert by["dense allreduce, sparse ps"].fixed_seconds == pytest.approx(8 * beta)
    assert plan.choice[0].label == "dense ps, sparse ps"      # ties: the servers first
    assert "first in the order of preference" in plan.format()


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
