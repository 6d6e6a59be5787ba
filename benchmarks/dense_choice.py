"""Does the default plan win? Every setting of issue 22's acceptance run:
both models (lm_small, the dense-heavy classifier), 2 and 4 workers, one
server or a server per worker host, on loopback and on emulated hosts with
1gbit and 100mbit NICs; in each, every mode that competes (hybrid and auto
as the planner chooses, each dense method, allreduce, ps and
MultiWorkerMirroredStrategy), each a `cluster_lm.py` job, medians of
--repeats jobs.

    python benchmarks/dense_choice.py run [--repeats 3] [--out FILE.jsonl]
                                          [--models lm,classifier] [--workers 2,4]
                                          [--networks loopback,1gbit,100mbit]
                                          [--layouts one,per_host] [--modes ...]
    python benchmarks/dense_choice.py report FILE.jsonl

`run` appends each mode's jobs to FILE as a JSON line (cluster_lm.py
--json); `report` prints, per setting, steps/s and ratios to the fastest
fixed mode, what hybrid and auto chose, and their bytes against the
traffic model. Modes without a server (allreduce, mwms) are the same in
both layouts and run once, under `one`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("hybrid", "auto-ps", "hybrid-allreduce", "hybrid-bfb", "ps", "allreduce", "mwms")
SERVERLESS = ("allreduce", "mwms")
FIXED = ("hybrid-allreduce", "hybrid-bfb", "ps", "allreduce")
# steps timed and warm-up steps per network: enough for a few seconds' window
STEPS = {"loopback": (300, 30), "1gbit": (200, 20), "100mbit": (60, 10)}


def run(args) -> None:
    for network in args.networks.split(","):
        steps, warmup = STEPS[network]
        for model in args.models.split(","):
            for workers in map(int, args.workers.split(",")):
                for layout in args.layouts.split(","):
                    modes = [m for m in args.modes.split(",")
                             if layout == "one" or m not in SERVERLESS]
                    cmd = [sys.executable, os.path.join(HERE, "cluster_lm.py"),
                           "--model", model, "--workers", str(workers), "--layout", layout,
                           "--steps", str(steps), "--warmup", str(warmup),
                           "--repeats", str(args.repeats), "--modes", ",".join(modes),
                           "--json", args.out] + (
                               ["--netlab", network] if network != "loopback" else [])
                    print(" ".join(cmd[2:]), flush=True)
                    subprocess.run(cmd, check=False)


def load(path: str) -> dict:
    """(network, model, workers, layout) -> mode -> [jobs]"""
    out: dict = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            key = (r["network"], r["model"], r["workers"], r["layout"])
            out.setdefault(key, {}).setdefault(r["mode"], []).extend(r["runs"])
    return out


def median(jobs: list) -> float:
    return statistics.median(j["steps_per_s"] for j in jobs)


def chose(job: dict) -> str:
    """The dense and sparse methods a job's plan used."""
    methods = job.get("methods", {})
    sparse = set(job.get("gradient_rows", {}))
    dense = sorted({m for v, m in methods.items() if v not in sparse})
    rows = sorted({m for v, m in methods.items() if v in sparse})
    return f"{'+'.join(dense)}/{'+'.join(rows)}"


def report(path: str) -> None:
    data = load(path)
    print(f"{'network':9} {'model':10} {'w':>2} {'layout':8} {'mode':17} {'steps/s':>8} "
          f"{'vs best':>8} {'chose':22} {'x model':>8}")
    for key in sorted(data):
        modes = data[key]
        if key[3] == "per_host":     # the serverless modes ran under `one`
            modes = {**{m: j for m, j in data.get(key[:3] + ("one",), {}).items()
                        if m in SERVERLESS}, **modes}
        fixed = {m: median(j) for m, j in modes.items() if m in FIXED}
        best = max(fixed.values()) if fixed else None
        for mode in MODES:
            if mode not in modes:
                continue
            jobs = modes[mode]
            speed = median(jobs)
            mid = sorted(jobs, key=lambda j: j["steps_per_s"])[len(jobs) // 2]
            model = mid.get("model_bytes_per_step", {})
            sent = mid.get("bytes_per_step", {})
            worst = max((sent[t] / model[t] for t in model if model[t] and t in sent),
                        default=None)
            print(f"{key[0]:9} {key[1]:10} {key[2]:2d} {key[3]:8} {mode:17} {speed:8.2f} "
                  f"{speed / best if best else 0:8.3f} "
                  f"{chose(mid) if mode != 'mwms' else '':22} "
                  f"{worst if worst else 0:8.3f}")
        print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--out", default="dense_choice.jsonl")
    r.add_argument("--models", default="lm,classifier")
    r.add_argument("--workers", default="2,4")
    r.add_argument("--networks", default="loopback,1gbit,100mbit")
    r.add_argument("--layouts", default="one,per_host")
    r.add_argument("--modes", default=",".join(MODES))
    p = sub.add_parser("report")
    p.add_argument("path")
    args = parser.parse_args()
    run(args) if args.command == "run" else report(args.path)


if __name__ == "__main__":
    main()
