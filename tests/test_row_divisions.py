"""Keras 3's division of an embedding's rows by a dense tensor checks the
rows, not the whole table (graph/row_divisions.py): Adagrad and Adadelta
without clipping equal one device in every mode, a step runs no op of the
table's shape, and a zero in the rows' divisor still takes Keras's other
branch."""
import keras            # Keras 3 by name, whatever TF_USE_LEGACY_KERAS the suite sets
import numpy as np
import pytest
import tensorflow as tf

from parallax_ng.graph.tracing import capture
from test_row_updates import (VOCAB, embedding_model, ops_run, trained_like_one_device,
                              whole_table_ops)
from test_tf2 import data, step_of

OPTIMIZERS = {"adagrad": lambda: keras.optimizers.Adagrad(0.3),
              "adadelta": lambda: keras.optimizers.Adadelta(1.0)}


def test_the_check_reads_the_rows_and_the_whole_table_waits_behind_it():
    """The cond's predicate is computed from the accumulator's rows; the
    whole square root, read behind a Switch on it, does not run."""
    model, optimizer = embedding_model(), OPTIMIZERS["adagrad"]()
    ids, y = data(vocab=VOCAB)
    cap = capture(step_of(model, optimizer), (ids[0], y[0]))
    ops = cap.graph.get_operations()
    gated = [op for op in ops if op.type == "ReadVariableOp" and
             op.name.endswith("parallax_whole")]
    assert gated and all(op.inputs[0].op.type == "Switch" for op in gated)
    ran = ops_run(cap, ids[0], y[0])
    assert not [op.name for op in gated if op.name in ran]
    assert [n for n in whole_table_ops(cap.graph, (VOCAB, 4)) if n in ran] == []


@pytest.mark.parametrize("config", [
    {"run_option": "hybrid"}, {"run_option": "ps"}, {"run_option": "allreduce"},
    {"sparse_method": "alltoall"}], ids=["hybrid", "ps", "allgather", "alltoall"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unclipped_divisions_on_an_embedding_equal_one_device(name, config):
    step = trained_like_one_device(OPTIMIZERS[name], config)
    assert any(vp.info.sparse for vp in step.runner.plan.variables.values())


def test_a_zero_in_the_rows_divisor_takes_the_union_branch_as_keras_does():
    """A divisor with zeros at some of the rows' ids (and elsewhere): the
    rows' check finds them, so the cond takes Keras's union branch, which
    reads the whole divisor; the result (infinities included, at an id and
    off the ids) equals eager Keras's."""
    divisor = tf.Variable(np.ones((20, 3), np.float32))
    table = tf.Variable(np.zeros((20, 3), np.float32))
    start = np.ones((20, 3), np.float32)
    start[[3, 11]] = 0.0                       # 3 is one of the ids, 11 is not

    def fn(values, ids):
        rows = tf.IndexedSlices(values, ids, tf.constant([20, 3]))
        out = keras.ops.divide(rows, tf.sqrt(divisor + 0.0))
        table.scatter_add(out)
        return tf.constant(0.0)
    values = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    ids = np.array([3, 7, 3, 19], np.int32)
    divisor.assign(start)
    cap = capture(fn, (values, ids))
    assert any(op.name.endswith("parallax_whole") for op in cap.graph.get_operations())
    with tf.compat.v1.Session(graph=cap.graph) as sess:
        sess.run(cap.init, {**cap.init_feeds})
        sess.run(cap.train, dict(zip([n + ":0" for n in cap.inputs], (values, ids))))
        got = {id(cap.variables[n]): sess.run(r) for n, r in cap.reads.items()}
    tf.function(fn)(values, ids)
    np.testing.assert_array_equal(got[id(table)], table.numpy())
    assert not np.isfinite(got[id(table)][[3, 11]]).any()     # the union branch ran


def test_a_zero_only_outside_the_rows_is_the_stated_difference():
    """The one place the rewrite departs from Keras (docs/limits.md): a
    divisor with a zero only at ids the gradient does not touch. Eager
    Keras takes its union branch and writes a non-finite value there; the
    rewritten step checks the rows, divides them, and leaves the rest."""
    divisor = tf.Variable(np.ones((20, 3), np.float32))
    table = tf.Variable(np.zeros((20, 3), np.float32))
    start = np.ones((20, 3), np.float32)
    start[11] = 0.0

    def fn(values, ids):
        rows = tf.IndexedSlices(values, ids, tf.constant([20, 3]))
        table.scatter_add(keras.ops.divide(rows, tf.sqrt(divisor + 0.0)))
        return tf.constant(0.0)
    values = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    ids = np.array([3, 7, 5, 19], np.int32)     # distinct: Keras's union keeps one row
                                                # of an id that repeats
    divisor.assign(start)
    cap = capture(fn, (values, ids))
    with tf.compat.v1.Session(graph=cap.graph) as sess:
        sess.run(cap.init, cap.init_feeds)
        sess.run(cap.train, dict(zip([n + ":0" for n in cap.inputs], (values, ids))))
        got = {id(cap.variables[n]): sess.run(r) for n, r in cap.reads.items()}[id(table)]
    tf.function(fn)(values, ids)
    want = table.numpy()
    assert not np.isfinite(want[11]).any() and (got[11] == 0).all()
    others = [r for r in range(20) if r != 11]
    np.testing.assert_array_equal(got[others], want[others])
