"""transforms/counts.py: which counts a loss divides by the data's values
set (a mask's sum, the size of rows a mask picks; not the batch's size),
where a count is floored or smoothed, and, on 2 replicas against one
device with the global batch, a masked mean over `tf.maximum(count, 1)`
or `count + eps`, or `tf.cast(tf.maximum(tf.size(picked), 1), ...)` (a
replica counting no row in the first step): the
fetched loss every step and every variable and slot after 6 steps within
1e-5, all-reduce and parameter servers. Before, each replica floored its
own count: the loss 0.83 off one device's, and with `count + 1e-3`
1.8e-3 off. So is a sum over the batch's rows less one (a covariance's
count, Bessel's), which no mean of the replicas' quotients equals."""
import pytest
import tensorflow as tf

from passkit import context
from parallax_ng.graph import forms
from parallax_ng.graph.ir import parse_tensor
from test_selected_means import BATCH, check_tf1, tf1_model
from transforms import counts

tf1 = tf.compat.v1


def floored_loss(kind):
    def losses(pred, y):
        mask = tf.cast(y > 0, tf.float32)
        count = tf.reduce_sum(mask, name="count")
        if kind == "int-max":       # an integer count floored, then cast
            count = tf.cast(tf.maximum(tf.size(tf.boolean_mask(y, y > 0)), 1), tf.float32)
        count = tf.maximum(count, 1.0) if kind == "max" else count + 1e-3 \
            if kind == "eps" else count
        tf.size(pred, name="rows"), tf.size(tf.boolean_mask(pred, y[:, 0] > 0), name="picked")
        rows = tf.cast(tf.shape(pred)[0], tf.float32)
        if kind == "rows minus one":      # a covariance's (Bessel's) count of rows
            return [tf.reduce_sum(tf.square(pred - y)) / (rows - 1.0)]
        if kind == "root of the rows":
            return [tf.reduce_sum(tf.square(pred - y)) / tf.sqrt(rows)]
        if kind == "root of the count":
            return [tf.reduce_sum(tf.square(pred - y) * mask) / tf.sqrt(count + 1.0)]
        if kind == "norm of the targets":       # tf.norm: a root of a sum, squeezed
            return [tf.reduce_sum(tf.square(pred - y)) / tf.norm(y)]
        return [tf.reduce_sum(tf.square(pred - y) * mask) / count]
    return losses


@pytest.mark.parametrize("run", ["allreduce", "ps"])
@pytest.mark.parametrize("kind", ["max", "eps", "int-max", "rows minus one", "root of the rows",
                                  "root of the count", "norm of the targets"])
def test_a_floored_count_is_floored_from_the_jobs_count(kind, run):
    """The norm of the targets: its root is past a squeeze (before, each
    replica divided by the replicas' mean norm, silently 9.4 apart in a
    sweep's model)."""
    check_tf1(floored_loss(kind), run)


def test_the_counts_a_loss_divides_by_and_their_floors():
    g, *_ = tf1_model(BATCH // 2, floored_loss("max"))
    ctx = context(n=2, graph=g)
    tg, sources = ctx.tg, forms.sources(g)
    form = counts.Forms(sources)
    shared = counts.shared(tg, sources, form, {}, {})
    assert [(c.node, widen) for c, widen in shared] == [("Maximum", False)]
    at, inner = counts.floored(tg, shared[0][0], set(sources))
    assert at == ("Maximum", 0) and inner.node == "count"
    assert counts.from_values(tg, inner, set(sources))
    # a count of shapes alone is the same on every replica: not the data's
    shape = tg.ir.data_inputs("Maximum")[1]                     # (the constant 1)
    assert not counts.from_values(tg, shape, set(sources))
    assert counts.floored(tg, inner, set(sources)) == (None, inner)
    # the size of the batch is its shape's; the size of rows a mask picks, the data's
    rows, picked = parse_tensor("rows:0"), parse_tensor("picked:0")
    assert not counts.from_values(tg, rows, set(sources))
    assert counts.from_values(tg, picked, set(sources))


def test_the_ratios_a_program_reads_beside_its_loss():
    """`beside`: a masked accuracy (a Sum over the batch over a mask's sum,
    also through divide_no_nan) and an RMSE (a function of a mean) are
    read, and so are an RMSE and a masked accuracy per feature (vectors
    of means and of sums over the batch); a ratio over the batch's size (a
    shape, equal on every replica), one taken into rows again, one inside
    a cond branch, a tf.compat.v1 metric's update (a sum kept in a
    variable) and a function of per-row means are not. A mean of rows
    centred on a mean over the batch (a variance) is read. `shared` then shares the accuracies' counts.
    `centres` names the mean a read spread takes back into rows, not one
    the loss reads."""
    from test_branches import lowered_conds
    g = tf.Graph()
    with g.as_default(), lowered_conds():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 4], name="y")
        pred = x * tf1.get_variable("w", [4])
        mask = tf.cast(y > 0, tf.float32)
        hit = tf.cast(tf.abs(pred - y) < 0.5, tf.float32)
        tf.math.truediv(tf.reduce_sum(hit * mask), tf.reduce_sum(mask, name="real"), name="acc")
        tf.math.divide_no_nan(tf.reduce_sum(hit * mask), tf.reduce_sum(mask, name="real_nan"),
                              name="acc_nan")
        tf.math.truediv(tf.reduce_sum(hit), tf.cast(tf.size(hit), tf.float32), name="of_size")
        tf.sqrt(tf.reduce_mean(tf.square(pred - y), name="mse"), name="rmse")
        tf.sqrt(tf.reduce_mean(tf.square(pred - y), 1), name="per_row")
        tf.sqrt(tf.reduce_mean(tf.square(pred - y), 0), name="per_feature")
        tf.math.truediv(tf.reduce_sum(hit * mask, 0), tf.reduce_sum(mask, 0, name="real_each"),
                        name="acc_each")
        centred = tf.reduce_sum(pred * mask) / tf.reduce_sum(mask, name="centring")
        tf.identity(pred - centred, name="rows")
        tf1.cond(tf1.placeholder_with_default(False, []),
                 lambda: tf.reduce_sum(hit * mask) / tf.reduce_sum(mask), lambda: 0.0)
        tf1.metrics.mean(tf.reduce_sum(hit), weights=None)
        centred = y - tf.reduce_mean(y, name="y_mean")      # a spread read beside the loss
        tf.sqrt(tf.reduce_mean(tf.square(centred), name="variance"), name="spread")
        tf.identity(x - tf.reduce_mean(x, name="x_mean"), name="x_centred")   # the loss's
        loss = tf.reduce_mean(tf.square(pred - y) + g.get_tensor_by_name("x_centred:0"))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    ctx = context(n=2, graph=g)
    tg, sources = ctx.tg, forms.sources(g)
    read = counts.beside(tg, sources)
    assert counts.centres(tg, sources, read) == ["y_mean:0"]
    assert {"spread", "variance"} <= {t.op.name for t in read}
    read = [t for t in read if t.op.name not in ("spread", "variance")]     # (its square)
    assert sorted(t.op.name for t in read) == ["acc", "acc_each", "acc_nan", "per_feature",
                                               "rmse"]
    form = counts.Forms(sources)
    by_name = {t.op.name: t for t in read}
    assert form(by_name["rmse"]).exchanged == ["mse:0"]     # the RMSE's mean: the job's
    assert form(by_name["per_feature"]).exchanged == ["Mean_1:0"]   # so its vector's
    shared = counts.shared(tg, sources, form, {}, {}, read)
    assert sorted(c.node for c, _ in shared) == ["real", "real_nan"]
    # the vector's sums, numerator and count, are the job's (a Dice coefficient's way)
    assert sorted(form(by_name["acc_each"]).summed) == ["Sum_3:0", "real_each:0"]
