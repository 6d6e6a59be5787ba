"""Benchmark: bucket and fusion-buffer sizes tuned while training against a
sweep of fixed sizes, on the jobs of cluster_lm.py.

For each model (`lm`: lm_small, 330 KB of dense weights; `classifier`: the
dense-heavy one, about 2 MB) and knob (`buckets`: allreduce, all-reduce
buckets by a byte threshold, and one per variable; `fusion`: hybrid with
dense variables by balanced fusion buffers on one server), one 2-worker job
per fixed size (and, for fusion buffers, the default size, four buffers
from the model and cluster), then one with the size `auto`
(parallax_ng/runtime/tuning.py).
Every job runs --warmup steps first and worker 0 times --steps more; the
tuned job runs --tuning more steps first, in which it tries its sizes (so
its timed window starts well after its last graph was built: a job's
first steps are slower). Each row is the median of --repeats jobs
(sizes interleaved), every job's steps/s beside it. The tuned job's
steps/s is printed against the best fixed size's, with the size it
chose (and each tuned job's choice and trials); with 4 repeats or more,
also held out: the best fixed size picked on the even repeats, compared
with auto on the odd ones (the fastest of several noisy rows is partly
the luckiest).

    python benchmarks/tuned_sizes.py [--models lm,classifier] [--knobs buckets,fusion]
        [--steps 200] [--warmup 100] [--tuning 600] [--repeats 1] [--netlab 1gbit]
        [--sizes 16,64,256,1024,4096] [--margins 0.05,0.03]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_lm import NETLAB, job  # noqa: E402

SIZES = "16,64,256,1024,4096"      # KB


def knobs(sizes: list[int]) -> dict:
    """knob -> (cluster_lm mode, {row: config}, config of auto), the fixed
    rows at `sizes` bytes."""
    return {
        "buckets": ("allreduce",
                    {"one per variable": {"buckets": {"mode": "none"}},
                     **{f"{s // 1024} KB": {"buckets": {"mode": "threshold", "bytes": s}}
                        for s in sizes}},
                    {"buckets": {"mode": "auto"}}),
        "fusion": ("hybrid-bfb",
                   {"the default": {"fusion": {"buffer_bytes": 0}},
                    **{f"{s // 1024} KB": {"fusion": {"buffer_bytes": s}} for s in sizes}},
                   {"fusion": {"buffer_bytes": "auto"}}),
    }


def run(mode: str, config: dict, args, tmp: str, repeat: int, model: str) -> dict:
    """One cluster_lm job of `mode` with `config` added."""
    tuned = "auto" in json.dumps(config)
    opts = argparse.Namespace(
        steps=args.steps, warmup=args.warmup + args.tuning * tuned, devices=1, workers=2,
        model=model,
        config=json.dumps(config), no_clip=False, optimizer="adagrad", vocab=None,
        layout="one", netlab=args.netlab)
    return job(mode, opts, tmp, repeat)


def median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def held_out(runs: dict, fixed: dict, auto: str) -> None:
    """The best of several noisy medians is biased up (the fastest row
    is partly the luckiest): pick the best fixed size on the even repeats
    and compare the `auto` row with it on the odd ones, which did not pick it."""
    pick, judge = ({row: [x["steps_per_s"] for x in rs[k::2]] for row, rs in runs.items()}
                   for k in (0, 1))
    best = max(fixed, key=lambda r: median(pick[r]))
    print(f"  held out: best fixed on even repeats {best}; on odd repeats {auto} / it "
          f"{median(judge[auto]) / median(judge[best]):.3f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="lm,classifier")
    parser.add_argument("--knobs", default="buckets,fusion")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--tuning", type=int, default=600,
                        help="steps the tuned job runs before the others' warm-up")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sizes", default=SIZES, help="the fixed sizes swept, KB")
    parser.add_argument("--netlab", metavar="RATE", help="emulated hosts, NICs at RATE")
    parser.add_argument("--margins", default="",
                        help="tuning.margin of each tuned row (e.g. 0.05,0.03); the "
                             "default: one row with the config's default")
    args = parser.parse_args()
    if args.netlab:
        subprocess.run([NETLAB, "up", "3", args.netlab], check=True, capture_output=True)
    summary = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for model in args.models.split(","):
                for knob in args.knobs.split(","):
                    mode, fixed, auto = knobs([int(k) * 1024 for k in
                                               args.sizes.split(",")])[knob]
                    tuned = {f"auto, margin {m}": {**auto, "tuning": {"margin": float(m)}}
                             for m in args.margins.split(",") if m} or {"auto": auto}
                    rows = {**fixed, **tuned}
                    runs = {row: [] for row in rows}
                    for r in range(args.repeats):
                        for row, config in rows.items():
                            runs[row].append(run(mode, config, args, tmp, r, model))
                    medians = {row: sorted(rs, key=lambda x: x["steps_per_s"])[len(rs) // 2]
                               for row, rs in runs.items()}
                    print(f"\n{model}, {knob} ({mode}, "
                          f"{args.netlab or 'loopback'}): steps/s")
                    for row, result in medians.items():
                        every = sorted(round(x["steps_per_s"], 1) for x in runs[row])
                        print(f"  {row:18} {result['steps_per_s']:8.2f}  (jobs: {every})")
                    best = max((r for r in fixed), key=lambda r: medians[r]["steps_per_s"])
                    for row in tuned:
                        ratio = medians[row]["steps_per_s"] / medians[best]["steps_per_s"]
                        chosen = {k: v["chosen"] for k, v in medians[row]["tuned"].items()}
                        print(f"  {row} / best fixed ({best}): {ratio:.3f}x; chose {chosen}")
                        if args.repeats >= 4:
                            held_out(runs, fixed, row)
                        for r in runs[row]:
                            print(f"  a tuned job ({r['steps_per_s']:.2f} steps/s) chose "
                                  f"{[v['chosen'] for v in r['tuned'].values()]}, tried (ms a "
                                  "step): " + ", ".join(f"{size}: {t * 1e3:.1f}"
                                                        for v in r["tuned"].values()
                                                        for size, t in v["tried"].items()))
                        summary.append((model, f"{knob} {row}", ratio, best, chosen))
    finally:
        if args.netlab:
            subprocess.run([NETLAB, "down"], capture_output=True)
    print("\nmodel       knob, row                 tuned / best fixed")
    for model, knob, ratio, best, chosen in summary:
        print(f"{model:11} {knob:25} {ratio:8.3f}x  (best fixed {best}; chose {chosen})")


if __name__ == "__main__":
    main()
