"""The batch's axis of a tensor (parallax_ng/graph/rows.py): through
transposes, stacks, slices, reshapes, tensordot (of a time-major tensor
too), gathers, convolutions, transposed convolutions, pools, paddings,
tilings, splits, scans and scatters into a tensor; and the losses read
through them (through loops and calls: tests/test_row_loops.py)."""
import numpy as np
import tensorflow as tf

import parallax_ng as pn
from models import train_both
from parallax_ng.graph.rows import batch_axis, batch_rows, counts_rows

tf1 = tf.compat.v1
DATA = ["x", "y"]


def inputs():
    return (tf1.placeholder(tf.float32, (None, 7, 4), name="x"),
            tf1.placeholder(tf.int32, (None, 7), name="y"))


def axis(t):
    return batch_axis(t, DATA)


def test_axes_through_array_ops():
    with tf.Graph().as_default():
        x, y = inputs()
        time_major = tf.transpose(x, [1, 0, 2])
        flat = tf.reshape(x, [-1, 4])
        per_row = tf.reshape(x, [tf.shape(x)[0], -1])
        shaped = tf.reshape(tf.reshape(tf.cast(y, tf.float32), [-1]), tf.shape(y))
        steps = tf.zeros([7, tf.shape(x)[0], 4])        # filled a time step at a time
        put = tf.tensor_scatter_nd_add(steps, [[2]], time_major[2:3])
        rows_put = tf.tensor_scatter_nd_update(x, [[0]], x[:1])   # rows moved: unknown
        cases = {
            put: 1, tf.tensor_scatter_nd_update(time_major, [[1]], x[None, :, 0]): 1,
            rows_put: None, tf.tensor_scatter_nd_add(time_major, [[1, 0]], x[:1, 0]): None,
            time_major: 1, time_major[-1]: 0, time_major[2:]: 1, time_major[:, 2:]: None,
            x[:, -1]: 0,
            # new axes and ellipses where x's rank is known
            x[..., 0]: 0, x[None]: 1, x[None, :, 1:]: 1, time_major[..., None, :]: 1,
            x[None, 1:]: None, time_major[None, ..., 2]: 2,
            tf.unstack(x, axis=1)[0]: 0, tf.unstack(time_major)[3]: 0,
            tf.stack([x, x], axis=1): 0, tf.stack([x, x]): 1,
            flat: 0, per_row: 0, shaped: 0, tf.reshape(x, [7, -1]): None,
            tf.expand_dims(time_major, 0): 2, tf.squeeze(x[:, :1], 1): 0,
            tf.reduce_sum(time_major, 0): 0, tf.reduce_sum(x, 0): None,
            tf.reduce_mean(time_major, 2, keepdims=True): 1,
            tf.tensordot(x, tf.ones((4, 3)), 1): 0,
            # back to [time, batch] (a time-major projection); the batch contracted: none
            tf.tensordot(time_major, tf.ones((4, 3)), 1): 1,
            tf.tensordot(tf.transpose(x, [1, 2, 0]), tf.ones((4, 3)), [[1], [0]]): None,
            # by hand, back to a time-major input's leading axes (CTC scripts' logits)
            tf.reshape(tf.matmul(tf.reshape(time_major, [-1, 4]), tf.ones((4, 3))) + 1.0,
                       [tf.shape(time_major)[0], tf.shape(time_major)[1], 3]): 1,
            tf.reshape(tf.matmul(tf.reshape(time_major, [-1, 4]), tf.ones((4, 3))),
                       [tf.shape(x)[0], tf.shape(x)[1], 3]): None,
            tf.einsum("btd->tbd", x): 1, tf.einsum("tbd,de->bte", time_major, tf.ones((4, 2))): 0,
            tf.gather(x, [0, 1], axis=1): 0, tf.gather(tf.ones((9, 3)), y): 0,
            tf.one_hot(y, 5): 0, tf.one_hot(y, 5, axis=0): 1,
            tf.concat([time_major, time_major], 0): 1, tf.concat([x, x], 0): 0,
            tf.nn.softmax(time_major): 1, tf.nn.softmax(tf.transpose(x[:, 0])): None,
            tf.zeros([tf.shape(time_major)[1], 5]): 0, tf.matmul(x[:, 0], tf.ones((4, 2))): 0,
            tf.matmul(x[:, 0], tf.ones((9, 4)), transpose_a=True): None,
        }
        img = tf.reshape(x, [-1, 7, 4, 1])
        normed, mean, _ = tf1.nn.fused_batch_norm(img, tf.ones(1), tf.zeros(1))
        cases.update({
            tf.nn.conv2d(img, tf.ones((2, 2, 1, 3)), 1, "SAME"): 0,
            tf.nn.max_pool2d(img, 2, 1, "SAME"): 0, normed: 0, mean: None,
            tf.pad(x, [[0, 0], [1, 1], [0, 0]]): 0, tf.pad(x, [[1, 0], [0, 0], [0, 0]]): None,
            tf.cumsum(x, 1): 0, tf.cumsum(x, 0): None, tf.reverse(time_major, [0]): 1,
            tf.math.top_k(x, 2)[1]: 0, tf.split(x, 2, axis=2)[1]: 0, tf.split(x, [3, 4], 1)[0]: 0,
            tf.split(time_major, 7)[0]: 1, tf.split(x, 2)[0]: None,
            tf.tile(x, [1, 2, 1]): 0, tf.tile(x, [2, 1, 1]): None,
            tf.slice(x, [0, 1, 0], [-1, 2, 4]): 0, tf.slice(x, [1, 0, 0], [-1, 7, 4]): None,
            tf.nn.conv2d_transpose(img, tf.ones((2, 2, 3, 1)), tf.stack(
                [tf.shape(img)[0], 14, 8, 3]), 2): 0,
            tf.nn.softmax_cross_entropy_with_logits(tf.ones((1, 4)), x[:, 0]): 0,
            # softmax losses over more dimensions flatten to rows and go back
            tf.nn.sparse_softmax_cross_entropy_with_logits(tf.transpose(y), time_major): 1,
            tf.nn.softmax_cross_entropy_with_logits(tf.nn.softmax(time_major), time_major): 1,
            tf.nn.sparse_softmax_cross_entropy_with_logits(y, x): 0,
            # a label per row, the logits of no shown rows (a model's own state)
            tf.nn.sparse_softmax_cross_entropy_with_logits(y[:, 0], tf.ones((5, 3))): 0,
            tf.nn.softmax_cross_entropy_with_logits(x[:, 0], tf.ones((1, 4))): 0,
            # the top k of a vector of the batch's values are k of its examples, not its rows
            tf.math.top_k(x[:, 0, 0], 2)[0]: None,
        })
        for t, want in cases.items():
            assert axis(t) == want, (t.name, axis(t), want)
        assert batch_rows(flat, DATA) and not batch_rows(time_major, DATA)
        assert counts_rows(tf.shape(time_major)[1].op, DATA)
        assert not counts_rows(tf.shape(time_major)[0].op, DATA)


def test_rows_behind_leading_ones_as_tf_keras_normalizes_layers():
    """tf_keras's LayerNormalization reshapes x to [1, prod(shape[:k]),
    prod(shape[k:]), 1], normalizes each row with FusedBatchNormV3 (NCHW:
    the rows on the channels' axis) and reshapes back to x's shape: the
    rows are on axis 1 between, and first again after (before: unknown,
    so every tf_keras model with a LayerNormalization printed "the graph
    does not show whether the loss ... is a mean or a sum")."""
    with tf.Graph().as_default():
        x, _ = inputs()
        for k, flat in ((1, x[:, :, 0]), (2, x)):
            shape = tf.shape(flat)
            squeezed = tf.reshape(flat, [1, tf.reduce_prod(shape[:k]),
                                         tf.reduce_prod(shape[k:]), 1])
            normed, mean, _ = tf1.nn.fused_batch_norm(
                squeezed, tf.ones([tf.reduce_prod(shape[:k])]),
                tf.zeros([tf.reduce_prod(shape[:k])]), data_format="NCHW")
            assert (axis(squeezed), axis(normed), axis(mean)) == (1, 1, None)
            assert axis(tf.reshape(normed, shape)) == 0
        time_major = tf.transpose(x, [1, 0, 2])     # rows not outermost: not merged
        shape = tf.shape(time_major)
        assert axis(tf.reshape(time_major, [1, tf.reduce_prod(shape[:2]), 4, 1])) is None
        assert axis(tf.reshape(x, [1, tf.reduce_prod(shape[:2]), 4, 1])) is None  # another's
        assert axis(tf.reshape(x, [1, tf.reduce_prod(tf.shape(x)[1:]), 1])) is None


def test_rows_of_a_sparse_batch_through_sparse_layers():
    """tf.nn.embedding_lookup_sparse (each combiner, weighted or not) and
    tf.sparse.sparse_dense_matmul give a row per row of a fed
    sparse_placeholder (of a shape given in part too, as an edit distance
    does), or of a dense batch made sparse in the graph; of a
    constant SparseTensor, or by another column of the coordinates, not
    (before: unknown, so a wide model's mean loss printed "the graph does not
    show whether the loss ... is a mean or a sum")."""
    with tf.Graph().as_default():
        ids = tf1.sparse_placeholder(tf.int64, name="ids")
        weights = tf1.sparse_placeholder(tf.float32, name="weights")
        y = tf1.placeholder(tf.int64, (None, 3), name="y")
        table = tf.ones((30, 4))
        made = tf.sparse.from_dense(y)
        fixed = tf.SparseTensor([[0, 1], [2, 0]], tf.constant([3, 4], tf.int64), [5, 2])
        flipped = tf.SparseTensor(made.indices[:, ::-1], made.values, made.dense_shape[::-1])
        cases = {tf.sparse.sparse_dense_matmul(tf.cast(made, tf.float32), tf.ones((3, 2))): 0,
                 tf1.nn.embedding_lookup_sparse(table, made, None): 0,
                 tf1.nn.embedding_lookup_sparse(table, fixed, None): None,
                 tf1.nn.embedding_lookup_sparse(table, flipped, None): None}
        for combiner in ("sum", "mean", "sqrtn"):
            for w in (None, weights):
                cases[tf1.nn.embedding_lookup_sparse(table, ids, w, combiner=combiner)] = 0
        # a shape given in part (a traced step's SparseTensor argument) makes
        # dense_shape a PlaceholderWithDefault
        shaped = tf1.sparse_placeholder(tf.int64, [None, 5], name="shaped")
        cases[tf1.nn.embedding_lookup_sparse(table, shaped, None)] = 0
        cases[tf.edit_distance(shaped, shaped)] = 0
        for t, want in cases.items():
            assert batch_axis(t, ["y", "ids/indices", "ids/values", "ids/shape", "weights/values",
                                  "shaped/indices", "shaped/values", "shaped/shape"]) == want, \
                (t.name, want)


def test_a_fed_scalar_holds_no_rows():
    """A scalar placeholder fed beside the batch (a loss weight, a rate, a
    flag) has no batch axis, nor does a sum over the batch times it; the
    batch's placeholder and a product of its rows with it keep axis 0
    (before: the scalar read as rows, so a sum over the batch times a fed
    weight printed "statistics over the batch's axis ['Sum'] are applied to
    the batch's rows")."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, (None, 3), name="x")
        weight = tf1.placeholder_with_default(0.5, [], name="weight")
        rate = tf1.placeholder(tf.float32, [], name="rate")
        cases = {weight: None, rate: None, x: 0, x * weight: 0,
                 tf.reduce_sum(x) * weight: None, tf.square(rate): None}
        for t, want in cases.items():
            assert batch_axis(t, ["x", "weight", "rate"]) == want, (t.name, want)


def test_the_recursion_of_a_deep_chain_is_bounded():
    """A chain deeper than Python's default recursion limit is still read."""
    with tf.Graph().as_default():
        x, _ = inputs()
        h = x[:, 0]
        for _ in range(1500):
            h = h + 1.0
        assert batch_rows(h, DATA)
        assert axis(tf.transpose(tf.stack([h] * 2))) == 1


def test_images_through_tf_image_and_element_wise_math():
    """Keras's augmentation and resizing layers and tf.image keep each
    image a row (a crop's begin and size computed, as tf.image's are), and
    so does the rest of tf.math's element-wise ops."""
    with tf.Graph().as_default():
        img = tf1.placeholder(tf.float32, (None, 8, 8, 3), name="x")
        y0, x0 = tf.constant(1), tf.constant(2)
        times = tf1.placeholder(tf.int32, [], name="times")
        moved = tf.raw_ops.ImageProjectiveTransformV3(
            images=img, transforms=tf.ones((1, 8)), output_shape=[6, 6], fill_value=0.0,
            interpolation="BILINEAR")
        cases = {
            moved: 0,
            tf.image.resize(img, (4, 4), "bicubic"): 0, tf.image.resize(img, (4, 4), "area"): 0,
            tf.image.resize(img, (4, 4), "lanczos3"): 0, tf.image.adjust_hue(img, 0.1): 0,
            tf.image.adjust_saturation(img, 2.0): 0, tf.image.adjust_contrast(img, 2.0): 0,
            tf.image.rgb_to_hsv(img): 0, tf.image.hsv_to_rgb(img): 0,
            tf.image.extract_patches(img, [1, 2, 2, 1], [1, 2, 2, 1], [1, 1, 1, 1], "VALID"): 0,
            tf.nn.depth_to_space(tf.tile(img, [1, 1, 1, 4]), 2): 0,
            tf.nn.space_to_depth(img, 2): 0, tf.nn.max_pool_with_argmax(img, 2, 2, "SAME")[0]: 0,
            tf.slice(img, tf.stack([0, y0, x0, 0]), tf.stack([tf.shape(img)[0], 4, 4, -1])): 0,
            tf.slice(img, tf.stack([y0, 0, 0, 0]), [-1, 4, 4, -1]): None,    # rows dropped
            tf.math.atan(img) + tf.math.erfc(img) * tf.math.xlogy(img, img): 0,
            tf.quantization.fake_quant_with_min_max_args(img): 0,
            tf.nn.convolution(img, tf.ones((3, 3, 3, 2)), dilations=2, padding="SAME"): 0,
            tf.tile(img, tf.stack([1, times, 1, 1])): 0,
            tf.tile(img, tf.stack([times, 1, 1, 1])): None,
            tf.math.bincount(tf.cast(img[:, 0, :, 0], tf.int32), minlength=4, axis=-1): 0,
        }
        for t, want in cases.items():
            assert batch_axis(t, ["x"]) == want, (t.name, batch_axis(t, ["x"]), want)


def test_a_sum_over_images_an_image_op_changed_sums_the_replicas_gradients():
    """A loss summed over the batch after image ops (before, an op the
    rows did not pass through made its form unknown: averaged, half of
    one device's step) equals one device with the global batch, 1e-5."""
    rng = np.random.RandomState(3)
    images, labels = rng.rand(32, 8, 8, 3).astype(np.float32), rng.randint(0, 3, 32)

    def build(batch):
        g = tf.Graph()
        with g.as_default():
            ds = pn.shard(tf.data.Dataset.from_tensor_slices((images, labels)))
            x, y = tf1.data.make_one_shot_iterator(ds.batch(batch).repeat()).get_next()
            h = tf.image.adjust_hue(tf.image.resize(x, (6, 6), "bicubic"), 0.1)
            h = tf.raw_ops.ImageProjectiveTransformV3(
                images=h, transforms=tf.constant([[1, 0.1, 0, 0, 1, 0, 0, 0]], tf.float32),
                output_shape=[6, 6], fill_value=0.0, interpolation="BILINEAR")
            k = tf1.get_variable("k", initializer=rng.randn(3, 3, 3, 4).astype(np.float32))
            w = tf1.get_variable("w", initializer=rng.randn(4, 3).astype(np.float32))
            logits = tf.matmul(tf.reduce_mean(tf.nn.conv2d(h, k, 1, "SAME"), [1, 2]), w)
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
            init = tf1.global_variables_initializer()
        return g, {"train": train, "init": init}
    parallel, single, names = train_both(build, 2, 4, config={"run_option": "allreduce"})
    for name in names:
        for got in parallel[name]:
            np.testing.assert_allclose(got, single[name], atol=1e-5, rtol=1e-5)


def test_equal_parts_of_the_rows_keep_them_in_a_reading_of_parts():
    """A split of the batch's rows into equal parts (micro-batches: a count
    of parts, or sizes all one tensor or one constant) keeps the batch's
    axis in a reading of parts, as a loss's form is read; a split into
    unequal sizes, and any split in the plain reading, has none (one
    device's part holds other rows than a replica's)."""
    from parallax_ng.graph.rows import reading
    with tf.Graph().as_default() as g:
        x, _ = inputs()
        half = tf.shape(x)[0] // 2
        cases = [(tf.split(x, 2)[1], 0, None), (tf.split(x, [half, half])[0], 0, None),
                 (tf.split(x, [3, 3])[1], 0, None),
                 (tf.split(x, [half, tf.shape(x)[0] - half])[0], None, None),
                 (tf.split(x, [2, 4])[0], None, None),
                 (tf.split(tf.transpose(x, [1, 0, 2]), 2, 1)[0], 1, None),
                 (tf.split(x, 7, axis=1)[0], 0, 0)]       # along another axis: both
        parts = reading(DATA, g, parts=True)
        assert reading(parts, g) is parts and reading(parts, g, parts=True) is parts
        plain = reading(parts.sources, g)
        assert reading(plain, g, parts=True) is not plain
        assert [(parts.axis(t), plain.axis(t)) for t, _, _ in cases] == \
            [(a, b) for _, a, b in cases]


def test_strings_through_per_entry_ops_lookups_and_splits_padded():
    """A batch of strings keeps its rows through per-entry string ops, a
    lookup table and a split into words padded back to a tensor (Keras's
    TextVectorization and StringLookup); a padding to a fixed number of
    rows, or a split of another tensor, is not the batch."""
    with tf.Graph().as_default():
        text = tf1.placeholder(tf.string, (None,), name="x")
        other = tf.constant(["a b", "c"])
        clean = tf.strings.regex_replace(tf.strings.lower(tf.strings.strip(text)), "[.]", "")
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(["a", "b"], [1, 2], tf.string, tf.int32), 0)
        words = tf.strings.split(clean)
        cases = {clean: 0, tf.strings.length(text): 0, tf.strings.substr(text, 0, 1): 0,
                 table.lookup(clean): 0, words.to_tensor(): 0,
                 words.to_tensor(shape=[None, 3]): 0, words.to_tensor(shape=[4, 3]): None,
                 tf.strings.split(other).to_tensor(): None,
                 tf.ragged.map_flat_values(table.lookup, words).to_tensor(): 0}
        for t, want in cases.items():
            assert axis(t) == want, t
