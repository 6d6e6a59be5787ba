"""Fetch and feed mapping: how each kind of fetch is run and combined."""
import numpy as np
import pytest

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng.runtime.fetches import Fetch, combine


def test_each_kind_of_fetch():
    g, h = embedding_regression(4, "adam")
    with pn.get_runner(g, local(2), {"run_option": "hybrid"}) as runner:
        fm = runner.fetches
        op = fm.fetch(h["train"])
        assert op.how == "none" and len(op.names) == 2            # every replica's train op
        assert fm.fetch("dense/w/Read/ReadVariableOp:0").how == "first"    # equal everywhere
        loss = fm.fetch("loss:0")
        assert loss.how == "mean" and loss.names == ("loss:0", "parallax/replica_1/loss:0")
        assert fm.fetch(h["pred"]).how == "concat"
        shared = fm.fetch("emb/Read/ReadVariableOp:0", per_replica=True)
        assert shared.how == "list" and len(shared.replicas) == 2


def test_combining_values():
    a, b = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    assert combine([a, b], Fetch(("x", "y"), "mean", "x")).tolist() == [2.0, 3.0]
    assert combine([a, b], Fetch(("x", "y"), "sum", "x")).tolist() == [4.0, 6.0]
    assert combine([a, b], Fetch(("x", "y"), "concat", "x")).tolist() == [1, 2, 3, 4]
    assert combine([a], Fetch(("x",), "list", "x", (0, 0)))[1] is a
    assert combine([a, b], Fetch(("x", "y"), "first", "x")) is a
    assert combine([None], Fetch(("x",), "none", "x")) is None
    with pytest.raises(ValueError):
        combine([a, np.array(5.0)], Fetch(("x", "y"), "mean", "x"))   # shapes disagree
