"""A small job for the launcher's tests (tests/test_launch.py): a linear
model trained by all-reduce over the job's workers (or hybrid with its
server), worker 0 printing each step.

    launch_script.py [--steps N] [--config JSON] [--block-at K] [--fewer K]

--block-at K: worker 1 blocks outside its runner at step K (a sleep that
releases the interpreter, as a read that never returns does).
--fewer K: worker 0 makes K steps fewer than the others and ends."""
import argparse
import json
import time

import numpy as np
import tensorflow as tf

import parallax_ng as pn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--config", default="{}")
parser.add_argument("--block-at", type=int, default=-1)
parser.add_argument("--fewer", type=int, default=0)
args = parser.parse_args()
tf1 = tf.compat.v1
g = tf.Graph()
with g.as_default():
    x = tf1.placeholder(tf.float32, [None, 2], name="x")
    w = tf1.get_variable("w", [2, 1])
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
    train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
    init = tf1.global_variables_initializer()
runner = pn.get_runner(g, None, json.loads(args.config) or None)
runner.run(init)
worker = runner.plan.worker
for step in range(args.steps - (args.fewer if worker == 0 else 0)):
    if worker == 1 and step == args.block_at:
        time.sleep(3600)
    _, value = runner.run([train, loss], {x: np.ones([4, 2], np.float32)})
    if worker == 0 and (step < 10 or step % 1000 == 0):
        print(f"step {step} loss {value:.4f}", flush=True)
