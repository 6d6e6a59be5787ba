"""Keras 3 models with the structure of Keras's own examples
(tests/keras_examples.py) under `pn.parallelize` and `model.fit`: N
replicas with the global batch equal one device, every weight, optimizer
variable and epoch log (dropout off, as one device's masks over the global
batch are not the replicas'); with dropout on they train."""
import keras
import numpy as np
import pytest

import parallax_ng as pn
import keras_examples as ex
from models import local
from test_tf2 import check_equal
from task_env import TASK_PATH

ROWS, BATCH = 64, 16           # 4 steps an epoch


def twins(name, dropout):
    keras.utils.set_random_seed(0)      # seeded weights: a run is the next one
    a = ex.MODELS[name](dropout=dropout)
    b = ex.MODELS[name](dropout=dropout)
    b.set_weights(a.get_weights())
    for m in (a, b):
        m.compile(**ex.compile_args(name))
    return a, b


@pytest.mark.parametrize("name, config", [
    ("transformer", None),
    ("recommender", None),
    ("recommender", {"run_option": "allreduce"}),
    ("convnet", None),
    ("structured", None),
    ("captcha_ocr", None),
])
def test_example_model_fit_equals_one_device(name, config):
    parallel, single = twins(name, 0.0)
    pn.parallelize(parallel, local(2), config)
    x, y = ex.data(name, ROWS)
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for key in h2.history:
        np.testing.assert_allclose(h1.history[key], h2.history[key], atol=1e-5, rtol=1e-5,
                                   err_msg=key)
    check_equal((parallel, parallel.optimizer), (single, single.optimizer), rtol=1e-5)
    if name == "recommender":      # the regularizer reads whole tables: dense gradients
        plan = parallel._parallax_ng.step.runner.plan
        sparse = {v.split("/")[-1]: vp.info.sparse for v, vp in plan.variables.items()}
        assert sparse == {"embeddings": False, "embeddings_1": True, "embeddings_2": False,
                          "embeddings_3": True}


def test_weights_set_after_fit_reach_tables_cut_by_columns():
    """The transformer's embeddings by alltoall (each replica holds its
    columns of each table): weights the program sets after `fit`
    (`set_weights`) go into the runner before `evaluate` and the next
    `fit`, each replica its columns of them (before: the whole table was
    assigned to each replica's part, "Dimension 1 in both shapes must be
    equal"). Evaluation and further training equal one device's, 1e-5."""
    parallel, single = twins("transformer", 0.0)
    pn.parallelize(parallel, local(2), {"sparse_method": "alltoall"})
    x, y = ex.data("transformer", ROWS)
    for m in (parallel, single):
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    plan = parallel._parallax_ng.step.runner.plan
    assert len(plan.columns()) == 3, plan.columns()     # a table and its 2 slots
    rng = np.random.default_rng(5)
    weights = [w + rng.normal(scale=0.1, size=w.shape).astype(w.dtype)
               for w in single.get_weights()]
    for m in (parallel, single):
        m.set_weights(weights)
    want = single.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=BATCH, verbose=0), want,
                               atol=1e-5, rtol=0)
    for m in (parallel, single):
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    check_equal((parallel, parallel.optimizer), (single, single.optimizer), rtol=1e-5)


def test_example_convnet_with_dropout_trains():
    model = ex.mnist_convnet()
    model.compile(**ex.compile_args("convnet"))
    pn.parallelize(model, local(2))
    x, y = ex.data("convnet", ROWS)
    y = np.eye(10, dtype=np.float32)[(x.mean(axis=(1, 2, 3)) * 20).astype(int) % 10]
    history = model.fit(x, y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert keras.ops.all(keras.ops.isfinite(model.weights[0]))


@pytest.mark.parametrize("case", ["hybrid", "clipnorm-ring-beside-server", "no-server"])
def test_example_transformer_in_a_two_worker_job_equals_one_device(tmp_path, case):
    """2 workers x 1 device, `model.fit` on 5 global batches of 8, then
    `evaluate` on the replicas: both workers end equal to one device, every
    weight and optimizer variable, 1e-5.
    - hybrid: a parameter server, sparse gradients pinned to `ps` (the token
      table on the server, its positions' rows summed row for row across
      the workers there; the plan weighed with the rows the first batch
      touches), each task on a loopback address of its own (so the plan
      weighs links, not one machine's loopback) and a configured 100 Mb/s
      network: the head's 16 x 20 kernel goes by its factors (4 rows a
      replica of 16 + 20 values against the ring's 320), rows the traced
      step does not know, which worker 0's first step measures.
    - clipnorm: Adam with `global_clipnorm` and the dense variables by
      all-reduce, so each step is a collective run beside a server run; the
      clipped IdentityN's output for the embedding, unread on worker 1 (its
      update is the chief's), once left a value in the queue between the
      runs and the second step waited forever.
    - no-server: the default config on two loopback addresses at a
      configured 100 Mb/s, no server: hybrid weighs the ring against the
      ring with kernels by their factors (the tables by all-gather) and
      sends the head's kernel by its factors."""
    import json
    clipnorm = case == "clipnorm-ring-beside-server"
    # but with clipping, loopback addresses of their own: hosts whose links the plan weighs
    hosts = ["127.0.0.1"] * 3 if clipnorm else ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    workers = example_job(tmp_path, hosts[:2], [] if case == "no-server" else hosts[2:],
                          "transformer", *(["--clipnorm"] if clipnorm else
                                           ["--network", "1.25e7"]),
                          *(["--default-config"] if case == "no-server" else []))
    plan = json.loads(str(workers[0]["plan"]))
    table = "token_and_position_embedding/embeddings"
    if case == "no-server":
        assert plan[table] == "allgather", plan
    else:
        assert plan[table] == "ps" and plan[table + "_1"] == "alike ps", plan
    assert clipnorm or "factors" in plan.values(), plan
    # the job's first step was measured on the first batch (the step's
    # arguments are fed), so the plan was weighed by the rows it touches
    assert case != "hybrid" or json.loads(str(workers[0]["sources"])) == {
        table: "measured", table + "_1": "measured"}
    check_example_job(workers, "transformer", clipnorm)


@pytest.mark.parametrize("case", ["ps", "alltoall_bfb"])
def test_example_bidirectional_lstm_in_a_job_with_a_server_equals_one_device(tmp_path, case):
    """IMDB's bidirectional LSTMs by `model.fit` in a job of 2 workers x 1
    device and a server (`ps`: the embedding's rows on it): a worker's push
    waits for its reads of the server's variables, and the recurrent layers
    read theirs inside their loops over time; it waits for those loops'
    exits. Before, the push waited for the reads themselves, and TensorFlow
    refused the graph ("inputs from different frames"). `alltoall_bfb`:
    the embedding by alltoall (a collective), the dense gradients by fusion
    buffers through the server, so each step is two session runs and the
    loops lie between them: they run whole in one (before: refused, "in a
    conditional branch or loop body ... both collective ops and
    parameter-server ops"), and the first step's profile reads the loop
    that run leaves out of its trace without going round it (before: at
    full CPU for good)."""
    flags = ["--dense-method", "bfb", "--sparse-method", "alltoall"] \
        if case == "alltoall_bfb" else []
    workers = example_job(tmp_path, ["127.0.0.1"] * 2, ["127.0.0.1"], "bidirectional_lstm",
                          *flags)
    check_example_job(workers, "bidirectional_lstm")


def test_example_structured_with_a_lookup_in_a_two_worker_job_equals_one_device(tmp_path):
    """The structured-data model (an IntegerLookup in the model: its table
    rebuilt in each worker's graph, graph/tables.py) by `model.fit` in a job
    of 2 workers x 1 device and the default config: both workers end equal
    to one device, every weight and optimizer variable, and evaluate alike."""
    workers = example_job(tmp_path, ["127.0.0.1"] * 2, [], "structured", "--default-config")
    check_example_job(workers, "structured")


@pytest.mark.parametrize("servers", [[], ["127.0.0.1"]], ids=["ring", "server"])
def test_example_convnet_with_synchronized_batchnorm_in_a_job_equals_one_device(tmp_path,
                                                                                servers):
    """The MNIST convnet with synchronized BatchNormalization, by
    `model.fit` in a job of 2 workers x 1 device: the layers' sums (count,
    sum, sum of squares) and their gradients' are the job's, by a
    collective op (ring) or on the server (its dense gradients summed
    there by fusion buffers, pinned: hybrid weighs them against the ring
    by the measured network, which a loaded machine changes), so both
    workers equal one device with the global batch, every weight, moving
    statistic and slot."""
    workers = example_job(tmp_path, ["127.0.0.1"] * 2, servers, "convnet_sync_bn",
                          *(["--dense-method", "bfb"] if servers else ["--default-config"]))
    import json
    methods = set(json.loads(str(workers[0]["plan"])).values())
    assert methods == {"bfb"} if servers else "bfb" not in methods, methods
    check_example_job(workers, "convnet_sync_bn")


def example_job(tmp_path, hosts, servers, name, *flags):
    """tf2_job_script.py --example NAME (5 global batches of 8) as a job
    on `hosts` (1 device each) and `servers`: each worker's saved arrays."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "resources.yaml"
    path.write_text("hosts:\n" + "".join(f"  - address: {h}\n    devices: [cpu:0]\n"
                                          for h in hosts) +
                    (f"ps: [{', '.join(servers)}]\n" if servers else ""))
    out = str(tmp_path / "vars")
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run",
         os.path.join(root, "tests", "tf2_job_script.py"), "-r", str(path), "--", out, "5",
         "--example", name, *flags], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [dict(np.load(f"{out}.{k}.npz")) for k in range(len(hosts))]


def check_example_job(workers, name, clipnorm=False):
    """One device fit from worker 0's starting weights on the job's 5
    global batches: the workers' weights, optimizer variables and
    evaluation equal its own, 1e-5."""
    import json
    model = ex.MODELS[name](dropout=0.0)
    model.set_weights([workers[0][f"start{i}"] for i in range(len(model.weights))])
    args = ex.compile_args(name)
    if clipnorm:
        args["optimizer"] = keras.optimizers.Adam(1e-3, global_clipnorm=1.0)
    model.compile(**args)
    x, y = ex.data(name, 40)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    want = model.evaluate(x, y, batch_size=8, verbose=0)     # the trained model's
    for w in workers:
        np.testing.assert_allclose(w["evaluated"], want, atol=1e-5, rtol=0)
        assert json.loads(str(w["on_model"])) == {}         # every batch on the replicas
        for i, v in enumerate(model.weights):
            np.testing.assert_allclose(w[f"w{i}"], np.asarray(v), atol=1e-5, rtol=1e-5,
                                       err_msg=v.path)
        for i, v in enumerate(model.optimizer.variables):
            np.testing.assert_allclose(w[f"o{i}"], np.asarray(v), atol=1e-5, rtol=1e-5,
                                       err_msg=v.path)
