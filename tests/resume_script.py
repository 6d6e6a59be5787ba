"""Trains to a global step with checkpoints; can kill itself at a step.

    python resume_script.py CKPT_DIR OUT STEPS [--die-at STEP] [--config JSON]
        [--every N] [--print-steps] [--die-on-host ADDRESS] [--once] [--dropout RATE]
        [--hold-at STEP --hold-file PATH] [--die-as exit|refused]

CKPT_DIR "-": the config names no checkpoint.dir (a launcher with
--restarts gives one).
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
from parallax_ng.errors import REFUSED, explained  # noqa: E402
from models import embedding_regression, local, read_name, variable_names  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("ckpt")
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--replicas", type=int, default=2)
parser.add_argument("--run-option", default="allreduce", help="in a multi-worker job")
parser.add_argument("--no-ema", action="store_true", help="no moving averages")
parser.add_argument("--no-clip", action="store_true", help="no global-norm clipping")
parser.add_argument("--config", default="{}", help="more config keys, as JSON")
parser.add_argument("--every", type=int, default=5, help="checkpoint.every_steps")
parser.add_argument("--print-steps", action="store_true", help="say each step trained")
parser.add_argument("--die-on-host", help="--die-at only in a worker at this address")
parser.add_argument("--once", action="store_true", help="--die-at only in a run from step 0")
parser.add_argument("--die-as", choices=("exit", "refused"), default="exit",
                    help="--die-at: exit with code 9, or end with the error a run TensorFlow's "
                         "runtime refused as a repeated request raises (parallax_ng/errors.py)")
parser.add_argument("--dropout", type=float, default=0.0, help="seeded dropout at this rate")
parser.add_argument("--hold-at", type=int, default=-1,
                    help="in a run from step 0, wait after this step until --hold-file exists "
                         "(a test acts on the job there, however fast the steps go)")
parser.add_argument("--hold-file", help="the file --hold-at waits for (at most 120 s)")
args = parser.parse_args()


def my_host() -> str:
    """This worker's address in its job, without the port."""
    cluster = json.loads(os.environ["PARALLAX_NG_CLUSTER"])
    return cluster["worker"][cluster["task"]].rpartition(":")[0]


g, h = embedding_regression(4, "adam", clip=not args.no_clip, ema=not args.no_ema,
                            dropout=args.dropout)
step = tf.compat.v1.train.get_global_step(g)
resources = None if os.environ.get("PARALLAX_NG_CLUSTER") else local(args.replicas)
runner = pn.get_runner(g, resources, {"run_option": "hybrid" if resources else args.run_option,
                                      "checkpoint": {"every_steps": args.every, **(
                                          {} if args.ckpt == "-" else {"dir": args.ckpt})},
                                      **json.loads(args.config)})
runner.run([h["init"], h["iterator_init"]])       # restores the latest checkpoint if any
start = runner.run(step)
print(f"starting at step {start}", flush=True)   # one write: workers share stdout
while runner.run(step) < args.steps:
    runner.run(h["train"])
    done = runner.run(step)
    if args.print_steps:
        print(f"step {done}", flush=True)
    if done == args.die_at and (args.die_on_host is None or args.die_on_host == my_host()) \
            and not (args.once and start > 0):
        if args.die_as == "refused":
            raise explained(tf.errors.AbortedError(None, None, "From /job:ps/replica:0/task:0:\n"
                                                   f"The same RunGraph (Worker) {REFUSED}."))
        os._exit(9)
    if done == args.hold_at and start == 0:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)
names = variable_names(g)
values = runner.run([read_name(v, g) for v in names], per_replica=True)
np.savez(f"{args.out}.{runner.plan.worker}.npz",
         **{f"{n}#{k}": v for n, vs in zip(names, values) for k, v in enumerate(vs)})
