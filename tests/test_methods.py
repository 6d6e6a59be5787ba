"""The method registry: what each communication method takes (and why
not), its cost and bytes, its placement flags and the passes that build it,
and that the config, the planner and the cost model all read it."""
from dataclasses import replace

import pytest

import parallax_ng as pn
import transforms
from models import embedding_regression, local
from parallax_ng import config, methods
from parallax_ng.planning import costmodel
from parallax_ng.planning.analysis import VariableInfo
from parallax_ng.planning.costmodel import Network

NET = Network(bandwidth=1.0, latency=0.0)


def info(sparse=True, nbytes=1000, alpha=0.1, shape=(100, 10)):
    return VariableInfo("v", shape, "float32", nbytes, sparse, alpha if sparse else None,
                        "estimate" if sparse else "dense", 0)


def test_the_config_and_the_cost_model_list_the_registry():
    assert config.METHODS == tuple(methods.METHODS) == costmodel.METHODS
    assert config.DENSE_METHODS == ("auto", "allreduce", "bfb", "ps", "factors")
    assert config.SPARSE_METHODS == ("auto", "allreduce", "alltoall", "allgather", "ps")


def test_each_method_refuses_what_it_cannot_take_and_says_what_can():
    m = methods.METHODS
    assert m["bfb"].refusal("emb", sparse=True) == (
        "config key 'variable_methods.emb' is bfb (balanced fusion buffers, for dense "
        "gradients), but emb has a sparse gradient; use allreduce, alltoall, allgather, ps")
    assert "has a dense gradient; use allreduce, bfb, ps" in m["alltoall"].refusal("w", False)
    assert "has a dense gradient" in m["allgather"].refusal("w", False)
    assert "sees them one by one; use alltoall, allgather, ps" in m["allreduce"].refusal(
        "emb", True, can_sum_rows=False)
    assert m["allreduce"].refusal("emb", True, can_sum_rows=True) is None
    assert all(m[n].refusal("w", False) is None for n in ("allreduce", "bfb", "ps", "factors"))
    assert "not MatMul(a, b, transpose_a=True) of two 2-D tensors" in m["factors"].refusal(
        "b", False, factors=False)
    assert "has a sparse gradient" in m["factors"].refusal("emb", True)
    assert all(m[n].refusal("e", True) is None for n in ("allreduce", "alltoall",
                                                          "allgather", "ps"))


def test_costs_are_the_papers_tables():
    """With beta = 0 and B = 1: EmbRace's Table 2 in bytes; Parallax's Table 3
    for the bytes one replica sends and receives."""
    n, s, v = 4, 2, info()
    assert methods.seconds("ps", v, n, s, NET) == pytest.approx(2 * n * 0.1 * 1000 / s)
    assert methods.seconds("allgather", v, n, s, NET) == pytest.approx((n - 1) * 0.1 * 1000)
    assert methods.seconds("alltoall", v, n, s, NET) == pytest.approx(
        (n - 1) * 2 * 0.1 * 1000 / n)
    assert methods.seconds("allreduce", v, n, s, NET) == pytest.approx(
        2 * (n - 1) * 1100 / n)                       # the rows' counts besides
    assert all(methods.seconds(m, v, 1, s, NET) == 0.0 for m in methods.METHODS)
    dense = info(sparse=False)
    assert methods.METHODS["ps"].replica_bytes(dense, n) == 2000
    assert methods.METHODS["allreduce"].replica_bytes(dense, n) == 2 * 3 * 1000 / 4
    assert methods.METHODS["allgather"].replica_bytes(v, n) == pytest.approx(2 * 3 * 100)
    assert costmodel.seconds("bfb", dense, n, s, NET) == methods.seconds("bfb", dense, n, s,
                                                                         NET)
    # a [100, 10] float32 weight whose gradient is [32 rows of 100 | 32 rows of 10]^T products:
    # every replica's factors (32 * 110 * 4 bytes, a 4-byte id a row) to every other
    factored = replace(dense, nbytes=4000, factors=(32, 110))
    assert methods.factor_bytes(factored) == 32 * 110 * 4
    bytes_only = replace(NET, flops=float("inf"))
    assert methods.seconds("factors", factored, n, s, bytes_only) == (n - 1) * 32 * (110 + 1) * 4
    # and the product of the gathered factors on every replica: 2 N rows x 1000 elements
    assert methods.seconds("factors", factored, n, s, replace(NET, flops=1e3)) == \
        pytest.approx((n - 1) * 32 * (110 + 1) * 4 + 2 * n * 32 * 1000 / 1e3)
    assert methods.METHODS["factors"].replica_bytes(factored, n) == 2 * (n - 1) * 32 * 110 * 4


def test_flags_say_where_a_method_puts_a_variable():
    m = methods.METHODS
    assert [n for n, x in m.items() if x.shared] == ["ps"]
    assert [n for n, x in m.items() if x.fused] == ["bfb"]
    assert [n for n, x in m.items() if x.columns] == ["alltoall"]
    assert [n for n, x in m.items() if x.servers] == ["bfb", "ps"]
    assert [n for n, x in m.items() if x.all_reduced] == ["allreduce"]
    assert [n for n, x in m.items() if x.factored] == ["factors"]


def test_the_passes_a_method_names_exist():
    names = {p.name for p in (getattr(transforms, n)() for n in dir(transforms)
                              if n.endswith("Pass"))}
    for m in methods.METHODS.values():
        assert "aggregate" in m.passes and set(m.passes) <= names, m.name


def test_the_planner_takes_its_choices_from_the_registry():
    g, _ = embedding_regression(4, "adam")
    with pytest.raises(pn.ConfigError, match="is bfb .* use allreduce, alltoall"):
        pn.transform_plan(g, local(2), {"variable_methods": {"emb": "bfb"}})
    plan = pn.transform_plan(g, local(2), {"variable_methods": {"emb": "allgather"}})
    assert not plan.variables["emb"].shared and plan.variables["emb"].method == "allgather"
