"""How the replicas' values of one fetch make one value."""
import numpy as np
import pytest
from tensorflow.compat.v1 import SparseTensorValue

from parallax_ng.runtime.combining import Fetch, combine


def test_combining_values():
    a, b = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    assert combine([a, b], Fetch(("x", "y"), "mean", "x")).tolist() == [2.0, 3.0]
    assert combine([a, b], Fetch(("x", "y"), "sum", "x")).tolist() == [4.0, 6.0]
    assert combine([a, b], Fetch(("x", "y"), "concat", "x")).tolist() == [1, 2, 3, 4]
    assert combine([a, b], Fetch(("x", "y"), "max", "x")).tolist() == [3.0, 4.0]
    assert combine([a, b], Fetch(("x", "y"), "min", "x")).tolist() == [1.0, 2.0]
    assert combine([a], Fetch(("x",), "list", "x", (0, 0)))[1] is a
    assert combine([a, b], Fetch(("x", "y"), "first", "x")) is a
    assert combine([None], Fetch(("x",), "none", "x")) is None
    with pytest.raises(ValueError):
        combine([a, np.array(5.0)], Fetch(("x", "y"), "mean", "x"))   # shapes disagree


def test_sparse_values_join_by_rows_or_come_from_replica_0():
    """A SparseTensor's three tensors from each replica: "sparse rows" joins
    the replicas' rows (replica 1's after replica 0's 2 rows), "sparse
    first" is replica 0's, "sparse list" every replica's."""
    def part(name):
        return Fetch((f"{name}:0", f"{name}_1:0"), "list", name, (0, 1))
    parts = (part("indices"), part("values"), part("shape"))
    values = [np.array([[0, 1], [1, 0]]), np.array([[0, 0]]), np.array([7, 8]), np.array([9]),
              np.array([2, 2]), np.array([2, 1])]
    joined = combine(values, Fetch(tuple(n for p in parts for n in p.names), "sparse rows",
                                   "values", parts=parts))
    assert isinstance(joined, SparseTensorValue)
    assert joined.indices.tolist() == [[0, 1], [1, 0], [2, 0]]
    assert joined.values.tolist() == [7, 8, 9] and joined.dense_shape.tolist() == [4, 2]
    first = combine(values, Fetch((), "sparse first", "values", parts=parts))
    assert first.values.tolist() == [7, 8] and first.dense_shape.tolist() == [2, 2]
    each = combine(values, Fetch((), "sparse list", "values", parts=parts))
    assert [v.values.tolist() for v in each] == [[7, 8], [9]]
