"""Variance: which nodes differ between replicas (their sources, and what
follows them along data edges, gradients aside)."""
import warnings

import numpy as np
import pytest
import tensorflow as tf
from models import embedding_regression, local, recompute_step

import parallax_ng as pn
from parallax_ng.graph import frontend
from parallax_ng.graph.ir import TensorRef
from parallax_ng.graph.variance import is_input_source, replica_variant


def test_replica_variant_stops_at_gradients():
    tg = frontend.load(embedding_regression(4, "adam", ema=True)[0])
    variant = replica_variant(tg)
    assert "IteratorGetNext" in variant and "loss" in variant
    assert "dense/w/Read/ReadVariableOp" not in variant
    # update math fed by (aggregated) gradients is the same on every replica
    assert not any(n.startswith("Adam/update_dense/w") for n in variant)


def test_sources_are_inputs_split_by_replica_and_random_draws():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="batch")
        lr = tf.compat.v1.placeholder(tf.float32, [], name="lr")
        noise = tf.identity(tf.random.uniform([2]), name="noise")
        w = tf.Variable([1.0, 2.0], name="w")
        loss = tf.reduce_sum(x * w * lr + noise, name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    tg = frontend.load(g)
    assert is_input_source(tg, tg.ir.node("batch"))
    assert not is_input_source(tg, tg.ir.node("lr"))          # fed whole
    variant = replica_variant(tg)
    assert {"batch", "random_uniform/RandomUniform", "noise", "loss"} <= variant
    assert "lr" not in variant
    # a draw every replica makes alike is no source
    alike = replica_variant(tg, identical=frozenset({"random_uniform/RandomUniform"}))
    assert "noise" not in alike and "batch" in alike


def test_a_sparse_placeholder_s_rows_count_is_each_replica_s():
    """A sparse placeholder's three tensors are each replica's (its rows'
    entries and their count): a count of examples read from its dense
    shape is the replica's, and adding it to a variable sums over them."""
    g = tf.Graph()
    with g.as_default():
        ids = tf.compat.v1.sparse_placeholder(tf.int64, [None, 3], name="ids")
        other = tf.compat.v1.placeholder(tf.int64, [2], name="other/shape")
        tf.identity(tf.shape(ids, out_type=tf.int64)[0] + other[0], name="seen")
        w = tf.Variable(tf.ones([5, 2]), name="w")
        loss = tf.reduce_sum(tf.nn.embedding_lookup_sparse(w, ids, None))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    tg = frontend.load(g)
    assert all(is_input_source(tg, tg.ir.node(f"ids/{p}"))
               for p in ("indices", "values", "shape"))
    assert not is_input_source(tg, tg.ir.node("other/shape"))    # no sparse placeholder's
    assert "seen" in replica_variant(tg)


def test_inputs_the_state_sync_reduced_stop_differences():
    """A metric's total written from the batch varies, unless its increment
    is synced (the state-sync pass's SyncedInputs): then the write and the
    update op reading it are equal on every replica; the count beside it
    still varies where its own increment is not synced."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        total = tf.compat.v1.get_variable("total", [], use_resource=False)
        count = tf.compat.v1.get_variable("count", [], use_resource=False)
        add_total = tf.compat.v1.assign_add(total, tf.reduce_sum(x), name="add_total")
        add_count = tf.compat.v1.assign_add(count, tf.cast(tf.size(x), tf.float32),
                                            name="add_count")
        tf.math.divide_no_nan(add_total, add_count, name="value")
        w = tf.compat.v1.get_variable("w", [])
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(x * w))
    tg = frontend.load(g)
    assert {"add_total", "add_count", "value"} <= replica_variant(tg)
    synced = replica_variant(tg, synced=frozenset({("add_total", 1), ("add_count", 1)}))
    assert "x" in synced and not {"add_total", "add_count", "value"} & synced
    half = replica_variant(tg, synced=frozenset({("add_total", 1)}))
    assert "add_total" not in half and {"add_count", "value"} <= half


def test_an_identity_ns_outputs_vary_each_with_its_own_input():
    """tf.custom_gradient passes its outputs, its inputs and the weights it
    reads through one IdentityN (and in a traced step, its gradient
    function returns the input's gradient, each replica's own, and the
    weight's, aggregated, through another): each output varies with its
    own input."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 1], use_resource=True)

        @tf.custom_gradient
        def project(x):
            def grad(dy, variables=None):
                return dy @ tf.transpose(w), [tf.matmul(x, dy, transpose_a=True)]
            return x @ w, grad
        loss = tf.reduce_mean(tf.square(project(x)), name="loss")
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
    tg = frontend.load(g)
    variant = replica_variant(tg)
    ident = [n.name for n in tg.ir.nodes if n.op == "IdentityN"]
    assert ident and all(n in variant for n in ident)
    assert not any(n.startswith("Adam/update_w") for n in variant)
    outputs = [TensorRef(ident[0], k) for k in range(3)]     # x @ w, x, w's value
    assert [variant.varies(ref) for ref in outputs] == [True, True, False]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_recomputed_block_trains_as_one_device_with_no_state_synced(optimizer):
    """tf.recompute_grad (a custom gradient) in a pn.function step: every
    weight and slot equals one device's after 4 steps, and no slot is
    synced as state (before: a line naming Adam's slots as written from
    each replica's data, and a collective for each)."""
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(4, 16, 4)), rng.normal(size=(4, 16, 1))

    (wa, oa, sa), (wb, ob, sb) = recompute_step(optimizer), recompute_step(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # no line on the slots
        parallel = pn.function(sa, local(2))
        single = sb     # eagerly: tf.function's own graph may race (tests/test_orderings.py)
        for x, y in zip(xs, ys):
            parallel(x, y), single(x, y)
    parallel.sync()
    for a, b in zip(wa + oa.variables, wb + ob.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-12, rtol=0)
    synced = [r.report for r in parallel.runner.pass_records if r.name == "state_sync"]
    assert synced == [{"synced": 0}]
