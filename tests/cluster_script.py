"""A training script for the multi-process tests: trains, then saves every
replica's variables to OUT.<worker>.npz.

    python cluster_script.py OUT STEPS [--random-init] [--die-at STEP] [--optimizer NAME] ...
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parallax_ng as pn  # noqa: E402
from models import counting_graph, embedding_regression, read_name, variable_names  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--random-init", action="store_true")
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--run-option", default="allreduce")
parser.add_argument("--partitions", type=int, default=None, help="embedding row ranges")
parser.add_argument("--no-ema", action="store_true", help="no moving averages")
parser.add_argument("--no-clip", action="store_true", help="no global-norm clipping")
parser.add_argument("--optimizer", default="adam", help="a key of models.OPTIMIZERS")
parser.add_argument("--v1", action="store_true", help="call disable_v2_behavior() first")
parser.add_argument("--dense-method", default="auto")
parser.add_argument("--lookup", default="gather", help="gather | sparse (models.py)")
parser.add_argument("--static-batch", action="store_true", help="batches of a known size")
parser.add_argument("--masked", action="store_true", help="a mean over the rows of positive y")
parser.add_argument("--sum-and-mean", action="store_true",
                    help="a summed loss plus a tf.reduce_mean (models.embedding_regression)")
parser.add_argument("--bn", help="the dense layer's input batch-normalized: moments | fused | "
                                 "keras (models.embedding_regression; frozen at every third step) "
                                 "| own (by hand) | weighted (tf.nn.weighted_moments)")
parser.add_argument("--counting", choices=["count", "applied"],
                    help="models.counting_graph: a count added under a fed tf.cond (applied: "
                         "and the update applied there), the flag True at even steps (the "
                         "branch every replica skips at odd ones)")
parser.add_argument("--buffer-bytes", type=int, default=0, help="fusion buffer size")
parser.add_argument("--config", default="{}", help="more config keys, as JSON")
parser.add_argument("--slow-writes", type=float, default=0.0,
                    help="worker 1 waits this many seconds for its learning rate (Adam) "
                         "each step, so its writes land well after worker 0's run ends")
parser.add_argument("--late-read", type=float, default=0.0,
                    help="worker 0 waits this many seconds after its steps before it reads "
                         "the trained values (the other workers read at once and end)")
parser.add_argument("--saver", help="a Saver in the graph: save to this path (worker 0) after "
                                    "the steps, train 2 more, restore")
args = parser.parse_args()
if args.v1:
    tf.compat.v1.disable_v2_behavior()

SLOW = []      # worker 1's wait, once the plan says which worker this is


def slow_adam():
    def rate():
        time.sleep(SLOW[0] if SLOW else 0.0)
        return np.float32(0.01)
    lr = tf.compat.v1.py_func(rate, [], tf.float32, stateful=True, name="slow_rate")
    lr.set_shape([])
    return tf.compat.v1.train.AdamOptimizer(lr)


if args.counting:
    g, h = counting_graph("fed", applied=args.counting == "applied")
    h["iterator_init"] = None
    COUNTED = np.random.RandomState(0).randn(args.steps, 8, 3).astype(np.float32)
elif args.random_init:
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 2])
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(tf.reduce_sum(tf.matmul(x, w)))
        h = {"init": tf.compat.v1.global_variables_initializer(), "iterator_init": None,
             "train": None}
else:
    g, h = embedding_regression(4, slow_adam if args.slow_writes else args.optimizer, clip=not args.no_clip, ema=not args.no_ema,
                                partitions=args.partitions, static_batch=args.static_batch,
                                lookup=args.lookup, masked=args.masked, bn=args.bn,
                                loss_sum="and mean" if args.sum_and_mean else False)
saver = None
if args.saver:      # built before training, as most TF1 scripts build theirs
    with g.as_default():
        saver = tf.compat.v1.train.Saver()
runner = pn.get_runner(g, None, {"run_option": args.run_option,
                                 "dense_method": args.dense_method,
                                 "fusion": {"buffer_bytes": args.buffer_bytes},
                                 "communication": {"timeout_seconds": 120},
                                 **json.loads(args.config)})
if args.slow_writes and runner.plan.worker == 1:
    SLOW.append(args.slow_writes)
if h["train"] is not None:
    runs = runner.session_runs(h["train"])
    print(f"worker {runner.plan.worker}: {runs} session run(s) "
          f"{'at once ' if runs > 1 and runner.executor.parts else ''}per step", flush=True)
chosen = [c.label for c in runner.plan.choice if c.chosen]
if chosen:
    print(f"worker {runner.plan.worker}: chose {chosen[0]}", flush=True)
if runner.plan.buffers:
    packed = [s.var for b in runner.plan.buffers for s in b.segments]
    print(f"worker {runner.plan.worker}: buffers packed {packed} in "
          f"{runner.plan.order_source}", flush=True)
if runner.plan.blocks:
    print(f"worker {runner.plan.worker}: blocks {[list(b) for b in runner.plan.blocks]}",
          flush=True)
cut = runner.plan.sharded().get("emb")
if cut is not None and cut.axis == 0:
    print(f"worker {runner.plan.worker}: emb cut {cut.describe()}", flush=True)
ahead = sorted(v for v, vp in runner.plan.variables.items() if vp.prefetch)
if ahead:
    print(f"worker {runner.plan.worker}: prefetch {ahead}", flush=True)
factored = sorted(v for v, vp in runner.plan.variables.items() if vp.method == "factors")
if factored:
    print(f"worker {runner.plan.worker}: factors {factored}", flush=True)
if runner.plan.buckets:
    print(f"worker {runner.plan.worker}: buckets "
          f"{[list(b.variables) for b in runner.plan.buckets]}", flush=True)
runner.run([op for op in (h["init"], h["iterator_init"]) if op is not None])
for step in range(args.steps):
    if step == args.die_at and runner.plan.worker == 1:
        print(f"worker 1 dies at step {step}", flush=True)
        os._exit(3)
    if args.bn == "keras":     # the batch normalization frozen at every third step
        runner.run(h["train"], {h["training"]: step % 3 != 2})
        continue
    if args.counting:
        rows = np.array_split(COUNTED[step], runner.plan.num_workers)[runner.plan.worker]
        runner.run(h["train"], {h["x"]: rows, h["flag"]: step % 2 == 0})   # its own rows
        continue
    runner.run(h["train"])
if saver is not None:
    if runner.plan.worker == 0:
        print(f"saved {runner.save(saver, args.saver)}", flush=True)
    runner.run(h["train"])     # every worker: a step of the job
    runner.run(h["train"])
    runner.restore(saver, args.saver)
    print(f"worker {runner.plan.worker}: methods "
          f"{ {v: vp.method for v, vp in sorted(runner.plan.variables.items())} }", flush=True)
if args.late_read and runner.plan.worker == 0:
    time.sleep(args.late_read)
names = variable_names(g)
values = runner.run([read_name(v, g) for v in names], per_replica=True)
np.savez(f"{args.out}.{runner.plan.worker}.npz",
         **{f"{n}#{k}": v for n, vs in zip(names, values) for k, v in enumerate(vs)})
