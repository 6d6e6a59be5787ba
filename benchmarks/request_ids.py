"""Benchmark: how often TensorFlow's runtime refuses a session run that
reaches a parameter server, as "The same RunGraph (Worker) request was
received twice".

TensorFlow's master gives every RunGraph request a random id, and a
server refuses an id among the last 100,000 it took (RecentRequestIds,
tensorflow/core/distributed_runtime/worker.cc). The id comes from a
thread-local generator that a fresh thread (one per step,
Master::RunStep's SchedClosure) seeds with one 32-bit value, so ids are
32-bit random in effect: once a server holds 100,000 ids, each request
is refused with probability 100,000 / 2**32 = 2.3e-5, and the expected
refusals over R requests are about R**2 / 2**33 up to 100,000 of them.
A job with servers makes one such request per worker and step (two where
a step runs its collectives and its server work in two runs).

This starts a server task (a process of its own, on 127.0.0.1) and, in
this process, a worker whose session runs an op on the server as fast as
it can, counts the refusals, and prints them against that model.

    python benchmarks/request_ids.py [--runs 150000] [--via run|callable] [--on ps|worker]

(`--via callable`: the runs through `Session.make_callable`, which
TensorFlow's master runs as RunCallable; `--on worker`: the variable on
the worker's own task, whose worker service the master asks the same way,
the server task idle.)
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SERVER = """
import sys, tensorflow as tf
spec = tf.train.ClusterSpec({"worker": [sys.argv[1]], "ps": [sys.argv[2]]})
tf.distribute.Server(spec, job_name="ps", task_index=0, start=True).join()
"""
WINDOW = 100_000         # ids a server remembers (RecentRequestIds)
IDS = 2 ** 32            # distinct ids in effect


def expected(runs: int) -> float:
    """Refusals expected over `runs` requests to one server."""
    first = min(runs, WINDOW)
    return first * (first - 1) / 2 / IDS + max(0, runs - WINDOW) * WINDOW / IDS


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=150_000)
    parser.add_argument("--via", choices=("run", "callable"), default="run")
    parser.add_argument("--on", choices=("ps", "worker"), default="ps")
    args = parser.parse_args()
    import tensorflow as tf

    from parallax_ng.tools.launch import free_port
    worker, ps = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    server = subprocess.Popen([sys.executable, "-c", SERVER, worker, ps], env=env)
    try:
        spec = tf.train.ClusterSpec({"worker": [worker], "ps": [ps]})
        mine = tf.distribute.Server(spec, job_name="worker", task_index=0, start=True)
        graph = tf.Graph()
        with graph.as_default():
            with tf.device(f"/job:{args.on}/task:0/device:CPU:0"):
                count = tf.compat.v1.get_variable("count", [], tf.int64,
                                                  tf.compat.v1.zeros_initializer())
                step = count.assign_add(1)
            init = tf.compat.v1.global_variables_initializer()
        options = tf.compat.v1.RunOptions(timeout_in_ms=60_000)
        refused, start = [], time.monotonic()
        with tf.compat.v1.Session(mine.target, graph=graph) as session:
            session.run(init, options=options)
            run = session.make_callable(step) if args.via == "callable" else \
                (lambda: session.run(step, options=options))
            for i in range(args.runs):
                try:
                    run()
                except tf.errors.AbortedError as e:
                    if "received twice" not in e.message:
                        raise
                    refused.append(i + 1)
                    said = e.message.split("goo.gle")[0].strip().splitlines()[-1]
                    print(f"run {i + 1}: refused: {said}", flush=True)
            applied = session.run(count, options=options)
        seconds = time.monotonic() - start
        print(f"{args.via}, on the {args.on} task: {args.runs} runs in {seconds:.1f} s "
              f"({args.runs / seconds:.0f} runs/s): {len(refused)} refused "
              f"(expected {expected(args.runs):.2f}); the task "
              f"applied {applied} (runs less refusals: {args.runs - len(refused)})")
    finally:
        server.kill()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
