import numpy as np
import pytest
import tensorflow as tf

from models import OPTIMIZERS, embedding_regression
from parallax_ng.graph import frontend
from parallax_ng.errors import GraphError
from parallax_ng.graph.ir import TensorRef

tf1 = tf.compat.v1


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [False, True])
def test_gradients_are_the_autodiff_outputs(optimizer, clip):
    g, _ = embedding_regression(4, optimizer, clip=clip, ema=True)
    tg = frontend.load(g)
    assert set(tg.gradients) == {"emb", "dense/w", "dense/b", "out/v"}
    emb = tg.gradients["emb"]
    assert emb.sparse
    assert emb.values.node.startswith("gradients/") and emb.indices.node.startswith("gradients/")
    assert tg.tensor(emb.indices).dtype in (tf.int32, tf.int64)
    for name in ("dense/w", "dense/b", "out/v"):
        grad = tg.gradients[name]
        assert not grad.sparse
        assert grad.values.node.startswith("gradients/")
        assert tg.tensor(grad.values).shape == tg.variables[name].shape


def test_gradient_matches_compute_gradients_ground_truth():
    g, _ = embedding_regression(4, "momentum", clip=True)
    with g.as_default():
        # the tensors the optimizer got from compute_gradients feed the clip op
        clip_inputs = {t.name for op in g.get_operations()
                       if op.type == "L2Loss" for t in op.inputs}
    tg = frontend.load(g)
    found = {str(tg.gradients[v].values) for v in tg.gradients}
    assert found == clip_inputs


def test_state_ownership_slots_ema_and_beta_powers():
    g, _ = embedding_regression(4, "adam", ema=True)
    tg = frontend.load(g)
    v = tg.variables
    assert v["emb/Adam"].owner == "emb" and v["emb/Adam_1"].owner == "emb"
    assert v["dense/w/ExponentialMovingAverage"].owner == "dense/w"
    assert v["beta1_power"].owner in tg.trainable       # colocated with a variable
    assert v["global_step"].owner is None and not v["global_step"].trainable
    assert "Adam/update_emb/ResourceScatterAdd" in tg.writers["emb/Adam"]
    assert "embedding_lookup" in tg.readers["emb"]
    assert v["emb"].nbytes == 40 * 4 * 4


def test_graph_without_optimizer_is_an_error():
    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("w", [3])
        tf.reduce_sum(w * 2.0)
    with pytest.raises(GraphError, match="no optimizer update"):
        frontend.load(g)


def test_sync_replicas_optimizer_is_refused_with_what_to_write_instead():
    """TF1's own synchronous replication: the variables are written from
    accumulators, not from gradients; the error says to use the wrapped
    optimizer."""
    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("w", [3])
        opt = tf1.train.SyncReplicasOptimizer(tf1.train.AdamOptimizer(0.1), 1, 1)
        opt.minimize(tf.reduce_sum(w * w), tf1.train.get_or_create_global_step())
    with pytest.raises(GraphError, match="no optimizer update.*SyncReplicasOptimizer makes.*"
                                         "use the optimizer SyncReplicasOptimizer wraps"):
        frontend.load(g)


def test_unknown_op_on_a_variable_names_it():
    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("w", [3])
        counter = tf1.get_variable("counter", dtype=tf.int64, initializer=np.int64(0),
                                   trainable=False)
        tf.raw_ops.DisableCopyOnRead(resource=counter.handle)
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(w))
    with pytest.raises(GraphError, match="DisableCopyOnRead.*counter"):
        frontend.load(g)


def test_meta_graph_file_round_trip(tmp_path):
    g, _ = embedding_regression(4, "adagrad")
    path = str(tmp_path / "model.meta")
    with g.as_default():
        tf1.train.export_meta_graph(filename=path)
    tg = frontend.load(path)
    assert set(tg.gradients) == {"emb", "dense/w", "dense/b", "out/v"}
    assert tg.shard_consts == [("parallax_shard/num_shards", "parallax_shard/index")]


def test_bad_sources():
    with pytest.raises(GraphError, match="does not exist"):
        frontend.load("/nonexistent/model.meta")
    with pytest.raises(GraphError, match="tf.Graph"):
        frontend.load(42)


def test_shard_marks_the_dataset():
    g, _ = embedding_regression(4, "sgd")
    tg = frontend.load(g)
    (num, index), = tg.shard_consts
    assert tg.ir.node(num).op == "Const" and tg.ir.node(index).op == "Const"
    consumers = {c for c, _ in tg.ir.consumers[TensorRef(num)]}
    assert any(tg.ir.node(c).op == "ShardDataset" for c in consumers)
    assert np.array_equal(tf.make_ndarray(tg.ir.node(num).attr["value"].tensor), 1)
