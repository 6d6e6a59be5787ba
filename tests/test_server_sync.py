"""The cross-worker parameter-server protocol, read off the generated graphs
(the multi-process runs are in test_cluster.py)."""
import pytest
import tensorflow as tf

from models import embedding_regression
from passkit import cluster_transform, context, run_passes
from parallax_ng.errors import GraphError
from transforms import pipeline_for
from parallax_ng.pipeline.results import Barrier
from transforms.step_barrier import RELEASE, WAIT, writers

tf1 = tf.compat.v1
PS0 = "/job:ps/replica:0/task:0/device:CPU:0"
HOST1 = "/job:worker/replica:0/task:1/device:CPU:0"


def test_chief_takes_every_workers_element_and_applies_once():
    g, _ = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, coalesce_rows=False)
    take = ir.node("parallax/server_sync/take_0_1")
    assert take.op == "QueueDequeueV2" and take.device == PS0
    job = ir.node("parallax/ps/emb/mean/job")     # values: chief's + worker 1's
    assert job.op == "ConcatV2" and job.input[:2] == ["parallax/ps/emb/mean",
                                                       "parallax/server_sync/take_0_1:0"]
    assert ir.node("parallax/ps/emb/indices/job").input[1] == "parallax/server_sync/take_0_1:1"
    assert ir.node("Adam/update_emb/ResourceScatterAdd").op == "ResourceScatterAdd"
    assert ir.node("Adam/update_emb/ResourceScatterAdd").device == PS0
    assert ir.node(RELEASE).op == "NoOp" and WAIT not in ir
    # the global norm that clips the dense gradients reads the job's aggregate,
    # which is queued for worker 1 first
    given = ir.node("parallax/ps/emb/mean/job_given")
    assert "^parallax/server_sync/result_0_1/put" in given.input


def test_other_workers_push_and_never_write_shared_state():
    g, _ = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=1, devices=2, coalesce_rows=False,
                                dense_method="allreduce")
    push = ir.node("parallax/server_sync/push_0")
    assert push.op == "QueueEnqueueV2" and push.device == PS0
    assert push.input[1:3] == ["parallax/ps/emb/mean", "parallax/ps/emb/indices"]
    # the push waits for both replicas' reads of the embedding
    assert {"^embedding_lookup", "^parallax/replica_1/embedding_lookup"} <= set(push.input)
    for var in ("emb", "emb/Adam", "emb/Adam_1"):
        for w in ctx.tg.writers[var]:
            node = ir.node(w)
            assert node.op == "NoOp" and node.device == HOST1, w
    update = ir.node("Adam/update_emb/ResourceScatterAdd")
    # ... and, the barrier being in the training run, the chief's token
    index = writers(ctx).index("Adam/update_emb/ResourceScatterAdd")
    assert set(update.input) == {"^parallax/server_sync/push_0",
                                 "^parallax/server_sync/result_0/take",
                                 f"^parallax/server_sync/step_{index}/take"}
    # the dense layers are mirrored: worker 1 applies their updates itself
    assert ir.node("Adam/update_dense/w/ResourceApplyAdam").op == "ResourceApplyAdam"
    assert ir.node(WAIT).op == "QueueDequeueV2" and RELEASE not in ir


def test_the_chiefs_decay_of_a_shared_variable_waits_for_the_pushes():
    """Decoupled weight decay (`w.assign_sub(wd * w)`, which the update
    waits on and which reads no gradient): the chief's write waits for the
    other workers' pushes, which follow their forward reads, as the update
    itself does; before, it ran at the step's start, and a worker's
    forward pass could read decayed weights. The initializer is left alone
    (no training run holds it)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        w = tf1.get_variable("w", initializer=tf.ones([2, 1]), use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w))
        decay = w.assign_sub(0.1 * w.read_value(), name="decay")
        with tf.control_dependencies([decay]):
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    ir, ctx = cluster_transform(g, worker=0, run_option="ps")
    decay_op = ctx.tg.writers["w"]
    assert "^parallax/server_sync/take_0_1" in ir.node("decay").input, decay_op
    assert not [i for i in ir.node("w/Assign").input if "take" in i]


def test_aggregates_go_back_only_when_mirrored_updates_need_them():
    g, _ = embedding_regression(4, "adam", clip=False)
    for worker in (0, 1):
        ir, _ = cluster_transform(g, worker=worker)
        assert not [n.name for n in ir.nodes if "/result" in n.name]


def test_ps_mode_spreads_variables_over_servers():
    g, _ = embedding_regression(4, "momentum")
    ir, ctx = cluster_transform(g, worker=0, servers=2, run_option="ps")
    servers = {ctx.plan.server(v) for v in ctx.plan.variables}
    assert len(servers) == 2
    for var in ctx.plan.variables:
        assert ir.node(var).device == ctx.plan.server(var)
        assert ir.node(f"{var}/Momentum").device == ctx.plan.server(var)
    for j in range(2):
        assert ir.node(f"parallax/server_sync/take_{j}_1").device == \
            f"/job:ps/replica:0/task:{j}/device:CPU:0"


def test_single_process_graphs_are_untouched():
    ctx = context(n=2, optimizer="adam", run_option="hybrid")
    ir = run_passes(ctx, *pipeline_for(ctx.plan))
    assert not [n.name for n in ir.nodes if n.name.startswith("parallax/server_sync")]


def test_a_used_output_of_a_shared_writer_is_refused():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 1], use_resource=False)
        loss = tf.reduce_mean(tf.matmul(x, w))
        grad, = tf.gradients(loss, [w])
        step = tf1.assign_sub(w, 0.1 * grad)
        tf.identity(step * 2.0, name="doubled")
    with pytest.raises(GraphError, match="'AssignSub'.*writes shared variable 'w'.*doubled"):
        cluster_transform(g, worker=1, run_option="ps")


@pytest.mark.parametrize("devices", [1, 2])
def test_a_writer_output_feeding_only_silenced_writers_becomes_a_read(devices):
    """Adam's sparse update of a reference variable scales `m` through its
    ScatterAdd's output; on worker 1 that chain only feeds other silenced
    writers, so the ScatterAdd becomes an Identity of the variable."""
    tf1.disable_resource_variables()
    try:
        g, _ = embedding_regression(4, "adam")
    finally:
        tf1.enable_resource_variables()
    ir, _ = cluster_transform(g, worker=1, devices=devices)
    writer = ir.node("Adam/update_emb/ScatterAdd")
    assert writer.op == "Identity" and writer.input[0] == "emb/Adam"
    assert len(writer.input) > 1 and all(i.startswith("^parallax/server_sync/")
                                         for i in writer.input[1:])
    assert ir.node("Adam/update_emb/AssignSub").op == "NoOp"


def test_sparse_writer_reading_the_indices_is_silenced_and_only_values_come_back():
    """GradientDescent's ScatterAdd reads the aggregated indices directly; on
    worker 1 it is a no-op, and the job aggregate it takes back for the
    global norm is the values alone."""
    g, _ = embedding_regression(4, "sgd", clip=True)
    ir, ctx = cluster_transform(g, worker=1, coalesce_rows=False)
    writer = ir.node("GradientDescent/update_emb/ResourceScatterAdd")
    assert writer.op == "NoOp" and all(i.startswith("^") for i in writer.input)
    take = ir.node("parallax/server_sync/result_0/take")
    assert [tf.as_dtype(t) for t in take.attr["component_types"].list.type] == [tf.float32]
    chief, _ = cluster_transform(g, worker=0, coalesce_rows=False)
    put = chief.node("parallax/server_sync/result_0_1/put")
    assert put.input[1:] == ["parallax/ps/emb/mean/job"]


def test_the_step_barrier_is_inside_the_training_run():
    """The chief puts one token per other worker after each shared writer,
    before whatever follows that writer; worker 1's silenced writers take
    them after its pushes. With collectives in the step too (dense variables
    by all-reduce): those run in a session run of their own beside the one
    that takes the tokens."""
    g, _ = embedding_regression(4, "adam", clip=True)
    _, split = cluster_transform(g, worker=0, dense_method="allreduce")
    assert split.result(Barrier).folded
    chief, ctx = cluster_transform(g, worker=0, dense_method="bfb")
    assert ctx.result(Barrier).folded
    writer = "Adam/update_emb/ResourceScatterAdd"
    index = writers(ctx).index(writer)
    put = chief.node(f"parallax/server_sync/step_{index}_1/put")
    assert f"^{writer}" in put.input and put.device == PS0
    after = [c for c in ctx.tg.ir.node_consumers[writer]]
    assert after and all(f"^{put.name}" in chief.node(c).input for c in after)
    other, _ = cluster_transform(g, worker=1, dense_method="bfb")
    take = other.node(f"parallax/server_sync/step_{index}/take")
    assert "^parallax/server_sync/push_0" in take.input
    assert f"^{take.name}" in other.node(writer).input


def test_a_read_after_a_shared_writer_sees_the_jobs_rows_on_the_chief():
    """Keras 3's Adagrad reads the accumulator's rows at the gradient's ids
    after adding to them (graph/row_divisions.py); on the chief that read
    also waits for the step's barrier token, and it must still read the
    job's ids (every worker's rows), not the chief's own: else the division
    meets rows of two sizes ("Incompatible shapes: [1024,128] vs. [512,128]"
    on the server in a 2-worker job)."""
    import keras
    import numpy as np

    import parallax_ng as pn
    from models import local
    inp = keras.Input((3,), dtype="int32")
    out = keras.layers.Dense(5)(keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(100, 8)(inp)))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.Adagrad(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pn.parallelize(model, local(2), {"run_option": "ps"})
    rng = np.random.default_rng(0)
    model.fit(rng.integers(0, 100, (32, 3)), rng.integers(0, 5, (32,)), batch_size=16,
              verbose=0)
    captured = model._parallax_ng.step.runner.ctx.tg.graph
    ir, _ = cluster_transform(captured, worker=0, run_option="ps")
    prefix = model.optimizer.name + "/"      # adagrad, adagrad_1, ...: one per optimizer made
    rows = [n for n in ir.nodes if n.op == "ResourceGather" and n.name.startswith(prefix)]
    assert rows, "Keras 3's Adagrad reads its accumulator's rows"
    for n in rows:
        assert any(i.startswith("^parallax/server_sync/step_") for i in n.input), n.input
        assert n.input[1].endswith("/indices/job"), n.input


@pytest.mark.parametrize("dense_method", ["bfb", "ps"])
def test_a_later_graph_of_the_process_queues_under_names_of_its_own(dense_method):
    """A server keeps its queues for as long as it runs; a tuned plan's
    graph may push other components than the first graph's (ps against
    fusion buffers), so each graph a process builds after its first takes
    its own shared names (the first keeps the fixed ones)."""
    from test_choice import resources

    from parallax_ng.build import Build, resolve
    from parallax_ng.graph import frontend
    g, _ = embedding_regression(4, "adam", clip=True)
    build = Build(frontend.load(g), resolve(resources(2), {"dense_method": dense_method},
                                            planned=True))
    plan = build.plan()
    names = [{n.attr["shared_name"].s.decode() for n in build.rewrite(plan, graph=k)[0].nodes
              if n.op == "FIFOQueueV2" and "/job:ps/" in n.device} for k in (0, 3)]
    assert "parallax_ng/grads/0/1" in names[0] and "parallax_ng/done/1" in names[0]
    assert names[1] == {f"{n}@graph3" for n in names[0]}
