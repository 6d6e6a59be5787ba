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
    handle = combine([b"h1", b"h0"], Fetch(("a", "b"), "handles", "h", (1, 0)))
    assert handle == b"h0" and isinstance(handle, bytes) and handle.each == [b"h0", b"h1"]
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


def test_indexed_slices_combine_each_part_as_fetched():
    """A tf.IndexedSlices' values and indices (and dense shape) fetched as
    themselves: "slices" one IndexedSlicesValue of the parts' combined
    values (rows joined, the shape replica 0's), "slices list" each
    replica's; without a dense shape, None, as a session gives it."""
    values = Fetch(("v:0", "v_1:0"), "concat", "v")
    indices = Fetch(("i:0", "i_1:0"), "concat", "i")
    shape = Fetch(("s:0",), "first", "s")
    got = [np.array([[1.0], [2.0]]), np.array([[3.0]]), np.array([4, 0]), np.array([4]),
           np.array([5, 1])]
    one = combine(got, Fetch((), "slices", "v", parts=(values, indices, shape)))
    assert type(one).__name__ == "IndexedSlicesValue"
    assert one.values.tolist() == [[1.0], [2.0], [3.0]] and one.indices.tolist() == [4, 0, 4]
    assert one.dense_shape.tolist() == [5, 1]
    each = [Fetch((f"{n}:0", f"{n}_1:0"), "list", n, (0, 1)) for n in "vi"]
    apart = combine(got[:4], Fetch((), "slices list", "v", parts=tuple(each)))
    assert [(a.values.tolist(), a.indices.tolist(), a.dense_shape) for a in apart] == \
        [([[1.0], [2.0]], [4, 0], None), ([[3.0]], [4], None)]


def test_an_indexed_slices_gradient_made_dense_is_the_replicas_mean():
    """tf.convert_to_tensor of an embedding's gradient (an UnsortedSegmentSum
    outside the autodiff's scope) is each replica's gradient of its own
    loss, as the autodiff's tensors are: averaged, or summed where the
    gradients are (it was joined, twice one device's rows)."""
    import tensorflow as tf
    from parallax_ng.runtime.combining import default_reduction
    g = tf.Graph()
    with g.as_default():
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        emb = tf.compat.v1.get_variable("emb", [10, 3])
        loss = tf.reduce_mean(tf.gather(emb, ids))
        dense = tf.convert_to_tensor(tf.gradients(loss, emb)[0])
    assert dense.op.type == "UnsortedSegmentSum"
    assert default_reduction(dense, ["ids"])[:2] == ("mean", 0)
    assert default_reduction(dense, ["ids"], averaged=False)[:2] == ("sum", 0)


def test_a_scaled_tf1_sum_is_a_mean_or_a_sum_as_the_gradients_are():
    """tf.reduce_sum(e) / 16 with a fed batch: the graph does not show
    whether 16 is a replica's batch size, so it is taken as a mean; where
    the config sums the gradients (average_dense: false, the loss over the
    global batch) it is a sum (before, averaged: half one device's loss)."""
    import tensorflow as tf

    from parallax_ng.runtime.combining import default_reduction
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        loss = tf.reduce_sum(tf.square(tf.matmul(x, tf1.get_variable("w", [3, 1])))) / 16.0
    assert default_reduction(loss, ["x"])[:2] == ("mean", 0)
    assert default_reduction(loss, ["x"], averaged=False)[:2] == ("sum", 0)


def test_a_count_of_the_rows_times_a_number_is_a_sum():
    """tf.size(x) * 2 with a fed batch is a count, not a scaled loss: the
    replicas' values are summed (before, taken as a mean, silently: half
    one device's); a scaled sum of the rows' values stays the guessed mean."""
    import tensorflow as tf

    from parallax_ng.runtime.combining import default_reduction
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        size = tf.cast(tf.size(x), tf.float32)
        rows = tf.cast(tf.shape(x)[0], tf.float32)
        assert default_reduction(tf.identity(size * 2.0), ["x"]) == ("sum", 0, True)
        assert default_reduction(3.0 * rows, ["x"]) == ("sum", 0, True)
        assert default_reduction(tf.reduce_sum(x) * 2.0, ["x"])[:2] == ("mean", 0)


def test_a_step_s_outputs_are_named_by_their_keys_in_the_warning():
    import tensorflow as tf
    from parallax_ng.runtime.combining import OUTPUT_NAMES, name_outputs, unread
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        picked = tf.identity(tf.argmax(x), name="picked")
    name_outputs(g, {"loss": "l:0", "extra": [picked.name, None]})
    assert dict(g.get_collection(OUTPUT_NAMES)) == {
        "l:0": "the step's output 'loss'", "picked:0": "the step's output 'extra/0'"}
    said = unread("picked:0", picked, "mean")
    assert "of the step's output 'extra/0' (tensor 'picked:0', ArgMax) make" in said
    assert "they are averaged" in said and "per_replica=True" in said
    with g.as_default():
        other = tf.identity(x, name="other")
    assert "of 'other:0' (Identity) make" in unread("other:0", other, "concat")
