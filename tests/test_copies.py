"""Which replicas' copies a run runs (parallax_ng/runtime/copies.py): a fetched
assign to state every replica holds writes every copy (PTB's learning-rate
update), made before or after get_runner; a write to state that exists once
runs once."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.runtime import copies

tf1 = tf.compat.v1
RNG = np.random.RandomState(0)
X = RNG.randn(64, 4).astype(np.float32)
Y = RNG.randn(64, 1).astype(np.float32)


def lr_model(use_resource):
    """A linear model whose learning rate is a variable the script assigns
    (PTB's `lr_update`) and a step counter bumped beside the training op."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w = tf1.get_variable("w", initializer=np.full((4, 1), 0.1, np.float32),
                             use_resource=use_resource)
        lr = tf1.get_variable("lr", initializer=1.0, trainable=False, use_resource=use_resource)
        count = tf1.get_variable("count", initializer=0.0, trainable=False,
                                 use_resource=use_resource)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        train = tf1.train.GradientDescentOptimizer(lr).minimize(loss)
        new_lr = tf1.placeholder(tf.float32, [], name="new_lr")
        h = {"loss": loss, "train": train, "w": w, "lr": lr, "count": count, "x": x, "y": y,
             "new_lr": new_lr, "lr_update": tf1.assign(lr, new_lr),
             "bump": tf1.assign_add(count, 1.0), "init": tf1.global_variables_initializer()}
    return g, h


def lr_schedule(sess, g, h):
    """Set the rate, train 4 steps, halving it midway with an assign made
    after the session (a runner: after get_runner); every value seen."""
    with g.as_default():
        halve = tf1.assign(h["lr"], h["lr"] * 0.5)
    sess.run(h["init"])
    seen = [sess.run(h["lr_update"], {h["new_lr"]: 0.3})]
    for i in range(4):
        feed = {h["x"]: X[i * 16:(i + 1) * 16], h["y"]: Y[i * 16:(i + 1) * 16]}
        seen += sess.run([h["loss"], h["train"], h["bump"]], feed)[::2]
        if i == 1:
            seen.append(sess.run(halve))
    return seen + sess.run([h["w"], h["lr"], h["count"]])


@pytest.mark.parametrize("use_resource", [False, True], ids=["ref", "resource"])
@pytest.mark.parametrize("run_option", ["allreduce", "ps"])
def test_a_fetched_assign_writes_every_replicas_copy(use_resource, run_option):
    """Before, only replica 0's learning rate changed: the other replica kept
    training at 1.0 (PTB's loss 0.07 off one device's after 12 steps), and
    an assign made after get_runner could not be fetched at all."""
    g, h = lr_model(use_resource)
    with tf1.Session(graph=g) as sess:
        want = lr_schedule(sess, g, h)
    g, h = lr_model(use_resource)
    with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
        got = lr_schedule(runner, g, h)
        rates = runner.run(h["lr"], per_replica=True)
        counts = runner.run(h["count"], per_replica=True)
    assert [float(r) for r in rates] == [np.float32(0.15)] * 2
    assert [float(c) for c in counts] == [4.0, 4.0]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_resource", [False, True], ids=["ref", "resource"])
def test_a_late_write_to_a_variable_that_exists_once_runs_once(use_resource):
    """With parameter servers the weights exist once: an assign_add made
    after get_runner, run as an op and fetched as a tensor, adds once each
    (every replica's copy of it would add it twice), on the server that
    holds the variable."""
    g, h = lr_model(use_resource)
    with pn.get_runner(g, local(2), {"run_option": "ps"}) as runner:
        with g.as_default():
            add = tf1.assign_add(h["w"], tf.ones([4, 1]))
        runner.run(h["init"])
        runner.run(add.op)
        runner.run(add)
        np.testing.assert_allclose(runner.run(h["w"]), np.full((4, 1), 2.1, np.float32))
        copied = [runner.session.graph.get_operation_by_name(c)
                  for c in dict.fromkeys(runner.fetches.late[add.op.name])]
        held = runner.session.graph.get_operation_by_name(h["w"].op.name)
    assert len(copied) == 1 and copied[0].device == held.device


def test_only_writes_through_a_variable_count():
    g, h = lr_model(False)
    ops = {op.type: op for op in g.get_operations()}
    assert copies.writes(ops["Assign"]) and copies.writes(ops["AssignAdd"])
    assert copies.writes(ops["ApplyGradientDescent"])
    assert not copies.writes(ops["Identity"]) and not copies.writes(ops["MatMul"])
    g, h = lr_model(True)
    ops = {op.type: op for op in g.get_operations()}
    assert copies.writes(ops["AssignVariableOp"])
    assert copies.writes(ops["ResourceApplyGradientDescent"])
    assert not copies.writes(ops["ReadVariableOp"]) and not copies.writes(ops["VarHandleOp"])


def test_a_saver_made_after_get_runner_saves_once_and_restores_every_copy(tmp_path):
    """A Saver built after get_runner (its ops copied in then): its save op is
    copied once (replica 0's values, one file), its restore writes every
    replica's copy, and one device reads the file as its own."""
    g, h = lr_model(False)
    with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
        with g.as_default():
            saver = tf1.train.Saver()
            variables = g.get_collection("variables")
        runner.run(h["init"])
        for i in range(2):
            runner.run([h["train"], h["bump"]], {h["x"]: X[i * 16:(i + 1) * 16],
                                                  h["y"]: Y[i * 16:(i + 1) * 16]})
        want = [np.array(v, copy=True) for v in runner.run(variables)]
        runner.save(saver, str(tmp_path / "ckpt"))
        saves = list(dict.fromkeys(runner.fetches.late["save/SaveV2"]))
        runner.run(h["init"])
        runner.restore(saver, str(tmp_path / "ckpt"))
        got = runner.run(variables, per_replica=True)
    assert len(saves) == 1
    for per, value in zip(got, want):
        for copy in per:
            np.testing.assert_array_equal(copy, value)
    with tf1.Session(graph=g) as sess:
        saver.restore(sess, str(tmp_path / "ckpt"))
        for v, value in zip(variables, want):
            np.testing.assert_array_equal(sess.run(v), value)


@pytest.mark.parametrize("run_option", ["hybrid", "alltoall"])
def test_late_ops_on_a_table_cut_by_columns_see_it_whole(run_option):
    """Ops made after get_runner on an embedding the plan cuts by columns
    (sparse_method alltoall: each replica holds its columns): an assign
    writes each replica its columns of the value, an assign_add likewise,
    a read gives every part side by side, the shape and "initialized" are
    the table's; training on from the assigned value equals one device
    from it. Before, the assign failed ("Dimension 1 in both shapes must be
    equal") and a read gave replica 0's columns, silently. A late gather
    (tf.gather, embedding_lookup, gather_nd) gives the whole table's rows;
    a late scatter is refused, naming it. Under hybrid (the table whole) the same ops act
    on the whole table."""
    from models import (DIM, VOCAB, embedding_regression, load_values, read_name,
                        variable_names)
    cfg = {"run_option": "allreduce", "sparse_method": "alltoall"} \
        if run_option == "alltoall" else {"run_option": run_option}
    value = np.random.RandomState(3).randn(VOCAB, DIM).astype(np.float32)
    g, h = embedding_regression(4)
    with pn.get_runner(g, local(2), cfg) as runner:
        assert bool(runner.plan.columns()) == (run_option == "alltoall")
        runner.run([h["init"], h["iterator_init"]])
        with g.as_default():
            emb = [v for v in tf1.global_variables() if v.op.name == "emb"][0]
            assign = tf1.assign(emb, value)
            late = emb.read_value()
            shape, initialized = tf.shape(emb), tf1.is_variable_initialized(emb)
            add = emb.assign_add(tf.ones([VOCAB, DIM]))
            gather = tf.gather(emb, [[1, 2], [39, 1]])
            lookup = tf1.nn.embedding_lookup(emb, tf.constant([3, 0]))
            pairs = tf.gather_nd(emb, [[5, 1], [6, 0]])
            scatter = emb.scatter_add(tf.IndexedSlices(tf.ones([1, DIM]), [1]))
        runner.run(assign.op)
        np.testing.assert_array_equal(runner.run(read_name("emb", g)), value)
        np.testing.assert_array_equal(runner.run(late), value)
        assert list(runner.run(shape)) == [VOCAB, DIM] and runner.run(initialized)
        runner.run(add.op)
        np.testing.assert_allclose(runner.run(late), value + 1, rtol=0, atol=1e-6)
        np.testing.assert_allclose(runner.run(gather), (value + 1)[[[1, 2], [39, 1]]],
                                   rtol=0, atol=1e-6)
        np.testing.assert_allclose(runner.run(lookup), (value + 1)[[3, 0]], rtol=0, atol=1e-6)
        np.testing.assert_allclose(runner.run(pairs), (value + 1)[[5, 6], [1, 0]],
                                   rtol=0, atol=1e-6)
        if run_option == "alltoall":
            with pytest.raises(pn.FetchError, match=r"\(ResourceScatterAdd\) was made after "
                                                    "get_runner and uses variable 'emb', which "
                                                    "the plan cuts into parts"):
                runner.run(scatter.op)
        runner.run(assign.op)
        names = variable_names(g)
        start = dict(zip(names, runner.run([read_name(v, g) for v in names])))
        for _ in range(3):
            runner.run(h["train"])
        got = dict(zip(names, runner.run([read_name(v, g) for v in names])))
    g1, h1 = embedding_regression(8)
    with tf1.Session(graph=g1) as sess:
        sess.run([h1["init"], h1["iterator_init"]])
        load_values(sess, g1, start)
        for _ in range(3):
            sess.run(h1["train"])
        want = dict(zip(names, sess.run([read_name(v, g1) for v in names])))
    for name in names:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5, err_msg=name)


LATE_SHARDED = """
import sys
sys.path.insert(0, sys.argv[1])      # tests/, for models.py
import numpy as np
import tensorflow as tf
import parallax_ng as pn
from models import DIM, VOCAB, embedding_regression, read_name
tf1 = tf.compat.v1
g, h = embedding_regression(4)
runner = pn.get_runner(g, None, {"run_option": "ps"})
runner.run([h["init"], h["iterator_init"]])
assert type(runner.plan.placement["emb"]).__name__ == "Sharded", runner.plan.placement["emb"]
value = np.random.RandomState(3).randn(VOCAB, DIM).astype(np.float32)
with g.as_default():
    emb = [v for v in tf1.global_variables() if v.op.name == "emb"][0]
    assign, late = tf1.assign(emb, value), emb.read_value()
    rows = tf1.nn.embedding_lookup(emb, tf.constant([0, 39, 7, 20]))
runner.run(assign.op)
np.testing.assert_array_equal(runner.run(read_name("emb", g)), value)
np.testing.assert_array_equal(runner.run(late), value)
np.testing.assert_array_equal(runner.run(rows), value[[0, 39, 7, 20]])
runner.run(h["train"])
np.testing.assert_array_equal(runner.run(late), runner.run(read_name("emb", g)))
print("late ops saw the table whole", flush=True)
"""


def test_late_ops_on_a_table_sharded_over_servers_see_it_whole(tmp_path):
    """A job of 2 workers and 2 servers (run_option ps: the embedding cut
    into row ranges, one per server): an assign made after get_runner
    writes each server its rows of the value, and a late read gives the
    ranges joined (a late embedding_lookup, rows of both ranges). Before,
    the assign went to a handle no step uses (the table kept its values,
    silently) and the read failed ("Could not find variable emb")."""
    import os

    from task_env import run_script_job
    done = run_script_job(tmp_path, LATE_SHARDED, servers=2,
                          args=[os.path.dirname(os.path.abspath(__file__))])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("late ops saw the table whole") == 2


def test_a_saver_made_after_get_runner_saves_and_restores_a_table_cut_by_columns(tmp_path):
    """A Saver built after get_runner on a model whose table is cut by
    columns (alltoall): its save reads the table whole (every replica's
    columns side by side) and its restore writes each replica its columns,
    so the round trip is exact and one device reads the file as its own
    (before: the table read back had 8 columns where 4 were saved)."""
    from models import embedding_regression, read_name, variable_names
    g, h = embedding_regression(4)
    cfg = {"run_option": "allreduce", "sparse_method": "alltoall"}
    with pn.get_runner(g, local(2), cfg) as runner:
        assert runner.plan.columns()
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(3):
            runner.run(h["train"])
        names = variable_names(g)
        want = runner.run([read_name(v, g) for v in names])
        with g.as_default():
            saver = tf1.train.Saver()
        runner.save(saver, str(tmp_path / "ckpt"))
        runner.run(h["init"])
        runner.restore(saver, str(tmp_path / "ckpt"))
        got = runner.run([read_name(v, g) for v in names])
    with tf1.Session(graph=g) as sess:
        saver.restore(sess, str(tmp_path / "ckpt"))
        saved = sess.run([read_name(v, g) for v in names])
    for name, w, a, b in zip(names, want, got, saved):
        np.testing.assert_array_equal(a, w, err_msg=name)
        np.testing.assert_array_equal(b, w, err_msg=name)
