"""Ported TF1 tutorials (tests/tutorials.py) under every run option, in-process
and as two-worker jobs of scripts that call disable_v2_behavior(): every
variable and slot equals one device with the global batch (1e-5 after 6
steps), where the math allows (see README: dropout, NCE negatives).

In-process, mnist runs in float64 (1e-12): its replicas' convolutions run
side by side, where the kernels' float32 sums are not reproducible from run
to run (oneDNN's, and Eigen's too, a few 1e-7 under load), and a relu or
max pool near a tie turns such a rounding into a different gradient: once
in CI, 2.8e-5 after 6 steps of Adam. Its jobs (one replica per process)
stay float32."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import load_values, local, read_name
from task_env import TASK_PATH
from tutorials import (BATCH, MODELS, build, config, ptb_windows, single_windows,
                       start_queue_runners, train)

tf1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, TOL = 6, 1e-5
IN_PROCESS = {"mnist": {"dtype": tf.float64}}    # see above
OPTIONS = ["hybrid", "allreduce", "ps"]
# every model under every option; DeepFM's tables also by alltoall and auto
CASES = [(m, o) for m in MODELS for o in OPTIONS] + [("deepfm", "alltoall"),
                                                     ("deepfm", "auto")]
# as two-worker jobs: every model with its servers (hybrid), DeepFM's tables
# by alltoall and auto, and allreduce and ps once each (a job's collectives
# and server protocol are crossed with every plan in test_cluster.py; the
# in-process cases above cross every model with every option) -- CI time
JOB_CASES = [(m, "hybrid") for m in MODELS] + [("deepfm", "alltoall"), ("deepfm", "auto"),
                                               ("ptb", "allreduce"), ("word2vec", "ps")]


def global_variables(graph):
    return [v.op.name for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)]


def one_device(model, replicas, start, **kwargs):
    """Train the model with the global batch on one device from `start`."""
    if model == "ptb":
        kwargs["windows"] = single_windows(ptb_windows(STEPS * replicas, BATCH), replicas)
    graph, h = build(model, BATCH * replicas, **kwargs)
    names = global_variables(graph)
    with tf1.Session(graph=graph) as sess:
        sess.run(h["init"])
        load_values(sess, graph, start)
        coord, threads = start_queue_runners(sess)
        losses = train(model, sess.run, h, STEPS, BATCH * replicas)
        coord.request_stop()
        coord.join(threads)
        return dict(zip(names, sess.run([read_name(v, graph) for v in names]))), losses


def unmet(model, sparse_method):
    """What get_runner says: for DeepFM under alltoall, what the config asks
    that the plan does not do (its [features, 1] first-order weights cannot
    be cut into columns); for ptb, that the graph does not show its loss's
    form (the windows are picked from a constant by a dequeued index: no op
    shows the batch's rows), so the gradients are averaged, as the cost,
    a sum over `batch_size`, wants."""
    if model == "ptb":
        return ["the graph does not show whether the loss 'Model/truediv:0' is a mean or a "
                "sum over the batch (an op between it and the data hides the batch's rows); "
                "the replicas' gradients are averaged, which equals one device for a mean. "
                "For a sum, set config average_dense and average_sparse: false (summed)"]
    if sparse_method != "alltoall":
        return []
    return ["feature_bias: sparse_method alltoall not used (alltoall cuts 'feature_bias' "
            "into one part of its 1 columns per replica, but the job has 2 replicas; use ps "
            "or allgather for 'feature_bias'); it goes by allgather"]


def in_process(model, n, cfg, tmp_path):
    kwargs = dict(IN_PROCESS.get(model, {}))
    if model == "ptb":
        kwargs["windows"] = ptb_windows(STEPS * n, BATCH)
    if model == "ptb":     # the tutorial trains from its exported MetaGraphDef
        kwargs["meta_path"] = str(tmp_path / "ptb.meta")
    source, h = build(model, BATCH, **kwargs)
    with pn.get_runner(source, local(n), cfg) as runner:
        if tf1.resource_variables_enabled():
            assert runner.plan.unmet() == unmet(model, cfg.get("sparse_method"))
            if cfg.get("sparse_method") == "alltoall":
                assert runner.plan.variables["feature_embeddings"].method == "alltoall"
        else:       # disable_v2_behavior: tf.Variable makes reference variables
            assert all("is a reference variable" in line or line in unmet(model, None)
                       for line in runner.plan.unmet())
        graph = runner.ctx.tg.graph
        names = global_variables(graph)
        reads = [read_name(v, graph) for v in names]
        runner.run(h["init"])
        start = dict(zip(names, runner.run(reads)))
        losses = train(model, runner.run, h, STEPS, BATCH * n)
        return dict(zip(names, runner.run(reads, per_replica=True))), start, losses


def assert_equal_to_one_device(parallel, single, copies, tol=TOL):
    assert set(parallel) == set(single) and len(single) >= 3
    for name, want in single.items():
        assert len(parallel[name]) == copies
        for k, got in enumerate(parallel[name]):
            diff = np.max(np.abs(np.asarray(got) - want))
            assert diff <= tol, f"{name} on replica {k}: max abs diff {diff}"


@pytest.mark.parametrize("model,run_option", CASES)
def test_tutorial_in_process_equals_one_device(tmp_path, model, run_option):
    parallel, start, losses = in_process(model, 2, config(model, run_option), tmp_path)
    single, single_losses = one_device(model, 2, start, **IN_PROCESS.get(model, {}))
    assert_equal_to_one_device(parallel, single, 2, 1e-12 if model in IN_PROCESS else TOL)
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5, atol=1e-6)


def test_word2vec_with_distinct_negatives_trains_but_is_not_one_device(tmp_path):
    """`random: distinct`: every replica draws its own NCE negatives, a
    different (as valid) estimate of the loss than one device's single draw."""
    parallel, start, losses = in_process("word2vec", 2, {"run_option": "hybrid",
                                                          "random": "distinct"}, tmp_path)
    single, _ = one_device("word2vec", 2, start)
    assert np.max(np.abs(parallel["nce_weights"][0] - single["nce_weights"])) > 1e-3
    np.testing.assert_array_equal(parallel["nce_weights"][0], parallel["nce_weights"][1])
    assert np.all(np.isfinite(losses))


def run_job(tmp_path, model, run_option, workers=2):
    res = tmp_path / "resources.yaml"
    res.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * workers
                   + ("ps: [127.0.0.1]\n" if run_option not in ("allreduce", "alltoall")
                      else ""))
    out = str(tmp_path / "vars")
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run",
         os.path.join(ROOT, "tests", "tutorial_job.py"), "-r", str(res), "--",
         model, out, str(STEPS), run_option, str(workers)]
        + (["v2"] if model == "deepfm" else []),
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-4000:]
    if run_option == "alltoall":
        assert "'feature_embeddings': 'alltoall'" in done.stdout, done.stdout
    said = [line.split("parallax_ng: ", 1)[1] for line in done.stderr.splitlines()
            if "parallax_ng: " in line and "on the parameter servers; they stop" not in line]
    assert said == unmet(model, run_option), done.stderr       # once per job, worker 0
    with np.load(f"{out}.init.npz") as d:
        start = {k: d[k] for k in d.files}
    parallel = {}
    for w in range(workers):
        with np.load(f"{out}.{w}.npz") as d:
            for key in d.files:
                parallel.setdefault(key.split("#")[0], []).append(d[key])
    return parallel, start


@pytest.mark.parametrize("model,run_option", JOB_CASES)
def test_tutorial_two_worker_job_equals_one_device(tmp_path, model, run_option):
    parallel, start = run_job(tmp_path, model, run_option)
    single, _ = one_device(model, 2, start)
    assert_equal_to_one_device(parallel, single, 2)
