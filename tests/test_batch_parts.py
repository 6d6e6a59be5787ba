"""A global batch's parts: a replica's rows of dense and sparse batches."""
import numpy as np

from parallax_ng.runtime.batch_parts import first_part, sparse_rows


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
