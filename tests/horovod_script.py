"""A training script for the Horovod tests, started by horovodrun: trains
with `communication.backend: horovod`, then saves every replica's variables
to OUT.<rank>.npz.

    horovodrun --gloo -np 2 -H localhost:2 python horovod_script.py OUT STEPS [--devices D]
        [--buckets MODE] [--sparse METHOD] [--horizontal] [--compression fp16|bf16]
        [--bn moments|fused]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parallax_ng as pn  # noqa: E402
from models import embedding_regression, local, read_name, variable_names  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--buckets", default="none",
                    help="buckets.mode (40-byte threshold; mgwfbp with a given cost)")
parser.add_argument("--sparse", default="auto",
                    help="sparse_method, or prefetch (alltoall with prefetch)")
parser.add_argument("--horizontal", action="store_true",
                    help="horizontal scheduling of the dense updates (no clipping)")
parser.add_argument("--compression", default="none", help="communication.compression")
parser.add_argument("--dense", default="auto", help="dense_method")
parser.add_argument("--bn", help="features batch-normalized (moments | fused), synchronized")
args = parser.parse_args()

prefetch = args.sparse == "prefetch"
g, h = embedding_regression(4, "adam", clip=not args.horizontal, ema=True, bn=args.bn)
runner = pn.get_runner(g, local(args.devices), {
    "run_option": "allreduce", "sparse_method": "alltoall" if prefetch else args.sparse,
    "prefetch": prefetch, "horizontal_scheduling": args.horizontal,
    "dense_method": args.dense, "batch_norm": "synchronized" if args.bn else "per_replica",
    "communication": {"backend": "horovod", "timeout_seconds": 120,
                      "compression": args.compression},
    "buckets": {"mode": args.buckets, "bytes": 40,
                **({"a": 1e-3, "b": 1e-9} if args.buckets == "mgwfbp" else {})}})
factored = sorted(v for v, vp in runner.plan.variables.items() if vp.method == "factors")
if factored:
    print(f"rank {runner.plan.worker}: factors {factored}", flush=True)
runner.run([h["init"], h["iterator_init"]])
for _ in range(args.steps):
    runner.run(h["train"])
names = variable_names(g)
values = runner.run([read_name(v, g) for v in names], per_replica=True)
np.savez(f"{args.out}.{runner.plan.worker}.npz",
         **{f"{n}#{k}": v for n, vs in zip(names, values) for k, v in enumerate(vs)})
