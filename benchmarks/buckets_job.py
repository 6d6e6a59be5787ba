"""Benchmark: all-reduce buckets on a localhost job, measured and predicted.

A model of many small layers (a stack of transformer-like blocks: query,
key, value and output projections, two layer norms, a two-layer
feed-forward; small widths, dense inputs, so every gradient is all-reduced)
trains on a localhost job (--workers x --devices, TensorFlow collectives)
with buckets.mode none, single, threshold and mgwfbp (a and b measured by
the job's own benchmark). First `parallax-ng profile --per-variable` gives
the job's profile (worker 0's steps, a layer per variable as the planner's
buckets see them) and the all-reduce fit; the simulator's prediction from
it (wfbp for none) stands beside each measured step time (median of the
timed steps of worker 0, after warm-up steps; each mode --repeats jobs, the
median of those), with the prediction's error.

    python benchmarks/buckets_job.py [--blocks 24] [--dim 32] [--steps 40] [--repeats 2]
                                     [--netlab RATE]

With --netlab RATE (e.g. 100mbit, 1gbit) the workers run on emulated hosts
with rate-limited NICs (../shared/tools/netlab, or $NETLAB), profile too,
and the bytes each host's NIC sent over the timed steps are printed beside
the ring all-reduce's 2(N-1)/N x gradient bytes per worker per step.

Run as a worker (by the jobs this script starts) with --worker.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

import parallax_ng as pn
from cluster_lm import NETLAB, nic_window   # the NIC window protocol of that benchmark
from transform_time import dense, layer_norm   # the same layers as the transform benchmark

tf1 = tf.compat.v1
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build(blocks, dim, seq, batch):
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        rng = np.random.RandomState(0)
        xs = rng.randn(512, seq, dim).astype(np.float32)
        ys = rng.randn(512, 1).astype(np.float32)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((xs, ys)).repeat().batch(batch))
        x, y = tf1.data.make_one_shot_iterator(ds).get_next()
        h = x
        for k in range(blocks):
            with tf1.variable_scope(f"block_{k}"):
                q, kk, v = (dense(h, n, dim, dim) for n in ("query", "key", "value"))
                att = tf.nn.softmax(tf.matmul(q, kk, transpose_b=True) / np.sqrt(dim))
                h = layer_norm(h + dense(tf.matmul(att, v), "output", dim, dim), "ln1", dim)
                ff = dense(tf.nn.relu(dense(h, "ff1", dim, 4 * dim)), "ff2", 4 * dim, dim)
                h = layer_norm(h + ff, "ln2", dim)
        loss = tf.reduce_mean(tf.square(dense(tf.reduce_mean(h, 1), "out", dim, 1) - y))
        train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, train, init


def worker(opts):
    """Train; worker 0 writes its median step time to --out. With --window it
    first writes OUT.start and waits for OUT.go (the driver reads the NICs)."""
    g, train, init = build(opts.blocks, opts.dim, opts.seq, opts.batch)
    runner = pn.get_runner(g, None, None)
    runner.run(init)
    times = []
    for step in range(opts.warmup + opts.steps):
        if step == opts.warmup and opts.window and runner.plan.worker == 0:
            open(opts.out + ".start", "w").close()
            while not os.path.exists(opts.out + ".go"):
                time.sleep(0.005)
        start = time.perf_counter()
        runner.run(train)
        if step >= opts.warmup:
            times.append(time.perf_counter() - start)
    if runner.plan.worker == 0:
        with open(opts.out, "w") as f:
            json.dump({"step_ms": 1e3 * statistics.median(times),
                       "buckets": len(runner.plan.buckets),
                       "variables": len(runner.plan.variables)}, f)
    runner.close()


CRASHES = []      # jobs that failed and were run again, reported at the end


def cli(*args, timeout=900, tries=2):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    for _ in range(tries):
        done = subprocess.run([sys.executable, "-m", "parallax_ng", *args], text=True,
                              capture_output=True, timeout=timeout, env=env)
        if not done.returncode:
            return done.stdout
        CRASHES.append(f"parallax-ng {' '.join(args[:1])}: " + done.stderr.strip()[-300:])
    raise SystemExit(f"parallax-ng {args[0]} failed:\n{done.stderr[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--threshold", type=int, default=64 * 1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--netlab", metavar="RATE", help="emulated hosts, NICs at RATE")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--window", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        return worker(opts)
    if opts.netlab:
        subprocess.run([NETLAB, "up", str(opts.workers), opts.netlab], check=True,
                       capture_output=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            measure(opts, tmp)
    finally:
        if opts.netlab:
            subprocess.run([NETLAB, "down"], capture_output=True)
    for crash in CRASHES:
        print(f"run again after a failure: {crash}")


_ports = iter(range(41000, 50000, 10))


def resource_file(opts, path: str) -> str:
    """Localhost, or the emulated hosts (fresh ports for every job)."""
    devices = ", ".join(f"cpu:{k}" for k in range(opts.devices))
    if opts.netlab:
        port = next(_ports)
        hosts = [f"10.254.0.{10 + i}:{port + 2 * i}" for i in range(opts.workers)]
    else:
        hosts = ["127.0.0.1"] * opts.workers
    with open(path, "w") as f:
        f.write("hosts:\n" + "".join(f"- address: {h}\n  devices: [{devices}]\n"
                                     for h in hosts))
        if opts.netlab:
            f.write(f"ssh: {NETLAB} ssh\n")
    return path


def job(opts, tmp, config, model, name) -> dict:
    """One training job; worker 0's result, with the NICs' bytes per step."""
    out = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, "-m", "parallax_ng", "run", __file__, "-r",
           resource_file(opts, os.path.join(tmp, f"{name}.yaml")), "-c", config,
           "--chief-only", "--", "--worker", "--out", out, "--steps", str(opts.steps),
           "--warmup", str(opts.warmup), *model] + (["--window"] if opts.netlab else [])
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    for _ in range(2):
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                    env=env)
            nic = nic_window(out, proc) if opts.netlab else None
            if proc.wait(timeout=1800) == 0:
                break
            log.seek(0)
            CRASHES.append(f"{name}: " + log.read().strip()[-300:])
    else:
        raise SystemExit(f"{name} failed twice:\n{CRASHES[-1]}")
    with open(out) as f:
        result = json.load(f)
    if nic is not None:
        result["sent_per_step"] = {h: b / opts.steps for h, b in sorted(nic.items())}
    return result


def measure(opts, tmp):
    model = ["--blocks", str(opts.blocks), "--dim", str(opts.dim), "--seq", str(opts.seq),
             "--batch", str(opts.batch)]
    base = {"run_option": "allreduce", "communication": {"timeout_seconds": 300}}
    config = os.path.join(tmp, "config.yaml")
    with open(config, "w") as f:
        json.dump(base, f)
    profile = os.path.join(tmp, "profile.json")
    cli("profile", __file__, "-r", resource_file(opts, os.path.join(tmp, "profile.yaml")),
        "-c", config, "--steps", "3", "--per-variable", "--out", profile, "--", "--worker",
        *model)
    with open(profile) as f:
        data = json.load(f)
    fit = data["allreduce"]
    strategies = {"none": "wfbp", "single": "single",
                  "threshold": f"threshold:{opts.threshold}", "mgwfbp": "mgwfbp"}
    predicted = json.loads(cli("simulate", "--profile", profile, "--strategies",
                               ",".join(strategies.values()), "--json"))["strategies"]
    compute = data["forward_time"] + sum(x["backward_time"] for x in data["layers"])
    total = sum(x["bytes"] for x in data["layers"])
    print(f"{opts.workers} workers x {opts.devices} device(s)"
          f"{' on netlab hosts at ' + opts.netlab if opts.netlab else ' on localhost'}, "
          f"{opts.blocks} blocks, dim {opts.dim}: {len(data['layers'])} variables, "
          f"{total / 1e6:.2f} MB of gradients; "
          f"worker 0's step without communication {compute * 1e3:.1f} ms")
    print(f"job's all-reduce fit: a = {fit['a'] * 1e6:.0f} us, b = {fit['b'] * 1e9:.3f} "
          f"ns/byte, error rms {fit['rms_relative_error']:.0%}, "
          f"largest {fit['max_relative_error']:.0%}")
    ring = 2 * (opts.workers - 1) / opts.workers * total
    print(f"{'mode':10} {'buckets':>8} {'measured ms':>12} {'predicted ms':>13} "
          f"{'error':>7}  jobs" + ("  MB sent per step per host (ring model "
                                   f"{ring / 1e6:.3f})" if opts.netlab else ""))
    for mode, strategy in strategies.items():
        with open(config, "w") as f:
            json.dump({**base, "buckets": {"mode": mode, "bytes": opts.threshold}}, f)
        runs = [job(opts, tmp, config, model, f"{mode}-{r}") for r in range(opts.repeats)]
        measured = statistics.median(r["step_ms"] for r in runs)
        guess = predicted[strategy]["iteration_time"] * 1e3
        sent = "  " + ", ".join(f"{b / 1e6:.3f}" for b in runs[0]["sent_per_step"].values()) \
            if opts.netlab else ""
        print(f"{mode:10} {runs[0]['buckets'] or runs[0]['variables']:8d} "
              f"{measured:12.1f} {guess:13.1f} {(guess - measured) / measured:+7.0%}  "
              + ", ".join(f"{r['step_ms']:.1f}" for r in runs) + sent, flush=True)


if __name__ == "__main__":
    main()
