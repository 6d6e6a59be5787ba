"""Whole-table updates that change only the gradient's rows become row
updates (graph/row_updates.py): Keras 3 optimizers after `global_clipnorm`
on an embedding equal one device, in every mode, and their step touches
the rows only; updates that change other rows too are left whole."""
import keras            # Keras 3 by name, whatever TF_USE_LEGACY_KERAS the suite sets
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.graph.tracing import capture
from test_tf2 import STEPS, data, step_of, twins

VOCAB = 40


def embedding_model():
    return keras.Sequential([keras.Input((3,), dtype="int32"),
                             keras.layers.Embedding(VOCAB, 4),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def whole_table_ops(graph, shape):
    """Ops of the step (not the initializer) whose output has `shape`."""
    return sorted(op.name for op in graph.get_operations()
                  if op.outputs and tuple(op.outputs[0].shape) == shape and
                  op.type not in ("VarHandleOp", "Placeholder") and
                  not op.name.endswith(("/Assign", "/Read/ReadVariableOp", "/initial_value",
                                        "IsInitialized/VarIsInitializedOp")))


def trained_like_one_device(make_optimizer, config):
    """The embedding model trained STEPS steps by `pn.function` on 2
    devices and by one device: outputs, weights and slots within 1e-5
    (relative where Adagrad's accumulators grow). Returns the step."""
    parallel, single = twins(embedding_model, make_optimizer)
    step = pn.function(step_of(*parallel), local(2), config)
    ref = tf.function(step_of(*single))
    x, y = data(vocab=VOCAB)
    for k in range(STEPS):
        np.testing.assert_allclose(step(x[k], y[k]), ref(x[k], y[k]).numpy(), atol=1e-5)
    step.sync()
    (pm, po), (sm, so) = parallel, single
    pairs = list(zip(pm.weights + po.variables, sm.weights + so.variables))
    assert len(pm.weights + po.variables) == len(pairs) == len(sm.weights + so.variables)
    for a, b in pairs:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5,
                                   err_msg=a.path)
    return step


def ops_run(cap, *args) -> set:
    """The names of the ops one step of `cap` runs (a session's trace)."""
    with tf.compat.v1.Session(graph=cap.graph) as sess:
        sess.run(cap.init, cap.init_feeds)
        meta = tf.compat.v1.RunMetadata()
        sess.run(cap.train, dict(zip([n + ":0" for n in cap.inputs], args)),
                 options=tf.compat.v1.RunOptions(
                     trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=meta)
    return {n.node_name.split(":")[0] for d in meta.step_stats.dev_stats for n in d.node_stats}


OPTIMIZERS = {
    "adagrad-global": lambda: keras.optimizers.Adagrad(0.3, global_clipnorm=0.05),
    "sgd-global": lambda: keras.optimizers.SGD(0.3, global_clipnorm=0.05),
    "adam-global": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
}


@pytest.mark.parametrize("name, rows_only", [("adagrad-global", True), ("sgd-global", True),
                                             ("adam-global", False)])
def test_only_updates_that_keep_other_rows_become_row_updates(name, rows_only):
    """Adagrad's and SGD's updates add zero to rows without gradient, so
    the step reads and writes the gradient's rows (ResourceGather,
    ResourceScatterAdd/Sub); Adam's moments decay every row, so its update
    stays whole. (The ops that ran, from the session's trace.)"""
    model, optimizer = embedding_model(), OPTIMIZERS[name]()
    ids, y = data(vocab=VOCAB)
    cap = capture(step_of(model, optimizer), (ids[0], y[0]))
    ops = cap.graph.get_operations()
    ran = ops_run(cap, ids[0], y[0])
    assert {op.name for op in ops if op.type.startswith("ResourceScatter")} <= ran
    whole = [n for n in whole_table_ops(cap.graph, (VOCAB, 4)) if n in ran]
    tables = {op.name for op in ops if op.type == "VarHandleOp" and
              tf.TensorShape(op.get_attr("shape")).as_list() == [VOCAB, 4]}
    writes = {op.type for op in ops if op.inputs and op.inputs[0].op.name in tables and
              op.type not in ("AssignVariableOp", "ReadVariableOp", "ResourceGather",
                              "VarIsInitializedOp", "Switch")}
    if rows_only:
        assert whole == [], whole
        assert writes and writes <= {"ResourceScatterAdd", "ResourceScatterSub"}, writes
    else:
        assert whole and "AssignSubVariableOp" in writes, (whole, writes)


@pytest.mark.parametrize("config", [
    {"run_option": "hybrid"}, {"run_option": "ps"}, {"run_option": "allreduce"},
    {"sparse_method": "alltoall"}, {"sparse_method": "allreduce"}],
    ids=["hybrid", "ps", "allgather", "alltoall", "dense-allreduce"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_clipped_updates_on_an_embedding_equal_one_device(name, config):
    """Clipping is active (the norm is above 0.05 at every step), so every
    step scales the rows by the global norm of all gradients."""
    step = trained_like_one_device(OPTIMIZERS[name], config)
    table = next(v for v, vp in step.runner.plan.variables.items()
                 if tuple(step.runner.ctx.tg.variables[v].shape) == (VOCAB, 4))
    plan = step.runner.plan.variables[table]
    assert plan.info.sparse
    # Keras's norm of the rows (UnsortedSegmentSum of their squares) is read as
    # an L2Loss, so each replica sums its duplicate rows before they travel
    assert plan.coalesce == (plan.method != "allreduce"), (plan.method, plan.coalesce)


def rewritten(fn, *args):
    """`fn`'s captured graph, run once, and the values of its variables."""
    cap = capture(fn, args)
    with tf.compat.v1.Session(graph=cap.graph) as sess:
        sess.run(cap.init, cap.init_feeds)
        sess.run(cap.train, dict(zip([n + ":0" for n in cap.inputs], args)))
        values = {id(cap.variables[name]): sess.run(read) for name, read in cap.reads.items()}
    types = {op.type for op in cap.graph.get_operations()}
    return values, types


@pytest.mark.parametrize("kind", ["scaled", "by-vector", "divided-by-rows", "sum-of-axis-0",
                                  "assigned"])
def test_each_use_of_the_dense_rows_decides(kind):
    """A sum into the table's shape is made a row update only when every
    use keeps the other rows as they are: a Mul by a scalar does; a Mul by
    a vector that broadcasts along the rows, a division by the rows, a Sum
    along one axis and a plain assign do not (they are left whole). Each
    graph gives the values eager execution gives."""
    table = tf.Variable(np.linspace(1.0, 2.0, 60, dtype=np.float32).reshape(20, 3))
    start = table.numpy()
    acc = tf.Variable(np.full((20, 3), 0.5, np.float32))

    def fn(values, ids):
        dense = tf.math.unsorted_segment_sum(values, ids, 20)
        if kind == "scaled":
            acc.assign_add(tf.square(dense))
            table.assign_sub(0.5 * dense / tf.sqrt(acc + 0.1))
        elif kind == "by-vector":
            table.assign_sub(dense * tf.constant([1.0, 2.0, 3.0]))
        elif kind == "divided-by-rows":
            table.assign_sub(tf.ones((20, 3)) / (dense + 1.0))
        elif kind == "sum-of-axis-0":
            table.assign_sub(tf.broadcast_to(tf.reduce_sum(dense, axis=0), (20, 3)))
        else:
            table.assign(dense)
        return tf.constant(0.0)
    values = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    ids = np.array([3, 7, 3, 19], np.int32)
    got, types = rewritten(fn, values, ids)
    table.assign(start)
    acc.assign(np.full((20, 3), 0.5, np.float32))
    tf.function(fn)(values, ids)
    for var in (table, acc):
        if id(var) in got:
            np.testing.assert_allclose(got[id(var)], var.numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=var.name)
    if kind == "scaled":
        assert {"ResourceScatterAdd", "ResourceScatterSub", "Unique"} <= types
        assert not {"AssignAddVariableOp", "AssignSubVariableOp"} & types
    else:
        assert "Unique" not in types and not types & {"ResourceScatterSub",
                                                       "ResourceScatterUpdate"}


def test_in_a_job_with_servers_the_clipped_update_runs_on_them():
    """Keras 3's clipping leaves results the step drops (an Identity of each
    scaled gradient); the capture keeps only what the step runs, so the
    update math (the norm, the scaling, Adagrad's) moves to the server with
    the variables and no worker op reads a summed dense gradient from it.
    The accumulator's rows are gathered there too, at ids found there: a
    gather on the update side is not a lookup the workers fetch rows for."""
    from passkit import cluster_transform
    model = keras.Sequential([keras.Input((3,), dtype="int32"),
                              keras.layers.Embedding(VOCAB, 4), keras.layers.Flatten(),
                              keras.layers.Dense(8), keras.layers.Dense(1)])
    optimizer = OPTIMIZERS["adagrad-global"]()
    ids, y = data(vocab=VOCAB)
    cap = capture(step_of(model, optimizer), (ids[0], y[0]))
    with cap.graph.as_default():
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TRAIN_OP,
                                       cap.graph.get_operation_by_name(cap.train))
    ir, ctx = cluster_transform(cap.graph, worker=0, servers=1, run_option="ps", workers=2)
    summed = {n.name for n in ir.nodes if n.name.startswith("parallax/ps/") and
              n.name.endswith("/mean/job")}
    assert summed
    on_worker = [(n.name, ref.node) for n in ir.nodes if "/job:worker" in n.device
                 for ref in ir.data_inputs(n.name) if ref.node in summed]
    assert on_worker == []
    fetched = {n.name.removeprefix("parallax/lookups/").rsplit("/", 1)[0]
               for n in ir.nodes if n.name.startswith("parallax/lookups/")}
    assert len(fetched) == 1 and fetched <= ctx.tg.before_gradients   # the embedding's
    accumulators = {v for v in ctx.plan.shared_state() if v.endswith("_accumulator")}
    gathers = [n for n in ir.nodes if n.op == "ResourceGather" and
               ir.data_inputs(n.name)[0].node in accumulators]
    assert gathers
    for n in gathers:
        ids = ir.node(ir.data_inputs(n.name)[1].node)
        assert "/job:ps/" in n.device and "/job:ps/" in ids.device, (n.name, ids.name)


@pytest.mark.parametrize("n", [1, 2])
def test_sums_per_class_a_step_returns_keep_their_classes(n):
    """A Keras 3 loop that returns an accuracy and a mean loss per class
    (tf.math.unsorted_segment_sum and _mean at the labels) and counts the
    classes into a variable: on one device and on 2 replicas, each step's
    values and the count equal tf.function's with the global batch, 1e-5.
    Before, a returned sum was taken for a table's gradient and computed at
    the distinct labels only (1.38 off on one device; 2 replicas joined
    theirs); the count, a write, still becomes a row update."""
    classes = 3
    (model, opt), (ref_model, ref_opt) = twins(
        lambda: keras.Sequential([keras.Input((5,)), keras.layers.Dense(classes)]),
        lambda: keras.optimizers.Adam(0.1))
    counted = [tf.Variable(tf.zeros(classes), trainable=False) for _ in range(2)]

    def step_of(model, optimizer, count):
        def step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x)
                per = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
                loss = tf.reduce_mean(per)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            hit = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.float32)
            ones = tf.math.unsorted_segment_sum(tf.ones_like(hit), y, classes)
            count.assign_add(tf.math.unsorted_segment_sum(tf.ones_like(hit), y, classes))
            return (loss, tf.math.unsorted_segment_sum(hit, y, classes) / tf.maximum(ones, 1.0),
                    tf.math.unsorted_segment_mean(per, y, classes))
        return step
    step = pn.function(step_of(model, opt, counted[0]), local(n))
    ref = tf.function(step_of(ref_model, ref_opt, counted[1]))
    x, _ = data(3)
    labels = np.random.default_rng(4).integers(0, classes, size=x.shape[:2]).astype(np.int32)
    for k in range(STEPS):
        got, want = step(x[k], labels[k]), ref(x[k], labels[k])
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    step.sync()
    np.testing.assert_allclose(counted[0].numpy(), counted[1].numpy(), atol=1e-5, rtol=0)
    assert counted[1].numpy().sum() == STEPS * x.shape[1]
    np.testing.assert_allclose(model.weights[0].numpy(), ref_model.weights[0].numpy(),
                               atol=1e-5, rtol=0)
    if n == 1:
        types = {op.type for op in step.runner.ctx.tg.graph.get_operations()}
        assert "ResourceScatterAdd" in types and "Unique" in types
