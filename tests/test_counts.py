"""transforms/counts.py: which counts a loss divides by the data's values
set (a mask's sum, the size of rows a mask picks; not the batch's size),
where a count is floored or smoothed, and, on 2 replicas against one
device with the global batch, a masked mean over `tf.maximum(count, 1)`
or `count + eps` (a replica counting no row in the first step): the
fetched loss every step and every variable and slot after 6 steps within
1e-5, all-reduce and parameter servers. Before, each replica floored its
own count: the loss 0.83 off one device's, and with `count + 1e-3`
1.8e-3 off."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local, read_name, variable_names
from passkit import context
from parallax_ng.graph import forms
from parallax_ng.graph.ir import parse_tensor
from test_selected_means import BATCH, STEPS, TOL, arrays
from transforms import counts

tf1 = tf.compat.v1


def model(batch, kind):
    g = tf.Graph()
    with g.as_default():
        ds = pn.shard(tf.data.Dataset.from_tensor_slices(arrays())).batch(batch)
        it = tf1.data.make_initializable_iterator(ds)
        x, y = it.get_next()
        rng = np.random.RandomState(4)
        w = tf1.get_variable("w", initializer=rng.randn(5, 4).astype(np.float32))
        v = tf1.get_variable("v", initializer=rng.randn(4, 1).astype(np.float32))
        pred = tf.matmul(tf.tanh(tf.matmul(x, w)), v)
        tf.size(x, name="rows"), tf.size(tf.boolean_mask(x, y[:, 0] > 0), name="picked")
        mask = tf.cast(y > 0, tf.float32)
        count = tf.reduce_sum(mask, name="count")
        count = tf.maximum(count, 1.0) if kind == "max" else count + 1e-3
        loss = tf.reduce_sum(tf.square(pred - y) * mask) / count
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, train, loss, init, it.initializer


@pytest.mark.parametrize("run", ["allreduce", "ps"])
@pytest.mark.parametrize("kind", ["max", "eps"])
def test_a_floored_count_is_floored_from_the_jobs_count(kind, run):
    g, train, loss, init, it_init = model(BATCH // 2, kind)
    names = variable_names(g)
    reads = [read_name(n, g) for n in names]
    with pn.get_runner(g, local(2), {"run_option": run}) as runner:
        runner.run([init, it_init])
        start = runner.run(reads)
        losses = [runner.run([train, loss])[1] for _ in range(STEPS)]
        parallel = dict(zip(names, runner.run(reads, per_replica=True)))
    g1, train1, loss1, init1, it_init1 = model(BATCH, kind)
    with tf1.Session(graph=g1) as sess:
        sess.run([init1, it_init1])
        load_values(sess, g1, dict(zip(names, start)))
        want = [sess.run([train1, loss1])[1] for _ in range(STEPS)]
        single = dict(zip(names, sess.run(reads)))
    np.testing.assert_allclose(losses, want, atol=TOL, rtol=0)
    for name in names:
        for got in parallel[name]:
            np.testing.assert_allclose(got, single[name], atol=TOL, rtol=0, err_msg=name)


def test_the_counts_a_loss_divides_by_and_their_floors():
    g, *_ = model(BATCH // 2, "max")
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
