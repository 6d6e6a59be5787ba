"""Flat buffers: the packing helpers build what TensorFlow runs as slices and
concatenations of flat tensors, and the pass's fusion buffers and buckets
are built from them (their equivalence is in test_fusion_buffers.py and
test_buckets.py)."""
import numpy as np
import tensorflow as tf

from parallax_ng.config import BucketsConfig
from parallax_ng.graph import emit
from passkit import context, op_counts, run_passes
from transforms.aggregate import AggregatePass
from transforms.flat_buffers import concat, elements, flat_slice
from transforms.replicate import ReplicatePass


def run_nodes(nodes, fetch):
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.extend(nodes)
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        return sess.run(fetch)


def test_slices_and_concatenations_of_flat_tensors():
    nodes = [emit.const("flat", np.arange(10, dtype=np.float32), tf.float32),
             emit.const("axis", 0, tf.int32)]
    assert flat_slice(nodes, "whole", "flat", 0, 10, tf.float32, "", whole=True) == "flat"
    a = flat_slice(nodes, "a", "flat", 2, 3, tf.float32, "")
    b = flat_slice(nodes, "b", "flat", 7, 2, tf.float32, "")
    nodes += [concat("ab", [a, b], "axis", tf.float32, ""),
              concat("only", [a], "axis", tf.float32, "")]
    assert nodes[-1].op == "Identity" and nodes[-2].op == "ConcatV2"
    ab, only = run_nodes(nodes, ["ab:0", "only:0"])
    np.testing.assert_array_equal(ab, [2, 3, 4, 7, 8])
    np.testing.assert_array_equal(only, [2, 3, 4])


def test_one_bucket_is_one_packed_all_reduce_per_replica():
    """`buckets.mode: single`: every dense variable in one bucket, packed on
    each replica's device (one ConcatV2 of `elements` per variable), one
    all-reduce, split back."""
    ctx = context(n=2, run_option="allreduce", buckets=BucketsConfig(mode="single"))
    variables = ctx.plan.buckets[0].variables
    assert len(ctx.plan.buckets) == 1 and len(variables) > 1
    ir = run_passes(ctx, ReplicatePass(), AggregatePass())
    counts = op_counts(ir, "parallax/bucket_0/")
    assert counts["CollectiveReduce"] == 2 and counts["ConcatV2"] == 2
    packed = [n for n in ir.nodes if n.name.startswith("parallax/bucket_0/") and
              n.op == "ConcatV2"]
    assert all(len(n.input) == len(variables) + 1 for n in packed)
    assert sum(elements(ctx.tg, v) for v in variables) > len(variables)


def test_gradients_computed_after_an_update_pack_apart():
    """A step that updates a variable and then computes another gradient
    from its new value (a GAN's two optimizers in one step): the second
    gradient is of a later stage, and neither buckets nor fusion buffers
    pack gradients of two stages together (one would wait for the other's
    update, which waits for it)."""
    from parallax_ng.graph import frontend
    from parallax_ng.planning import packing
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.ones((2, 3), np.float32))
        d = tf1.get_variable("d", initializer=np.ones((3, 1), np.float32))
        gen = tf1.get_variable("gen", initializer=np.ones((3, 3), np.float32))
        d_loss = tf.reduce_mean(tf.matmul(tf.matmul(x, gen), d))
        d_train = tf1.train.GradientDescentOptimizer(0.1).minimize(d_loss, var_list=[d])
        with tf.control_dependencies([d_train]):
            g_loss = tf.reduce_mean(tf.matmul(tf.matmul(x, gen), d.read_value()))
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(g_loss, var_list=[gen])
        tf1.add_to_collection(tf1.GraphKeys.TRAIN_OP, train)
    tg = frontend.load(g)
    assert packing.stages(tg) == {"d": 0, "gen": 1}
    order = packing.ready_order(tg, ["d", "gen"])
    one = BucketsConfig(mode="single")
    assert [b.variables for b in packing.allreduce_buckets(tg, order, one)] == [("d",), ("gen",)]
    buffers = packing.fusion_buffers(tg, order, ["/job:ps/task:0"], 1 << 20)
    assert [[s.var for s in b.segments] for b in buffers] == [["d"], ["gen"]]


def test_gradients_two_train_ops_apply_pack_apart():
    """A TF1 GAN's two `minimize` ops, run in turn: each variable's run is
    the train op it ends in (not a fetch of a gradient's norm, which ends
    nowhere a variable is written), and neither buckets nor fusion
    buffers pack the two runs' gradients together (a run of either would
    compute both, reading the other's batch)."""
    from parallax_ng.graph import frontend
    from parallax_ng.planning import packing
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.ones((2, 3), np.float32))
        d, d2, gen = (tf1.get_variable(n, initializer=np.ones((3, 3), np.float32))
                      for n in ("d", "d2", "gen"))
        fake = tf.matmul(x, gen)
        d_loss = tf.reduce_mean(tf.matmul(tf.matmul(x, d), d2) - tf.matmul(fake, d))
        grads = tf.gradients(d_loss, [d, d2])
        tf.norm(grads[0], name="watched")       # a fetch of its own
        tf1.train.AdamOptimizer(0.1).apply_gradients(zip(grads, [d, d2]))
        tf1.train.AdamOptimizer(0.1).minimize(tf.reduce_mean(tf.matmul(fake, d)),
                                              var_list=[gen])
    tg = frontend.load(g)
    runs = packing.runs(tg)
    assert runs["d"] == runs["d2"] != runs["gen"]
    order = packing.ready_order(tg, ["d", "d2", "gen"])
    one = BucketsConfig(mode="single")
    assert {frozenset(b.variables) for b in packing.allreduce_buckets(tg, order, one)} == {
        frozenset({"d", "d2"}), frozenset({"gen"})}
    buffers = packing.fusion_buffers(tg, order, ["/job:ps/task:0"], 1 << 20)
    assert sorted(sorted(s.var for s in b.segments) for b in buffers) == [["d", "d2"], ["gen"]]


def test_a_gradient_the_backward_pass_goes_on_from_keeps_its_stage():
    """tf.nn.batch_normalization's offset gradient, in a GradientTape, is
    also the tensor the backward pass negates for the mean's gradient (on
    to the layer below): that read is the autodiff's, of the replica's own
    value, not of the aggregate, so every gradient is of stage 0 and one
    bucket takes them all (Keras's BatchNormalization and
    LayerNormalization; before, each layer below such an offset was a
    stage later: a bucket per stage, and jobs with servers refused)."""
    from parallax_ng.graph import frontend
    from parallax_ng.planning import packing
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
        w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32), use_resource=True)
        beta = tf1.get_variable("beta", initializer=np.zeros(3, np.float32), use_resource=True)
        with tf.GradientTape() as tape:
            h = tf.matmul(x, w)
            mean, variance = tf.nn.moments(h, [0])
            loss = tf.reduce_mean(tf.square(
                tf.nn.batch_normalization(h, mean, variance, beta, None, 1e-3) - 1.0))
        grads = tape.gradient(loss, [w, beta])
        train = tf1.train.GradientDescentOptimizer(0.1).apply_gradients(zip(grads, [w, beta]))
        tf1.add_to_collection(tf1.GraphKeys.TRAIN_OP, train)
    tg = frontend.load(g)
    offset = tg.gradients["beta"].values
    assert any(tg.ir.node(c).op == "Neg" for c, _ in tg.ir.consumers[offset])
    assert packing.stages(tg) == {"w": 0, "beta": 0}
    order = packing.ready_order(tg, ["w", "beta"])
    buckets = packing.allreduce_buckets(tg, order, BucketsConfig(mode="single"))
    assert [sorted(b.variables) for b in buckets] == [["beta", "w"]]
