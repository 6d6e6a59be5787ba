"""Does the default plan win? Every setting of issue 22's acceptance run:
both models (lm_small, the dense-heavy classifier), 2 and 4 workers, one
server or a server per worker host, on loopback and on emulated hosts with
1gbit and 100mbit NICs; in each, every mode that competes (hybrid and auto
as they train by default, the planner's three fastest predictions timed
while training; hybrid's predicted plan alone; each dense method, allreduce, ps and
MultiWorkerMirroredStrategy), each a `cluster_lm.py` job, medians of
--repeats jobs.

    python benchmarks/dense_choice.py run [--repeats 3] [--out FILE.jsonl]
                                          [--models lm,classifier] [--workers 2,4]
                                          [--networks loopback,1gbit,100mbit]
                                          [--layouts one,per_host] [--modes ...]
    python benchmarks/dense_choice.py report FILE.jsonl [FILE.jsonl ...] [--markdown]
    python benchmarks/dense_choice.py grid [FILE.jsonl ...]

`run` appends each mode's jobs to FILE as a JSON line (cluster_lm.py
--json); `report` prints, per setting, steps/s and ratios to the fastest
fixed mode, what hybrid and auto chose, and their bytes against the
traffic model (a mode in a later file replaces the earlier file's jobs of
that mode and setting, so a mode can be run again alone). `--markdown`
prints the tables of docs/benchmarks.md: steps/s per mode and setting, and
for the plans hybrid weighed that a fixed mode also ran, the predicted step
time against the fixed mode's measured one (and where the measured fastest
was not the plan chosen). `grid` reads the stored runs
(benchmarks/results/dense_choice-*.jsonl, oldest first, unless FILEs are
given) and prints issue 22's acceptance grid, 3 networks x 2 models x 2
and 4 workers x one server or a server per host: per setting, whether it
holds (hybrid and auto at least 0.97x the fastest fixed mode, no mode
below MultiWorkerMirroredStrategy, the chosen plan's bytes within 1.05x
of its model, every mode a median of 3 jobs), else what is short or
missing (a mode below MultiWorkerMirroredStrategy is marked NIC-bound
where the bytes its busiest host sent a step, at the NIC's rate, allow
fewer steps/s than MultiWorkerMirroredStrategy ran), and the `run` lines that would fill the gaps. Modes without a server (allreduce, mwms) are the same in
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
MODES = ("hybrid", "hybrid-predicted", "auto-ps", "hybrid-allreduce", "hybrid-bfb", "ps", "allreduce", "mwms")
SERVERLESS = ("allreduce", "mwms")
FIXED = ("hybrid-allreduce", "hybrid-bfb", "ps", "allreduce")
# steps timed and warm-up steps per network: enough for a few seconds'
# window, a warm-up that holds the trials of the plans hybrid and auto
# time by default (`tuning.plans: auto`: three plans, about 200 steps), and
# a shorter one for the modes that time none (cluster_lm.py --fixed-warmup)
STEPS = {"loopback": (300, 300, 100), "1gbit": (200, 260, 60), "100mbit": (60, 230, 30)}


def run(args) -> None:
    for network in args.networks.split(","):
        steps, warmup, fixed_warmup = STEPS[network]
        for model in args.models.split(","):
            for workers in map(int, args.workers.split(",")):
                for layout in args.layouts.split(","):
                    modes = [m for m in args.modes.split(",")
                             if layout == "one" or m not in SERVERLESS]
                    cmd = [sys.executable, os.path.join(HERE, "cluster_lm.py"),
                           "--model", model, "--workers", str(workers), "--layout", layout,
                           "--steps", str(steps), "--warmup", str(warmup),
                           "--fixed-warmup", str(fixed_warmup),
                           "--repeats", str(args.repeats), "--modes", ",".join(modes),
                           "--json", args.out] + (
                               ["--netlab", network] if network != "loopback" else [])
                    print(" ".join(cmd[2:]), flush=True)
                    subprocess.run(cmd, check=False)


def load(paths) -> dict:
    """(network, model, workers, layout) -> mode -> [jobs]; a later file's
    jobs of a mode and setting replace an earlier file's. Each job takes
    its line's `cores` (the machine's, where the line records it)."""
    out: dict = {}
    for path in [paths] if isinstance(paths, str) else paths:
        mine: dict = {}
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                key = (r["network"], r["model"], r["workers"], r["layout"])
                mine.setdefault(key, {}).setdefault(r["mode"], []).extend(
                    {**job, "cores": r["cores"]} if "cores" in r else job for job in r["runs"])
        for key, modes in mine.items():
            out.setdefault(key, {}).update(modes)
    return out


def with_serverless(data: dict, key: tuple) -> dict:
    """A setting's modes; per_host takes the serverless modes of `one`."""
    modes = data.get(key, {})
    if key[3] == "per_host":
        modes = {**{m: j for m, j in data.get(key[:3] + ("one",), {}).items()
                    if m in SERVERLESS}, **modes}
    return modes


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
        modes = with_serverless(data, key)
        fixed = {m: median(j) for m, j in modes.items() if m in FIXED}
        best = max(fixed.values()) if fixed else None
        for mode in MODES:
            if mode not in modes:
                continue
            jobs = modes[mode]
            speed = median(jobs)
            mid = sorted(jobs, key=lambda j: j["steps_per_s"])[len(jobs) // 2]
            worst = worst_bytes(mid)
            print(f"{key[0]:9} {key[1]:10} {key[2]:2d} {key[3]:8} {mode:17} {speed:8.2f} "
                  f"{speed / best if best else 0:8.3f} "
                  f"{chose(mid) if mode != 'mwms' else '':22} "
                  f"{worst if worst else 0:8.3f}")
        print()


# the plans hybrid weighs that a fixed mode runs as well
SAME = {"dense allreduce, sparse allgather": "allreduce", "dense ps, sparse ps": "ps",
        "dense bfb, sparse ps": "hybrid-bfb", "dense allreduce, sparse ps": "hybrid-allreduce"}
COLUMNS = ("hybrid", "hybrid-predicted", "auto-ps", "hybrid-allreduce", "hybrid-bfb", "ps", "allreduce", "mwms")
SHORT = {"allreduce/allgather": "ring+gather", "ps/ps": "servers", "bfb/ps": "bfb+servers",
         "allreduce/ps": "ring+servers", "bfb/allgather": "bfb+gather",
         "ps/allgather": "servers+gather"}


def worst_bytes(job: dict) -> float | None:
    """The largest measured / model bytes over a job's tasks (or hosts: a
    netlab job holds its hosts' socket bytes there and their NIC bytes in
    `nic_bytes_per_step`; one stored before the sockets were read there
    has only the NIC bytes, TCP/IP headers and acknowledgements included)."""
    model, sent = job.get("model_bytes_per_step", {}), job.get("bytes_per_step", {})
    return max((sent[t] / model[t] for t in model if model[t] and t in sent), default=None)


def middle(jobs: list) -> dict:
    return sorted(jobs, key=lambda j: j["steps_per_s"])[len(jobs) // 2]


def markdown(paths) -> None:
    data = load(paths)
    for network in ("loopback", "1gbit", "100mbit"):
        for model in ("lm", "classifier"):
            keys = sorted(k for k in data if k[0] == network and k[1] == model)
            if not keys:
                continue
            jobs = sorted({len(j) for k in keys for j in data[k].values()})
            count = "-".join(map(str, (jobs[0], jobs[-1]) if len(jobs) > 1 else jobs))
            print(f"\n{network}, {model} (steps/s, median of {count} job(s) per mode; ratios "
                  "to the fastest of ring+servers, bfb+servers, ps and allreduce)\n")
            print("| workers, servers | hybrid | hybrid, predicted plan | auto | ring+servers | "
                  "bfb+servers | ps | allreduce | MWMS | hybrid / best | auto / best | "
                  "hybrid chose | x model |")
            print("|---|" + "---|" * 12)
            for key in keys:
                modes = with_serverless(data, key)
                speed = {m: median(j) for m, j in modes.items()}
                best = max(speed[m] for m in FIXED if m in speed)
                cells = [f"{speed[m]:.2f}" if m in speed else "-" for m in COLUMNS]
                mid = middle(modes["hybrid"]) if "hybrid" in modes else {}
                ratio = lambda m: f"{speed[m] / best:.3f}" if m in speed else "-"  # noqa: E731
                bold = [f"**{c}**" if m in FIXED and m in speed and speed[m] == best else c
                        for m, c in zip(COLUMNS, cells)]
                layout = "1 server" if key[3] == "one" else "a server per host"
                print(f"| {key[2]}, {layout} | " + " | ".join(bold) +
                      f" | {ratio('hybrid')} | {ratio('auto-ps')} | "
                      f"{SHORT.get(chose(mid), chose(mid)) if mid else '-'} | "
                      f"{worst_bytes(mid) or 0:.3f} |")
    print("\nThe model of the links against the measurement: for each plan hybrid weighed "
          "that a fixed mode also ran, its predicted communication time (its busiest link "
          "plus its rounds of messages; compute is not in it) and the fixed mode's "
          "measured step time; "
          "`missed` where the measured fastest of them was not the plan chosen\n")
    print("| setting | plan | predicted communication ms | measured step ms | "
          "measured / predicted | |")
    print("|---|---|---|---|---|---|")
    for key in sorted(data):
        modes = with_serverless(data, key)
        weighed = "hybrid-predicted" if "hybrid-predicted" in modes else "hybrid"
        if weighed not in modes:     # (a job that moved to a timed plan keeps no choice)
            continue
        mid = middle(modes[weighed])
        predicted = {SAME[c["label"]]: c["seconds"] for c in mid.get("choice", [])
                     if c["label"] in SAME}
        chosen = [SAME.get(c["label"], c["label"]) for c in mid.get("choice", [])
                  if c["chosen"]]
        measured = {m: 1 / median(j) for m, j in modes.items() if m in predicted}
        if not chosen or not measured:
            continue
        fastest = min(measured, key=measured.get)
        for m in sorted(measured, key=measured.get):
            mark = "chosen" if m == chosen[0] else ""
            if m == fastest and m != chosen[0]:
                mark = f"missed: {chosen[0]} was chosen"
            print(f"| {key[0]} {key[1]} {key[2]}w {key[3]} | {m} | "
                  f"{predicted[m] * 1e3:.1f} | {measured[m] * 1e3:.1f} | "
                  f"{measured[m] / predicted[m]:.2f} | {mark} |")


NETWORKS, MODELS, WORKERS, LAYOUTS = ("loopback", "1gbit", "100mbit"), ("lm", "classifier"), \
    (2, 4), ("one", "per_host")
RESULTS = os.path.join(HERE, "results")
CPU_BOUND = 0.85    # the share of the cores busy that makes a setting CPU-bound
RATES = {"1gbit": 1e9 / 8, "100mbit": 1e8 / 8}     # a netlab NIC's bytes/s each way


def nic_bound(network: str, job: dict) -> float | None:
    """The steps/s a job's busiest host's NIC allows at `network`'s rate
    (the bytes it sent a step, measured at the NIC where the job has them),
    or None on loopback."""
    rate = RATES.get(network)
    busiest = max(job.get("nic_bytes_per_step", job.get("bytes_per_step", {})).values(),
                  default=0)
    return rate / busiest if rate and busiest else None


def busy_cores(job: dict, workers: int) -> float | None:
    """The cores a job's workers kept busy: worker 0's CPU seconds a step
    (every process on its host but the servers, measured in the window)
    times the workers and the steps/s; servers not counted."""
    cpu = job.get("cpu_seconds_per_step", {}).get("worker 0")
    return cpu * workers * job["steps_per_s"] if cpu else None


def verdict(modes: dict, network: str = "loopback",
            workers: int = 0) -> tuple[str, list[str]]:
    """(a line of figures, what falls short) for one setting's modes; a
    mode below MultiWorkerMirroredStrategy is marked NIC-bound where its
    busiest host's bytes at the NIC's rate allow fewer steps/s than
    MultiWorkerMirroredStrategy ran, and hybrid or auto short of the
    fastest fixed mode as CPU-bound where that mode's workers kept
    CPU_BOUND of the machine's cores busy (the jobs' record, else this
    machine's count)."""
    wanted = [m for m in MODES if m != "hybrid-predicted"]
    missing = [m for m in wanted if m not in modes]
    few = [m for m in wanted if m in modes and len(modes[m]) < 3]
    speed = {m: median(j) for m, j in modes.items()}
    fastest = max((m for m in FIXED if m in speed), key=speed.get, default=None)
    best = speed[fastest] if fastest else None
    short = ([f"missing {','.join(missing)}"] if missing else []) + (
        [f"under 3 jobs: {','.join(few)}"] if few else [])
    figures = []
    for mode in ("hybrid", "auto-ps"):
        if mode in speed and best:
            ratio = speed[mode] / best
            figures.append(f"{mode} {ratio:.3f}x")
            if ratio < 0.97:
                job = middle(modes[fastest])
                busy, cores = busy_cores(job, workers), job.get("cores", os.cpu_count())
                short.append(f"{mode} {ratio:.3f}x the best fixed mode" + (
                    f" (CPU-bound: its workers kept {busy:.2f} of {cores} cores busy)"
                    if busy and busy >= CPU_BOUND * cores else ""))
            worst = worst_bytes(middle(modes[mode]))
            if worst and worst > 1.05:
                short.append(f"{mode}'s bytes {worst:.3f}x its model")
    if "mwms" in speed:
        slower = []
        for m in (m for m in speed if m != "mwms" and speed[m] < speed["mwms"]):
            bound = nic_bound(network, middle(modes[m]))
            slower.append(f"{m} {speed[m] / speed['mwms']:.2f}x" + (
                f" (NIC-bound: its busiest host's bytes allow {bound:.2f} steps/s)"
                if bound and bound < speed["mwms"] else ""))
        if slower:
            short.append("below MWMS: " + ", ".join(slower))
    if best:
        figures.append(f"best {fastest} {best:.2f} steps/s")
    return "; ".join(figures), short


def grid(paths) -> None:
    if not paths:
        paths = sorted(os.path.join(RESULTS, f) for f in os.listdir(RESULTS)
                       if f.startswith("dense_choice-") and f.endswith(".jsonl"))
    data = load(paths)
    todo: dict = {}
    held = 0
    for network in NETWORKS:
        for model in MODELS:
            for workers in WORKERS:
                for layout in LAYOUTS:
                    key = (network, model, workers, layout)
                    modes = with_serverless(data, key)
                    figures, short = verdict(modes, network, workers)
                    held += not short
                    rerun = [m for m in MODES if m != "hybrid-predicted" and
                             len(modes.get(m, ())) < 3 and (layout == "one" or
                                                            m not in SERVERLESS)]
                    print(f"{network:8} {model:10} {workers}w {layout:8} " + (
                        "holds" if not short else "not run" if not figures else "SHORT") +
                        f"  {figures}")
                    for s in short if figures else ():
                        print(f"    {s}")
                    if rerun:
                        todo.setdefault((network, tuple(rerun)), []).append(key)
    print(f"\n{held} of {len(NETWORKS) * len(MODELS) * len(WORKERS) * len(LAYOUTS)} "
          "settings hold. To run the modes with fewer than 3 jobs:")
    for (network, rerun), keys in sorted(todo.items()):
        for key in keys:
            print(f"  dense_choice.py run --networks {network} --models {key[1]} "
                  f"--workers {key[2]} --layouts {key[3]} --modes {','.join(rerun)}")


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
    p.add_argument("paths", nargs="+")
    p.add_argument("--markdown", action="store_true")
    g = sub.add_parser("grid")
    g.add_argument("paths", nargs="*")
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    elif args.command == "grid":
        grid(args.paths)
    elif args.markdown:
        markdown(args.paths)
    else:
        report(args.paths)


if __name__ == "__main__":
    main()
