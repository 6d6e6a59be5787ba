"""Forms over the batch (parallax_ng/graph/forms.py): whether a loss is a
mean or a sum over the batch, the divisors that make it a mean, and the
refusal of a sum plus a term without data (layer-by-layer execution would
add it once per micro-batch; without `strict`, no form)."""
import pytest
import tensorflow as tf

import parallax_ng as pn
from parallax_ng.graph import averaging, forms
from test_averaging import _Asked

tf1 = tf.compat.v1


def mean_p(e):
    """The batch's mean of each example's softmax over its columns."""
    return tf.reduce_mean(tf.nn.softmax(e), 0)


LOSS_FORMS = {
    "mean": (lambda e, x: tf.reduce_mean(e), "mean"),
    "sum": (lambda e, x: tf.reduce_sum(e), "sum"),
    "sum times a number": (lambda e, x: 0.5 * tf.reduce_sum(e) / 100.0, "sum"),
    "sum over the batch size": (lambda e, x: tf.reduce_sum(e) / 8.0, "mean"),
    "sum over the rows counted": (
        lambda e, x: tf.reduce_sum(e) / tf.cast(tf.shape(x)[0], tf.float32), "mean"),
    "mean of a sum per row": (lambda e, x: tf.reduce_mean(tf.reduce_sum(e, 1)), "mean"),
    "sum of a mean per row": (lambda e, x: tf.reduce_sum(tf.reduce_mean(e, 1)), "sum"),
    "mean plus a penalty": (
        lambda e, x: tf.reduce_mean(e) + tf.add_n([tf.nn.l2_loss(v) for v in
                                                  tf1.trainable_variables()]), "mean"),
    "tf.compat.v1.losses": (
        lambda e, x: tf1.losses.mean_squared_error(tf.zeros_like(e), e), "mean"),
    "binary cross-entropy summed over the batch size": (   # Select and a folded zeros_like
        lambda e, x: tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=tf.ones_like(e), logits=e)) / 32.0, "mean"),
    "sum of kept columns over the batch size": (lambda e, x: tf.reduce_sum(e[:, 1:]) / 24.0,
                                                "mean"),
    "sum of the per-column sums": (lambda e, x: tf.reduce_sum(e[:, 0]) * 0.0 +
                                   tf.reduce_sum(tf.reduce_sum(e, 0)), "sum"),
    # a sequence loss as the ptb tutorial takes it: the batch's mean per time step, summed
    "per-column means summed": (lambda e, x: tf.reduce_sum(tf.reduce_mean(e, 0)), "mean"),
    "per-column sums averaged": (lambda e, x: tf.reduce_mean(tf.reduce_sum(e, 0)), "sum"),
    "per-column sums over the batch's elements": (
        lambda e, x: tf.reduce_sum(tf.reduce_sum(e, 0)) / 32.0, "mean"),
    "mean of a column-major copy": (lambda e, x: tf.reduce_mean(tf.transpose(e)), "mean"),
    "sum of a column-major copy": (lambda e, x: tf.reduce_sum(tf.transpose(e), [1, 0]), "sum"),
    "max over the batch, summed": (lambda e, x: tf.reduce_sum(tf.reduce_max(e, 0)), None),
    # half the sum of squares (no form before: a loss of it was averaged, 1/N of one device's)
    "tf.nn.l2_loss": (lambda e, x: tf.nn.l2_loss(e), "sum"),
    "tf.nn.l2_loss over the batch's elements": (lambda e, x: tf.nn.l2_loss(e) / 32.0, "mean"),
    "mean plus l2_loss of activations over the batch size": (
        lambda e, x: tf.reduce_mean(e) + tf.nn.l2_loss(e) / 8.0, "mean"),
    # zero where no row counts (no form before: averaged, 1/N of one device's)
    "a sum kept where a count over the batch is positive": (
        lambda e, x: tf.where(tf.reduce_sum(tf.abs(e)) > 0.0, tf.reduce_sum(e), 0.0), "sum"),
    "tf.compat.v1.losses.mean_pairwise_squared_error": (
        lambda e, x: tf1.losses.mean_pairwise_squared_error(tf.zeros_like(e), e), "sum"),
    "a sum kept where it passes a threshold": (      # a gate on the job's value: no form
        lambda e, x: tf.where(tf.reduce_sum(e) > 1.0, tf.reduce_sum(e), 0.0), None),
    # taken of the job's means (LossForm.exchanged): no form before
    "an RMSE": (lambda e, x: tf.sqrt(tf.reduce_mean(e)), "mean"),
    "a ratio of means plus a mean": (
        lambda e, x: tf.reduce_mean(e) / tf.reduce_mean(e[:, 0]) + tf.reduce_mean(e), "mean"),
    # of vectors of the job's means (no form before: averaged, with a line)
    "a function of per-column means": (
        lambda e, x: tf.reduce_sum(tf.square(tf.reduce_mean(e, 0) - 1.0)), "mean"),
    "an entropy of the mean prediction": (lambda e, x: -tf.reduce_sum(mean_p(e) * tf.math.log(
        mean_p(e))), "mean"),
    # each example's outer product summed over the batch: a gram matrix, a sum
    "a gram matrix summed": (lambda e, x: tf.reduce_sum(tf.matmul(e, e, transpose_a=True)),
                             "sum"),
    "a decorrelation penalty": (lambda e, x: tf.reduce_sum(tf.square(tf.matmul(
        e, e, transpose_a=True) / 8.0 - tf.eye(4))), "mean"),
    # of the job's sums over the batch (LossForm.summed, with their gradients): no form before
    "a root of a sum": (lambda e, x: tf.sqrt(tf.reduce_sum(e)), "mean"),
    "a Dice loss's ratio of sums": (lambda e, x: 1.0 - 2.0 * tf.reduce_sum(tf.square(e)) / (
        tf.reduce_sum(e) + tf.reduce_sum(tf.square(e)) + 1.0), "mean"),
    "a sum or a constant": (lambda e, x: tf.where(tf.reduce_sum(e) > 0.0, tf.reduce_sum(e),
                                                  1.0), None),
}


@pytest.mark.parametrize("name", sorted(LOSS_FORMS))
def test_how_the_loss_depends_on_the_batch(name):
    """forms.loss_form, on losses over an einsum stack's outputs (batch 8)."""
    build, want = LOSS_FORMS[name]
    g = tf.Graph()
    with g.as_default():
        ids = tf1.data.make_one_shot_iterator(tf.data.Dataset.from_tensors(
            tf.zeros([8, 3], tf.int32)).repeat()).get_next()
        x = tf.nn.embedding_lookup(tf1.get_variable("emb", [10, 4]), ids)     # [8, 3, 4]
        with tf1.variable_scope("block_0"):
            x = tf.einsum("bsd,de->bse", x, tf1.get_variable("w", [4, 4]))
        per_row = tf.transpose(tf.square(x), [0, 2, 1])                     # [8, 4, 3]
        loss = build(tf.reduce_mean(per_row, 2), ids)                        # rows [8, 4]
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    sess = tf1.Session(graph=g)
    form = forms.loss_form(loss, ["IteratorGetNext"], 8,
                            lambda t: tf.get_static_value(t) if t.op.type == "Const"
                            else sess.run(t))
    assert form.kind == want
    if name in ("sum over the batch size", "tf.compat.v1.losses",
                "binary cross-entropy summed over the batch size",
                "sum of kept columns over the batch size",
                "per-column sums over the batch's elements",
                "tf.nn.l2_loss over the batch's elements"):
        assert len(form.by_batch) == 1          # the divisor a micro-batch replaces
    assert len(set(form.exchanged)) == {"an RMSE": 1, "a ratio of means plus a mean": 2,
                                        "a function of per-column means": 1,
                                        "a decorrelation penalty": 1,
                                        "an entropy of the mean prediction": 3}.get(name, 0)
    assert len(form.summed) == {"a root of a sum": 2, "a Dice loss's ratio of sums": 6}.get(
        name, 0)        # each Sum and its incoming gradient


def test_a_sum_plus_a_term_without_data_is_refused_or_named():
    """Refused for layer-by-layer execution (strict); otherwise a sum
    whose term is named (the op and input that add it: the state-sync pass
    divides it among replicas), and `averages` sums the gradients; beside a
    loss that averages, it says what averaging does to it (the data's part
    1/N of one device's) and what would be exact."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4])
        w = tf1.get_variable("w", [4, 4])
        loss = tf.reduce_sum(tf.matmul(x, w)) + tf.reduce_sum(w)
    with pytest.raises(pn.GraphError, match="sums over the batch and adds a term"):
        forms.loss_form(loss, [x.op.name], None)
    form = forms.loss_form(loss, [x.op.name], None, strict=False)
    assert form.kind == "sum" and form.once == [(loss.op.name, 1)]
    with g.as_default():
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    assert averaging.averages(_Asked(), g) == (False, False, "")
    assert averaging.added_once(g) == [(loss.op.name, 1)]
    with g.as_default():
        keras3 = tf.reduce_sum(tf.stack([tf.reduce_sum(tf.matmul(x, w)), tf.reduce_sum(w)]))
        mean = tf.reduce_mean(tf.matmul(x, w))
        tf1.train.GradientDescentOptimizer(0.1).minimize(keras3)
    assert forms.loss_form(keras3, [x.op.name], None, strict=False).once == \
        [(keras3.op.inputs[0].op.name, 1)]
    with g.as_default():
        tf1.train.GradientDescentOptimizer(0.1).minimize(mean)
    dense, sparse, note = averaging.averages(_Asked(), g)
    assert dense and sparse and f"adds a term that does not depend on the data " \
        f"({loss.op.name!r}" in note and "1/N of one device's" in note


def test_a_mean_loss_and_a_count_of_correct_examples():
    """What the state-sync pass asks: a batch's mean loss is a mean (its
    replicas' values are averaged), a count of correct examples a sum."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        logits = tf.matmul(x, tf1.get_variable("w", [4, 3]))
        loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        summed = tf.reduce_sum(loss)          # tf.compat.v1.metrics.mean's total's increment
        assert forms.batch_rows(logits, ["x", "y"]) and not forms.batch_rows(loss, ["x", "y"])
        assert forms.loss_form(loss, ["x", "y"], None).kind == "mean"
        assert forms.loss_form(summed, ["x", "y"], None).kind == "mean"
        assert forms.loss_form(correct, ["x", "y"], None).kind == "sum"


def test_a_static_batch_counted_by_tf1_losses_is_a_mean():
    """Placeholders of a fixed batch (fully_connected_feed's [batch_size,
    pixels]): tf.compat.v1.losses divides by a count made of constants (a
    Sum of a broadcast of ones) that TensorFlow does not fold; its value is
    computed, so the loss is a mean over the batch, and a count of correct
    examples by in_top_k a sum (were: a scaled sum, gradients summed and
    the loss fetched as the replicas' sum; the count averaged)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [16, 4], name="x")
        y = tf1.placeholder(tf.int32, [16], name="y")
        logits = tf.matmul(x, tf1.get_variable("w", [4, 3]))
        loss = tf1.losses.sparse_softmax_cross_entropy(tf.cast(y, tf.int64), logits)
        correct = tf.reduce_sum(tf.cast(tf1.nn.in_top_k(logits, y, 1), tf.int32))
        best = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y),
                                     tf.float32))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    divisor = loss.op.inputs[1]
    assert tf.get_static_value(divisor) is None and forms.constant_value(divisor) == 16
    assert forms.constant_value(x) is None
    form = forms.loss_form(loss, ["x", "y"], 16)
    assert form.kind == "mean" and form.by_batch == [(loss.op.name, 1, False)]
    assert forms.scalar_kind(loss, ["x", "y"]) == "mean"
    assert forms.scalar_kind(correct, ["x", "y"]) == forms.scalar_kind(best, ["x", "y"]) == "sum"
    assert averaging.averages(_Asked(), g)[:2] == (True, True)


def test_a_count_of_the_batchs_rows_is_a_sum():
    """tf.shape(x)[0] and tf.size(y), fetched to count examples: the
    replicas' sum is one device's (their mean had been half of it); a
    dimension other than the rows' is the same on every replica."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        rows = tf.shape(x)[0]
        width = tf.shape(x)[1]
        size = tf.cast(tf.size(y), tf.float32)
    assert forms.scalar_kind(rows, ["x", "y"]) == forms.scalar_kind(size, ["x", "y"]) == "sum"
    assert forms.scalar_kind(width, ["x", "y"]) is None


def test_a_mean_times_the_rows_counted_is_a_sum_and_a_sum_times_one_over_them_a_mean():
    """With the batch fed (its rows counted at run time): a mean times the
    rows counted is a sum (before: no form, averaged with a line, 1/N of
    one device's); a sum times 1 / the rows (or tf.math.reciprocal of the
    size) is a mean (before: averaged, exactly, but with the line); a
    masked mean times the rows has no form (the mask's count is not the
    rows'), and a fetched count times a number is a sum, not a scaled loss."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        e = tf.square(tf.matmul(x, tf1.get_variable("w", [3, 2])))
        rows = tf.cast(tf.shape(x)[0], tf.float32)
        kept = tf.cast(e > 0.5, tf.float32)
        want = {tf.reduce_mean(e) * rows: "sum", rows * tf.reduce_mean(e, [0, 1]): "sum",
                tf.reduce_sum(e) * (1.0 / rows): "mean",
                tf.math.reciprocal(tf.cast(tf.size(x), tf.float32)) * tf.reduce_sum(e): "mean",
                tf.reduce_sum(e * kept) / tf.reduce_sum(kept) * rows: None, rows * 2.0: "sum"}
    for loss, kind in want.items():
        assert forms.scalar_kind(loss, ["x"]) == kind, loss.name
        assert forms.scalar_form(loss, ["x"])[1] is False, loss.name       # (not guessed)


def test_a_scaled_sum_where_the_batch_is_not_shown_is_a_mean():
    """scalar_kind (fetches, metrics' increments) reads a TF1 sum over a
    number as the gradients do: a mean where a replica's batch size is not
    shown (fed), a sum where it is shown and differs."""
    for batch, want in [(None, "mean"), (8, "sum")]:
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [batch, 3], name="x")
            value = tf.reduce_sum(tf.square(x)) / 32.0
        assert forms.scalar_kind(value, ["x"]) == want


def test_a_mean_over_a_count_added_to_a_sum_is_a_widened_sum():
    """A sum over the batch plus tf.compat.v1.losses' mean (a sum over a
    count the data's shape sets): a sum whose mean divides by N times its
    count where the gradients are summed (`widened`, its division named);
    strict (layer-by-layer), no form. A tf.reduce_mean added so is widened
    too, by its Mean (transforms/selected_means.py divides its value and
    its gradient's count; before, no form: the replicas' gradients were
    averaged, the sum's part 1/N of one device's, warned), alone or beside
    the count's mean in a term (before that, the count alone was widened
    there, N times the Mean's part, silently), and a sum times 1 / the
    rows' count by its product. A function of a mean beside the sum (a
    root) is still no form (`mixed` names the summed term). A sum over a
    static batch's size (a constant) is widened by its division, a mean
    over rows a mask picks by its Mean. A penalty added
    inside a widened mean is a term each replica adds 1/N of (`once`;
    before, N times, silently)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        e = tf.square(tf.matmul(x, tf1.get_variable("w", [3, 1])))
        summed, average = tf.reduce_sum(e), tf.reduce_mean(e)
        mean = tf1.losses.absolute_difference(e, e * e)
        twice = 2.0 * average
        loss, raw = summed + 0.5 * mean, summed + twice
        rated = summed + tf.reduce_sum(e) * (1.0 / tf.cast(tf.shape(x)[0], tf.float32))
        rooted = summed + tf.sqrt(average)
    form = forms.loss_form(loss, ["x"], None, strict=False)
    assert form.kind == "sum" and form.widened == [mean.op.name] and not form.mixed
    assert forms.loss_form(loss, ["x"], None).kind is None
    assert forms.over_widened(mean, ["x"], {mean.op.name})          # summed where fetched
    assert not forms.over_widened(mean, ["x"], set()) and not forms.over_widened(
        summed, ["x"], {mean.op.name})
    form = forms.loss_form(raw, ["x"], None, strict=False)
    assert form.kind == "sum" and form.widened == [average.op.name] and not form.mixed
    assert forms.over_widened(twice, ["x"], {average.op.name})      # summed where fetched
    assert forms.loss_form(raw, ["x"], None).kind is None
    form = forms.loss_form(rated, ["x"], None, strict=False)
    assert form.kind == "sum" and form.widened == [rated.op.inputs[1].op.name]
    form = forms.loss_form(rooted, ["x"], None, strict=False)
    assert form.kind is None and form.mixed == [(summed.name, False)] and not form.widened
    with g.as_default():        # a Mean beside the count's mean in the term: both widened
        both = summed + (average + mean)
        inner = mean + tf.reduce_sum(0.1 * tf.nn.l2_loss(tf1.get_variable("v", [3, 1])))
        penalized = summed + 0.5 * inner        # a penalty in the widened mean: once
    form = forms.loss_form(both, ["x"], None, strict=False)
    assert form.kind == "sum" and average.op.name in form.widened and \
        mean.op.name in form.widened and not form.mixed
    form = forms.loss_form(penalized, ["x"], None, strict=False)      # (1/N on each replica)
    assert form.kind == "sum" and form.widened and form.once == [(inner.op.name, 1)]
    g = tf.Graph()
    with g.as_default():        # over a static batch size: the division is widened
        x = tf1.placeholder(tf.float32, [8, 3], name="x")
        e = tf.square(tf.matmul(x, tf1.get_variable("w", [3, 1])))
        sized = tf.reduce_sum(e) / 8.0
        loss = tf.reduce_sum(e) + sized
    form = forms.loss_form(loss, ["x"], 8, strict=False)
    assert form.kind == "sum" and form.widened == [sized.op.name]
    assert forms.over_widened(sized, ["x"], {sized.op.name})
    g = tf.Graph()
    with g.as_default():        # a mean over rows a mask picks: widened by its Mean
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        e = tf.square(tf.matmul(x, tf1.get_variable("w", [3, 1])))[:, 0]
        picked = tf.reduce_mean(tf.boolean_mask(e, x[:, 0] > 0))
        loss = tf.reduce_sum(e) + picked
    form = forms.loss_form(loss, ["x"], None, strict=False)
    assert form.kind == "sum" and form.widened == [picked.op.name]


def test_rows_made_with_the_batch_and_concatenated_along_it_are_the_batchs():
    """Keras's GAN example: labels of `ops.ones((batch_size, 1))` and
    zeros, random latents of that shape and a concatenation of generated
    and real rows along the rows all have the batch's rows, so a mean of
    the loss over them (a sum over a count of its elements) is a mean; a
    concatenation with rows that are not the batch's, or of a fixed
    shape, is not."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        b = tf.shape(x)[0]
        ones, zeros = tf.ones(tf.stack([b, 1])), tf.zeros_like(x[:, :1])
        latents = tf.random.normal(tf.stack([b, 4]))
        fake = tf.matmul(latents, tf1.get_variable("g", [4, 4]))
        both = tf.concat([fake, x], 0)
        labels = tf.concat([ones, zeros], 0)
        values = tf.square(tf.matmul(both, tf1.get_variable("d", [4, 1])) - labels)
        loss = tf.reduce_sum(values) / tf.cast(tf.size(values), tf.float32)
        padded = tf.concat([x, tf.zeros([2, 4])], 0)
        fixed = tf.ones([3, 1])
    for t in (ones, zeros, latents, fake, both, labels, values):
        assert forms.batch_rows(t, ["x"]), t.name
    assert not forms.batch_rows(padded, ["x"]) and not forms.batch_rows(fixed, ["x"])
    assert forms.loss_form(loss, ["x"], None).kind == "mean"


@pytest.mark.parametrize("length", [7, None], ids=["fixed", "open"])
def test_a_masked_mean_over_a_padded_length_names_both_divisions(length):
    """Keras's masked mean weighs each kept token by tokens / kept tokens,
    tokens = tf.reduce_prod of the mask's shape (rows, length), and divides
    the weighted sum by the tokens: both divisions by a count the data sets.
    With the length open (a padded batch's), the shape is packed from two
    dimensions of the data; before, the weight's division went unnamed and
    each replica weighed its tokens by its own kept count (3e-4 off one
    device in a Keras 3 fit)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.int32, [None, length], name="x")
        e = tf.reduce_sum(tf.nn.embedding_lookup(tf1.get_variable("w", [9, 2]), x), -1)
        mask = tf.cast(tf.not_equal(x, 0), tf.float32)
        shape = tf.stack([tf.shape(mask)[0], length or tf.shape(mask)[1]])
        total = tf.cast(tf.reduce_prod(shape), tf.float32)
        weight = tf.math.divide_no_nan(total, tf.reduce_sum(mask), name="weight")
        loss = tf.math.divide_no_nan(tf.reduce_sum(e * mask * weight), total, name="loss")
    form = forms.loss_form(loss, ["x"], None, strict=False)
    assert form.kind == "mean" and set(form.by_count) == {"weight", "loss"}


def divided_sum_graph(divisor, batch):
    """A squared error summed over the batch of a shard of 64 examples,
    divided by `divisor(y)` (y: targets [None, 3]), trained by Adam."""
    import numpy as np
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(1)
        data = (rng.randn(64, 5).astype(np.float32), rng.randn(64, 3).astype(np.float32))
        ds = pn.shard(tf.data.Dataset.from_tensor_slices(data)).batch(batch).repeat()
        x, y = tf1.data.make_one_shot_iterator(ds).get_next()
        w = tf1.get_variable("w", initializer=(np.arange(15).reshape(5, 3) / 15 - 0.3).astype(
            np.float32))
        loss = tf.reduce_sum(tf.square(tf.matmul(x, w) - y)) / divisor(y)
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "loss": loss, "init": init}


DIVISORS = {
    "its feature count": lambda y: tf.cast(tf.shape(y)[1], tf.float32),
    "its rows less one": lambda y: tf.cast(tf.shape(y)[0], tf.float32) - 1.0,
    "the square root of its rows": lambda y: tf.sqrt(tf.cast(tf.shape(y)[0], tf.float32)),
    "a power of its rows": lambda y: tf.pow(tf.cast(tf.shape(y)[0], tf.float32), 1.5),
    "the root of a count of its values": lambda y: tf.sqrt(tf.reduce_sum(
        tf.cast(y[:, 0] > 0, tf.float32)) + 1.0),
    "the square of its rows": lambda y: tf.cast(tf.shape(y)[0], tf.float32) *
    tf.cast(tf.shape(y)[0], tf.float32),
}


@pytest.mark.parametrize("name", sorted(DIVISORS))
def test_a_sum_over_the_batch_divided_by_a_size_of_its_shape(name, capsys):
    """By its feature count (`tf.shape(y)[1]`: every replica's alike, a
    number: the sum is summed), by its rows less one (a covariance's: the
    job's count), by the square root of its rows, by a power of them or
    the root of a count the data's values set (each replica divides by
    1/N of the function of the job's count) the replicas equal one device
    (4 steps, every variable and slot, 1e-5; before: 0.072, 0.066 and
    0.044 apart, the first two silently, each read as a mean over a
    count; the root named); so by the product of two counts, a function of
    the job's sum and counts (graph/batch_sums.py; before: averaged, with a
    line saying the form is not shown)."""
    from models import train_both
    from test_normalization import worst
    parallel, single, names = train_both(lambda b: divided_sum_graph(DIVISORS[name], b), 2, 4)
    said = capsys.readouterr().err
    assert "parallax_ng:" not in said, said
    assert worst(parallel, single, names) <= 1e-5 and len(names) == 5


FUNCTIONS_OF_MEANS = {      # a loss per example plus a function of the batch's means
    "squared per-column means": lambda z: tf.reduce_sum(tf.square(tf.reduce_mean(z, 0) - 1.0)),
    "entropy of the mean prediction": lambda z: tf.reduce_sum(mean_p(z) * tf.math.log(
        mean_p(z))),
    "per-column RMSE": lambda z: tf.reduce_mean(tf.sqrt(tf.reduce_mean(tf.square(z - 1.0), 0))),
    "decorrelation penalty": lambda z: tf.reduce_sum(tf.square(tf.matmul(
        z, z, transpose_a=True) / tf.cast(tf.shape(z)[0], tf.float32) - tf.eye(3))),
}


def functions_of_means_graph(name):
    import numpy as np
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], "x")
        y = tf1.placeholder(tf.int32, [None], "y")
        w = tf1.get_variable("w", initializer=(np.arange(15).reshape(5, 3) / 15.0).astype(
            np.float32))
        z = tf.matmul(x, w)
        loss = tf.add(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=z)), 0.5 * FUNCTIONS_OF_MEANS[name](z), name="loss")
        tf1.train.AdamOptimizer(0.1).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("name", sorted(FUNCTIONS_OF_MEANS))
def test_a_function_of_a_vector_of_means_over_the_batch_equals_one_device(name, capsys):
    """The batch's means per column taken by a function not linear in them
    (a squared distance, an entropy, a root), or its gram matrix over its
    count (each example's outer product summed: a decorrelation penalty):
    every replica uses the job's means, so 2 replicas equal one device with
    the global batch, every variable and slot after 4 steps and the loss
    each step within 1e-5, with no line (before: 0.019 to 0.86 apart, with
    the line "does not show whether the loss is a mean or a sum")."""
    import numpy as np

    from models import load_values, local, read_name, variable_names
    rng = np.random.default_rng(2)
    xs, ys = rng.normal(size=(4, 8, 5)).astype(np.float32), rng.integers(0, 3, (4, 8))
    g = functions_of_means_graph(name)
    names = variable_names(g)
    reads = [read_name(k, g) for k in names]
    with pn.get_runner(g, local(2)) as runner:
        runner.run([v.initializer for v in g.get_collection("variables")])
        start = dict(zip(names, runner.run(reads)))
        got = [runner.run(["train", "loss:0"], {"x:0": a, "y:0": b})[1] for a, b in zip(xs, ys)]
        parallel = dict(zip(names, runner.run(reads)))
    assert "does not show" not in capsys.readouterr().err
    g1 = functions_of_means_graph(name)
    with tf1.Session(graph=g1) as sess:
        load_values(sess, g1, start)
        want = [sess.run(["train", "loss:0"], {"x:0": a, "y:0": b})[1] for a, b in zip(xs, ys)]
        single = dict(zip(names, sess.run(reads)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert len(names) == 5          # w, its two slots, the powers of beta
    for k in names:
        np.testing.assert_allclose(parallel[k], single[k], atol=1e-5, rtol=0, err_msg=k)


JOB = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import parallax_ng as pn
from models import read_name, variable_names
from test_forms import functions_of_means_graph

g = functions_of_means_graph({name!r})
names = variable_names(g)
reads = [read_name(k, g) for k in names]
runner = pn.get_runner(g, None, {{"dense_method": "bfb"}})
runner.run([v.initializer for v in g.get_collection("variables")])
w = runner.plan.worker
start = dict(zip(names, runner.run(reads)))
rng = np.random.default_rng(2)
xs, ys = rng.normal(size=(4, 8, 5)).astype(np.float32), rng.integers(0, 3, (4, 8))
for a, b in zip(xs, ys):
    runner.run("train", {{"x:0": a[4 * w:4 * w + 4], "y:0": b[4 * w:4 * w + 4]}})
np.savez({out!r} + f".{{w}}.npz", **dict(zip(names, runner.run(reads))),
         **{{"start/" + k: v for k, v in start.items()}})
print("servers", runner.plan.reduces_on_servers, flush=True)
"""


def test_a_job_that_sums_on_its_server_exchanges_a_vector_of_means(tmp_path):
    """2 workers and a server, fusion buffers (the exchange goes through the
    server): both workers' variables equal one device's after 4 steps."""
    import numpy as np

    from models import load_values, read_name, variable_names
    from test_extremes import run_job
    name = "entropy of the mean prediction"
    done, out = run_job(tmp_path, JOB, name=name)
    assert done.stdout.count("servers True") == 2, done.stdout[-2000:]
    saved = [dict(np.load(f"{out}.{w}.npz")) for w in (0, 1)]
    g = functions_of_means_graph(name)
    names = variable_names(g)
    rng = np.random.default_rng(2)
    xs, ys = rng.normal(size=(4, 8, 5)).astype(np.float32), rng.integers(0, 3, (4, 8))
    with tf1.Session(graph=g) as sess:
        load_values(sess, g, {k: saved[0]["start/" + k] for k in names})
        for a, b in zip(xs, ys):
            sess.run("train", {"x:0": a, "y:0": b})
        want = dict(zip(names, sess.run([read_name(k, g) for k in names])))
    for w, got in enumerate(saved):
        for k in names:
            np.testing.assert_allclose(got[k], want[k], atol=1e-5, rtol=0, err_msg=f"{w}: {k}")
