"""parallax_ng/planning/costmodel.py and run_option auto: EmbRace's Table 2 by hand,
the network constants from an all-reduce fit, and choices where the answer
is clear."""
import numpy as np
import pytest

import parallax_ng as pn
from models import embedding_regression, local, train_both
from parallax_ng.planning import costmodel
from parallax_ng.planning.analysis import VariableInfo
from parallax_ng.config import load_config
from parallax_ng.errors import ConfigError

NET = costmodel.Network(bandwidth=1e9, latency=1e-5)


def table(rows=1000, cols=64, alpha=0.01, sparse=True):
    return VariableInfo("emb", (rows, cols), "float32", rows * cols * 4, sparse,
                        alpha if sparse else None, "measured", 0)


def test_embrace_table_2_by_hand():
    v = table()                     # M = 256,000 bytes, alpha M = 2,560 bytes
    m, am, n, s = 256_000, 2_560, 4, 2
    got = costmodel.costs(v, costmodel.METHODS, n, s, NET)
    assert got["allreduce"] == pytest.approx(2 * 3 * (m * 65 / 64 / (4 * 1e9) + 1e-5))
    assert got["ps"] == pytest.approx(2 * 4 * (am / (2 * 1e9) + 1e-5))
    # the bytes are Table 2's; the latency terms count this lowering's
    # collectives: 3 per all-gather, 4 per alltoall lookup and gradient
    assert got["allgather"] == pytest.approx(3 * (am / 1e9 + 3 * 1e-5))
    assert got["alltoall"] == pytest.approx(3 * (2 * am / (4 * 1e9) + 4 * 1e-5))
    dense = costmodel.costs(table(sparse=False), ("allreduce",), n, s, NET)
    assert dense == {"allreduce": pytest.approx(2 * 3 * (m / (4 * 1e9) + 1e-5))}
    assert costmodel.costs(v, costmodel.METHODS, 1, 0, NET)["alltoall"] == 0.0
    # a 1-D sparse variable summed as dense carries a count per row: twice its bytes
    bias = VariableInfo("b", (1000,), "float32", 4000, True, 0.01, "measured", 0)
    got = costmodel.costs(bias, ("allreduce",), n, s, NET)["allreduce"]
    assert got == pytest.approx(2 * 3 * (8000 / (4 * 1e9) + 1e-5))


def test_network_from_a_ring_allreduce_fit():
    n = 4
    a, b = 2 * (n - 1) * NET.latency, 2 * (n - 1) / (n * NET.bandwidth)
    got = costmodel.Network.from_allreduce(a, b, n)
    assert got.bandwidth == pytest.approx(NET.bandwidth)
    assert got.latency == pytest.approx(NET.latency)
    assert "all-reduce benchmark" in got.describe()


@pytest.mark.parametrize("alpha,replicas,servers,want", [
    (0.01, 8, 0, "alltoall"),      # many replicas: a part of each row each way
    (0.001, 2, 0, "allgather"),    # two replicas: the same bytes, half the messages
    (0.05, 2, 8, "ps"),            # more servers than replicas share the rows' bytes
])
def test_sparse_choices(alpha, replicas, servers, want):
    v = table(rows=100_000, alpha=alpha)
    got = costmodel.costs(v, ("allreduce", "alltoall", "allgather", "ps"), replicas, servers,
                          NET)
    assert costmodel.choose(got) == want
    assert got["alltoall"] < got["allreduce"]      # a sparse table never wins by the ring


def test_auto_keeps_dense_variables_on_allreduce_and_cuts_a_large_table():
    g, _ = embedding_regression(4, "adam")
    plan = pn.transform_plan(g, local(4), {"run_option": "auto", "network": {
        "bandwidth": 1e9, "latency": 0.0}})
    assert {v: vp.method for v, vp in plan.variables.items() if not vp.info.sparse} == \
        {"dense/w": "allreduce", "dense/b": "allreduce", "out/v": "allreduce"}
    assert plan.variables["emb"].method == "alltoall"   # no latency: the fewest bytes
    assert set(plan.costs["emb"]) == {"allreduce", "alltoall", "allgather"}
    text = plan.format()
    assert "predicted ms/step by method (network 8 Gb/s, 0 us per message (config " \
           "network))" in text and "alltoall* " in text
    assert plan.decisions().costs == {}
    slow = pn.transform_plan(g, local(2), {"run_option": "auto", "network": {
        "bandwidth": 1e12, "latency": 1.0}})
    assert slow.variables["emb"].method == "allreduce"    # one ring: the fewest messages


def test_auto_trains_like_one_device():
    """Whatever auto picks (it measures the network at the profile step and
    may plan and build again), the result equals one device."""
    seen = {}
    parallel, single, names = train_both(lambda b: embedding_regression(b, "adam", clip=True),
                                         4, 6, config={"run_option": "auto"}, seen=seen)
    assert seen["plan"].costs and "all-reduce benchmark" in seen["plan"].network
    for name, want in single.items():
        for got in parallel[name]:
            assert np.max(np.abs(np.asarray(got) - want)) <= 1e-5, name


def test_network_config_errors():
    with pytest.raises(ConfigError, match="network.bandwidth"):
        load_config({"network": {"bandwidth": -1}})
    with pytest.raises(ConfigError, match="network.latency"):
        load_config({"network": {"bandwidth": 1e9, "latency": "fast"}})


def test_auto_takes_each_variable_s_cheapest_method_and_weighs_whole_plans_in_a_job():
    """Per variable, the cheapest method of EmbRace's table (a dense one:
    `dense_method` when set). In a job with servers the plans that mix
    those with each dense method, or put every sparse variable on the
    servers or on collectives, are weighed whole by their links
    (parallax_ng/planning/choice.py, test_choice.py)."""
    from parallax_ng.config import Config
    from parallax_ng.planning.planner import choose_methods
    info = {"emb": table(), "w": table(sparse=False)}
    costs = {"emb": {"allgather": 2.0, "ps": 1.0}, "w": {"allreduce": 1.0, "bfb": 2.0}}
    assert choose_methods(info, Config(run_option="auto"), True, costs=costs) == {
        "emb": "ps", "w": "allreduce"}
    assert choose_methods(info, Config(run_option="auto", dense_method="bfb"), True,
                          costs=costs) == {"emb": "ps", "w": "bfb"}
    g, _ = embedding_regression(4, "adam")
    hosts = [{"address": f"10.0.0.{i}", "devices": ["cpu:0"]} for i in range(4)]
    plan = pn.transform_plan(g, {"hosts": hosts, "ps": ["10.0.0.9"]}, {
        "run_option": "auto", "network": {"bandwidth": 1e6, "latency": 0.0}})
    assert set(plan.costs["emb"]) == {"allreduce", "alltoall", "allgather", "ps"}
    assert {c.label for c in plan.choice} >= {"dense allreduce, sparse EmbRace's costs",
                                              "dense bfb, sparse on the servers"}
    won = [c for c in plan.choice if c.chosen]
    assert len(won) == 1 and won[0].seconds == min(c.seconds for c in plan.choice)
