"""Deferral analysis: which ops update a table cut by columns, which scalars
they read from the step, and why an update cannot wait."""
import pytest
import tensorflow as tf

from models import embedding_regression
from parallax_ng.planning import deferral
from parallax_ng.planning.facts import Facts
from parallax_ng.errors import ConfigError
from parallax_ng.graph.frontend import load
from parallax_ng.graph.ir import TensorRef

tf1 = tf.compat.v1


def test_sgd_updates_by_one_scatter_with_a_constant_rate():
    tg = load(embedding_regression(4, "sgd")[0])
    d = deferral.analyse(Facts(tg), "emb")
    assert d.writers == ("GradientDescent/update_emb/ResourceScatterAdd",)
    assert d.frontier == ()
    assert TensorRef("GradientDescent/learning_rate", 0) in d.constants
    assert d.lookup == "embedding_lookup"


def test_adam_keeps_its_bias_corrected_rate_and_the_average_its_decay():
    """Adam's moments decay every row (their assigns are writers too), its
    learning rate comes from the step counters (a scalar kept per step),
    and the moving average reads the table after the table's update."""
    tg = load(embedding_regression(4, "adam", ema=True)[0])
    d = deferral.analyse(Facts(tg), "emb")
    kinds = sorted(tg.ir.node(w).op for w in d.writers)
    assert kinds == ["AssignSubVariableOp", "AssignSubVariableOp", "AssignVariableOp",
                     "AssignVariableOp", "ResourceScatterAdd", "ResourceScatterAdd"]
    assert TensorRef("Adam/update_emb/truediv", 0) in d.frontier    # lr_t from beta powers
    average = "ExponentialMovingAverage/AssignMovingAvg/AssignSubVariableOp"
    assert "Adam/update_emb/AssignSubVariableOp" in d.after[average]
    assert all(tg.tensor(r).shape.rank == 0 for r in d.frontier)
    # the writers are in the order they run, the frontier reads each needs
    assert set(d.needs[average]) == {TensorRef("ExponentialMovingAverage/AssignMovingAvg/sub",
                                               0)}


def test_a_global_norm_stays_in_the_step_and_a_second_lookup_keeps_the_update():
    """Clipping: the norm's L2Loss of the rows is not part of the update (each
    replica's share is summed in the rows' step); the clip scale it makes
    is a scalar kept for the delayed rows."""
    tg = load(embedding_regression(4, "adam", clip=True)[0])
    d = deferral.analyse(Facts(tg), "emb")
    assert not any(tg.ir.node(op).op == "L2Loss" for op in d.ops)
    assert any(r.node.startswith("clip_by_global_norm/") for r in d.frontier)
    g = tf.Graph()
    with g.as_default():
        emb = tf1.get_variable("emb", [10, 4])
        a = tf1.placeholder(tf.int32, [None])
        b = tf1.placeholder(tf.int32, [None])
        loss = tf.reduce_sum(tf.gather(emb, a)) + tf.reduce_sum(tf.gather(emb, b) ** 2)
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(ConfigError, match="not one lookup's ids"):
        deferral.analyse(Facts(load(g)), "emb")


def test_an_update_that_needs_the_whole_table_cannot_wait():
    """A write computed from the table's mean over rows is not row by row
    (the whole read in the update is named first: column_cut's check, as
    alltoall's columns could not hold it either)."""
    g = tf.Graph()
    with g.as_default():
        emb = tf1.get_variable("emb", [10, 4], use_resource=True)
        ids = tf1.placeholder(tf.int32, [None])
        opt = tf1.train.GradientDescentOptimizer(0.1)
        train = opt.minimize(tf.reduce_sum(tf.gather(emb, ids)))
        with tf.control_dependencies([train]):
            emb.assign(emb - tf.reduce_mean(emb, 0))
    with pytest.raises(ConfigError, match=r"\(Mean\) updates 'emb' from its rows|'Mean/"
                       r"ReadVariableOp' reads the whole of 'emb' in the update of 'emb'"):
        deferral.analyse(Facts(load(g)), "emb")


def test_a_dense_update_keeps_the_scalars_it_reads_from_the_step():
    """Adam's dense apply reads its step counters (beta powers) as scalars;
    a moving average of the weight comes along; a global norm keeps the
    update in its step."""
    tg = load(embedding_regression(4, "adam", ema=True)[0])
    d = deferral.analyse_dense(tg, "dense/w")
    assert [tg.ir.node(w).op for w in d.writers] == ["ResourceApplyAdam",
                                                     "AssignSubVariableOp"]
    reads = {tg.ir.node(r.node).op for r in d.frontier}
    assert reads == {"ReadVariableOp", "Sub"}     # beta1/beta2 powers, the decay's 1 - d
    tg = load(embedding_regression(4, "adam", clip=True)[0])
    with pytest.raises(ConfigError, match="a global norm reads its gradient"):
        deferral.analyse_dense(tg, "dense/w")
    with pytest.raises(ConfigError, match="'emb''s is sparse"):
        deferral.analyse_dense(tg, "emb")
