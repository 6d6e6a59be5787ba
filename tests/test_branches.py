"""Writes of state inside conditionals (parallax_ng/graph/branches.py) and
what the state-sync pass makes of them: synced where every replica takes
the same branch, a GraphError naming the variable where the replicas'
branches could differ (a hang until the timeout, or copies parting silently,
before), a warning naming
it where the write is inside a function (silently drifting copies)."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import counting_graph, local, read_name
from parallax_ng.errors import GraphError
from parallax_ng.graph import branches, frontend

tf1 = tf.compat.v1


@contextlib.contextmanager
def lowered_conds():
    """tf.cond as Switch/Merge (TF1 control flow), in this block only."""
    tf1.disable_control_flow_v2()
    try:
        yield
    finally:
        tf1.enable_control_flow_v2()


@contextlib.contextmanager
def conds(kind: str):
    """tf.cond lowered by TensorFlow ("v1") or an If op ("v2", which
    graph/lowering.py lowers)."""
    with lowered_conds() if kind == "v1" else contextlib.nullcontext():
        yield


def test_a_write_in_a_lowered_branch_is_below_its_switch():
    with lowered_conds():
        g, t = counting_graph("data")
    tg = frontend.load(g)
    writer = next(n.name for n in tg.ir.nodes if n.op == "AssignAddVariableOp")
    above = branches.switches_above(tg.ir, writer)
    assert above and all(tg.ir.node(s).op == "Switch" for s in above)
    assert branches.switches_above(tg.ir, t["train"].name) == []    # after the cond
    assert branches.function_writes(tg) == []


def looping_graph(apply: bool = False):
    """`hits` counts positive inputs inside a tf.while_loop of one turn
    (TF2 behavior: a While op); `apply`: Adam's update of `w` in the loop."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        hits = tf1.get_variable("hits", initializer=np.float32(0), trainable=False)
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(x * w, 1) - 1.0))
        opt = tf1.train.AdamOptimizer(0.1)
        grads = opt.compute_gradients(loss)

        def body(i):
            write = opt.apply_gradients(grads) if apply else \
                tf1.assign_add(hits, tf.reduce_sum(tf.sign(x)))
            with tf.control_dependencies([write]):
                return i + 1
        done = tf1.while_loop(lambda i: i < 1, body, [tf.constant(0)], name="loop",
                              return_same_structure=True)[0]
        with tf.control_dependencies([done]):
            train = tf.group(opt.apply_gradients(grads) if not apply else tf.no_op(),
                             name="train")
        init = tf1.global_variables_initializer()
    return g, dict(x=x, hits=hits, train=train, init=init, loop=done)


def test_a_write_in_a_functional_loop_is_found_in_its_function():
    g, t = looping_graph()                              # TF2 behavior: a While op
    tg = frontend.load(g)
    [(var, op)] = branches.function_writes(tg)
    assert var == "hits" and tg.ir.node(op).op in ("While", "StatelessWhile")


def test_a_write_in_a_functional_cond_is_lowered_below_a_switch():
    g, t = counting_graph("data")                              # TF2 behavior: an If op
    tg = frontend.load(g)
    assert branches.function_writes(tg) == []
    writer = next(n.name for n in tg.ir.nodes if n.op == "AssignAddVariableOp")
    above = branches.switches_above(tg.ir, writer)     # the predicate's and the handle's
    assert above and {tg.ir.node(s).op for s in above} == {"Switch"}


def applied_in_a_cond():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        flag = tf1.placeholder(tf.bool, [], name="flag")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(x * w, 1) - 1.0))
        opt = tf1.train.AdamOptimizer(0.1)
        grads = opt.compute_gradients(loss)
        tf.cond(flag, lambda: tf.group(opt.apply_gradients(grads)), tf.no_op, name="apply")
    return g


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_an_update_under_a_cond_is_found(kind):
    """An optimizer's update under a tf.cond: below a Switch, its gradient
    found (with TF2 behavior it had been refused: out of reach in the If)."""
    with conds(kind):
        assert list(frontend.load(applied_in_a_cond()).gradients) == ["w"]


def test_an_update_in_a_functional_loop_is_refused_by_name():
    """Out of reach (its gradient cannot be aggregated in the While's body);
    the error names it (it said only that the graph had no optimizer update)."""
    g, _ = looping_graph(apply=True)
    with pytest.raises(GraphError, match="trainable variable 'w' is written inside op "
                                         "'loop' .*loop in Python"):
        frontend.load(g)


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize("step", [None, 1.0], ids=["from-data", "constant"])
def test_state_written_in_a_branch_the_replicas_decide_apart_is_refused(kind, step):
    """From the data, the sync would hang; a constant, the replicas' counts
    would part silently (1 and 0, where one device counts 0)."""
    with conds(kind):
        g, _ = counting_graph("data", step)
    with pytest.raises(GraphError, match="variable 'hits' .*predicate .* differs between "
                                         "replicas"):
        pn.get_runner(g, local(2))


def test_state_written_inside_a_functional_loop_is_named_in_a_warning():
    """No pass reaches a write inside a While's function: each replica
    keeps its own count, as the warning says (it had been silent)."""
    g, t = looping_graph()
    with pytest.warns(UserWarning, match=r"variables \['hits'\] are written inside ops "
                                         r"\['loop'\].*outside the loop or call"):
        runner = pn.get_runner(g, local(2))
    with runner:
        runner.run(t["init"])
        runner.run(t["train"], {t["x"]: np.float32([[1, 1, 1]] * 2 + [[-1, -1, -1]] * 2)})
        assert runner.run(t["hits"], per_replica=True) == [6.0, -6.0]


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_state_written_in_a_branch_every_replica_takes_equals_one_device(kind):
    """The predicate is fed, the same on every replica: the write inside the
    branch is synced there (the replicas' counts summed), as one device
    counts the global batch. 4 steps, the flag alternating, 1e-6."""
    data = np.random.RandomState(0).randn(4, 8, 3).astype(np.float32)

    def run(call, t):
        call(t["init"])
        for k in range(4):
            call(t["train"], {t["x"]: data[k], t["flag"]: k % 2 == 0})
        return call(t["hits"])
    with conds(kind):
        g1, t1 = counting_graph("fed")
        g2, t2 = counting_graph("fed")
    with tf1.Session(graph=g1) as sess:
        want = run(sess.run, t1)
    with pn.get_runner(g2, local(2)) as runner:
        got = run(runner.run, t2)
        per = runner.run(t2["hits"], per_replica=True)
    assert want != 0 and per[0] == per[1]
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("run_option,servers,counting", [
    ("ps", 1, "count"), ("allreduce", 0, "count"), ("ps", 1, "applied")])
def test_a_branch_every_worker_skips_in_a_job_equals_one_device(tmp_path, run_option, servers,
                                                                 counting):
    """tests/cluster_script.py --counting: 2 workers, the count under a fed
    tf.cond (and the update applied there), 4 steps, the branch taken at
    even steps. Under ps the count's sum goes through the server, whose
    side worker 0 runs: a step that skips the branch left worker 0 waiting
    there for worker 1's part (which it then took at the next step's: both
    workers timed out) until the take waited on its own part too. The
    chief's token that it has applied the update was put after the update
    (never, in a step that skipped it: worker 1 waited for it until the
    timeout); it is put where the cond ends. The count and the weights
    equal one device's (1e-6)."""
    from test_cluster import load, run_job
    done, out, _ = run_job(tmp_path, 2, 1, "4", "--counting", counting, "--run-option",
                           run_option, servers=servers, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    g, t = counting_graph("fed", applied=counting == "applied")
    data = np.random.RandomState(0).randn(4, 8, 3).astype(np.float32)
    with tf1.Session(graph=g) as sess:
        sess.run(t["init"])
        for k in range(4):
            sess.run(t["train"], {t["x"]: data[k], t["flag"]: k % 2 == 0})
        want = {"hits": sess.run(t["hits"]), "w": sess.run(read_name("w", g))}
    got = load(out, 2)
    assert want["hits"] != 0
    for name, value in want.items():
        for copy in got[name]:
            np.testing.assert_allclose(copy, value, rtol=1e-6, err_msg=name)


def test_state_written_in_a_v1_loops_body_is_named_and_the_step_runs():
    """A statistic moved every turn of a v1 while loop (4 turns) from each
    replica's batch: its sync would be an exchange inside the loop, which
    runs once a step, so the second turn's waited until the run's timeout
    (5 minutes by default). A warning names the variable and its writer,
    each replica keeps its own value, and the trained weight equals one
    device's (the statistic does not feed the loss), 3 steps, 1e-5."""
    from test_batch import looped_graph
    tf1.disable_control_flow_v2()
    try:
        g, t = looped_graph(write=True)
    finally:
        tf1.enable_control_flow_v2()
    rng = np.random.default_rng(1)
    feeds = [(rng.normal(size=(8, 4, 3)), rng.normal(size=(8, 2))) for _ in range(3)]
    with pytest.warns(UserWarning, match=r"variables \['mm'\] are written inside a "
                                         r"tf.while_loop's body \(by \['while/Assign"):
        runner = pn.get_runner(g, local(2), {"communication": {"timeout_seconds": 60}})
    with runner:
        runner.run(t["init"])
        start = runner.run(t["w"])
        for a, b in feeds:
            runner.run(t["train"], {t["x"]: a, t["y"]: b})
        trained, own = runner.run(t["w"]), runner.run(t["mm"], per_replica=True)
    assert np.max(np.abs(own[0] - own[1])) > 1e-3          # each replica's own batches
    with tf1.Session(graph=g) as sess:
        sess.run(t["init"])
        t["w"].load(start, sess)
        for a, b in feeds:
            sess.run(t["train"], {t["x"]: a, t["y"]: b})
        np.testing.assert_allclose(trained, sess.run(t["w"]), atol=1e-5, rtol=0)


def test_an_exchange_inside_a_v1_loops_body_is_refused_by_name():
    """The pipeline's last check (branches.check_no_exchange_in_loops): a
    collective op reading a value of a v1 loop's body would run every
    turn and wait on the second; a GraphError names it. One reading the
    loop's result (an Exit) is fine."""
    from parallax_ng.graph.ir import GraphIR

    def reduce(t, name):
        return tf.raw_ops.CollectiveReduceV2(
            input=t, group_size=2, group_key=1, instance_key=7, ordering_token=[],
            merge_op="Add", final_op="Id", name=name)
    tf1.disable_control_flow_v2()
    try:
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [3])
            done = tf1.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, reduce(v, "inside")),
                                  [tf.constant(0), x])[1]
            outside = tf.Graph()
            with outside.as_default():
                y = tf1.placeholder(tf.float32, [3])
                reduce(tf1.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0),
                                      [tf.constant(0), y])[1], "after")
    finally:
        tf1.enable_control_flow_v2()
    assert done is not None
    with pytest.raises(GraphError, match=r"exchange 'while/inside' \(CollectiveReduceV2\) "
                                         r"inside a while loop's body"):
        branches.check_no_exchange_in_loops(GraphIR(g.as_graph_def()))
    branches.check_no_exchange_in_loops(GraphIR(outside.as_graph_def()))
