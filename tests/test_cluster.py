"""Multi-process jobs on 127.0.0.1: real worker processes with gRPC servers,
collectives across processes, started and stopped by `parallax-ng run`."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from models import embedding_regression, train_single
from parallax_ng import cluster
from parallax_ng.tools import launch
from parallax_ng.errors import ResourceError
from parallax_ng.resources import load_resources
from task_env import TASK_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "cluster_script.py")


def resources(tmp_path, workers, devices, servers=0):
    path = tmp_path / "resources.yaml"
    listed = ", ".join(f"cpu:{k}" for k in range(devices))
    hosts = f"  - address: 127.0.0.1\n    devices: [{listed}]\n" * workers
    if servers == "per_host":
        ps = "ps: per_host\n"
    else:
        ps = f"ps: [{', '.join(['127.0.0.1'] * servers)}]\n" if servers else ""
    path.write_text("hosts:\n" + hosts + ps)
    return str(path)


def run_job(tmp_path, workers, devices, *args, timeout=300, servers=0):
    out = str(tmp_path / "vars")
    cmd = [sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r",
           resources(tmp_path, workers, devices, servers), "--", out, *args]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    return done, out, time.monotonic() - start


def load(out, workers):
    values = {}
    for t in range(workers):
        with np.load(f"{out}.{t}.npz") as d:
            for key in d.files:
                values.setdefault(key.split("#")[0], []).append(d[key])
    return values


def test_one_worker_job_uses_its_server(tmp_path):
    """One worker (2 devices) and a server: the embedding lives on the server."""
    done, out, _ = run_job(tmp_path, 1, 2, "10", "--run-option", "hybrid", servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    single = train_single(*embedding_regression(8, "adam", clip=True, ema=True), 10)
    parallel = load(out, 1)
    for name, copies in parallel.items():
        for got in copies:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name


PLANS = [("allreduce", 0, "auto"), ("hybrid", 1, "bfb"), ("hybrid", 2, "bfb"),
         ("hybrid", 1, "allreduce"), ("hybrid", 2, "allreduce"), ("hybrid", 1, "auto"),
         ("ps", 1, "auto"), ("ps", 2, "auto")]
# every plan with two devices per worker (local aggregation first); one device
# each for a covering few (the ring, a server per buffer shard, ps, and ids the
# Horovod environment of .ci/run selects)
ONE_DEVICE = [("allreduce", 0, "auto"), ("hybrid", 2, "bfb"), ("hybrid", 1, "allreduce"),
              ("ps", 2, "auto")]


@pytest.mark.parametrize("workers,devices,run_option,servers,dense",
                         [(2, 2, *p) for p in PLANS] + [(2, 1, *p) for p in ONE_DEVICE])
def test_workers_match_one_device(tmp_path, workers, devices, run_option, servers, dense):
    """Adam, gradients clipped by their global norm (dense and sparse), EMA of
    every weight, 10 steps: every variable and slot on every replica of every
    worker within 1e-5 of one device with the total batch. Hybrid's dense
    variables by fusion buffers, by all-reduce (the step's collectives in a
    session run of their own beside the server work's) and by the plan the
    links favour (every worker weighs the same measurements alike)."""
    done, out, _ = run_job(tmp_path, workers, devices, "10", "--run-option", run_option,
                           "--dense-method", dense, servers=servers)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_matches_one_device(out, workers, devices)
    if run_option == "hybrid" and dense == "bfb":
        packed = [line.split("buffers packed ", 1)[1] for line in done.stdout.splitlines()
                  if "buffers packed" in line]
        assert len(packed) == workers and len(set(packed)) == 1, packed
        assert "measured in worker 0's first step" in packed[0]
    if run_option == "hybrid" and dense == "allreduce":
        for w in range(workers):
            assert f"worker {w}: 2 session run(s) at once per step" in done.stdout
    if run_option == "hybrid" and dense == "auto":
        chose = [line.split("chose ", 1)[1] for line in done.stdout.splitlines()
                 if ": chose " in line]
        assert len(chose) == workers and len(set(chose)) == 1, chose


def assert_matches_one_device(out, workers: int, devices: int, clip: bool = True,
                              steps: int = 10) -> None:
    """Every variable and slot of every replica of a `steps`-step job of
    cluster_script.py (Adam, clipping unless `clip` is off, EMA) within 1e-5
    of one device."""
    parallel = load(out, workers)
    single = train_single(*embedding_regression(4 * workers * devices, "adam",
                                                clip=clip, ema=True), steps)
    assert set(parallel) == set(single)
    for name, copies in parallel.items():
        assert len(copies) == workers * devices
        for got in copies:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name


# GradientDescent in every mode (its sparse writer reads the indices
# directly), every other optimizer in one of them: each optimizer and each
# mode once at least, in 6 jobs (the in-process suites cross them all).
# embedding_lookup_sparse (each distinct id once in one device's gradient):
# the chief sums the workers' rows by id on the server before the norm and
# the update (transforms/server_sync.py)
@pytest.mark.parametrize("optimizer,run_option,dense,lookup", [
    ("sgd", "hybrid", "bfb", "gather"), ("sgd", "hybrid", "allreduce", "gather"),
    ("sgd", "ps", "auto", "gather"), ("momentum", "hybrid", "bfb", "gather"),
    ("adagrad", "hybrid", "allreduce", "gather"), ("rmsprop", "ps", "auto", "gather"),
    ("adagrad", "hybrid", "bfb", "sparse")])
def test_every_optimizer_with_clipping_on_a_server(tmp_path, optimizer, run_option, dense,
                                                   lookup):
    """Gradients clipped by their global norm with the embedding on a server:
    the other workers take back the job's sparse values for the norm, and
    their silenced sparse writers (GradientDescent's ScatterAdd reads the
    indices directly) stay no-ops; with the dense gradients all-reduced, the
    norm crosses from the collective run to the server run of each step.
    Adam: test_workers_match_one_device."""
    done, out, _ = run_job(tmp_path, 2, 1, "10", "--run-option", run_option,
                           "--dense-method", dense, "--optimizer", optimizer,
                           "--lookup", lookup, servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    single = train_single(*embedding_regression(8, optimizer, clip=True, ema=True,
                                                lookup=lookup), 10)
    parallel = load(out, 2)
    assert set(parallel) == set(single)
    for name, copies in parallel.items():
        for got in copies:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name


def test_random_initial_values_are_broadcast_from_worker_0(tmp_path):
    done, out, _ = run_job(tmp_path, 2, 1, "0", "--random-init")
    assert done.returncode == 0, done.stderr[-3000:]
    w = load(out, 2)["w"]
    assert np.std(w[0]) > 0.05
    np.testing.assert_array_equal(w[0], w[1])


def test_a_dying_worker_ends_the_job_with_its_name(tmp_path):
    done, _, seconds = run_job(tmp_path, 2, 1, "50", "--die-at", "3", timeout=120)
    assert done.returncode != 0
    assert "worker 1" in done.stderr and "exited with code 3" in done.stderr
    assert seconds < 60


PRINTING = """
import numpy as np, tensorflow as tf
import parallax_ng as pn
g = tf.Graph()
with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 2])
    w = tf.compat.v1.get_variable("w", [2, 1])
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    init = tf.compat.v1.global_variables_initializer()
runner = pn.get_runner(g)
runner.run(init)
for step in range(40):
    _, value = runner.run([train, loss], {x: np.ones([4, 2], np.float32)})
    print(f"step {step} loss {value:.6f}", flush=True)
"""


TWO_STEPS = """
import numpy as np, tensorflow as tf
import parallax_ng as pn
for i in range(2):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        w = tf.compat.v1.get_variable("w", [2, 1])
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.matmul(x, w)))
        init = tf.compat.v1.global_variables_initializer()
    runner = pn.get_runner(g)
    runner.run(init)
    runner.run(train, {x: np.ones([4, 2], np.float32)})
    print(f"trained graph {i}", flush=True)
"""


def test_a_second_step_in_a_jobs_task_is_refused_naming_why(tmp_path):
    """A script that builds a second runner in a job's task (a second
    graph, model or pn.function): a task's server serves its first step.
    The error says so and what to do; before, it read "could not start its
    server ... another process holds the port", which sent users after
    another process."""
    from task_env import run_script_job
    done = run_script_job(tmp_path, TWO_STEPS)
    assert done.returncode != 0
    assert "[worker 0] trained graph 0" in done.stdout and "graph 1" not in done.stdout
    assert "already runs a step" in done.stderr and "a job of its own" in done.stderr
    assert "another process holds the port" not in done.stderr


def test_task_output_is_labelled_whole_and_free_of_harmless_noise(tmp_path):
    script = tmp_path / "printing.py"
    script.write_text(PRINTING)
    res = resources(tmp_path, 2, 1)
    env = dict(os.environ, PYTHONPATH=TASK_PATH)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)    # TensorFlow's default logging
    done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", str(script),
                           "-r", res], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for w in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[worker {w}] ")]
        assert [ln.split()[3] for ln in mine] == [str(s) for s in range(40)]
    assert all(re.fullmatch(r"\[worker [01]\] step \d+ loss \d+\.\d{6}", ln) for ln in lines)
    assert "Cleanup" not in done.stderr and "cpu_feature_guard" not in done.stderr
    # the default plan times its first steps with traced runs: TensorFlow's
    # profiler sessions say nothing, nor a CPU-only trace's warning
    assert "Profiler session" not in done.stderr
    assert "GPU trace was not collected" not in done.stderr, done.stderr[-3000:]
    assert "DeleteWorkerSession" not in done.stderr and "deprecated" not in done.stderr
    # --chief-only: worker 1 is silent
    done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", str(script),
                           "-r", res, "--chief-only"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and "[worker 1]" not in done.stdout + done.stderr
    assert done.stdout.count("[worker 0] step") == 40


def test_chief_only_shows_the_last_lines_of_a_failing_worker(tmp_path):
    out = str(tmp_path / "vars")
    done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r",
                           resources(tmp_path, 2, 1), "--chief-only", "--", out, "50",
                           "--die-at", "3"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode != 0
    said = done.stderr.index("worker 1 (pid")
    assert done.stderr.index("[worker 1] worker 1 dies at step 3") > said


def test_a_worker_listing_a_missing_gpu_ends_the_job_in_seconds(tmp_path):
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n  - address: 127.0.0.1\n    devices: [cpu:0]\n"
                   "  - address: 127.0.0.1\n    devices: [gpu:99]\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r",
                           str(res), "--", str(tmp_path / "vars"), "3"], capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode != 0 and time.monotonic() - start < 60
    assert "lists gpu:99 on worker 1" in done.stderr


def test_hybrid_without_parameter_servers_gathers_sparse_gradients_and_says_so(tmp_path):
    """A resource file without `ps:`: the embedding's gradients go by
    all-gather, said once (worker 0), and the job equals one device."""
    done, out, _ = run_job(tmp_path, 2, 1, "10", "--run-option", "hybrid")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("so sparse gradients go by all-gather") == 1, done.stderr
    assert_matches_one_device(out, 2, 1)


@pytest.mark.parametrize("dense", ["bfb", "allreduce"])
def test_hybrid_with_a_server_runs_600_steps_in_step(tmp_path, dense):
    """Dense variables by fusion buffers (one run per step, no collectives),
    or by all-reduce with collectives and parameter-server work in two
    session runs of each step at once: a long run never hits TensorFlow's
    step-id cleanup abort, and the workers' mirrored copies stay
    bit-identical."""
    done, out, _ = run_job(tmp_path, 2, 1, "600", "--run-option", "hybrid",
                           "--dense-method", dense, servers=1, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, copies in load(out, 2).items():
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=name)


def test_cluster_plan_and_bad_resources(tmp_path):
    workers, ps = launch.plan_cluster(load_resources(resources(tmp_path, 2, 1)))
    assert len(workers) == 2 and len(set(workers)) == 2 and ps == []
    assert all(w.startswith("127.0.0.1:") for w in workers)
    uneven = {"hosts": [{"devices": ["cpu:0"]}, {"devices": ["cpu:0", "cpu:1"]}]}
    with pytest.raises(ResourceError, match="same number of devices"):
        launch.plan_cluster(load_resources(uneven))
    remote = {"hosts": [{"address": "10.0.0.5", "devices": ["cpu:0"]}]}
    with pytest.raises(ResourceError, match="give its port"):
        launch.plan_cluster(load_resources(remote))
    with pytest.raises(ResourceError, match="launch"):
        load_resources({"hosts": [{"devices": ["cpu:0"], "launch": "rsh"}]})


def test_remote_command_line():
    argv = launch.remote_command("ssh -o BatchMode=yes", "node7:2222",
                                 ["/usr/bin/python3", "train.py", "--name", "a b"],
                                 {"PARALLAX_NG_CLUSTER": '{"task": 1}', "HOME": "/root"})
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "node7"]
    assert "PARALLAX_NG_CLUSTER=" in argv[4] and "HOME" not in argv[4]
    assert argv[4].endswith("/usr/bin/python3 train.py --name 'a b'")


def test_a_worker_started_through_the_ssh_command(tmp_path):
    """A stand-in for ssh runs the remote command line on this machine."""
    fake = tmp_path / "fake-ssh"
    fake.write_text('#!/bin/sh\nshift\nexec sh -c "$1"\n')
    fake.chmod(0o755)
    port = launch._with_port("127.0.0.1").rpartition(":")[2]
    res = tmp_path / "r.yaml"
    res.write_text(f"ssh: {fake}\nhosts:\n"
                   "  - address: 127.0.0.1\n    devices: [cpu:0]\n"
                   f"  - address: 127.0.0.1:{port}\n    devices: [cpu:0]\n    launch: ssh\n")
    out = str(tmp_path / "vars")
    done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r",
                           str(res), "--", out, "3"], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=TASK_PATH,
                                                TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    values = load(out, 2)
    for name, (a, b) in values.items():
        np.testing.assert_array_equal(a, b)


def test_tf_config_from_an_orchestrator(monkeypatch):
    monkeypatch.delenv(cluster.ENV, raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001"],
                    "ps": ["127.0.0.1:2002"]},
        "task": {"type": "worker", "index": 0}}))
    res = load_resources({"hosts": [{"devices": ["cpu:0"]}, {"devices": ["cpu:0", "cpu:1"]}]})
    info = cluster.from_env(res)
    assert info.task == 1 and info.task_type == "worker"       # the chief is worker 0
    assert info.workers == ("127.0.0.1:2000", "127.0.0.1:2001")
    assert info.devices == (("CPU", 0), ("CPU", 1))
    assert info.device_strings()[1] == "/job:worker/replica:0/task:1/device:CPU:1"
    assert info.session_config().experimental.collective_group_leader == \
        "/job:worker/replica:0/task:0"
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {}, "task": {}}))
    with pytest.raises(ResourceError, match="TF_CONFIG"):
        cluster.from_env()


@pytest.mark.parametrize("victim", ["worker 1", "ps 0"])
def test_killing_any_task_stops_every_process_within_60s(tmp_path, victim):
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2
                   + "ps: [127.0.0.1]\n")
    cmd = [sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r", str(res), "--",
           str(tmp_path / "vars"), "100000", "--run-option", "hybrid",
           "--dense-method", "bfb"]   # the server in use
    job = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    pids, lines = {}, []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 3 and time.monotonic() < deadline:
            line = job.stderr.readline()
            lines.append(line)
            if "started" in line:
                name = line.split("started ")[1].split(" (pid")[0]
                pids[name] = int(line.split("(pid ")[1].split(")")[0])
        assert len(pids) == 3, "".join(lines)
        os.kill(pids[victim], 9)
        killed = time.monotonic()
        rest = job.communicate(timeout=60)[1]
        assert time.monotonic() - killed < 60
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 137      # the shell's 128 + SIGKILL
    assert f"{victim} (pid {pids[victim]}) exited with signal 9" in rest
    for name, pid in pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_servers_the_plan_does_not_use_stop_and_the_job_trains_on(tmp_path):
    """A plan with nothing on the servers (allreduce, or what hybrid may
    choose) lets them go at once: idle, they would share the CPUs."""
    done, out, _ = run_job(tmp_path, 2, 1, "10", "--run-option", "allreduce", servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("the plan puts nothing on the parameter servers; they stop") == 1
    assert_matches_one_device(out, 2, 1)


def test_a_partitioned_embedding_trains_on_two_servers(tmp_path):
    """The embedding as two row ranges (pn.partitioner), one per server."""
    done, out, _ = run_job(tmp_path, 2, 1, "10", "--run-option", "hybrid", "--partitions",
                           "2", "--dense-method", "bfb", servers=2)
    assert done.returncode == 0, done.stderr[-3000:]
    single = train_single(*embedding_regression(8, "adam", clip=True, ema=True,
                                                partitions=2), 10)
    parallel = load(out, 2)
    assert {"emb/part_0", "emb/part_1"} <= set(parallel) and set(parallel) == set(single)
    for name, copies in parallel.items():
        for got in copies:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name


@pytest.mark.parametrize("run_option", ["hybrid", "ps"])
def test_an_embedding_split_by_rows_over_two_servers(tmp_path, run_option):
    """The plan cuts the embedding (and its Adam slots) into one row range per
    server (under ps, with ps_placement rows_touched, where the rows worker
    0's first steps touched split evenly), the same cut on both workers;
    2 workers x 2 devices still equal one device."""
    by_rows = ["--config", json.dumps({"ps_placement": "rows_touched"})] \
        if run_option == "ps" else []
    done, out, _ = run_job(tmp_path, 2, 2, "10", "--run-option", run_option, "--no-ema",
                           "--dense-method", "bfb" if run_option == "hybrid" else "auto",
                           *by_rows, servers=2)
    assert done.returncode == 0, done.stderr[-3000:]
    cuts = [line.split("emb cut ", 1)[1] for line in done.stdout.splitlines()
            if "emb cut " in line]
    assert len(cuts) == 2 and cuts[0] == cuts[1] and cuts[0].startswith("sharded rows 0..")
    single = train_single(*embedding_regression(16, "adam", clip=True), 10)
    parallel = load(out, 2)
    assert set(parallel) == set(single)
    for name, copies in parallel.items():
        for got in copies:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name


@pytest.mark.parametrize("devices", [1, 2])
def test_a_table_by_alltoall_beside_dense_variables_on_a_server(tmp_path, devices):
    """The table's columns by alltoall, every dense variable on the server
    (Adam, clipping by the global norm, EMA), as `auto` may plan it: each
    worker clips its columns' update by the job's norm, so it takes the
    job's dense gradients back from the server; and the table's
    initializer, a cond whose branches read the table or take worker 0's
    broadcast, runs whole in the collective run (a branch not taken is
    dead and would leave the other run waiting). Equals one device, 1e-5."""
    config = {"variable_methods": {"emb": "alltoall"},
              "communication": {"timeout_seconds": 60}}
    done, out, _ = run_job(tmp_path, 2, devices, "10", "--run-option", "hybrid",
                           "--dense-method", "ps", "--config", json.dumps(config), servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_matches_one_device(out, 2, devices)


@pytest.mark.parametrize("servers", [0, 1])
def test_a_worker_whose_parts_others_read_ends_after_them(tmp_path, servers):
    """The table's columns by alltoall live on the workers, and reading the
    whole table reads every worker's part. Worker 0 reads the trained values
    5 s after worker 1 has read them and its program ended: worker 1's
    process waits at its end until worker 0 has reached its own
    (serving.leave_ops), so the read finds its part. Before, worker 1's
    server was gone and the read failed ("Connection refused", seen on a
    loaded machine at `step.sync()` in a TF2 job). Equals one device."""
    config = {"variable_methods": {"emb": "alltoall"},
              "communication": {"timeout_seconds": 60}}
    done, out, _ = run_job(tmp_path, 2, 1, "4", "--run-option", "hybrid", "--late-read", "5",
                           "--dense-method", "ps" if servers else "auto",
                           "--config", json.dumps(config), servers=servers)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "without every other worker" not in done.stderr
    assert_matches_one_device(out, 2, 1, steps=4)


LEAVING = """
import sys, time
import tensorflow as tf
from parallax_ng.runtime import serving
from parallax_ng.tools import launch
spec = tf.train.ClusterSpec({"worker": [launch._with_port("127.0.0.1") for _ in range(2)]})
servers = [tf.distribute.Server(spec, job_name="worker", task_index=k) for k in range(2)]
graphs = [tf.Graph() for _ in range(2)]
leave = [serving.leave_ops(graphs[k], 2, k) for k in range(2)]
sessions = [tf.compat.v1.Session(servers[k].target, graph=graphs[k]) for k in range(2)]
options = tf.compat.v1.RunOptions(timeout_in_ms=1000)
sys.last_value = RuntimeError("the program failed")
start = time.monotonic()
serving._end(sessions[0], None, leave[0], options)         # failed: leaves at once
print("failed", round(time.monotonic() - start, 1), flush=True)
del sys.last_value
sessions[1].run(leave[1][:-1])                             # worker 1 reaches its end
serving._end(sessions[0], None, leave[0], options)         # its token and worker 0's
print("together", flush=True)
start = time.monotonic()
serving._end(sessions[0], None, leave[0], options)         # again: worker 1 never comes
print("alone", round(time.monotonic() - start, 1), flush=True)
"""


def test_a_worker_leaves_when_every_worker_reached_its_end_or_at_once_on_a_failure():
    """serving.leave_ops between two workers (servers in one process): a
    process ending by an exception does not wait; one whose peer never
    comes waits for the run timeout and says so; once the peer has put its
    token in, the wait ends at once."""
    done = subprocess.run([sys.executable, "-c", LEAVING], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=TASK_PATH,
                                                TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict((line + " -").split(" ")[:2] for line in done.stdout.split("\n") if line)
    assert float(lines["failed"]) < 0.5 and 0.9 <= float(lines["alone"]) < 10, done.stdout
    assert "together" in lines and done.stderr.count("without every other worker") == 1, \
        done.stderr[-3000:]


def test_a_server_task_ends_when_its_workers_are_done(tmp_path):
    """As under an orchestrator: every task runs the script with TF_CONFIG;
    the server task's get_runner serves until both workers are done, then
    its process ends with 0 by itself. (Each task's output goes to a file:
    a pipe nobody reads while the test waits would block a task that logs
    much, and the test would hang instead of failing. A task still running
    at the deadline gets SIGABRT first, so its log ends with every
    thread's Python stack: where it hung.)"""
    ports = [launch._with_port("127.0.0.1") for _ in range(3)]
    cluster_spec = {"worker": ports[:2], "ps": ports[2:]}
    tasks = [("worker", 0), ("worker", 1), ("ps", 0)]
    procs, logs = [], [tmp_path / f"{kind}{index}.log" for kind, index in tasks]
    env = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONFAULTHANDLER="1")
    env.pop(cluster.ENV, None)
    try:
        for (kind, index), log in zip(tasks, logs):
            task_env = dict(env, TF_CONFIG=json.dumps({"cluster": cluster_spec,
                                                       "task": {"type": kind, "index": index}}))
            with open(log, "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, SCRIPT, str(tmp_path / "vars"), "5", "--run-option",
                     "hybrid"], env=task_env, stdout=err, stderr=err, text=True))
        deadline = time.monotonic() + 180
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGABRT)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=30)
    if codes != [0, 0, 0]:     # pytest.fail keeps the logs whole (an assert's repr is cut)
        pytest.fail(f"exit codes {codes} (None: still running at the deadline), ports "
                    f"{ports}\n" + "\n".join(
                        f"--- {log.name} ---\n{_without_noise(log.read_text())[-8000:]}"
                        for log, code in zip(logs, codes) if code != 0))


def _without_noise(text: str) -> str:
    """A task's log without TensorFlow's start-up lines about CUDA and oneDNN."""
    noise = ("cuInit", "cuda", "oneDNN", "absl::Init")
    return "\n".join(line for line in text.splitlines()
                     if not any(word in line for word in noise))


def test_a_waiting_server_logs_nothing_with_tensorflow_s_default_logging(tmp_path):
    """A server waits for its workers' tokens in one run it never gives up
    (a run given up every poll makes TensorFlow log four lines each time:
    about 5,400 an hour). Its worker is reachable until the server listens
    and 2 s (10 polls) more, then gone."""
    import socket
    with socket.socket() as fake_worker:
        fake_worker.bind(("127.0.0.1", 0))
        fake_worker.listen()
        worker = f"127.0.0.1:{fake_worker.getsockname()[1]}"
        server = launch._with_port("127.0.0.1")
        code = ("from parallax_ng import cluster\nfrom parallax_ng.runtime import serving\n"
                f"info = cluster.ClusterInfo(({worker!r},), ({server!r},), 'ps', 0, "
                "(('CPU', 0),))\n"
                "raise SystemExit(serving.serve(info, timeout_seconds=2, poll_seconds=0.2))\n")
        env = dict(os.environ, PYTHONPATH=TASK_PATH)
        env.pop("TF_CPP_MIN_LOG_LEVEL", None)
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE,
                                text=True, env=env)
        host, port = server.rsplit(":", 1)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(2)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 1 and "no worker has been reachable for 2 s" in err
    for noise in ("Cancellation requested", "Client requested cancellation",
                  "cancelled dequeue", "aborting with status: CANCELLED"):
        assert noise not in err, err


def test_a_server_whose_workers_never_come_gives_up_after_the_timeout(tmp_path):
    ports = [launch._with_port("127.0.0.1") for _ in range(2)]
    info = cluster.ClusterInfo((ports[0],), (ports[1],), "ps", 0, (("CPU", 0),))
    code = ("import sys\nfrom parallax_ng import cluster\n"
            "from parallax_ng.runtime import serving\n"
            f"info = cluster.ClusterInfo(*{(info.workers, info.ps, 'ps', 0, info.devices)!r})\n"
            "raise SystemExit(serving.serve(info, timeout_seconds=3, poll_seconds=0.5))\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=TASK_PATH,
                                                TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 1 and "no worker has been reachable for 3 s" in done.stderr
    assert time.monotonic() - start < 60


def test_a_worker_called_with_another_first_batch_is_told():
    """runtime/serving.py compare_batches: a TF2 step's first batch on a
    worker against worker 0's (digests: rows, shape, dtype, bytes): other
    shapes (a part of the batch, as a dataset sharded per worker gives
    it) are a ConfigError naming the argument and both shapes; other
    values (an unseeded shuffle) a warning; worker 0 and equal batches say
    nothing. The job's exchange: tests/test_tf2.py."""
    import warnings

    import parallax_ng as pn
    from parallax_ng.runtime.serving import _digest, compare_batches
    x, y = np.arange(8.0).reshape(4, 2), np.array([b"a", b"b", b"c", b"d"], dtype=object)
    first = {"parallax_input_0:0": _digest(x), "parallax_input_1:0": _digest(y)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare_batches(first, dict(first), 1)
        compare_batches(first, {"parallax_input_0:0": _digest(x[:2])}, 0)
    with pytest.raises(pn.ConfigError, match=r"argument leaf 0: \[2, 2\] against \[4, 2\].*"
                                             "sharded per worker"):
        compare_batches(first, {**first, "parallax_input_0:0": _digest(x[:2])}, 1)
    with pytest.warns(UserWarning, match=r"differs from worker 0's \(argument leaf 1\).*seed"):
        compare_batches(first, {**first, "parallax_input_1:0": _digest(y[::-1])}, 1)
