from models import embedding_regression
from passkit import context, op_counts
from transforms.replicate import ReplicatePass


def test_every_user_node_is_copied_per_replica_except_shared_state():
    ctx = context(n=3, run_option="hybrid")
    ir, report = ReplicatePass().run(ctx.tg.ir, ctx)
    once = ctx.unreplicated
    assert "emb" in once and "GradientDescent/update_emb/ResourceScatterAdd" in once
    assert "dense/w" not in once
    assert len(ir) == len(ctx.tg.ir) * 3 - len(once) * 2
    assert report["copied"] == (len(ctx.tg.ir) - len(once)) * 2
    # replica 0 keeps names; copies are prefixed; shared nodes exist once
    assert "dense/w" in ir and "parallax/replica_2/dense/w" in ir
    assert "parallax/replica_1/emb" not in ir
    counts = op_counts(ir)
    assert counts["VarHandleOp"] == op_counts(ctx.tg.ir)["VarHandleOp"] * 3 - 2   # emb exists once


def test_copies_reference_shared_nodes_and_get_private_resources():
    ctx = context(n=2, run_option="hybrid")
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    gather = ir.node("parallax/replica_1/embedding_lookup")
    assert gather.input[0] == "emb"                       # the one shared embedding
    assert gather.input[1].startswith("parallax/replica_1/")
    w = ir.node("parallax/replica_1/dense/w")
    assert w.attr["shared_name"].s == b"parallax/replica_1/dense/w"
    assert ir.node("dense/w").attr["shared_name"].s == b"dense/w"
    named = [n.attr["shared_name"].s for n in ir.nodes
             if "shared_name" in n.attr and n.attr["shared_name"].s]
    assert len(named) == len(set(named))    # no two ops alias one resource


def test_shared_writer_waits_for_every_replicas_reads():
    ctx = context(n=2, optimizer="adam", run_option="hybrid")
    ir, report = ReplicatePass().run(ctx.tg.ir, ctx)
    assert report["ordering_edges"] > 0
    # the shared embedding's update runs after replica 1's lookup of it
    update = ir.node("Adam/update_emb/AssignSubVariableOp")
    assert "^parallax/replica_1/embedding_lookup" in update.input
    ir.verify()   # no cycle


def test_colocation_groups_follow_the_copy():
    ctx = context(n=2, optimizer="adam", run_option="allreduce")
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    slot = ir.node("parallax/replica_1/dense/w/Adam")
    assert list(slot.attr["_class"].list.s) == [b"loc:@parallax/replica_1/dense/w"]


def test_one_replica_is_identity():
    ctx = context(n=1)
    ir, report = ReplicatePass().run(ctx.tg.ir, ctx)
    assert list(ir.nodes) == list(ctx.tg.ir.nodes)
    assert report["ordering_edges"] == 0


def test_shared_reference_variable_writer_waits_for_the_ops_that_dereference_it():
    """A reference variable's `read` Identity aliases its buffer, which Assign
    overwrites in place: the shared beta-power update must wait for replica
    1's ApplyAdam of a mirrored weight, which reads through that Identity."""
    import tensorflow as tf
    tf.compat.v1.disable_resource_variables()
    try:
        graph = embedding_regression(4, "adam")[0]
    finally:
        tf.compat.v1.enable_resource_variables()
    # Adam's beta powers belong to the first variable by name, dense/b
    ctx = context(n=2, graph=graph, run_option="hybrid",
                  variable_methods={"dense/b": "ps"})
    assert ctx.tg.ir.node("beta1_power").op == "VariableV2" and \
        "beta1_power" in ctx.plan.shared_state()
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    writer = next(w for w in ctx.tg.writers["beta1_power"] if w != "beta1_power/Assign")
    assert "^parallax/replica_1/Adam/update_dense/w/ApplyAdam" in ir.node(writer).input
    ir.verify()


def test_a_shared_writer_waits_for_reads_in_a_conds_branches_by_its_merges():
    """A tf.cond of TF2 behavior whose branches read a variable the
    parameter servers hold, and whose taken branch writes a counter (so it
    is lowered to Switch/Merge, as batch normalization's `training` cond
    is under `batch_norm: synchronized`): the update waits on replica 1's
    reads through the Merges that end the cond, never on a read inside the
    branch not taken. Before, it waited on both branches' reads: the one
    not taken left the update dead, so under ps it never ran, and neither
    did Adam's step counters, silently (the global step stayed 0); after
    3 steps of 2 replicas the weight, its slots and the counters equal one
    device with the global batch (1e-6)."""
    import numpy as np
    import tensorflow as tf

    from models import fed_both, read_name
    tf1 = tf.compat.v1
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(3, 8, 4)).astype(np.float32), rng.normal(size=(3, 8, 1)).astype(
        np.float32)

    def build():
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 4], "x")
            y = tf1.placeholder(tf.float32, [None, 1], "y")
            training = tf1.placeholder_with_default(True, [], "training")
            w = tf1.get_variable("w", initializer=np.full((4, 1), 0.3, np.float32))
            seen = tf1.get_variable("seen", initializer=0.0, trainable=False)

            def taken():
                with tf.control_dependencies([seen.assign_add(1.0)]):
                    return tf.matmul(x, w)
            h = tf.cond(training, taken, lambda: tf.matmul(x, w * 0.5))
            step = tf1.train.get_or_create_global_step()
            tf1.train.AdamOptimizer(0.1).minimize(tf.reduce_mean(tf.square(h - y)),
                                                  global_step=step, name="train")
        names = ["w", "w/Adam", "global_step", "beta1_power"]
        return g, [read_name(n, g) for n in names]
    got, want = fed_both(build, {"run_option": "ps"},
                         [{"x:0": xs[k], "y:0": ys[k]} for k in range(3)])
    assert want[2] == 3
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
