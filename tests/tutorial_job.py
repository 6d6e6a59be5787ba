"""A tutorial model as a ported TF1 script run by `parallax-ng run`: each
worker feeds its own rows of the global batch; worker 0 writes the initial
values to OUT.init.npz, every worker its replicas' final values to
OUT.<worker>.npz.

    python tutorial_job.py MODEL OUT STEPS RUN_OPTION REPLICAS [v2]

`v2`: keep TensorFlow 2's behaviour (resource variables), as a script that
uses tf.compat.v1 without disable_v2_behavior() does.
"""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

if sys.argv[6:] != ["v2"]:
    tf.disable_v2_behavior()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parallax_ng as pn  # noqa: E402
from models import read_name  # noqa: E402
from tutorials import BATCH, build, config, ptb_windows, train  # noqa: E402

model, out, steps, run_option, replicas = sys.argv[1:6]
steps, replicas = int(steps), int(replicas)
kwargs = {"windows": ptb_windows(steps * replicas, BATCH)} if model == "ptb" else {}
graph, h = build(model, BATCH, **kwargs)
runner = pn.get_runner(graph, None, dict(config(model, run_option),
                                         communication={"timeout_seconds": 120}))
plan = runner.plan
print(f"worker {plan.worker}: methods "
      f"{ {v: vp.method for v, vp in sorted(plan.variables.items())} }", flush=True)
names = [v.op.name for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)]
reads = [read_name(v, graph) for v in names]
runner.run(h["init"])
if plan.worker == 0:
    np.savez(f"{out}.init.npz", **dict(zip(names, runner.run(reads))))
train(model, runner.run, h, steps, BATCH * replicas, part=(plan.worker, plan.num_workers))
values = runner.run(reads, per_replica=True)
np.savez(f"{out}.{plan.worker}.npz",
         **{f"{n}#{k}": v for n, vs in zip(names, values) for k, v in enumerate(vs)})
