"""graph/batch_sums.py: a loss that is a function of sums over the batch (a
Dice loss's ratio `1 - 2 sum(y p) / (sum(y) + sum(p))`, Keras 3's `Dice`
and `Tversky`) takes the job's sums forward and the job's sum of their
incoming gradients backward, so 2 replicas equal one device with the
global batch: the loss every step and every variable and slot after 6
steps of SGD with momentum (which, unlike Adam, shows a gradient's scale)
within 1e-5, in a Keras 3 `pn.function` loop, `model.fit` (Keras 3 and
tf_keras, with a Dice metric: logs and `evaluate` too), a TF1 graph
(all-reduce and parameter servers) and jobs of 2 workers (all-reduce; a
server). Before, each replica took the ratio of its own rows' sums
(weights 3e-3 apart, silently in `fit`). Where no exchange makes it one
device's (a variable on the way, a Sum used elsewhere too, a largest value
over the batch), the loss is read as before: averaged, with the line that
names it. A soft IoU, whose gradient reaches one Sum through another's,
was 0.36 apart before each Sum's gradient was exchanged as its own. A
sum divided by a mean of the batch (a normalized squared error) is such a
function (before, read as a mean over a count, silently). So is a mean
over classes of each class's mean (tf.math.unsorted_segment_mean: sums
per class over counts per class), whose gradient tf.math.unsorted_segment_sum
gathers back to the rows (before, each replica's own classes' means,
named as mixing the batch)."""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local, read_name, variable_names
from parallax_ng.graph import batch_sums, forms

tf1 = tf.compat.v1
TOL, STEPS, BATCH = 1e-5, 6, 16       # BATCH: the global batch


def arrays():
    """Features and two binary masks per example."""
    rng = np.random.RandomState(5)
    x = rng.randn(STEPS * BATCH, 5).astype(np.float32)
    y = (x[:, :2] + 0.5 * rng.randn(STEPS * BATCH, 2) > 0.3).astype(np.float32)
    return x, y


def dice(y, p, smooth=1.0):
    """A Dice loss over the whole batch, smoothed as segmentation code
    writes it."""
    inter = tf.reduce_sum(y * p)
    return 1.0 - (2.0 * inter + smooth) / (tf.reduce_sum(y) + tf.reduce_sum(p) + smooth)


def dice_coef(y, p):
    return 1.0 - dice(y, p)


def dice_model(k=keras):
    return k.Sequential([k.Input((5,)), k.layers.Dense(8, activation="tanh"),
                         k.layers.Dense(2, activation="sigmoid")])


def soft_iou(y, p):
    """Per class: its intersection is read twice, and the gradient of the
    union's difference reaches the second Sum from the first's."""
    inter = tf.reduce_sum(y * p, 0)
    return 1.0 - tf.reduce_mean(inter / (tf.reduce_sum(y + p, 0) - inter + 1e-6))


def soft_f1(y, p):
    tp, fp = tf.reduce_sum(y * p, 0), tf.reduce_sum((1.0 - y) * p, 0)
    fn = tf.reduce_sum(y * (1.0 - p), 0)
    return 1.0 - tf.reduce_mean(2.0 * tp / (2.0 * tp + fp + fn + 1e-7)) + \
        0.1 * tf.reduce_mean(tf.square(p - y))


def class_balanced(y, p):
    """The mean over classes of each class's mean squared error (the class
    of a row: its two masks' bits; tf.math.unsorted_segment_mean's sums
    and counts per class)."""
    classes = tf.cast(y[:, 0], tf.int32) + 2 * tf.cast(y[:, 1], tf.int32)
    per_class = tf.math.unsorted_segment_mean(tf.reduce_sum(tf.square(p - y), 1), classes, 4)
    return tf.reduce_mean(per_class)


LOSSES = {"own": lambda: dice, "a mean per class": lambda: class_balanced,
          "keras Dice": lambda: keras.losses.Dice(),
          "keras Tversky": lambda: keras.losses.Tversky(alpha=0.3, beta=0.7),
          "soft IoU": lambda: soft_iou, "soft F1 plus a mean": lambda: soft_f1}


def step_of(model, optimizer, loss=dice):
    def train_step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return value
    return train_step


def _form(build):
    """forms.loss_form of build(y, p) over a TF1 graph's dense layer,
    differentiated by tf.gradients."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5], name="x")
        y = tf1.placeholder(tf.float32, [None, 2], name="y")
        p = tf.sigmoid(tf.matmul(x, tf1.get_variable("w", [5, 2])))
        loss = build(y, p)
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return forms.loss_form(loss, ["x", "y"], None, strict=False), g


def _read_elsewhere(y, p):
    total = tf.reduce_sum(p)
    return 1.0 - 2.0 * tf.reduce_sum(y * p) / (tf.reduce_sum(y) + total) + 0.01 * total


SHAPES = {      # a loss -> (its form, how many names it exchanges)
    "a Dice loss": (dice, "mean", 5),       # 3 Sums, 2 of the model's with their gradients
    "a root of a sum": (lambda y, p: tf.sqrt(tf.reduce_sum(p)), "mean", 2),
    "a mean per class": (lambda y, p: class_balanced(y, p), "mean", 3),    # (its count's too)
    "a Sum read elsewhere too": (_read_elsewhere, None, 0),
    "a variable on the way": (lambda y, p: dice(y, p, tf1.get_variable("s", initializer=1.0)),
                              None, 0),
    "a largest value over the batch": (
        lambda y, p: 1.0 - tf.reduce_sum(y * p) / (tf.reduce_sum(p) + tf.reduce_max(p)), None, 0),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_which_functions_of_sums_are_exchanged(name):
    build, kind, exchanged = SHAPES[name]
    form, g = _form(build)
    assert form.kind == kind and len(form.summed) == exchanged, form
    gradients = [n for n in form.summed if n.startswith("gradients/")]
    assert len(gradients) == {5: 2, 2: 1, 3: 1}.get(exchanged, 0)


def test_what_a_gradient_flows_through():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 5])
        p = tf.sigmoid(tf.matmul(x, tf1.get_variable("w", [5, 2])))
        assert batch_sums.differentiable(tf.reduce_sum(p))
        assert not batch_sums.differentiable(tf.reduce_sum(x))          # the data alone
        assert not batch_sums.differentiable(                           # a mask's count
            tf.reduce_sum(tf.cast(p > 0.5, tf.float32)))
        assert not batch_sums.differentiable(tf.cast(tf.shape(p)[0], tf.float32))
        assert not batch_sums.differentiable(tf.stop_gradient(tf.reduce_sum(p)))


def test_which_sums_per_class_add_up_over_the_replicas():
    """The batch's rows summed at the classes its labels name, as many as
    the graph fixes: a part of one device's on each replica (not a sparse
    batch's values summed by their row: a value per row)."""
    from parallax_ng.graph.rows import reading
    g = tf.Graph()
    with g.as_default():
        x, label = tf1.placeholder(tf.float32, [None, 5]), tf1.placeholder(tf.int32, [None])
        table = tf1.get_variable("t", [4, 5])
        sparse = tf1.sparse_placeholder(tf.float32, [4, 10], name="sparse")
        made = {"per class": tf.math.unsorted_segment_sum(x, label, 3),
                "a sparse batch's values by their row": tf.math.unsorted_segment_sum(
                    sparse.values, sparse.indices[:, 0], 4),
                "as many as the labels": tf.math.unsorted_segment_sum(
                    x, label, tf.reduce_max(label) + 1),
                "a table's rows": tf.math.unsorted_segment_sum(table, [0, 1, 1, 2], 3),
                "largest": tf.math.unsorted_segment_max(x, label, 3)}
    rows = reading(forms.sources(g), g)
    assert {k for k, t in made.items() if batch_sums.per_segment(t.op, rows)} == {"per class"}
    assert batch_sums.per_segment(made["largest"].op, rows, "UnsortedSegmentMax")


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_keras3_loop_of_a_dice_loss_equals_one_device(name):
    keras.utils.set_random_seed(0)
    a, b = dice_model(), dice_model()
    b.set_weights(a.get_weights())
    oa, ob = (keras.optimizers.SGD(0.5, momentum=0.9) for _ in range(2))
    step = pn.function(step_of(a, oa, LOSSES[name]()), local(2))
    ref = tf.function(step_of(b, ob, LOSSES[name]()))
    x, y = arrays()
    for k in range(STEPS):
        at = slice(k * BATCH, (k + 1) * BATCH)
        np.testing.assert_allclose(step(x[at], y[at]), ref(x[at], y[at]).numpy(), atol=TOL,
                                   rtol=0)
    step.sync()
    for v1, v2 in zip(a.weights + oa.variables, b.weights + ob.variables):
        np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), atol=TOL, rtol=0,
                                   err_msg=v1.path)


def test_a_dice_loss_smoothed_by_a_variable_is_named(capsys):
    """The smoothing trained too: its gradient would take the job's sum
    where it shares the denominator's (a tape passes an add's gradient on
    as it is), so the loss is averaged, as any loss that mixes the batch's
    examples is, and the step says so."""
    keras.utils.set_random_seed(0)
    model, optimizer = dice_model(), keras.optimizers.SGD(0.5)
    smooth = tf.Variable(1.0)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            value = dice(y, model(x, training=True), smooth)
        variables = model.trainable_variables + [smooth]
        optimizer.apply_gradients(zip(tape.gradient(value, variables), variables))
        return value
    x, y = arrays()
    pn.function(train_step, local(2))(x[:BATCH], y[:BATCH])
    said = capsys.readouterr().err
    assert "mixes the batch's examples ('truediv': a division by a sum over the batch" in said


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_fit_with_a_dice_loss_equals_one_device(lib):
    """`model.fit` (2 epochs, validation) with Keras 3's Dice loss, or in
    tf_keras the own Dice plus a cross-entropy, and a Dice metric: every
    weight and slot, every logged value and `evaluate`'s."""
    k = keras if lib == "keras3" else __import__("tf_keras")
    k.utils.set_random_seed(0)
    parallel, single = dice_model(k), dice_model(k)
    single.set_weights(parallel.get_weights())
    loss = keras.losses.Dice() if lib == "keras3" else \
        (lambda y, p: dice(y, p) + tf.reduce_mean(k.losses.binary_crossentropy(y, p)))
    for m in (parallel, single):
        m.compile(optimizer=k.optimizers.SGD(0.5, momentum=0.9), loss=loss,
                  metrics=[dice_coef])
    pn.parallelize(parallel, local(2))
    logs = fit_both(parallel, single, *arrays(), rtol=0)
    assert set(logs[0]) == set(logs[1]) and len(logs[0]) == 4


def fit_both(parallel, single, x, y, rtol):
    """Both models fit 2 epochs with validation: every logged value,
    `evaluate`'s, every weight and slot within TOL (and `rtol`); the logs."""
    logs = [m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  validation_data=(x[:2 * BATCH], y[:2 * BATCH])).history
            for m in (parallel, single)]
    for key in logs[1]:
        np.testing.assert_allclose(logs[0][key], logs[1][key], atol=TOL, rtol=rtol, err_msg=key)
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=BATCH, verbose=0),
                               single.evaluate(x, y, batch_size=BATCH, verbose=0),
                               atol=TOL, rtol=rtol)
    for v1, v2 in zip(parallel.weights + parallel.optimizer.variables,
                      single.weights + single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v1), np.asarray(v2), atol=TOL, rtol=rtol)
    return logs


def tf1_model(batch, loss_of=dice):
    """A TF1 graph of two layers on the shard of `arrays()`, trained on
    the Dice loss (or `loss_of`) by momentum; the Dice coefficient fetched
    beside it."""
    g = tf.Graph()
    with g.as_default():
        ds = pn.shard(tf.data.Dataset.from_tensor_slices(arrays())).batch(batch)
        it = tf1.data.make_initializable_iterator(ds)
        x, y = it.get_next()
        rng = np.random.RandomState(4)
        w = tf1.get_variable("w", initializer=rng.randn(5, 8).astype(np.float32))
        v = tf1.get_variable("v", initializer=rng.randn(8, 2).astype(np.float32))
        p = tf.sigmoid(tf.matmul(tf.tanh(tf.matmul(x, w)), v))
        loss = loss_of(y, p)
        fetched = [loss, 2.0 * tf.reduce_sum(y * p) / (tf.reduce_sum(y + p))]
        train = tf1.train.MomentumOptimizer(0.5, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, train, fetched, init, it.initializer


def tf1_both(model, config=None):
    """`model(BATCH // 2)` on 2 replicas and `model(BATCH)` on one device
    from the same start, STEPS steps: the values fetched each step (the
    parallel run's, one device's) and the variables by name (every
    replica's, one device's)."""
    g, train, fetched, init, it_init = model(BATCH // 2)
    names = variable_names(g)
    reads = [read_name(n, g) for n in names]
    with pn.get_runner(g, local(2), config) as runner:
        runner.run([init, it_init])
        start = runner.run(reads)
        got = [runner.run([train, fetched])[1] for _ in range(STEPS)]
        parallel = dict(zip(names, runner.run(reads, per_replica=True)))
    g1, train1, fetched1, init1, it_init1 = model(BATCH)
    with tf1.Session(graph=g1) as sess:
        sess.run([init1, it_init1])
        load_values(sess, g1, dict(zip(names, start)))
        want = [sess.run([train1, fetched1])[1] for _ in range(STEPS)]
        single = dict(zip(names, sess.run(reads)))
    return (got, want), (parallel, single)


@pytest.mark.parametrize("run", ["allreduce", "ps"])
@pytest.mark.parametrize("loss", ["dice", "a mean per class"])
def test_a_tf1_dice_loss_equals_one_device(run, loss):
    """A mean per class (its sums and counts by tf.math.unsorted_segment_*)
    is such a function too: before, each replica took its own classes'
    means, and the step said the loss mixed the batch's examples."""
    (got, want), (parallel, single) = tf1_both(
        lambda b: tf1_model(b, LOSSES["own" if loss == "dice" else loss]()),
        {"run_option": run})
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert len(single) == 4                 # the weights and their momenta
    for name in single:
        for value in parallel[name]:
            np.testing.assert_allclose(value, single[name], atol=TOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("servers, loss", [(0, "dice"), (1, "dice"), (1, "a mean per class")])
def test_a_job_of_two_workers_equals_one_device(tmp_path, servers, loss):
    """tf2_job_script.py --dice: the Keras 3 loop above as a job of 2
    workers x 1 device on 127.0.0.1, the sums all-reduced between them, or
    (run option ps) summed on the server; so the mean per class."""
    from test_tf2 import run_job
    out, done = run_job(tmp_path, "--dice", *(["--ps"] if servers else []),
                        *(["--balanced"] if loss != "dice" else []), servers=servers)
    assert "worker 1 of 2: done" in done.stdout
    workers = [dict(np.load(f"{out}.{k}.npz")) for k in range(2)]
    model, optimizer = dice_model(), keras.optimizers.SGD(0.5, momentum=0.9)
    model.set_weights([workers[0][f"start{i}"] for i in range(len(model.weights))])
    ref = tf.function(step_of(model, optimizer, LOSSES["own" if loss == "dice" else loss]()))
    x, y = arrays()
    for k in range(5):
        ref(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
    for w in workers:
        assert set(json.loads(str(w["plan"])).values()) == {"ps" if servers else "allreduce"}
        for i, v in enumerate(model.weights):
            np.testing.assert_allclose(w[f"w{i}"], np.asarray(v), atol=TOL, rtol=0)
        for i, v in enumerate(optimizer.variables):
            np.testing.assert_allclose(w[f"o{i}"], np.asarray(v), atol=TOL, rtol=0)


@pytest.mark.parametrize("batch_norm", ["per_replica", "synchronized"])
def test_fit_with_a_dice_loss_and_sample_weights(batch_norm, capsys):
    """Keras 3 weighs a scalar loss by each row's sample weight: the Dice
    value meets the rows, so its sums are statistics applied to them (a
    normalization of the program's own), per replica by default, named by
    the mixing line, and the data's sum among them stays the replica's
    without the warning for a count the exchange does not read; with
    `batch_norm: synchronized` they are the job's and `fit` equals one
    device (every weight and slot, 1e-5)."""
    import warnings
    keras.utils.set_random_seed(0)
    parallel, single = dice_model(), dice_model()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9), loss=keras.losses.Dice())
    pn.parallelize(parallel, local(2), {"batch_norm": batch_norm})
    x, y = arrays()
    weights = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for m in (parallel, single):
            m.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0)
    assert not [w for w in seen if "the exchange does not read" in str(w.message)]
    said = capsys.readouterr().err
    assert "mixes the batch's examples" in said
    apart = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        parallel.weights + parallel.optimizer.variables,
        single.weights + single.optimizer.variables))
    if batch_norm == "synchronized":
        assert apart <= TOL
    else:
        assert "statistics over the batch's axis" in said and apart > TOL


def _over_statistic(kind):
    """A squared error summed over the batch over a statistic of the
    targets (a normalized squared error): their mean square, their
    standard deviation, or their largest magnitude."""
    def loss(y, p):
        statistic = {"mean square": lambda: tf.reduce_mean(tf.square(y)),
                     "standard deviation": lambda: tf.math.reduce_std(y),
                     "largest": lambda: tf.reduce_max(tf.abs(y))}[kind]()
        return tf.reduce_sum(tf.square(y - p)) / statistic
    return loss


def test_a_sum_over_a_statistic_of_the_batch_is_no_mean_over_a_count():
    """A divisor that takes a mean, a largest value or a product over the
    batch's rows is a statistic, not a count the exchange shares (before,
    a mean of squares and a largest value were read as one: silently 0.33
    and 0.52 apart in a `fit`): a mean is a function of the job's sum and
    mean; a largest value or tf.math.reduce_euclidean_norm (9.4 apart in a
    sweep), no form (named). A count of the rows that have
    any valid entry (a largest value over a later axis) stays a count."""
    g = tf.Graph()
    with g.as_default():
        y = tf1.placeholder(tf.float32, [None, 2], name="y")
        p = tf.tanh(tf.matmul(y, tf1.get_variable("w", [2, 2])))
        err = tf.reduce_sum(tf.square(y - p))
        means = forms.loss_form(_over_statistic("mean square")(y, p), ["y"], None)
        largest = forms.loss_form(_over_statistic("largest")(y, p), ["y"], None)
        rows = forms.loss_form(err / tf.reduce_sum(tf.reduce_max(y, 1)), ["y"], None)
        norm = forms.loss_form(err / tf.math.reduce_euclidean_norm(y), ["y"], None)
    assert means.kind == "mean" and not means.by_count and means.exchanged
    assert largest.kind is None and norm.kind is None       # (a norm's op: no sum to share)
    assert rows.kind == "mean" and len(rows.by_count) == 1


@pytest.mark.parametrize("statistic", ["mean square", "standard deviation"])
def test_a_tf1_sum_over_a_statistic_of_the_batch_equals_one_device(statistic):
    """The replicas take the job's sum and statistic (its own mean
    centred on the job's), so the loss every step and every variable and
    slot equal one device's (before: 21 and 44 apart after 7 steps of a
    sweep's model, silently)."""
    def model(batch):
        g = tf.Graph()
        with g.as_default():
            ds = pn.shard(tf.data.Dataset.from_tensor_slices(arrays())).batch(batch)
            it = tf1.data.make_initializable_iterator(ds)
            x, _ = it.get_next()
            w = tf1.get_variable("w", initializer=np.random.RandomState(4).randn(5, 8)
                                 .astype(np.float32))
            v = tf1.get_variable("v", initializer=np.full((8, 1), 0.1, np.float32))
            p = tf.matmul(tf.tanh(tf.matmul(x, w)), v)
            loss = _over_statistic(statistic)(2.0 * x[:, :1] + 3.0, p)
            train = tf1.train.MomentumOptimizer(0.002, 0.9).minimize(loss)
            init = tf1.global_variables_initializer()
        return g, train, loss, init, it.initializer
    (got, want), (parallel, single) = tf1_both(model)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=0)
    for name in single:
        for value in parallel[name]:
            np.testing.assert_allclose(value, single[name], atol=TOL, rtol=TOL, err_msg=name)


@pytest.mark.parametrize("lib", ["keras3", "tf_keras"])
def test_fit_with_a_sum_over_the_targets_mean_square_equals_one_device(lib, capsys):
    """`fit` (2 epochs, validation) of a normalized squared error: logs,
    `evaluate`, every weight and slot (before: 0.33 apart, silently); a
    largest value over the batch instead is named."""
    k = keras if lib == "keras3" else __import__("tf_keras")
    x = arrays()[0]
    y = 2.0 * x[:, :1] + 3.0

    def model(kind):
        k.utils.set_random_seed(0)
        m = k.Sequential([k.Input((5,)), k.layers.Dense(8, activation="tanh"),
                          k.layers.Dense(1)])
        m.compile(optimizer=k.optimizers.SGD(0.002, momentum=0.9),
                  loss=_over_statistic(kind), metrics=["mae"])
        return m
    parallel, single = model("mean square"), model("mean square")
    pn.parallelize(parallel, local(2))
    fit_both(parallel, single, x, y, rtol=TOL)
    assert "parallax_ng" not in capsys.readouterr().err
    largest = pn.parallelize(model("largest"), local(2))
    largest.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert "does not show whether the loss" in capsys.readouterr().err
