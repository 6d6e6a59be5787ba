"""parallax_ng/planning/column_cut.py: which uses of a table cut by columns change, and
which make alltoall impossible (named in the error)."""
import numpy as np
import pytest
import tensorflow as tf

from models import embedding_regression
from parallax_ng.graph import frontend
from parallax_ng.planning.column_cut import Branch, uses
from parallax_ng.errors import ConfigError
from parallax_ng.planning.facts import Facts
from parallax_ng.planning.placement import Columns
from parallax_ng.planning.planner import by_columns

tf1 = tf.compat.v1


def test_adam_with_clipping_and_moving_averages():
    """The update ops stay (element-wise on the replica's columns); the lookup
    is exchanged, the global norm's L2Loss summed, initializers cut, the
    moving average's `initialized_value()` If recognized, and reads nobody
    consumes (fetches) read the whole table."""
    tg = frontend.load(embedding_regression(4, "adam", clip=True, ema=True)[0])
    u = uses(tg, "emb")
    assert u.state == ("emb", "emb/Adam", "emb/Adam_1", "emb/ExponentialMovingAverage")
    assert u.lookups == ("embedding_lookup",)
    assert u.norms == ("global_norm/L2Loss",)
    assert {w for w, _ in u.cut} == {"emb/Assign", "emb/Adam/Assign", "emb/Adam_1/Assign"}
    assert u.selects == {"cond": (Branch("read", 0), Branch("pass", 1))}
    assert u.whole_selects == ()
    assert "emb/Read/ReadVariableOp" in u.whole_reads
    assert all(not tg.ir.node_consumers.get(r) for r in u.whole_reads)
    for op in ("Adam/update_emb/ResourceScatterAdd", "Adam/update_emb/AssignSubVariableOp"):
        assert op not in u.whole_reads and op not in {w for w, _ in u.cut}


def test_adagrad_keeps_its_sparse_apply():
    u = uses(frontend.load(embedding_regression(4, "adagrad")[0]), "emb")
    assert u.state == ("emb", "emb/Adagrad") and u.norms == ()
    assert u.lookups == ("embedding_lookup",)


def _tied(extra=None):
    """An embedding whose table is also the output layer (a whole read in
    the step), or whose gradient goes on to `extra`."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        emb = tf1.get_variable("emb", initializer=np.ones([10, 4], np.float32))
        h = tf.nn.embedding_lookup(emb, ids)
        if extra == "tied":     # the output layer reads the table, not trained there
            logits = tf.matmul(h, tf.stop_gradient(emb.read_value()), transpose_b=True)
            loss = tf.reduce_mean(logits)
        else:
            loss = tf.reduce_mean(h)
        opt = tf1.train.GradientDescentOptimizer(0.1)
        gv = opt.compute_gradients(loss)
        if extra == "summed":
            grad = gv[0][0]
            tf.identity(tf.reduce_sum(grad.values), name="grad_total")
        opt.apply_gradients(gv)
    return frontend.load(g)


def test_a_gradient_leaving_the_rows_is_an_error_naming_the_op():
    with pytest.raises(ConfigError, match=r"reaches op 'Sum' \(Sum\).*use ps or allgather"):
        uses(_tied("summed"), "emb")


def test_a_tied_output_layer_reads_the_whole_table_which_a_job_cannot():
    tg = _tied("tied")
    u = uses(tg, "emb")
    inside = [r for r in u.whole_reads if tg.ir.node_consumers.get(r)]
    assert inside == ["Read/ReadVariableOp"]
    assert by_columns(Facts(tg), ["emb"], ["d0", "d1"])["emb"].width == 4
    with pytest.raises(ConfigError, match="'Read/ReadVariableOp' reads the whole of 'emb' "
                                          "within a step.*use ps or allgather"):
        by_columns(Facts(tg), ["emb"], ["d0", "d1"], num_workers=2)


def test_a_whole_read_in_the_update_is_an_error_naming_it():
    """A learning rate from a norm over the table (as LAMB's trust ratio
    reads the variable and its slots whole in its update): after the
    gradient's exchange each replica writes its columns while the others
    read them, so alltoall is refused naming the read. A whole read of the
    forward pass (the rows scaled by the norm) comes before the exchange,
    which every write waits for, and stays."""
    for late in (True, False):
        g = tf.Graph()
        with g.as_default():
            ids = tf1.placeholder(tf.int32, [None], name="ids")
            emb = tf1.get_variable("emb", initializer=np.ones([10, 4], np.float32))
            rows = tf.nn.embedding_lookup(emb, ids)
            norm = tf.norm(tf.identity(emb.read_value(), name="whole"))
            if late:
                tf1.train.GradientDescentOptimizer(0.1 / norm).minimize(tf.reduce_mean(rows))
            else:       # the rows scaled by the norm: read before the gradient
                tf1.train.GradientDescentOptimizer(0.1).minimize(
                    tf.reduce_mean(rows * tf.stop_gradient(norm)))
        if late:
            with pytest.raises(ConfigError, match=r"op 'Read(_\d+)?/ReadVariableOp' reads the "
                               "whole of 'emb' in the update of 'emb'.*LAMB.*use ps or allgather"):
                uses(frontend.load(g), "emb")
        else:
            assert uses(frontend.load(g), "emb").whole_reads


def test_keras3_lamb_on_an_embedding_keeps_its_table_whole_and_equals_one_device(capsys):
    """Keras 3's Lamb scales each update by a norm over the variable and
    over its slots, read in the update: under `sparse_method: alltoall`
    the table trained 1.3e-3 apart from one device after 8 steps (the
    norms joined columns some replicas had written), silently. Now the
    plan keeps the table whole, with a line naming the read; `fit` equals
    one device, every weight and slot, 1e-5."""
    import keras
    from models import local
    import parallax_ng as pn

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                  keras.layers.Embedding(50, 4), keras.layers.Flatten(),
                                  keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Lamb(0.01), loss="mse")
        return model
    parallel, single = make(), make()
    pn.parallelize(parallel, local(2), {"sparse_method": "alltoall"})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (64, 3)).astype(np.int32)
    y = rng.normal(size=(64, 1)).astype(np.float32)
    for m in (parallel, single):
        m.fit(ids, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert "alltoall not used (op 'lamb" in capsys.readouterr().err    # lamb_<k>/ if others
    assert not parallel._parallax_ng.step.runner.plan.columns()
    for a, b in zip(parallel.weights + parallel.optimizer.variables,
                    single.weights + single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0,
                                   err_msg=a.path)


def test_reference_variables_and_other_shapes_are_errors():
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None])
        emb = tf1.get_variable("emb", [10, 4], use_resource=False)
        tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.nn.embedding_lookup(emb, ids)))
    with pytest.raises(ConfigError, match="reference variable.*use_resource=True"):
        uses(frontend.load(g), "emb")
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None])
        emb = tf1.get_variable("emb", initializer=np.ones([10, 2, 2], np.float32))
        tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.nn.embedding_lookup(emb, ids)))
    with pytest.raises(ConfigError, match=r"shape \[10, 2, 2\]"):
        uses(frontend.load(g), "emb")


def test_columns_cut_as_evenly_as_possible():
    part = Columns.even(6, ["a", "b", "c", "d"])
    assert [(s.device, s.start, s.size) for s in part.shards] == [
        ("a", 0, 2), ("b", 2, 2), ("c", 4, 1), ("d", 5, 1)]
    assert part.width == 6
    with pytest.raises(ValueError, match="3 columns cannot give each of 4"):
        Columns.even(3, ["a", "b", "c", "d"])
