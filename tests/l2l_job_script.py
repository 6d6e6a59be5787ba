"""Layer-to-layer training as one worker of a job (tests/test_eps.py):
each worker's initial values seeded apart (models.worker_seed);
saves every variable before and after training to OUT.<worker>.npz.

    python l2l_job_script.py OUT STEPS [--micro-batches 2] [--stash host]
        [--checkpoint DIR] [--apart]

--apart: the graph also holds an evaluation pipeline with a filter after
its pn.shard (never run), which worker 0 names in a line.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parallax_ng as pn  # noqa: E402
from models import read_name, variable_names, worker_seed  # noqa: E402
from test_l2l import LAYERS, stack  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--micro-batches", type=int, default=2)
parser.add_argument("--stash", default="host")
parser.add_argument("--checkpoint", default=None, help="checkpoint.dir, saved every 2 steps")
parser.add_argument("--apart", action="store_true")
args = parser.parse_args()

g, h = stack(4, "adam", seed=worker_seed(7))
if args.apart:
    import tensorflow as tf
    with g.as_default():
        tf.compat.v1.data.make_one_shot_iterator(pn.shard(tf.data.Dataset.range(8)).filter(
            lambda v: v > 2).batch(2)).get_next()
runner = pn.get_runner(g, None, {"l2l": {"layers": LAYERS, "micro_batches": args.micro_batches,
                                         "stash": args.stash},
                                 "communication": {"timeout_seconds": 120},
                                 "checkpoint": {"dir": args.checkpoint, "every_steps": 2}})
print(f"worker {runner.plan.worker}: {runner.plan}", flush=True)
names = variable_names(g)
reads = [read_name(n, g) for n in names]
runner.run(h["init"])
start = runner.run(reads)
losses = [runner.run([h["train"], h["loss"]])[1] for _ in range(args.steps)]
print(f"worker {runner.plan.worker}: losses {np.round(losses, 4).tolist()}", flush=True)
end = runner.run(reads)
np.savez(f"{args.out}.{runner.plan.worker}.npz",
         **{f"start/{n}": v for n, v in zip(names, start)},
         **{f"end/{n}": v for n, v in zip(names, end)})
