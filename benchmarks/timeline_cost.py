"""What the timeline costs: lm_small on 2 replicas in one process, steps/s
with `timeline` off, and of the traced steps with it on (every step after
the skipped ones traced), in one run; and the trace's size.

    python benchmarks/timeline_cost.py [--steps 60] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)


def seconds_per_step(steps: int, timeline_file: str | None) -> float:
    import lm_small

    import parallax_ng as pn
    args = lm_small.arguments(["--vocab", "20000", "--batch", "64"])
    graph, train_op, loss, _, init = lm_small.build(args)
    resources = {"hosts": [{"devices": ["cpu:0", "cpu:1"]}]}
    config = {"run_option": "allreduce"}
    if timeline_file:
        config["timeline"] = {"file": timeline_file, "steps": steps, "skip": 5}
    with pn.get_runner(graph, resources, config) as runner:
        runner.run(init)
        for _ in range(5):                 # warm-up (and the timeline's skipped steps)
            runner.run(train_op)
        start = time.perf_counter()
        for _ in range(steps):
            runner.run(train_op)
        return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    off, on, size = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):      # interleaved: a drift hits both alike
            off.append(seconds_per_step(args.steps, None))
            path = os.path.join(tmp, f"t{r}.json")
            on.append(seconds_per_step(args.steps, path))
            size = os.path.getsize(path)
    a, b = statistics.median(off), statistics.median(on)
    print(f"timeline off: {a * 1e3:.2f} ms/step; every step traced: {b * 1e3:.2f} ms/step "
          f"({b / a:.2f}x); trace of {args.steps} steps: {size / 1e6:.1f} MB "
          f"(medians of {args.repeats})")


if __name__ == "__main__":
    main()
