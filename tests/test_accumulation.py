"""Gradients a script accumulates in variables of its own
(parallax_ng/graph/accumulation.py): zero the accumulators, add k
micro-batches' gradients, apply their mean in a run of its own. Each
replica accumulates its own micro-batches; the accumulators are aggregated
once, by the update. 2 replicas with micro-batches of 8 equal one device
with micro-batches of 16: every variable, optimizer slot and accumulator
(fetched: the replicas' mean), and every micro-batch's loss, 1e-5 after 4
updates of 3 micro-batches each, and the norm of the accumulated gradient
fetched alone before each update (replica 0's alone waited for the
others' all-reduce until the run's timeout). The data comes from an initializable
iterator fed numpy arrays, as TensorFlow's TF1 guides feed it. Run as a
script (`python test_accumulation.py OUT`, under `parallax-ng run`), it
trains so in a job and saves worker's variables to OUT.<worker>.npz.
Gradients a step combines within itself (two tf.gradients over halves of
its batch, summed by constant factors) are aggregated where they are summed;
combined otherwise, they are refused naming the variable."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local, read_name
from parallax_ng.graph import frontend
from task_env import TASK_PATH

tf1 = tf.compat.v1
K, STEPS, VOCAB = 3, 4, 30
TOL = 1e-5


def _arrays():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, VOCAB, size=(384, 2)).astype(np.int32)
    x = rng.randn(384, 5).astype(np.float32)
    return ids, x, (x @ rng.randn(5, 1) + 0.1 * ids[:, :1]).astype(np.float32)


def build(batch, style="plain", optimizer="adam", parallel=True):
    """An embedding (its IndexedSlices gradient accumulated densely) and two
    dense layers; `style` how the accumulators are made and added to."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        feeds = [tf1.placeholder(a.dtype, (None,) + a.shape[1:]) for a in _arrays()]
        ds = tf.data.Dataset.from_tensor_slices(tuple(feeds))
        ds = pn.shard(ds) if parallel else ds
        it = tf1.data.make_initializable_iterator(ds.batch(batch).repeat())
        ids, x, y = it.get_next()
        emb = tf1.get_variable("emb", [VOCAB, 3])
        h = tf.concat([tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), 1), x], 1)
        h = tf.tanh(tf.matmul(h, tf1.get_variable("w1", [8, 16])) + tf1.get_variable(
            "b1", [16], initializer=tf1.constant_initializer(0.1)))
        loss = tf.reduce_mean(tf.square(tf.matmul(h, tf1.get_variable("w2", [16, 1])) - y))
        opt = {"adam": lambda: tf1.train.AdamOptimizer(0.01),
               "momentum": lambda: tf1.train.MomentumOptimizer(0.05, 0.9)}[optimizer]()
        tvars = tf1.trainable_variables()
        grads = tf.gradients(loss, tvars)
        accum = [tf1.Variable(tf.zeros(v.shape), trainable=False,
                              use_resource=style == "resource",
                              name=f"{v.op.name}/accum" if style == "named" else "accum")
                 for v in tvars]
        zero = tf.group([a.assign(tf.zeros_like(a)) for a in accum])
        if style == "assign":
            add = tf.group([a.assign(a + tf.convert_to_tensor(gr)) for a, gr in
                            zip(accum, grads)])
        elif style == "scatter":        # the embedding's rows added where they go
            add = tf.group([tf1.scatter_add(a, gr.indices, gr.values)
                            if isinstance(gr, tf.IndexedSlices) else a.assign_add(gr)
                            for a, gr in zip(accum, grads)])
        else:
            add = tf.group([a.assign_add(gr) for a, gr in zip(accum, grads)])
        train = opt.apply_gradients([(a / K, v) for a, v in zip(accum, tvars)],
                                    global_step=tf1.train.get_or_create_global_step())
        norm = tf.linalg.global_norm([a / K for a in accum])
        init = tf1.global_variables_initializer()
    return g, dict(init=init, it=it, feeds=feeds, zero=zero, add=add, train=train, loss=loss,
                   norm=norm)


def _train(run, h):
    run(h["init"])
    run(h["it"].initializer, dict(zip(h["feeds"], _arrays())))
    losses = []
    for _ in range(STEPS):
        run(h["zero"])
        losses.extend(run([h["add"], h["loss"]])[1] for _ in range(K))
        losses.append(run(h["norm"]))       # logged alone before the update
        run(h["train"])
    return losses


def _values(run, g):
    names = [v.op.name for v in g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)]
    return dict(zip(names, run([read_name(n, g) for n in names])))


def _one_device(n, style, optimizer):
    g, h = build(8 * n, style, optimizer, parallel=False)
    with tf1.Session(graph=g) as sess:
        losses = _train(sess.run, h)
        return losses, _values(sess.run, g)


@pytest.mark.parametrize("style", ["plain", "named", "assign", "resource", "scatter"])
def test_the_front_end_takes_a_read_of_the_accumulator_as_the_gradient(style):
    """Whatever the accumulators are called (under the trained variable's
    name, too) and however they are added to."""
    g, _ = build(8, style)
    tg = frontend.load(g)
    assert sorted(tg.accumulators.values()) == ["b1", "emb", "w1", "w2"]
    for acc, var in tg.accumulators.items():
        assert frontend.accumulation.read_variable(tg, tg.gradients[var].values) == acc
        assert not tg.gradients[var].sparse and tg.variables[acc].owner is None


@pytest.mark.parametrize("style,run_option,optimizer", [
    ("plain", "hybrid", "adam"), ("assign", "allreduce", "momentum"),
    ("resource", "ps", "adam"), ("named", "ps", "momentum"), ("scatter", "hybrid", "adam")])
def test_two_replicas_accumulating_equal_one_device(style, run_option, optimizer):
    want_losses, want = _one_device(2, style, optimizer)
    g, h = build(8, style, optimizer)
    config = {"run_option": run_option, "communication": {"timeout_seconds": 30}}
    with pn.get_runner(g, local(2), config) as runner:
        losses = _train(runner.run, h)
        got = _values(runner.run, g)
        # the micro-batches' runs aggregate nothing: the accumulators' adds
        # are the replicas' own
        rewritten = runner.graph
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOL, err_msg=name)
    adds = [op for op in rewritten.get_operations() if op.type in (
        "AssignAdd", "AssignAddVariableOp", "Assign", "AssignVariableOp") and "accum" in op.name]
    ancestors, todo = set(), [t.op for op in adds for t in op.inputs]
    while todo:
        op = todo.pop()
        if op.name not in ancestors:
            ancestors.add(op.name)
            todo.extend(t.op for t in op.inputs)
    kinds = {rewritten.get_operation_by_name(n).type for n in ancestors}
    assert adds and not kinds & {"CollectiveReduceV2", "CollectiveReduce", "NcclAllReduce",
                                 "CollectiveGatherV2", "ResourceAccumulatorApplyGradient"}


def test_a_job_stopped_between_micro_batches_resumes_exactly(tmp_path):
    """The runner's checkpoint (at close) holds each replica's accumulator
    as its own, besides the variable's one-device value (their mean): a
    runner stopped after 2 of the 3 micro-batches of its second update and
    started again ends where an uninterrupted one device does."""
    want_losses, want = _one_device(2, "plain", "adam")
    config = {"run_option": "hybrid", "checkpoint": {"dir": str(tmp_path), "every_steps": 100}}
    g, h = build(8)
    feeds = dict(zip(h["feeds"], _arrays()))
    losses = []
    with pn.get_runner(g, local(2), config) as runner:
        runner.run([h["init"], h["it"].initializer], feeds)
        for adds in (K, 2):
            runner.run(h["zero"])
            losses.extend(runner.run([h["add"], h["loss"]])[1] for _ in range(adds))
            if adds == K:
                losses.append(runner.run(h["norm"]))
                runner.run(h["train"])
    saved = tf.train.latest_checkpoint(str(tmp_path))
    assert saved.endswith("model.ckpt-1")
    mean = tf.train.load_variable(saved, "accum_2")         # w1's accumulator
    with pn.get_runner(g, local(2), config) as runner:
        runner.run([h["init"], h["it"].initializer], feeds)  # restores the checkpoint
        np.testing.assert_allclose(runner.run("accum_2:0"), mean, rtol=0, atol=1e-7)
        losses.append(runner.run([h["add"], h["loss"]])[1])
        losses.append(runner.run(h["norm"]))     # of the replicas' restored sums
        runner.run(h["train"])
        for _ in range(STEPS - 2):
            runner.run(h["zero"])
            losses.extend(runner.run([h["add"], h["loss"]])[1] for _ in range(K))
            losses.append(runner.run(h["norm"]))
            runner.run(h["train"])
        got = _values(runner.run, g)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOL, err_msg=name)


def test_a_two_worker_job_with_a_server_equals_one_device(tmp_path):
    """2 workers x 1 device and a parameter server (the default hybrid
    plan), each worker accumulating its own micro-batches: both end equal
    to one device, every variable and optimizer slot (the accumulators are
    each worker's own: not compared)."""
    _, want = _one_device(2, "plain", "adam")
    path = tmp_path / "resources.yaml"
    path.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2 +
                    "ps: [127.0.0.1]\n")
    out = str(tmp_path / "vars")
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", os.path.abspath(__file__), "-r", str(path),
         "--", out], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for w in range(2):
        got = dict(np.load(f"{out}.{w}.npz"))
        compared = [n for n in want if not n.endswith("accum") and "accum_" not in n]
        assert len(compared) == 15          # 4 weights, 8 Adam slots, 2 powers, global step
        for name in compared:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOL, err_msg=name)


if __name__ == "__main__":
    g, h = build(8)
    with pn.get_runner(g, None, {}) as runner:
        _train(runner.run, h)
        values = _values(runner.run, g)
    worker = json.loads(os.environ["PARALLAX_NG_CLUSTER"])["task"]
    np.savez(f"{sys.argv[1]}.{worker}.npz", **values)


def build_halves(combine):
    """A step that takes the gradients of its batch's two halves apart and
    applies `combine(g1, g2)` (the embedding's made dense by the sum)."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        ids = tf1.placeholder(tf.int32, [None, 2], name="ids")
        x = tf1.placeholder(tf.float32, [None, 5], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf1.get_variable("emb", [VOCAB, 3])
        h = tf.concat([tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), 1), x], 1)
        pred = tf.matmul(tf.tanh(tf.matmul(h, tf1.get_variable("w1", [8, 16]))),
                         tf1.get_variable("w2", [16, 1]))
        half = tf.shape(x)[0] // 2
        tvars = tf1.trainable_variables()
        parts = [tf.gradients(tf.reduce_mean(tf.square(p - t)), tvars)
                 for p, t in ((pred[:half], y[:half]), (pred[half:], y[half:]))]
        grads = [combine(tf.convert_to_tensor(a), tf.convert_to_tensor(b))
                 for a, b in zip(*parts)]
        loss = tf.reduce_mean(tf.square(pred - y))
        train = tf1.train.AdamOptimizer(0.01).apply_gradients(
            list(zip(grads, tvars)), global_step=tf1.train.get_or_create_global_step())
        init = tf1.global_variables_initializer()
    return g, train, loss, init


@pytest.mark.parametrize("run_option", ["hybrid", "allreduce"])
def test_gradients_a_step_sums_within_itself_are_aggregated_summed(run_option):
    """`(g1 + g2) * 0.5` of two tf.gradients: before, the nearer was
    aggregated and the other was each replica's own (a GraphError for the
    embedding, whose two were equally near; Adam's second moment of the
    replicas' mean increments in a TF2 step: 0.035 off after 6 steps)."""
    data = _arrays()
    feeds = [{f: a[16 * k:16 * k + 16] for f, a in zip(("ids:0", "x:0", "y:0"), data)}
             for k in range(STEPS)]
    g, train, loss, init = build_halves(lambda a, b: (a + b) * 0.5)
    with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
        runner.run(init)
        start = _values(runner.run, g)
        losses = [runner.run([train, loss], feed)[1] for feed in feeds]
        got = _values(runner.run, g)
    g, train, loss, init = build_halves(lambda a, b: (a + b) * 0.5)
    with tf1.Session(graph=g) as sess:
        sess.run(init)
        for v in g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES):
            v.load(start[v.op.name], sess)
        want_losses = [sess.run([train, loss], feed)[1] for feed in feeds]
        want = _values(sess.run, g)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOL, err_msg=name)


def test_gradients_combined_other_than_by_a_sum_are_refused():
    g, *_ = build_halves(lambda a, b: tf.maximum(a * 2.0, tf.square(b)))
    with pytest.raises(pn.GraphError, match="update of variable '(emb|w1|w2)' combines gradients "
                       "computed apart.*other than by a sum"):
        frontend.load(g)


def _tf2_accumulating(lib, parallel, run_option="hybrid"):
    """A TF2 custom loop that accumulates: each call adds its gradients / 2
    to variables of its own, every second call applies them with Adam
    (its moments read the accumulators: Keras 3's update math is not one
    fused op) and zeroes them, in a tf.cond on a call counter. Returns the
    calls' losses and the global norm of the accumulators after each call
    (before, replica 0's own sums: 0.2 off), and every variable's value by name."""
    import keras
    import tf_keras
    k = keras if lib == "keras3" else tf_keras
    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((2,), dtype="int32"), k.layers.Embedding(VOCAB, 3),
                          k.layers.Flatten(),
                          k.layers.Dense(8, activation="tanh"), k.layers.Dense(1)])
    optimizer = k.optimizers.Adam(0.01)
    tvars = model.trainable_variables
    accum = [tf.Variable(tf.zeros_like(v), trainable=False) for v in tvars]
    calls = tf.Variable(0, dtype=tf.int64, trainable=False)

    def train_step(ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids, training=True) - y))
        for a, g in zip(accum, tape.gradient(loss, tvars)):
            a.assign_add(tf.convert_to_tensor(g) / 2.0)
        calls.assign_add(1)

        def update():
            optimizer.apply_gradients(zip(accum, tvars))
            for a in accum:
                a.assign(tf.zeros_like(a))
            return tf.constant(0)
        tf.cond(calls % 2 == 0, update, lambda: tf.constant(0))
        return loss, tf.linalg.global_norm(accum)     # what the sums hold after it
    step = pn.function(train_step, local(2), {"run_option": run_option}) if parallel \
        else tf.function(train_step)
    ids, _, y = _arrays()
    losses = [np.array(step(ids[16 * i:16 * i + 16], y[16 * i:16 * i + 16]), float)
              for i in range(8)]
    if parallel:
        step.sync()
    variables = tvars + accum + [calls] + list(optimizer.variables) if lib == "keras3" else \
        tvars + accum + [calls] + optimizer.variables()
    return losses, [(v.name, v.numpy()) for v in variables]   # by position (names count models)


@pytest.mark.parametrize("lib,run_option", [("keras3", "hybrid"), ("keras3", "ps"),
                                            ("tf_keras", "allreduce")])
def test_a_tf2_loop_accumulating_into_its_own_variables_equals_one_device(lib, run_option):
    """Before, refused: "the step trains nothing" (the update reached the
    accumulators only through Adam's moments, which the front end did not
    follow to the accumulators' reads)."""
    want_losses, want = _tf2_accumulating(lib, False)
    losses, got = _tf2_accumulating(lib, True, run_option)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
    assert len(got) == len(want) > 10
    for (name, value), (_, wanted) in zip(got, want):
        np.testing.assert_allclose(value, wanted, rtol=0, atol=TOL, err_msg=name)


def _summed_in_python(batch, shape, parallel=True):
    """The gradient buffers of policy-gradient tutorials: tf.gradients (the
    embedding's made dense) fetched each run, summed in numpy, and fed to
    `apply_gradients(zip(placeholders, tvars))` every K runs; the
    placeholders of the variables' shapes, of an unknown first dimension,
    or of no shape. "mixed": the embedding's sums fed, `w` trained in the
    graph by its own optimizer in the same run."""
    g = tf.Graph()
    with g.as_default():
        ds = tf.data.Dataset.from_tensor_slices(_arrays())
        ids, x, y = tf1.data.make_one_shot_iterator(
            (pn.shard(ds) if parallel else ds).batch(batch).repeat()).get_next()
        emb = tf1.get_variable("emb", initializer=np.random.RandomState(2).randn(VOCAB, 3)
                               .astype(np.float32))
        w = tf1.get_variable("w", initializer=np.random.RandomState(3).randn(8, 1)
                             .astype(np.float32))
        h = tf.concat([tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), 1), x], 1)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - y))
        grads = [tf.convert_to_tensor(gr) for gr in tf.gradients(loss, [emb, w])]
        fed = [tf1.placeholder(tf.float32, {"static": v.shape, "open": [None, v.shape[1]],
                                            "none": None, "mixed": v.shape}[shape])
               for v in (emb, w)]
        train = tf1.train.AdamOptimizer(0.01).apply_gradients(
            zip(fed, [emb, w]), global_step=tf1.train.get_or_create_global_step())
        if shape == "mixed":        # the embedding's update after w's reads it
            fed = fed[:1]
            with tf.control_dependencies([tf1.train.GradientDescentOptimizer(0.1).minimize(
                    loss, var_list=[w])]):
                train = tf1.train.AdamOptimizer(0.01).apply_gradients(
                    [(fed[0], emb)], global_step=tf1.train.get_or_create_global_step())
        init = tf1.global_variables_initializer()

    def run_all(run):
        run(init)
        losses = []
        for _ in range(STEPS):
            buffers = [0.0, 0.0]
            for _ in range(K):
                loss_value, got = run([loss, grads])
                losses.append(loss_value)
                buffers = [b + gr for b, gr in zip(buffers, got)]
            run(train, dict(zip(fed, [b / K for b in buffers])))
        return losses
    return g, run_all


@pytest.mark.parametrize("shape,run_option", [("static", "allreduce"), ("open", "ps"),
                                              ("none", "hybrid"), ("mixed", "hybrid")])
def test_gradients_summed_in_python_and_fed_back_equal_one_device(shape, run_option):
    """Before, refused ("found no optimizer update"); let in, a placeholder
    of an unknown first dimension was split over the replicas as a batch,
    and the dense embedding gradient's replicas were joined, not averaged.
    Now the fetched gradients are one device's (the replicas' mean) and the
    fed sums go whole to every replica: every loss, weight and Adam slot
    within 1e-5 of one device's after 4 updates of 3 runs."""
    g1, run_all = _summed_in_python(16, shape, parallel=False)
    with tf1.Session(graph=g1) as sess:
        want_losses = run_all(sess.run)
        want = _values(sess.run, g1)
    g, run_all = _summed_in_python(8, shape)
    with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
        losses = run_all(runner.run)
        got = _values(runner.run, g)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
    # 2 weights, 4 Adam slots, Adam's 2 powers, the step; mixed: the applied Adam's too
    assert len(want) == (13 if shape == "mixed" else 9)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=TOL, err_msg=name)


@pytest.mark.parametrize("where,shape", [("job", "static"), ("l2l", "static"),
                                         ("job", "mixed")])
def test_gradients_summed_in_python_are_refused_in_a_job_and_under_l2l(where, shape,
                                                                       monkeypatch):
    """In a job each worker's fetched gradients are its own replicas' mean,
    so the workers' sums, fed back, would differ: refused before any server
    starts, naming the variables and the form that trains in a job; so
    under layer-to-layer. Before, the mixed graph (`w` trained in the graph
    beside) went in, and its workers applied apart."""
    import json
    from parallax_ng.cluster import ENV
    g, _ = _summed_in_python(8, shape)
    config = {"l2l": {"layers": r"layer_(\d+)"}} if where == "l2l" else {}
    if where == "job":
        monkeypatch.setenv(ENV, json.dumps({"worker": ["127.0.0.1:1", "127.0.0.1:2"],
                                            "task_type": "worker", "task": 0,
                                            "devices": [["CPU", 0]]}))
    fed = "'emb'" if shape == "mixed" else "'emb', 'w'"
    with pytest.raises(pn.GraphError, match=rf"apply fed values to \[{fed}\].*" + (
            "not in a job of 2 workers" if where == "job" else "not under layer-to-layer") +
            r".*opt.apply_gradients\(zip\(grads, tvars\)\)"):
        pn.get_runner(g, None if where == "job" else local(2), config)


def test_a_tf2_step_that_only_adds_its_gradients_is_refused_naming_them():
    """The accumulation split into two tf.functions, one adding each call's
    gradients and one applying them: the adding step has no update to find
    its gradients from, and is refused naming where it puts them and the
    one-step form that trains (the test above). `sinks` names the
    accumulators of a TF1 graph too, not the variables its update writes."""
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    sums = [tf.Variable(tf.zeros_like(v), trainable=False, name=f"sum_{i}")
            for i, v in enumerate(model.trainable_variables)]

    def adds_gradients(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        for total, grad in zip(sums, tape.gradient(loss, model.trainable_variables)):
            total.assign_add(grad)
        return loss
    _, x, y = _arrays()
    with pytest.raises(pn.GraphError, match=r"'adds_gradients' adds its gradients into "
                       r"variables \['sum_0', 'sum_1'\] and applies none.*under a tf.cond"):
        pn.function(adds_gradients, local(2))(x[:16], y[:16])
    g, _ = build(8)
    assert frontend.accumulation.sinks(g) == ["accum", "accum_1", "accum_2", "accum_3"]


def _applied_after_adds(batch, resource, parallel=True):
    """Every run adds the gradient to an accumulator; a tf.cond on a step
    counter (TF2 behavior: a functional If, lowered; v1 behavior's a v1
    cond) applies the mean and zeroes it every second run; with a reference
    variable under TF2 behavior (which a TF2 cond's function cannot
    write), the apply follows the add in every run, by a control edge."""
    in_cond = resource or not tf.executing_eagerly()        # (v1 behavior: v1 cond)
    g = tf.Graph()
    with g.as_default():
        _, x, y = _arrays()
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        xs, ys = tf1.data.make_one_shot_iterator(
            (pn.shard(ds) if parallel else ds).batch(batch).repeat()).get_next()
        w = tf1.get_variable("w", initializer=np.linspace(-1, 1, 5, dtype=np.float32)[:, None])
        loss = tf.reduce_mean(tf.square(tf.matmul(xs, w) - ys))
        opt, step = tf1.train.MomentumOptimizer(0.05, 0.9), tf1.train.get_or_create_global_step()
        (grad, _), = opt.compute_gradients(loss, [w])
        accum = tf1.Variable(tf.zeros(w.shape), trainable=False, name="accum",
                             use_resource=resource)
        with tf.control_dependencies([accum.assign_add(grad)]):
            count = step.assign_add(1)
        k = 2 if in_cond else 1

        def apply():
            with tf.control_dependencies([opt.apply_gradients([(accum / float(k), w)])]):
                with tf.control_dependencies([accum.assign(tf.zeros_like(accum))]):
                    return tf.constant(1)
        done = tf.cond(tf.equal(count % 2, 0), apply, lambda: tf.constant(0)) if in_cond \
            else apply()
        tf.identity(done, "train")
    return g


@pytest.mark.parametrize("run_option,resource", [("allreduce", True), ("ps", True),
                                                 ("allreduce", False), ("ps", False)])
def test_accumulated_gradients_applied_in_the_run_that_adds_equal_one_device(run_option,
                                                                             resource):
    """An accumulated gradient applied in the run that adds to it, in a
    tf.cond's branch every second run or after the add every run: 7 runs
    of 2 replicas (8 rows each) equal one device with 16 (1e-6), and the
    accumulator read alone then (a run that adds nothing: its snapshot too)
    is one device's. Before: the cond's refused, "found no optimizer
    update", because importing the graph to lower the cond added a Saver
    whose restore ops wrote the accumulator, so it was no accumulator (it
    is imported without one); and a reference accumulator's snapshot, its
    gradient, was aggregated without waiting for the run's add: under
    disable_v2_behavior with a v1 cond (tests/test_v1_behavior.py runs
    this file so) the weights 0.34 apart, silently. Its aggregation now
    waits for the add (transforms/aggregate.py)."""
    g = _applied_after_adds(8, resource)
    names = ["w", "accum", "w/Momentum", "global_step"]
    alone = [] if resource else ["accum/read:0"]
    with pn.get_runner(g, local(2), {"run_option": run_option}) as runner:
        runner.run([v.initializer for v in g.get_collection("variables")])
        for _ in range(7):
            runner.run("train")
        got = runner.run([read_name(n, g) for n in names]) + [runner.run(t) for t in alone]
    g1 = _applied_after_adds(16, resource, parallel=False)
    assert not [op.name for op in frontend.load(g1).graph.get_operations()
                if op.name.startswith("save")]
    with tf1.Session(graph=g1) as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(7):
            sess.run("train")
        want = sess.run([read_name(n, g1) for n in names]) + [sess.run(t) for t in alone]
    names += alone
    for name, a, b in zip(names, got, want):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=name)
