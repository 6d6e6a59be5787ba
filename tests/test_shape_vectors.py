"""What shape vectors say about a tensor's first dimension
(parallax_ng/graph/shape_vectors.py), read from small graphs."""
import tensorflow as tf

from parallax_ng.graph import frontend
from parallax_ng.graph.ir import TensorRef
from parallax_ng.graph.shape_vectors import const, counted, leading, shape_head, shape_of

tf1 = tf.compat.v1


def loaded(build):
    """The TrainingGraph of a graph `build()` makes (a trained variable
    beside it), and {name: TensorRef} of the tensors it returns."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        named = build(x)
        w = tf1.get_variable("w", [3, 1])
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(tf.matmul(x, w)))
    tg = frontend.load(g)
    return tg, {k: TensorRef(t.op.name, t.value_index) for k, t in named.items()}


def test_the_head_of_a_shape_vector_is_followed_to_its_tensor():
    """tf.shape(x), cast, sliced from 0, its first entry stacked with
    others, concatenated first, and a SparseReshape's new shape built so:
    x's first dimension; a slice from 1, a reversed one, or a constant: no
    tensor."""
    def build(x):
        shape = tf.shape(x)
        sliced = tf.slice(tf.cast(shape, tf.int64), [0], [1])
        ids = tf.sparse.from_dense(tf.cast(x > 0, tf.int64))
        reshaped = tf.sparse.reshape(ids, tf.stack([tf.cast(shape[0], tf.int64), -1]))
        return {"shape": shape, "sliced": sliced, "stacked": tf.stack([shape[0], 4]),
                "concat": tf.concat([sliced, [7]], 0), "sparse": reshaped.dense_shape,
                "tail": shape[1:], "reversed": shape[::-1], "constant": tf.constant([4, 3])}
    tg, ref = loaded(build)
    for name in ("shape", "sliced", "stacked", "concat", "sparse"):
        assert shape_head(tg, ref[name]) == TensorRef("x", 0), name
    for name in ("tail", "reversed", "constant"):
        assert shape_head(tg, ref[name]) is None, name


def test_shapes_that_keep_or_set_the_rows():
    """`shape_of`: tf.shape(x) sets the first dimension to x's; [tf.shape(x)[0],
    -1] keeps the reshaped tensor's rows as x's; a constant shape says
    nothing. `leading` reads a constant's (or a stack's) first entry."""
    def build(x):
        shape = tf.shape(x)
        return {"shape": shape, "rows": tf.stack([shape[0], -1]),
                "constant": tf.constant([-1, 3]), "flat": tf.stack([-1, shape[1]])}
    tg, ref = loaded(build)
    first = {TensorRef("x", 0): "x's"}
    assert shape_of(tg, ref["shape"], first) == ("x's", False)
    assert shape_of(tg, ref["rows"], first) == ("x's", True)
    assert shape_of(tg, ref["constant"], first) == (None, False)
    assert leading(tg, ref["constant"]) == -1 and leading(tg, ref["flat"]) == -1
    assert const(tg, ref["constant"]) == [-1, 3] and const(tg, ref["shape"]) is None


def test_a_stack_whose_first_column_counts_rows():
    def build(x):
        n = tf.shape(x)[0]
        picks = tf.cast(tf.argmax(x, 1), tf.int32)
        return {"counted": tf.stack([tf.range(n), picks], axis=1),
                "from_one": tf.stack([tf.range(1, n + 1), picks], axis=1),
                "rows": tf.stack([tf.range(n), picks], axis=0)}
    tg, ref = loaded(build)
    assert counted(tg, ref["counted"])
    assert not counted(tg, ref["from_one"]) and not counted(tg, ref["rows"])
