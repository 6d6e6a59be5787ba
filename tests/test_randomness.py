"""Random streams per replica: distinct by default, identical where asked and
for the candidate samplers of NCE and sampled softmax."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local, read_name
from parallax_ng.graph import frontend, randomness
from parallax_ng.errors import ConfigError
from passkit import cluster_transform

tf1 = tf.compat.v1
ROWS, FEATURES = 4, 64


def dropout_model(seed=None, in_loop=False):
    """Dropout over a batch of ones; fetch the mask (kept units are 2, dropped 0)."""
    g = tf.Graph()
    with g.as_default():
        if seed is not None:
            tf1.set_random_seed(seed)
        x = tf1.placeholder(tf.float32, [None, FEATURES], name="x")
        if in_loop:       # the random op lives in the body function of a While
            _, h = tf.while_loop(lambda i, h: i < 2,
                                 lambda i, h: (i + 1, tf1.nn.dropout(h, rate=0.5) / 2.0),
                                 [tf.constant(0), x])
        else:
            h = tf1.nn.dropout(x, rate=0.5)
        mask = tf.identity(h, name="mask")
        w = tf1.get_variable("w", [FEATURES, 1])
        loss = tf.reduce_mean(tf.matmul(mask, w), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g


def masks(graph, config=None, n=2):
    ones = np.ones([ROWS * n, FEATURES], np.float32)
    with pn.get_runner(graph, local(n), config) as runner:
        runner.run("init")
        return [runner.run("mask:0", {"x:0": ones}, per_replica=True) for _ in range(2)]


def single_mask(graph):
    with tf1.Session(graph=graph) as sess:
        return sess.run("mask:0", {"x:0": np.ones([ROWS, FEATURES], np.float32)})


@pytest.mark.parametrize("in_loop", [False, True], ids=["top-level", "in-while-body"])
def test_seeded_dropout_masks_differ_between_replicas(in_loop):
    (a0, a1), (b0, b1) = masks(dropout_model(seed=5, in_loop=in_loop))
    assert not np.array_equal(a0, a1) and not np.array_equal(b0, b1)
    assert not np.array_equal(a0, b0)               # a new draw every step
    # replica 0 keeps the user's seeds: it draws what one device draws
    np.testing.assert_array_equal(a0, single_mask(dropout_model(seed=5, in_loop=in_loop)))
    # deterministic: the same seeds give the same draws in a new runner
    (c0, c1), _ = masks(dropout_model(seed=5, in_loop=in_loop))
    np.testing.assert_array_equal(a1, c1)


def test_unseeded_dropout_masks_differ_between_replicas():
    (a0, a1), _ = masks(dropout_model())
    assert not np.array_equal(a0, a1)


def test_identical_draws_on_request():
    for graph, config in [(dropout_model(seed=5), {"random": "identical"}),
                          (dropout_model(), {"random": "identical"}),   # unseeded: pinned
                          (dropout_model(seed=5), {"random_ops": {"dropout": "identical"}})]:
        (a0, a1), (b0, b1) = masks(graph, config)
        np.testing.assert_array_equal(a0, a1)
        np.testing.assert_array_equal(b0, b1)
        assert not np.array_equal(a0, b0)


def test_identical_random_output_is_fetched_from_replica_0():
    """An identical draw is the same everywhere, so it is read from replica
    0, not averaged; a distinct one is per replica."""
    g = tf.Graph()
    with g.as_default():
        noise = tf1.random_uniform([3], seed=1, name="noise")
        w = tf1.get_variable("w", [3])
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(w * noise))
    for mode, variant in [("identical", False), ("distinct", True)]:
        with pn.get_runner(g, local(2), {"random": mode}) as runner:
            assert (noise.op.name in runner.ctx.variant) == variant
            a, b = runner.run(noise, per_replica=True)
            assert np.array_equal(a, b) == (not variant)


def test_worker_replicas_draw_their_own_streams():
    """Replica 0 of worker 1 is job-wide replica 1: its seeds are not worker 0's."""
    g = dropout_model(seed=5)
    chief, _ = cluster_transform(g, worker=0, servers=0, run_option="allreduce")
    other, _ = cluster_transform(g, worker=1, servers=0, run_option="allreduce")
    op = "dropout/random_uniform/RandomUniform"
    user = g.get_operation_by_name(op)
    seeds = (user.get_attr("seed"), user.get_attr("seed2"))
    assert drawn_with(chief, op) == seeds
    assert drawn_with(other, op) == randomness.seeds(op, "distinct", *seeds, 1) != seeds


def drawn_with(ir, op):
    """The (seed, seed2) op `op` draws with in a rewritten graph: its attrs,
    or the key and counter of the stateless op counting its calls."""
    node = ir.node(op)
    if node.op != "Identity":
        return node.attr["seed"].i, node.attr["seed2"].i
    value = lambda name: tf.make_ndarray(ir.node(f"{op}/parallax_draws/{name}")  # noqa: E731
                                         .attr["value"].tensor)
    return int(value("key")[0]), int(value("seed2"))


def test_stream_rules():
    assert randomness.seeds("op", "distinct", 7, 3, 0) == (7, 3)
    one, two = (randomness.seeds("op", "distinct", 7, 3, r) for r in (1, 2))
    assert one[0] == 7 and len({3, one[1], two[1]}) == 3 and 0 < one[1] < 2 ** 63
    assert randomness.seeds("op", "distinct", 0, 0, 5) == (0, 0)      # unseeded: fresh
    pinned = randomness.seeds("op", "identical", 0, 0, 0)
    assert pinned != (0, 0) and randomness.seeds("op", "identical", 0, 0, 3) == pinned
    assert randomness.seeds("op", "identical", 7, 3, 3) == (7, 3)


def sampled_model(sampled_softmax=False, seed=3):
    """NCE (or sampled softmax) over a seeded log-uniform sampler, with dropout."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(7)
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        labels = tf1.placeholder(tf.int64, [None, 1], name="labels")
        emb = tf1.get_variable("emb", initializer=np.linspace(-1, 1, 200 * 8, dtype=np.float32)
                               .reshape(200, 8))
        weights = tf1.get_variable("weights", initializer=np.cos(np.arange(200 * 8.0))
                                   .astype(np.float32).reshape(200, 8))
        biases = tf1.get_variable("biases", initializer=np.zeros(200, np.float32))
        rate = tf1.placeholder_with_default(0.2, [], name="rate")
        h = tf1.nn.dropout(tf1.nn.embedding_lookup(emb, ids), rate=rate)
        sampled = tf1.nn.log_uniform_candidate_sampler(labels, 1, 8, True, 200, seed=seed)
        loss_fn = tf1.nn.sampled_softmax_loss if sampled_softmax else tf1.nn.nce_loss
        loss = tf.reduce_mean(loss_fn(weights, biases, labels, h, 8, 200,
                                      sampled_values=sampled), name="loss")
        tf1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g


@pytest.mark.parametrize("sampled_softmax", [False, True], ids=["nce", "sampled-softmax"])
def test_sampled_negatives_are_one_devices_by_default(sampled_softmax):
    """`random: auto`: every replica draws the negatives one device draws
    once for the global batch, so the step equals one device's (dropout
    rate 0 there: its masks are per replica); `random: distinct` gives each
    replica its own negatives."""
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 200, 16), rng.integers(0, 200, (16, 1))) for _ in range(4)]
    names = ["emb", "weights", "biases"]

    def trained(config):
        g = sampled_model(sampled_softmax)
        with pn.get_runner(g, local(2), config) as runner:
            runner.run("init")
            for ids, labels in batches:
                runner.run("train", {"ids:0": ids, "labels:0": labels, "rate:0": 0.0})
            plan = runner.plan.random
            return plan, runner.run([read_name(n, g) for n in names])
    plan, got = trained(None)
    assert plan["LogUniformCandidateSampler"] == "identical"
    assert plan["dropout/random_uniform/RandomUniform"] == "distinct"
    g = sampled_model(sampled_softmax)
    with tf1.Session(graph=g) as sess:
        sess.run("init")
        for ids, labels in batches:
            sess.run("train", {"ids:0": ids, "labels:0": labels, "rate:0": 0.0})
        want = sess.run([read_name(n, g) for n in names])
    for name, a, b in zip(names, got, want):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=name)
    plan, other = trained({"random": "distinct"})
    assert plan["LogUniformCandidateSampler"] == "distinct"
    assert np.max(np.abs(other[1] - want[1])) > 1e-3


def test_random_config_errors_name_the_key():
    ops = {"a/RandomUniform": (1, 2), "nce/Sampler": (0, 0)}
    assert randomness.decide(ops, "distinct", {"nce": "identical"}) == {
        "a/RandomUniform": "distinct", "nce/Sampler": "identical"}
    assert randomness.decide(ops, "auto", {}, batch_free={"nce/Sampler"}) == {
        "a/RandomUniform": "distinct", "nce/Sampler": "identical"}
    assert randomness.decide(ops, "auto", {"nce": "distinct"}, batch_free={"nce/Sampler"}) == {
        "a/RandomUniform": "distinct", "nce/Sampler": "distinct"}
    with pytest.raises(ConfigError, match="random_ops.softmax.*matches no random op"):
        randomness.decide(ops, "distinct", {"softmax": "identical"})
    with pytest.raises(ConfigError, match="random_ops.\\(.*regular expression"):
        randomness.decide(ops, "distinct", {"(": "identical"})
    with pytest.raises(ConfigError, match="'random' has value 'same'"):
        pn.Config(random="same")
    with pytest.raises(ConfigError, match="random_ops.x"):
        pn.Config.from_dict({"random_ops": {"x": "shared"}})


def stateless_model():
    """A stateless draw seeded by a constant (the same on every replica) and
    one seeded by the input (already per replica)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, FEATURES], name="x")
        keep = tf.random.stateless_uniform(tf.shape(x), seed=[5, 9]) < 0.5
        mask = tf.identity(tf.where(keep, x, tf.zeros_like(x)), name="mask")
        per_row = tf.cast(tf.reduce_sum(x, axis=1), tf.int64)
        tf.identity(tf.random.stateless_uniform([1], tf.stack([per_row[0], per_row[0]])),
                    name="from_data")
        w = tf1.get_variable("w", [FEATURES, 1])
        loss = tf.reduce_mean(tf.matmul(mask, w), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g


def test_stateless_draws_with_a_shared_seed_differ_between_replicas():
    """A stateless op's seed the same on every replica is XORed with the
    replica's mask (replica 0 keeps it: it draws one device's first rows);
    a seed computed from the input is left alone; `identical` keeps them."""
    g = stateless_model()
    key = [op.name for op in g.get_operations()
           if op.type == "StatelessRandomGetKeyCounter"]
    tg = frontend.load(g)
    assert randomness.stateless_draws(tg.ir, tg.variant) == key[:1]
    ones = np.ones([2 * ROWS, FEATURES], np.float32)
    with tf1.Session(graph=g) as sess:
        one = sess.run("mask:0", {"x:0": ones})
    for mode in ("distinct", "identical"):
        with pn.get_runner(g, local(2), {"random": mode}) as runner:
            runner.run("init")
            a, b = runner.run("mask:0", {"x:0": ones}, per_replica=True)
            np.testing.assert_array_equal(a, one[:ROWS])
            assert np.array_equal(a, b) == (mode == "identical")
    chief, _ = cluster_transform(g, worker=0, servers=0, run_option="allreduce")
    other, _ = cluster_transform(g, worker=1, servers=0, run_option="allreduce")
    assert chief.node(key[0]).input[0] == g.get_operation_by_name(key[0]).inputs[0].op.name
    xor = other.node(other.node(key[0]).input[0].split(":")[0])
    assert xor.op == "BitwiseXor"
    mask = tf.make_ndarray(other.node(xor.input[1]).attr["value"].tensor)
    assert mask.tolist() == [randomness.seed_mask(1), 0]
    assert other.node(key[1]).input == chief.node(key[1]).input      # seeded by the input


def noisy_gradients_graph():
    """A TF1 step that adds seeded noise to its gradient after
    compute_gradients (gradient noise), momentum SGD."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=np.ones([3], np.float32))
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        pairs = opt.compute_gradients(tf.reduce_mean(tf.reduce_sum(x * w, 1) ** 2))
        opt.apply_gradients([(grad + tf1.random_normal(tf.shape(grad), stddev=0.1), v)
                             for grad, v in pairs], name="train")
    return g


def test_noise_added_to_the_gradients_is_drawn_alike_and_equals_one_device():
    """A draw the step uses only after its gradients (noise added to them)
    does not depend on the batch: `auto` draws it identically, with the
    user's seeds, so 2 replicas apply one device's update (1e-6: the
    gradient's sum in another order; before: each replica drew its own,
    and the update was refused)."""
    data = np.random.default_rng(0).normal(size=(4, 8, 3)).astype(np.float32)
    out = []
    for parallel in (False, True):
        g = noisy_gradients_graph()
        with (pn.get_runner(g, local(2)) if parallel else tf1.Session(graph=g)) as run:
            run.run([v.initializer for v in g.get_collection("variables")])
            for batch in data:
                run.run("train", {"x:0": batch})
            out.append(run.run(read_name("w", g)))
            if parallel:
                assert set(run.plan.random.values()) == {"identical"}, run.plan.random
    np.testing.assert_allclose(out[1], out[0], atol=1e-6, rtol=0)
