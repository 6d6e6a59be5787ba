"""Counted draws (transforms/counted_draws.py): a seeded stateful random op
becomes a stateless one keyed by a call counter, drawing what the stateful
op draws, call after call; ops a counter cannot stand for stay stateful."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local, read_name
from parallax_ng.graph import frontend, randomness
from parallax_ng.pipeline.results import CountedDraws

tf1 = tf.compat.v1
KINDS = ["RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt"]


def draws_graph(seeds=None):
    """One op of each kind with a shape fed at run time, and a loss that
    trains on their sum; `seeds`: kind -> (seed, seed2), else a graph seed."""
    g = tf.Graph()
    with g.as_default():
        if seeds is None:
            tf1.set_random_seed(4)
        shape = tf1.placeholder(tf.int32, [2], name="shape")
        ops = {}
        for kind in KINDS:
            seed, seed2 = seeds[kind] if seeds else (None, None)
            kw = dict(seed=seed, seed2=seed2) if seeds else {}
            if kind == "RandomUniformInt":
                out = tf.raw_ops.RandomUniformInt(shape=shape, minval=tf.constant(-5, tf.int64),
                                                  maxval=tf.constant(9, tf.int64), name=kind,
                                                  **(kw or _graph_seeds(kind)))
            else:
                out = getattr(tf.raw_ops, kind)(shape=shape, dtype=tf.float32, name=kind,
                                                **(kw or _graph_seeds(kind)))
            ops[kind] = out
        w = tf1.get_variable("w", initializer=1.0)
        total = sum(tf.reduce_sum(tf.cast(t, tf.float32)) for t in ops.values())
        tf1.train.GradientDescentOptimizer(0.1).minimize(w * total, name="train")
        tf1.global_variables_initializer()
    return g, ops


def _graph_seeds(kind):
    seed, seed2 = tf1.get_seed(None)
    return dict(seed=seed, seed2=seed2)


SHAPES = [[2, 3], [1, 5], [3, 3]]


@pytest.mark.parametrize("replicas", [1, 2])
def test_counted_ops_draw_what_the_stateful_ops_draw(replicas):
    """Three runs with different shapes: replica 0's draws are the user's
    graph's, replica 1's those of the stateful ops with its seeds
    (randomness.seeds); every op was counted."""
    g, ops = draws_graph()
    user = {kind: (op.op.get_attr("seed"), op.op.get_attr("seed2")) for kind, op in ops.items()}
    want = [[] for _ in range(replicas)]
    for r in range(replicas):
        h, theirs = draws_graph({k: randomness.seeds(ops[k].op.name, "distinct", *s, r)
                                 for k, s in user.items()})
        with tf1.Session(graph=h) as sess:
            want[r] = [sess.run(theirs, {"shape:0": [s[0] * replicas, s[1]]}) for s in SHAPES]
    with pn.get_runner(g, local(replicas), {"batch_feeds": {"shape": False}}) as runner:
        counted = runner.ctx.result(CountedDraws)
        assert sorted(op for _, op in counted.calls) == sorted(KINDS * replicas)
        assert all(runner.graph.get_operation_by_name(k).type == "Identity" for k in KINDS)
        runner.run("init")
        for i, s in enumerate(SHAPES):
            got = runner.run(ops, {"shape:0": [s[0] * replicas, s[1]]}, per_replica=True)
            for kind in KINDS:
                for r in range(replicas):
                    np.testing.assert_array_equal(got[kind][r], want[r][i][kind],
                                                  err_msg=f"{kind}, replica {r}, run {i}")


def test_a_branch_not_taken_does_not_advance_the_stream():
    """A tf.compat.v1 cond (control flow v1): a call that does not happen
    leaves the counter where it was, as the stateful op's stream stays."""
    tf1.disable_control_flow_v2()
    try:
        g = tf.Graph()
        with g.as_default():
            tf1.set_random_seed(2)
            take = tf1.placeholder(tf.bool, [], name="take")
            w = tf1.get_variable("w", [3])
            noise = tf1.cond(take, lambda: tf1.random_normal([3]), lambda: tf.zeros([3]))
            out = tf.identity(noise, name="out")
            tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(w * out))
            tf1.global_variables_initializer()
    finally:
        tf1.enable_control_flow_v2()
    pattern = [True, False, False, True, True]
    with tf1.Session(graph=g) as sess:
        want = [sess.run("out:0", {"take:0": t}) for t in pattern]
    with pn.get_runner(g, local(1)) as runner:
        assert runner.ctx.result(CountedDraws).calls
        runner.run("init")
        got = [runner.run("out:0", {"take:0": t}) for t in pattern]
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"run {i}")


def test_loops_initial_values_and_unseeded_ops_stay_stateful():
    """Counted: dropout in the step. Not: a random op in a tf.compat.v1 while
    loop's body (one counter read would serve every iteration), a random
    initializer (it only draws initial values), an unseeded op."""
    tf1.disable_control_flow_v2()
    try:
        g = tf.Graph()
        with g.as_default():
            tf1.set_random_seed(3)
            x = tf1.placeholder(tf.float32, [None, 4], name="x")
            w = tf1.get_variable("w", [4, 4], initializer=tf1.random_normal_initializer())
            h = tf1.nn.dropout(tf.matmul(x, w), rate=0.5)
            _, looped = tf1.while_loop(lambda i, v: i < 3,
                                       lambda i, v: (i + 1, v + tf1.random_uniform([4])),
                                       [tf.constant(0), tf.zeros([4])])
            loss = tf.reduce_sum(h) + tf.reduce_sum(looped * w[0])
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    finally:
        tf1.enable_control_flow_v2()
    tg = frontend.load(g)
    drawn = randomness.random_ops(tg.ir.nodes, tg.ir.library)
    kinds = {name: tg.ir.node(name).op for name in drawn}
    assert sorted(kinds.values()) == ["RandomStandardNormal", "RandomUniform", "RandomUniform"]
    assert randomness.counted(tg, dict.fromkeys(drawn, "distinct")) == [
        "dropout/random_uniform/RandomUniform"]
    with pn.get_runner(g, local(2)) as runner:
        assert "1 seeded with their calls counted" in runner.plan.format()
        assert sorted(runner.ctx.result(CountedDraws).calls) == [
            (0, "dropout/random_uniform/RandomUniform"),
            (1, "dropout/random_uniform/RandomUniform")]
    unseeded = tf.Graph()
    with unseeded.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", [4, 1])
        tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_sum(tf1.nn.dropout(tf.matmul(x, w), rate=0.5)))
    with pn.get_runner(unseeded, local(2)) as runner:
        assert runner.ctx.result(CountedDraws) is None and not runner.plan.counted
        assert runner.graph.get_operation_by_name(
            "dropout/random_uniform/RandomUniform").type == "RandomUniform"


SAMPLER = "sampled_softmax_loss/LogUniformCandidateSampler"
SPLIT = {"batch_feeds": {"x": True, "y": True}}
VALUES = ["out/w", "out/b", "hidden/v", "hidden/c"]


def sampled_graph():
    """Sampled softmax over 50 classes (a seeded LogUniformCandidateSampler,
    8 negatives) on a dense layer; a global step."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(5)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.int64, [None, 1], name="y")
        v = tf1.get_variable("hidden/v", [4, 4])
        c = tf1.get_variable("hidden/c", [4], initializer=tf1.zeros_initializer())
        w = tf1.get_variable("out/w", [50, 4])
        b = tf1.get_variable("out/b", [50], initializer=tf1.zeros_initializer())
        h = tf.tanh(tf.matmul(x, v) + c)
        loss = tf.reduce_mean(tf.nn.sampled_softmax_loss(w, b, y, h, num_sampled=8,
                                                         num_classes=50))
        step = tf1.train.get_or_create_global_step()
        tf1.train.GradientDescentOptimizer(0.5).minimize(loss, global_step=step, name="train")
        tf1.global_variables_initializer()
    return g


def sampled_feeds(step: int, batch: int = 8) -> dict:
    rng = np.random.RandomState(step)
    return {"x:0": rng.randn(batch, 4).astype(np.float32),
            "y:0": rng.randint(0, 50, [batch, 1]).astype(np.int64)}


def sampled_steps(runner, steps, first=0):
    """Train `steps` steps; each step's sampled classes, per replica."""
    return [runner.run(["train", SAMPLER + ":0"], sampled_feeds(first + s),
                       per_replica=True)[1] for s in range(steps)]


@pytest.mark.parametrize("random", ["auto", "distinct"])
def test_a_candidate_sampler_draws_on_where_its_checkpoint_was(tmp_path, random):
    """A candidate sampler stays stateful with its calls counted; a runner
    restored from step 3 calls it 3 times again and then draws what an
    uninterrupted runner draws at steps 4-6, and trains to its variables.
    Replicas draw alike by default (one device's negatives), apart with
    `random: distinct`."""
    split = {**SPLIT, "random": random}
    config = {"checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 3}, **split}
    with pn.get_runner(sampled_graph(), local(2), split) as whole:
        assert [op for _, op in whole.ctx.result(CountedDraws).calls] == [SAMPLER] * 2
        assert whole.graph.get_operation_by_name(SAMPLER).type == "IdentityN"
        whole.run("init")
        want = sampled_steps(whole, 6)
        want_values = whole.run([read_name(v, whole.ctx.tg.graph) for v in VALUES])
    assert np.array_equal(want[0][0], want[0][1]) == (random == "auto")
    with pn.get_runner(sampled_graph(), local(2), config) as first:
        first.run("init")
        np.testing.assert_array_equal(sampled_steps(first, 3), want[:3])
    g = sampled_graph()
    with pn.get_runner(g, local(2), config) as again:
        again.run("init")              # restores step 3, calls each sampler 3 times
        assert again.run(read_name("global_step", g)) == 3
        np.testing.assert_array_equal(sampled_steps(again, 3, first=3), want[3:])
        for got, value in zip(again.run([read_name(v, g) for v in VALUES]), want_values):
            np.testing.assert_array_equal(got, value)


def test_compute_accidental_hits_is_not_random():
    """It has seed attrs but draws nothing: no seed of its own, no counter."""
    tg = frontend.load(sampled_graph())
    drawn = randomness.random_ops(tg.ir.nodes, tg.ir.library)
    kinds = {tg.ir.node(n).op for n in drawn}
    assert "LogUniformCandidateSampler" in kinds and "ComputeAccidentalHits" not in kinds
    assert any(n.op == "ComputeAccidentalHits" for n in tg.ir.nodes)
