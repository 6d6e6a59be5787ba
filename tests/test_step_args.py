"""A TF2 step's arguments (parallax_ng/step_args.py): the dimensions a
trace leaves open (a padded batch's length, as a tf.function's
input_signature or a dataset's element_spec leaves it), a clear error
where a call does not fit the trace, and padded batches of several
lengths trained exactly as one device trains them, in a custom loop (in `fit`:
test_keras_fit.py's masked sequence loss)."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from models import local
from test_tf2 import check_equal, step_of, twins

import parallax_ng as pn
from parallax_ng.errors import ConfigError
from parallax_ng.step_args import fits_shape, open_shapes, positional, same_shapes


def test_open_shapes_follow_the_spec_where_its_structure_and_ranks_match():
    x, y = np.zeros((4, 6), np.int32), np.zeros((4, 1), np.float32)
    spec = (tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, 1], tf.float32))
    opened = open_shapes(spec, ((x, y),))
    assert opened[id(x)].as_list() == [None, None] and opened[id(y)].as_list() == [None, 1]
    assert open_shapes(spec[:1], ((x, y),)) == {}            # another structure: nothing
    assert open_shapes(None, (x,)) == {}
    assert id(x) not in open_shapes((tf.TensorSpec([None], tf.int32),), (x,))   # rank 1 != 2
    assert fits_shape(tf.TensorShape([None, None]), np.zeros((2, 9)))
    assert not fits_shape(tf.TensorShape([None, 6]), np.zeros((2, 5)))
    assert not fits_shape(tf.TensorShape([None, 6]), np.zeros((2, 6, 1)))


def test_arguments_by_position_with_the_python_defaults_after_the_given_ones():
    """The Python defaults after the last given argument are traced values
    (a later call that changes one is refused); a tensor or array default
    stays the function's own constant, with what follows it; *args as given."""
    def step(x, y, train=True, scale=1.0, weights=np.ones(3), last=0):
        pass

    def rest(x, y=3, *more):
        pass
    assert positional(step, (1, 2), {}) == (1, 2, True, 1.0)
    assert positional(step, (1,), {"y": 2, "scale": 2.0}) == (1, 2, True, 2.0)
    assert positional(rest, (1,), {}) == (1, 3)
    assert positional(rest, (1, 2, 5, 6), {}) == (1, 2, 5, 6)
    assert positional(lambda *a, **k: None, (1, 2), {}) == (1, 2)
    with pytest.raises(ConfigError, match="do not fit its parameters"):
        positional(step, (1, 2), {"other": 1})


def test_a_call_that_does_not_fit_the_trace_is_named():
    with pytest.raises(ConfigError, match=r"argument leaf 1 of the step has shape \[4, 5\].*"
                                          r"traced for \[None, 6\].*input_signature"):
        same_shapes([tf.TensorShape([None, 2]), tf.TensorShape([None, 6])],
                    (np.zeros((4, 2)), np.zeros((4, 5))))
    same_shapes([None, tf.TensorShape([None, None])],           # sparse, open: fine
                (tf.SparseTensor([[0, 0]], [1.0], [4, 3]), np.zeros((4, 5))))


def _padded(seed=0, steps=4, batch=8, vocab=20):
    """Global batches of id sequences padded with 0 to their longest."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(steps):
        lengths = rng.integers(1, 3 + k, batch)
        x = np.zeros((batch, lengths.max()), np.int32)
        for i, n in enumerate(lengths):
            x[i, :n] = rng.integers(1, vocab, n)
        out.append((x, rng.normal(size=(batch, 1)).astype(np.float32)))
    return out


def _sequence_model():
    return keras.Sequential([keras.Input((None,), dtype="int32"),
                             keras.layers.Embedding(20, 4, mask_zero=True),
                             keras.layers.GRU(3), keras.layers.Dense(1)])


def test_padded_batches_of_several_lengths_equal_one_device_with_an_input_signature():
    """A tf.function whose input_signature leaves the length open is traced
    with it open: 4 batches of 3 lengths, 2 replicas, 1e-5. The same step
    without the signature is traced for the first batch's length, and the
    next length is a ConfigError naming the argument (before: TensorFlow's
    feed error, "Cannot feed value of shape")."""
    signature = [tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, 1], tf.float32)]
    parallel, single = twins(_sequence_model, lambda: keras.optimizers.Adam(0.01))
    step = pn.function(tf.function(step_of(*parallel), input_signature=signature), local(2))
    ref = tf.function(step_of(*single), input_signature=signature)
    batches = _padded()
    assert len({x.shape[1] for x, _ in batches}) >= 3
    for x, y in batches:
        np.testing.assert_allclose(step(x, y), ref(x, y).numpy(), atol=1e-5, rtol=0)
    step.sync()
    check_equal(parallel, single)
    fixed = pn.function(step_of(*twins(_sequence_model, keras.optimizers.Adam)[0]), local(2))
    fixed(*batches[0])
    with pytest.raises(ConfigError, match="argument leaf 0 of the step has shape"):
        fixed(*batches[1])


def _bag_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])


def _bag_step(model, optimizer, table):
    """Ragged rows of ids, each row's embeddings averaged into a bag."""
    def step(ids, y):
        with tf.GradientTape() as tape:
            bags = tf.reduce_mean(tf.gather(table, ids), axis=1)
            loss = tf.reduce_mean(tf.square(model(bags)[:, 0] - y))
        weights = model.trainable_variables + [table]
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return loss
    return step


@pytest.mark.parametrize("splits", [tf.int64, tf.int32])
def test_a_ragged_batch_is_split_by_rows_and_equals_one_device(splits, capsys):
    """A tf.RaggedTensor argument (rows of 1 to 4 ids, row splits of either
    dtype) is fed as its sparse rows and made ragged again in the traced
    step: each of 2 replicas gets its rows, and 3 steps equal one device
    given the ragged batch (head, Adam's slots and the table, 1e-5), with
    no line (its row lengths, a bincount of the rows' ids, count entries
    per example, not values among the batch's examples). A RaggedTensor
    of ragged rank 2 is refused by name, with what to pass instead."""
    keras.utils.set_random_seed(0)
    tables = [tf.Variable(tf.random.normal([20, 4])) for _ in range(2)]
    tables[1].assign(tables[0])
    parallel, single = twins(_bag_model, lambda: keras.optimizers.Adam(0.05))
    rng = np.random.RandomState(0)
    batches = [(tf.ragged.constant([list(rng.randint(0, 20, rng.randint(1, 5)))
                                    for _ in range(8)], dtype=tf.int64, row_splits_dtype=splits),
                rng.randn(8).astype(np.float32)) for _ in range(3)]
    step = pn.function(_bag_step(*parallel, tables[0]), local(2))
    ref = tf.function(_bag_step(*single, tables[1]))
    capsys.readouterr()
    for ids, y in batches:
        np.testing.assert_allclose(step(ids, y), ref(ids, y).numpy(), atol=1e-5, rtol=0)
    step.sync()
    check_equal(parallel, single)
    np.testing.assert_allclose(tables[0].numpy(), tables[1].numpy(), atol=1e-5, rtol=0)
    assert "parallax_ng:" not in capsys.readouterr().err
    nested = tf.RaggedTensor.from_row_lengths(batches[0][0], [2, 6])
    with pytest.raises(pn.GraphError, match="is a RaggedTensor of rank 3 and ragged rank 2: "
                                            r".*pass this one padded \(x.to_tensor\(\)\)"):
        pn.function(lambda ids, y: step(ids.values, y), local(2))(nested, batches[0][1])
