"""Fetch and feed mapping: how each kind of fetch is run and combined."""
import numpy as np
import pytest

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng.runtime.fetches import Fetch, combine, first_part, sparse_rows


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


def test_a_sparse_batch_s_rows_and_a_batch_s_first_part():
    """Rows 2..3 of a sparse batch of 4 rows: their entries, numbered from
    0, under a dense shape of 2 rows; the first half of a global batch of
    feeds: dense rows, a sparse placeholder's rows (its three tensors),
    scalars whole."""
    indices = np.array([[0, 0], [1, 0], [1, 2], [2, 1], [3, 0], [3, 1]], np.int64)
    values = np.array([5, 6, 7, 8, 9, 10], np.int64)
    shape = np.array([4, 3], np.int64)
    i, v, sh = sparse_rows(indices, values, shape, 2, 2)
    assert i.tolist() == [[0, 1], [1, 0], [1, 1]] and v.tolist() == [8, 9, 10]
    assert sh.tolist() == [2, 3] and sh.dtype == np.int64
    batch = {"x:0": np.arange(8.0).reshape(4, 2), "lr:0": np.float32(0.1),
             "ids/indices:0": indices, "ids/values:0": values, "ids/shape:0": shape}
    half = first_part(batch, 2)
    assert half["x:0"].tolist() == [[0, 1], [2, 3]] and half["lr:0"] == np.float32(0.1)
    assert half["ids/indices:0"].tolist() == [[0, 0], [1, 0], [1, 2]]
    assert half["ids/values:0"].tolist() == [5, 6, 7] and half["ids/shape:0"].tolist() == [2, 3]
