"""transforms/input_gradients.py: a TF2 step's gradient with respect to its
inputs (`tape.gradient(loss, x)`, not of variables) is one device's on
every replica. Of a mean over the batch, each replica's was N times one
device's (it divides by its own rows): a penalty on its norm trained 0.033
away from one device in 8 steps before the pass. 2 replicas equal one
device with the global batch, every weight and Adam slot and every step's
loss within 1e-5 after 6 steps: FGSM's perturbation along the sign, a
penalty on a mean's input gradient, a penalty on a sum's (WGAN-GP's form),
a batch Jacobian's; in a `pn.function` loop (Keras 3) and a tf_keras
model's own `train_step` under `fit` (a TF1 graph's `tf.gradients(value,
x)`: tests/test_input_calls.py). A target that is neither a mean nor
a sum over the batch is named in a warning. The loss that adds such a
penalty reads as a mean (graph/rows.py follows an input's gradient to its
source's rows): no note that its form is unknown."""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.graph import recorders
from parallax_ng.graph.rows import batch_rows

TOL, STEPS = 1e-5, 6


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(STEPS, 16, 5)).astype("float32"),
            rng.integers(0, 3, (STEPS, 16)).astype("int32"))


def _ce(logits, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _inner(case, model, x, y):
    """The value whose gradient with respect to `x` the step takes."""
    return {"fgsm": lambda: _ce(model(x), y), "mean": lambda: _ce(model(x), y),
            "both": lambda: _ce(model(x), y),
            "sum": lambda: tf.reduce_sum(model(x) * tf.one_hot(y, 3)),
            "max": lambda: tf.reduce_max(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=model(x)))}[case]()


def step_of(case, model, optimizer):
    variables = model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(x)
                if case == "jacobian":
                    logits = model(x)
                else:
                    value = _inner(case, model, x, y)
            if case == "jacobian":
                penalty = tf.reduce_sum(tf.square(inner.batch_jacobian(logits, x)), [1, 2])
                loss = _ce(logits, y) + 0.01 * tf.reduce_mean(penalty)
            elif case == "fgsm":
                adversarial = x + 0.1 * tf.sign(inner.gradient(value, x))
                loss = 0.5 * _ce(model(x), y) + 0.5 * _ce(model(adversarial), y)
            else:       # "both": one call of the input and the variables
                grad = inner.gradient(value, x if case != "both" else [x] + variables)
                grad = grad[0] if case == "both" else grad
                loss = _ce(model(x), y) + 10.0 * tf.reduce_mean(tf.reduce_sum(grad ** 2, 1))
        if case == "both":
            grads = tape.gradient(loss, variables + [x])[:-1]
        else:
            grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss
    return step


def _model(lib):
    lib.utils.set_random_seed(1)
    return lib.Sequential([lib.Input((5,)), lib.layers.Dense(8, activation="tanh"),
                           lib.layers.Dense(3)])


def _worst(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


@pytest.mark.parametrize("case", ["fgsm", "mean", "sum", "jacobian", "both"])
def test_a_step_with_an_inputs_gradient_equals_one_device(case):
    """"both": `tape.gradient(value, [x] + variables)`, the input's gradient
    in a penalty and the variables' trained, and the outer call of the loss
    with the input too (before: the call was read as one of variables, the
    input's gradient N times one device's per example, 0.91 apart after 5
    steps in a smaller model)."""
    models = [_model(keras), _model(keras)]
    optimizers = [keras.optimizers.Adam(0.02), keras.optimizers.Adam(0.02)]
    step = pn.function(step_of(case, models[0], optimizers[0]), local(2))
    reference = tf.function(step_of(case, models[1], optimizers[1]))
    xs, ys = _data()
    losses = [(float(step(tf.constant(x), tf.constant(y))),
               float(reference(tf.constant(x), tf.constant(y)))) for x, y in zip(xs, ys)]
    step.sync()
    assert max(abs(a - b) for a, b in losses) < TOL
    assert _worst(models[0].weights + optimizers[0].variables,
                  models[1].weights + optimizers[1].variables) < TOL
    report = next(r.report for r in step.runner.pass_records if r.name == "input_gradients")
    assert report == {"scaled": {"fgsm": 1, "mean": 1, "both": 2}.get(case, 0), "summed": 0}
    # the loss reads as a mean: the input's gradient has its rows, and is no loss itself
    assert not [note for note in step.runner.plan.notes if "loss" in note]


def test_a_tf_keras_train_step_with_an_inputs_gradient_penalty_equals_one_device():
    import tf_keras

    class Penalized(tf_keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    value = _ce(self(x, training=True), y)
                grad = inner.gradient(value, x)
                loss = value + 10.0 * tf.reduce_mean(tf.reduce_sum(grad ** 2, 1))
            self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
            return {"loss": loss}

    def make():
        tf_keras.utils.set_random_seed(1)
        inputs = tf_keras.Input((5,))
        hidden = tf_keras.layers.Dense(8, activation="tanh")(inputs)
        model = Penalized(inputs, tf_keras.layers.Dense(3)(hidden))
        model.compile(optimizer=tf_keras.optimizers.Adam(0.02))
        return model
    parallel, single = make(), make()
    pn.parallelize(parallel, local(2))
    xs, ys = _data()
    x, y = xs.reshape(-1, 5), ys.reshape(-1)
    logs = [m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
            for m in (parallel, single)]
    assert np.max(np.abs(np.subtract(*logs))) < TOL
    assert _worst(parallel.weights + parallel.optimizer.variables(),
                  single.weights + single.optimizer.variables()) < TOL


def test_a_target_neither_a_mean_nor_a_sum_is_named_in_a_warning():
    model, optimizer = _model(keras), keras.optimizers.Adam(0.02)
    step = pn.function(step_of("max", model, optimizer), local(2))
    xs, ys = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(tf.constant(xs[0]), tf.constant(ys[0]))
    said = [str(w.message) for w in caught if "with respect to tensors" in str(w.message)]
    assert len(said) == 1 and "Max:0" in said[0], said
    report = next(r.report for r in step.runner.pass_records if r.name == "input_gradients")
    assert report == {"scaled": 0, "summed": 0}


def test_the_recorder_seeds_an_inputs_gradient_and_keeps_it_from_the_losses():
    w = tf.Variable(tf.ones([5, 1]))

    def step(x):
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(x)
                value = tf.reduce_mean(tf.matmul(x, w), name="value")
            loss = tf.reduce_sum(tf.square(inner.gradient(value, x)), name="loss")
        return tape.gradient(loss, [w])
    with recorders.tape_targets() as targets:
        concrete = tf.function(step).get_concrete_function(tf.TensorSpec([None, 5]))
    assert list(targets) == ["loss:0"]
    [(names, seeds, [(gradient, source)])] = targets.of_inputs
    assert names == ["value:0"] and len(seeds) == 1
    seed = concrete.graph.get_tensor_by_name(seeds[0])
    assert seed.op.type == "Identity" and seed.op.name.startswith(recorders.SEED)
    assert gradient.startswith(recorders.ROWS) and source == "x:0"
    graph = concrete.graph
    recorders.note_input_gradients(graph, targets.of_inputs)
    recorders.note_input_gradients(graph, targets.of_inputs)     # noted twice: read once
    assert recorders.input_gradients(graph) == [(names, seeds)]
    assert recorders.input_rows(graph) == {gradient[:-2]: graph.get_tensor_by_name("x:0")}
    assert batch_rows(graph.get_tensor_by_name(gradient), ["x"])   # the rows of its source


@pytest.mark.parametrize("run_option", ["hybrid", "ps"])
def test_one_call_of_an_embedding_s_rows_and_its_lookup_equals_one_device(run_option):
    """`tape.gradient(loss, variables + [embedded])`: the table's gradient
    (rows) is a replica's own, multiplied back as the dense ones are
    (before: left at 1/N of it, 0.021 apart
    after 5 steps), and the lookup's gradient is one device's."""
    rng = np.random.default_rng(0)
    ids, ys = rng.integers(0, 20, (5, 16, 3)), rng.normal(size=(5, 16, 1)).astype("float32")

    def make():
        keras.utils.set_random_seed(2)
        table, dense = keras.layers.Embedding(20, 4), keras.layers.Dense(1)
        table.build((None, 3))
        dense.build((None, 12))
        optimizer, weights = keras.optimizers.Adam(0.05), table.weights + dense.weights

        def step(i, y):
            with tf.GradientTape() as tape:
                embedded = table(i)
                tape.watch(embedded)
                loss = tf.reduce_mean(tf.square(dense(tf.reshape(embedded, [-1, 12])) - y))
            grads = tape.gradient(loss, weights + [embedded])
            optimizer.apply_gradients(zip(grads[:-1], weights))
            return loss, tf.reduce_mean(tf.reduce_sum(tf.square(grads[-1]), [1, 2]))
        return weights, optimizer, step
    (wa, oa, sa), (wb, ob, sb) = make(), make()
    parallel = pn.function(sa, local(2), {"run_option": run_option})
    for i, y in zip(ids, ys):
        got, want = parallel(i, y), sb(i, y)        # one device eagerly
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)
    parallel.sync()
    assert _worst(wa + oa.variables, wb + ob.variables) < TOL


@pytest.mark.parametrize("order", ["first", "second"])
def test_a_gradient_of_a_weight_s_value_is_summed_over_the_replicas(order):
    """MAML's inner step: `inner.gradient(loss, w_value)` of a tensor the
    batch does not index sums over every example; each replica's summed
    its own (0.10 apart after 4 steps, silently, before). It is now
    all-reduced: first-order MAML (tf.stop_gradient on it) equals one
    device; differentiated again, its own gradient is each replica's,
    and a warning says so."""
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(4, 16, 4)), rng.normal(size=(4, 16, 1))

    def make():
        w = tf.Variable(np.random.default_rng(1).normal(size=(4, 1)))
        optimizer = keras.optimizers.SGD(0.05)

        def step(x, y):
            with tf.GradientTape() as outer:
                value = tf.identity(w)
                with tf.GradientTape() as inner:
                    inner.watch(value)
                    inner_loss = tf.reduce_mean(tf.square(x @ value - y))
                g = inner.gradient(inner_loss, value)
                fast = value - 0.1 * (tf.stop_gradient(g) if order == "first" else g)
                loss = tf.reduce_mean(tf.square(x @ fast - y))
            optimizer.apply_gradients([(outer.gradient(loss, w), w)])
            return loss
        return w, step
    (wa, sa), (wb, sb) = make(), make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel = pn.function(sa, local(2))
        for x, y in zip(xs, ys):
            parallel(x, y), sb(x, y)
    parallel.sync()
    lines = [str(w.message) for w in caught if "differentiates it again" in str(w.message)]
    if order == "first":
        np.testing.assert_allclose(wa.numpy(), wb.numpy(), atol=1e-12, rtol=0)
        assert not lines
    else:
        assert len(lines) == 1 and "tf.stop_gradient on it" in lines[0]
    report = next(r.report for r in parallel.runner.pass_records if r.name == "input_gradients")
    assert report == {"scaled": 1, "summed": 1}


def test_the_scaled_seeds_run_on_their_replicas_devices():
    """The seed each replica's input gradient starts from (renamed, its
    1/N after it) runs on that replica's device: before, the copies had
    none, and TensorFlow put every replica's on the first device, a
    transfer each step (a GPU's to another GPU)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        w = tf.compat.v1.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        adversarial = x + 0.1 * tf.sign(tf.gradients(loss, x)[0])     # FGSM's
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            loss + tf.reduce_mean(tf.square(tf.matmul(adversarial, w) - y)))
    with pn.get_runner(g, local(2)) as runner:
        seeds = [op for op in runner.program.graph.get_operations()
                 if op.name.startswith("parallax/input_gradients/") and op.type != "Const"]
        devices = runner.plan.devices
    assert len(seeds) == 2 and all(op.device for op in seeds), seeds      # one a replica
    for op in seeds:
        assert op.device == devices[1 if "replica_1" in op.name else 0], (op.name, op.device)
