"""Reference variables (VariableV2), as scripts that call
tf.compat.v1.disable_v2_behavior() build them."""
import os
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import forked
from models import OPTIMIZERS, embedding_regression, train_both, train_single
from parallax_ng.graph import frontend
from task_env import TASK_PATH

tf1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def v1_variables():
    tf1.disable_resource_variables()
    tf1.disable_control_flow_v2()
    yield
    tf1.enable_resource_variables()
    tf1.enable_control_flow_v2()


def test_front_end_finds_reference_variables(v1_variables):
    tg = frontend.load(embedding_regression(4, "adam", clip=True, ema=True)[0])
    assert tg.ir.node("emb").op == "VariableV2"
    assert tg.gradients["emb"].sparse and not tg.gradients["dense/w"].sparse
    assert tg.variables["emb/Adam"].owner == "emb"
    assert "Adam/update_emb/ScatterAdd" in tg.writers["emb/Adam"]
    assert "emb/read" in tg.readers["emb"]
    # ops reading a slot through the output of the scatter that wrote it
    assert any(tg.ir.node(r).op == "Sqrt" for r in tg.readers["emb/Adam_1"])
    # the `read` Identity aliases the buffer: the ops behind it read too
    assert {"beta1_power/read", "Adam/update_dense/w/ApplyAdam"} <= set(tg.reads("beta1_power"))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("run_option", ["hybrid", "allreduce", "ps"])
def test_reference_variables_match_one_device(v1_variables, optimizer, run_option):
    def build(batch):
        return embedding_regression(batch, optimizer, clip=True, ema=True)
    parallel, single, names = train_both(build, 2, 10, config={"run_option": run_option})
    assert len(names) >= 9
    for name in names:
        for k, got in enumerate(parallel[name]):
            assert np.max(np.abs(got - single[name])) <= 1e-5, (name, k)


SCRIPT = textwrap.dedent("""
    import numpy as np
    import tensorflow.compat.v1 as tf
    import parallax_ng as pn
    tf.disable_v2_behavior()

    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    w = tf.Variable(tf.zeros([3, 1]), name="w")
    b = tf.Variable(tf.zeros([1]), name="b")
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
    train = tf.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
    runner = pn.get_runner(tf.get_default_graph(),
                           {"hosts": [{"devices": ["cpu:0", "cpu:1"]}]})
    runner.run(tf.global_variables_initializer())
    rng = np.random.RandomState(0)
    xs = rng.randn(64, 3).astype(np.float32)
    ys = xs @ np.array([[1.0], [-2.0], [3.0]], np.float32) + 0.5
    for _ in range(300):
        runner.run(train, {x: xs, y: ys})
    print("w", np.round(runner.run(w).ravel(), 2), "b", np.round(runner.run(b), 2))
""")


def test_plain_v1_script_with_default_graph_and_feeds(tmp_path):
    path = tmp_path / "v1_script.py"
    path.write_text(SCRIPT)
    done = forked.run([sys.executable, str(path)], timeout=300,
                      env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "w [ 1. -2.  3.] b [0.5]" in done.stdout


@pytest.mark.parametrize("run_option,devices,dense", [
    ("hybrid", 2, "allreduce"), ("hybrid", 1, "bfb"), ("ps", 1, "auto")])
def test_adam_on_a_server_in_a_job_of_v1_scripts(tmp_path, v1_variables, run_option, devices,
                                                 dense):
    """Two workers of a script that calls disable_v2_behavior(): Adam's sparse
    update of a reference variable scales `m` through its ScatterAdd's
    output; on the non-chief worker that chain only feeds silenced writers
    (and, with two replicas, replica 1's copy of the update math feeds
    nothing). Hybrid's dense variables by all-reduce (a step of two session
    runs at once) and by fusion buffers."""
    from test_cluster import load, run_job
    done, out, _ = run_job(tmp_path, 2, devices, "10", "--run-option", run_option, "--v1",
                           "--dense-method", dense, servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    single = train_single(*embedding_regression(8 * devices, "adam", clip=True, ema=True), 10)
    parallel = load(out, 2)
    assert set(parallel) == set(single)
    for name, copies in parallel.items():
        for got in copies:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name
