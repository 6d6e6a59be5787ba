"""A global batch's parts: a replica's rows of dense and sparse batches,
and the replicas' sparse rows joined."""
import numpy as np
from tensorflow.compat.v1 import SparseTensorValue

from parallax_ng.runtime.batch_parts import first_part, joined_rows, sparse_rows


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


def test_joined_rows_undo_the_parts():
    """A batch's sparse rows split in two and joined again: the whole batch;
    the other dimensions are the largest part's (a decoder's longest
    sequence), an empty part keeps its rows."""
    indices = np.array([[0, 0], [1, 0], [1, 2], [2, 1], [3, 0], [3, 1]], np.int64)
    values = np.array([5, 6, 7, 8, 9, 10], np.int64)
    shape = np.array([4, 3], np.int64)
    parts = [SparseTensorValue(*sparse_rows(indices, values, shape, first, 2)) for first in (0, 2)]
    parts[1] = parts[1]._replace(dense_shape=np.array([2, 2], np.int64))
    whole = joined_rows(parts)
    assert whole.indices.tolist() == indices.tolist() and whole.values.tolist() == values.tolist()
    assert whole.dense_shape.tolist() == [4, 3]
    empty = SparseTensorValue(np.zeros((0, 2), np.int64), np.zeros(0, np.int64),
                              np.array([3, 0], np.int64))
    both = joined_rows([empty, parts[1]])
    assert both.indices.tolist() == [[3, 1], [4, 0], [4, 1]] and both.dense_shape.tolist() == [5, 2]
