"""lm_small on a localhost job: 2 workers (+ parameter servers where the mode
uses them), for parallax_ng's hybrid (dense variables by balanced fusion
buffers with one server or a server per worker host, or by all-reduce in
stages), allreduce and ps run options and for TensorFlow's
MultiWorkerMirroredStrategy training the same model; on loopback, or with
--netlab RATE on emulated hosts with rate-limited NICs.

    python benchmarks/cluster_lm.py [--steps 500] [--warmup 50] [--repeats 1]
                                    [--workers 2] [--vocab N] [--modes a,b,...]

`--netlab` uses ../shared/tools/netlab beside the checkout, or $NETLAB.
`--modes ablation` runs the rows of a Table-4-shaped ablation (2 servers);
`--modes sparse` the sparse variables by alltoall, allgather, servers
(hybrid) and as dense all-reduce (EmbRace's comparison), with the gradient
rows a worker sends per step before and after coalescing;
`--modes scheduling` alltoall without and with prefetch, all-reduce of the
dense gradients without and with horizontal scheduling, and both (no
clipping), with the gradient rows sent first (those the next batch reads:
EmbRace's Table 3, prioritized);
`balance-*` modes put only dense gradients on 2 or 3 servers. A mode
`MODE+fp16` or `MODE+bf16` is MODE with gradients in 16 bits
(`communication.compression`); `MODE+factors` is MODE with dense weights
whose gradients are products by their factors (`dense_method: factors`).
`--modes fit` (with `--model classifier`) trains the classifier as a Keras
model with `model.fit`: Keras 3 through parallax_ng's TF2 front end
(`pn.parallelize`; `keras3` the default hybrid plan, `keras3-allreduce`),
and tf_keras under MultiWorkerMirroredStrategy (`mwms-fit`; Keras 3's fit
does not run under it), beside the TF1 graph's `hybrid` and `allreduce`.

Each mode is one `parallax-ng run` job. Worker 0 times a window of --steps
steps after --warmup steps, and counts the bytes every process of the job
sent in that window at its TCP sockets (`ss -tinp`, bytes_sent summed over
the sockets the process owns; under `--netlab`, over every socket of each
emulated host, beside the bytes its NIC carried: those add the TCP/IP
headers and the acknowledgements of what the host received). Prints
steps/s and bytes sent per step per process, and both as ratios to
MultiWorkerMirroredStrategy; for parallax_ng modes also the Parallax
traffic model's bytes per process beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
MODES = ("hybrid", "auto-ps", "hybrid-allreduce", "hybrid-bfb", "allreduce", "ps", "mwms")
# sparse variables (lm_small's embedding and softmax weights) by each method,
# dense ones by all-reduce: `--modes sparse` (EmbRace's comparison)
SPARSE = ("alltoall", "allgather", "hybrid", "dense-allreduce", "auto")
# EmbRace's 2D scheduling: vertical (prefetch) against alltoall without it,
# horizontal (dense updates a step later by layer) against all-reduce
# without it, and both; all without global-norm clipping (a global norm
# over the dense gradients needs their all-reduce in their step, so the
# horizontal schedule cannot wait): `--modes scheduling` runs them all
# `--model classifier`: the dense-heavy model (`classifier` below)
CLASSIFIER = {"vocab": 200000, "dim": 128, "hidden": 256, "classes": 2000}
# the classifier by `model.fit` (`--modes fit`): the TF2 front end against
# the TF1 graph of the same model and against tf_keras under MWMS
FIT = ("keras3", "keras3-allreduce", "mwms-fit")
FIT_ROWS = ("hybrid", "allreduce", *FIT)
NO_CLIP = ("alltoall-noclip", "prefetch", "allgather-noclip", "horizontal", "2d")
TWO = "[127.0.0.1, 127.0.0.1]"
OFF = {"local_aggregation": False, "colocate_updates": False, "lookups_on_servers": False}
# Parallax's Table 4, one feature added per row (2 servers): a plain
# parameter server, then hybrid (dense by all-reduce), local aggregation,
# the other placement rewrites, balanced fusion buffers, coalesced rows,
# distinct lookups (the last row is hybrid's default)
PREDICTED = {"tuning": {"plans": 1}}    # the planner's prediction trains, none timed
ABLATION = {
    "ps-plain": {"run_option": "ps", "placement_rewrites": OFF, "coalesce_rows": False,
                 "distinct_lookups": False},
    "+hybrid": {"run_option": "hybrid", "dense_method": "allreduce", "placement_rewrites": OFF,
                "coalesce_rows": False, "distinct_lookups": False},
    "+local-aggregation": {"run_option": "hybrid", "dense_method": "allreduce",
                           "placement_rewrites": {**OFF, "local_aggregation": True},
                           "coalesce_rows": False, "distinct_lookups": False},
    "+placement": {"run_option": "hybrid", "dense_method": "allreduce",
                   "coalesce_rows": False, "distinct_lookups": False},
    "+fusion-buffers": {"run_option": "hybrid", "coalesce_rows": False,
                        "distinct_lookups": False, **PREDICTED},
    "+coalesced-rows": {"run_option": "hybrid", "distinct_lookups": False, **PREDICTED},
    "+distinct-lookups": {"run_option": "hybrid", **PREDICTED},
}
# mode -> (parallax_ng config, the resource file's `ps:`). hybrid: the
# default (dense variables by the method the link model finds fastest, the
# three fastest predictions timed while training), one server; -allreduce: dense by all-reduce (collectives in a session run
# beside the servers'); -bfb: dense by balanced fusion buffers; -per-host:
# a server beside each worker; -no-server: none (the ring, kernels by
# their factors where faster, sparse by all-gather). `--layout per_host` gives every mode with a
# server a server per worker host instead
CONFIGS = {"hybrid": ({"run_option": "hybrid"}, "[127.0.0.1]"),
           "hybrid-allreduce": ({"run_option": "hybrid", "dense_method": "allreduce"},
                                "[127.0.0.1]"),
           "hybrid-bfb": ({"run_option": "hybrid", "dense_method": "bfb"}, "[127.0.0.1]"),
           "hybrid-per-host": ({"run_option": "hybrid"}, "per_host"),
           "hybrid-no-server": ({"run_option": "hybrid"}, None),
           "allreduce": ({"run_option": "allreduce"}, None),
           "allgather": ({"run_option": "allreduce"}, None),
           "alltoall": ({"run_option": "allreduce", "sparse_method": "alltoall"}, None),
           "dense-allreduce": ({"run_option": "allreduce", "sparse_method": "allreduce"}, None),
           "alltoall-noclip": ({"run_option": "allreduce", "sparse_method": "alltoall"}, None),
           "prefetch": ({"run_option": "allreduce", "sparse_method": "alltoall",
                         "prefetch": True}, None),
           "allgather-noclip": ({"run_option": "allreduce"}, None),
           "horizontal": ({"run_option": "allreduce", "horizontal_scheduling": True}, None),
           "2d": ({"run_option": "allreduce", "sparse_method": "alltoall", "prefetch": True,
                   "horizontal_scheduling": True}, None),
           "auto": ({"run_option": "auto"}, None),
           "auto-ps": ({"run_option": "auto"}, "[127.0.0.1]"),   # servers to weigh too
           # the planner's three fastest predictions timed while training (the
           # default, `tuning.plans: auto`; a warm-up of 300 steps or more
           # covers the trials), or its prediction alone
           "hybrid-plans": ({"run_option": "hybrid", "tuning": {"plans": 3}}, "[127.0.0.1]"),
           "hybrid-predicted": ({"run_option": "hybrid", **PREDICTED}, "[127.0.0.1]"),
           "ps": ({"run_option": "ps"}, "[127.0.0.1]"),
           "mwms": (None, None),
           "keras3": ({"run_option": "hybrid"}, "[127.0.0.1]"),
           "keras3-allreduce": ({"run_option": "allreduce"}, None),
           "mwms-fit": (None, None),
           **{mode: (config, TWO) for mode, config in ABLATION.items()},
           # servers that carry only dense gradients (sparse by all-gather), to
           # see their balance: fusion buffers, or whole variables (greedy by
           # bytes, round robin)
           **{f"balance-{how}-{n}": ({"run_option": "allreduce", "dense_method": method,
                                      "ps_placement": placement},
                                     "[" + ", ".join(["127.0.0.1"] * n) + "]")
              for how, method, placement in (("bfb", "bfb", "greedy"),
                                             ("greedy", "ps", "greedy"),
                                             ("rr", "ps", "round_robin"))
              for n in (2, 3)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--fixed-warmup", type=int, default=None,
                        help="warm-up steps for modes that time no plans while training "
                             "(default: --warmup); a job that did time some fails")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (median)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"any of {', '.join(CONFIGS)}; 'ablation' for its rows")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None, help="the model's vocabulary")
    parser.add_argument("--model", choices=("lm", "classifier"), default="lm",
                        help="lm_small, or the dense-heavy classifier (2.2 MB of dense "
                             "weights beside a 200,000-row embedding)")
    parser.add_argument("--layout", choices=("one", "per_host"), default="one",
                        help="modes with a server: one server, or one beside every worker")
    parser.add_argument("--no-clip", action="store_true", help="no global-norm clipping")
    parser.add_argument("--optimizer", choices=("adagrad", "sgd"), default="adagrad",
                        help="the classifier's optimizer (sgd: plain SGD, whose Keras 3 "
                             "update of the table stays sparse as TF1's does)")
    parser.add_argument("--config", default="{}",
                        help="more config keys for every parallax_ng mode, as JSON")
    parser.add_argument("--json", metavar="FILE",
                        help="append the setting and every job's result as a JSON line")
    parser.add_argument("--netlab", metavar="RATE",
                        help="run every task on its own emulated host with a NIC of RATE "
                             "(e.g. 100mbit, 1gbit; ../shared/tools/netlab); bytes are then "
                             "read at each host's sockets and NIC")
    parser.add_argument("--mode", help=argparse.SUPPRESS)      # inside a job
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return worker(args)
    results = {}
    if args.netlab:     # the workers' hosts, and one more for a single server
        subprocess.run([NETLAB, "up", str(args.workers + 1), args.netlab], check=True,
                       capture_output=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            modes = args.modes.replace("ablation", ",".join(ABLATION)).replace(
                "sparse", ",".join(SPARSE)).split(",")
            modes = [m for mode in modes for m in (FIT_ROWS if mode == "fit" else (mode,))]
            if args.model != "classifier" and {m.split("+")[0] for m in modes} & set(FIT):
                raise SystemExit(f"modes {FIT} train the classifier: add --model classifier")
            modes = [m for mode in modes for m in (NO_CLIP if mode == "scheduling" else
                                                   (mode,))]
            every = {mode: [] for mode in modes}
            for r in range(args.repeats):    # modes interleaved: a drift hits them alike
                for mode in modes:
                    every[mode].append(job(mode, args, tmp, r))
                    if args.repeats > 1:
                        tuned = every[mode][-1].get("tuned") or {}
                        print(f"{mode:16} run {r + 1}: "
                              f"{every[mode][-1]['steps_per_s']:.2f} steps/s" + "".join(
                                  f"; tuned {k} = {v['chosen']}" for k, v in tuned.items()),
                              flush=True)
            for mode, runs in every.items():
                results[mode] = sorted(runs, key=lambda r: r["steps_per_s"])[len(runs) // 2]
                print(f"{mode:16} {format_row(results[mode])}", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps({"model": args.model, "workers": args.workers,
                                            "devices": args.devices, "layout": args.layout,
                                            "network": args.netlab or "loopback",
                                            "vocab": args.vocab, "steps": args.steps,
                                            "clip": not args.no_clip,
                                            "optimizer": args.optimizer,
                                            "mode": mode, "commit": commit(),
                                            "date": time.strftime("%Y-%m-%d"),
                                            "cores": os.cpu_count(),
                                            "runs": runs}) + "\n")
    finally:
        if args.netlab:
            subprocess.run([NETLAB, "down"], capture_output=True)
    report(results, ablation=args.modes == "ablation")


NETLAB = os.environ.get("NETLAB", os.path.join(os.path.dirname(ROOT), "shared", "tools", "netlab"))
_ports = iter(range(31000, 40000, 10))


def commit() -> str | None:
    """The commit of the tree this benchmark runs from, if it is a clone."""
    out = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)),
                          "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def config_of(mode: str) -> tuple:
    """(config, servers) of a mode; `MODE+fp16` / `MODE+bf16` is MODE with
    compressed gradients (communication.compression), `MODE+factors` with
    `dense_method: factors` (both: `MODE+factors+fp16`)."""
    base, *extras = mode.split("+")
    config, servers = CONFIGS[base]
    for extra in extras:
        config = {**config, **({"dense_method": "factors"} if extra == "factors" else
                               {"communication": {"compression": extra}})}
    return config, servers


def resource_file(mode: str, args, path: str) -> None:
    servers = config_of(mode)[1]
    if args.layout == "per_host" and servers == "[127.0.0.1]":
        servers = "per_host"
    with open(path, "w") as f:
        devices = ", ".join(f"cpu:{d}" for d in range(args.devices))
        if not args.netlab:
            f.write("hosts:\n" + f"  - address: 127.0.0.1\n    devices: [{devices}]\n"
                    * args.workers)
            if servers:
                f.write(f"ps: {servers}\n")
            return
        port = next(_ports)
        f.write("hosts:\n" + "".join(f"  - address: 10.254.0.{10 + i}:{port + 2 * i}\n"
                                     f"    devices: [{devices}]\n"
                                     for i in range(args.workers)))
        if servers == "per_host":
            f.write("ps: per_host\n")
        elif servers:    # one emulated host for the servers
            count = servers.count("127.0.0.1")
            f.write("ps: [" + ", ".join(f"10.254.0.{10 + args.workers}:{port + 9 - k}"
                                        for k in range(count)) + "]\n")
        f.write(f"ssh: {NETLAB} ssh\n")


class JobFailed(Exception):
    """A job that ended with an error; its whole log is kept in `kept`."""

    def __init__(self, kept: str, text: str):
        super().__init__(text)
        self.kept = kept


def job(mode: str, args, tmp: str, repeat: int) -> dict:
    """One job's result. A job that fails is run once more, and the
    result says why the first try failed (`failed_try`): one transient
    fault of TensorFlow's runtime (a RunGraph request a server took for a
    duplicate, say) would otherwise end the setting's every remaining job."""
    try:
        return _job(mode, args, tmp, repeat, 0)
    except JobFailed as first:
        why = last_error(str(first))
        print(f"{mode} job failed ({why}; its whole log: {first.kept}); once more",
              flush=True)
        try:
            result = _job(mode, args, tmp, repeat, 1)
        except JobFailed as again:
            raise SystemExit(f"{mode} job failed twice (its whole log: {again.kept}):\n"
                             f"{str(again)[-3000:]}")
        result["failed_try"] = why
        return result


def last_error(text: str) -> str:
    """The last lines of a job's log (the error TensorFlow reported, and
    the launcher's line), without its tasks' prefixes and tracebacks."""
    lines = [re.sub(r"^\[[a-z]+ \d+\] ", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("File ", "^", "Traceback"))
             and "^^^" not in line]
    return " / ".join(lines[-3:])[-400:] if lines else "an empty log"


def times_plans(mode: str) -> bool:
    """Whether a mode's plan may be timed while it trains (hybrid and auto
    with the dense method left to them, `tuning.plans` not 1): its warm-up
    must hold the trials."""
    config = config_of(mode)[0]
    return bool(config) and config.get("run_option") in ("hybrid", "auto") and (
        "dense_method" not in config) and config.get("tuning", {}).get("plans") != 1


def warmup_of(mode: str, args) -> int:
    return args.warmup if args.fixed_warmup is None or times_plans(mode) else args.fixed_warmup


def _job(mode: str, args, tmp: str, repeat: int, attempt: int) -> dict:
    res, warmup = os.path.join(tmp, f"{mode}.yaml"), warmup_of(mode, args)
    resource_file(mode, args, res)
    out = os.path.join(tmp, f"{mode}-{repeat}-{attempt}.json")   # a try's own window marks
    cmd = [sys.executable, "-m", "parallax_ng", "run", os.path.abspath(__file__),
           "-r", res, "--", "--mode", mode, "--out", out, "--steps", str(args.steps),
           "--warmup", str(warmup), "--devices", str(args.devices),
           "--model", args.model, "--config", args.config] + (
               ["--no-clip"] if args.no_clip else []) + ["--optimizer", args.optimizer] + (
               ["--vocab", str(args.vocab)] if args.vocab else [])
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        nic = nic_window(out, proc) if args.netlab else None
        if proc.wait(timeout=1800) != 0:
            log.seek(0)
            text = log.read()
            kept = os.path.join(tempfile.gettempdir(),
                                f"cluster_lm-{mode}-{repeat}-{attempt}.log")
            with open(kept, "w") as f:
                f.write(text)
            raise JobFailed(kept, text)
    with open(out) as f:
        result = json.load(f)
    result["warmup"] = warmup
    if result.get("tuned") and warmup != args.warmup:
        raise SystemExit(f"{mode} timed {sorted(result['tuned'])} in its short warm-up "
                         f"(--fixed-warmup {args.fixed_warmup}): run it with --warmup")
    if nic is not None:     # the hosts' sockets and NICs over the timed window
        names = [f"host of worker {i}" for i in range(args.workers)] + ["server host"]
        sockets, wire = nic
        result["bytes_per_step"] = {names[int(host.split()[1])]: b / args.steps
                                    for host, b in sockets.items()}
        result["nic_bytes_per_step"] = {names[int(host.split()[1])]: b / args.steps
                                        for host, b in wire.items()}
    return result


def nic_window(out: str, proc) -> tuple[dict, dict] | None:
    """Bytes each emulated host sent between worker 0's window marks, at
    its TCP sockets and at its NIC: worker 0 writes OUT.start and waits
    for OUT.go, and after its timed steps writes OUT.stop and waits for
    OUT.stopped (the steps that count rows for the model come after), so
    both are read while the job waits."""
    before = None
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline and proc.poll() is None:
        if before is None and os.path.exists(out + ".start"):
            before = netlab_bytes()
            open(out + ".go", "w").close()
        if before is not None and os.path.exists(out + ".stop"):
            after = netlab_bytes()
            open(out + ".stopped", "w").close()
            return tuple({h: a[h] - b.get(h, 0) for h in a} for a, b in zip(after, before))
        time.sleep(0.005)
    return None


def netlab_bytes() -> tuple[dict[str, int], dict[str, int]]:
    """What each emulated host has sent: bytes_sent over its TCP sockets
    (what the traffic model counts), and its NIC's bytes."""
    text = subprocess.run([NETLAB, "bytes"], capture_output=True, text=True).stdout
    hosts = {f"host {m.group(1)}": (m.group(2), int(m.group(3)))
             for m in re.finditer(r"host (\d+) (\S+) sent (\d+)", text)}
    sockets = {}
    for host, (address, _) in hosts.items():
        listed = subprocess.run([NETLAB, "ssh", address, "ss -tin"], capture_output=True,
                                text=True).stdout
        sockets[host] = sum(int(b) for b in re.findall(r"bytes_sent:(\d+)", listed))
    return sockets, {host: sent for host, (_, sent) in hosts.items()}


def format_row(r: dict) -> str:
    model = r.get("model_bytes_per_step", {})
    sent = ", ".join(f"{task} {b / 1e6:.3f} MB" + (
        f" (model {model[task] / 1e6:.3f}, {b / model[task]:.3f}x)" if model.get(task) else "")
        for task, b in sorted(r["bytes_per_step"].items()))
    wire = r.get("nic_bytes_per_step", {})
    if wire:
        sent += "; at the NICs: " + ", ".join(f"{host} {b / 1e6:.3f} MB"
                                              for host, b in sorted(wire.items()))
    servers = [b for task, b in r["bytes_per_step"].items() if task.startswith("ps ")]
    balance = (f"  servers max/mean {max(servers) * len(servers) / sum(servers):.3f}"
               if len(servers) > 1 and sum(servers) else "")
    sparse = ", ".join(f"{v} {m}" for v, m in sorted(r.get("methods", {}).items())
                       if v in r.get("gradient_rows", {}))
    rows = ", ".join(f"{v} {n['before']:.0f} -> {n['after']:.0f}" + (
        f" -> {n['prior']:.0f} first" if "prior" in n else "")
        for v, n in sorted(r.get("gradient_rows", {}).items()))
    cpu = r.get("cpu_seconds_per_step", {})
    busy = (f"\n{'':17}CPU ms per step: " + ", ".join(
        f"{task} {s * 1e3:.1f}" for task, s in sorted(cpu.items())) +
        f" (all {sum(cpu.values()) * 1e3:.1f})") if cpu else ""
    return (f"{r['steps_per_s']:7.2f} steps/s  sent per step: {sent}{balance}{busy}" +
            (f"\n{'':17}sparse: {sparse}; gradient rows per replica and step: {rows}"
             if rows else ""))


def report(results: dict, ablation: bool = False) -> None:
    """Steps/s and bytes against MultiWorkerMirroredStrategy, or, for the
    ablation, against its first row."""
    name = "first row" if ablation else "MWMS"
    base = next(iter(results.values())) if ablation else \
        results.get("mwms") or results.get("mwms-fit")
    print(f"\nmode                 steps/s  vs {name:9}  MB sent/step (all processes)  vs {name}")
    for mode, r in results.items():
        total = sum(r["bytes_per_step"].values())
        speed = f"{r['steps_per_s'] / base['steps_per_s']:7.2f}x" if base else "      -"
        base_total = sum(base["bytes_per_step"].values()) if base else 0
        size = f"{total / base_total:7.2f}x" if base_total else "      -"
        print(f"{mode:19} {r['steps_per_s']:8.2f} {speed:>12} {total / 1e6:14.3f} {'':14} {size}")
    for tf2, tf1 in (("keras3", "hybrid"), ("keras3-allreduce", "allreduce")):
        if tf2 in results and tf1 in results:     # the TF2 front end against the TF1 graph
            print(f"{tf2} / {tf1} (TF1 graph): "
                  f"{results[tf2]['steps_per_s'] / results[tf1]['steps_per_s']:.2f}x")


def traffic_model(plan, rows: dict, index_bytes: dict, looked_up: dict, info) -> dict:
    """Bytes each task sends per step by the Parallax paper's traffic model
    (Table 3; parallax_ng/planning/traffic.py) for `plan`, with the rows a worker's
    sparse gradients send (`rows`, measured) and the ids its lookups ask a
    server for (`looked_up`); on emulated hosts, what each host's link
    carries out, named as the NICs are read."""
    from parallax_ng.planning import traffic
    flows = traffic.flows(plan, index_bytes, rows, looked_up)
    if not is_emulated(info):
        return traffic.task_bytes(flows)
    layout = traffic.Layout.of(info)
    sent = traffic.links(flows, layout).sent
    names = {layout.end(f"worker {i}"): f"host of worker {i}" for i in range(len(info.workers))}
    names.update({layout.end(f"ps {j}"): "server host" for j in range(len(info.ps))
                  if layout.end(f"ps {j}") not in names})
    return {names[end]: b for end, b in sent.items()}


# -- inside the job -----------------------------------------------------------
def model_arguments(args):
    """lm_small's options for `args.model`: the example's default model (or
    its --vocab), or the classifier's sizes."""
    import lm_small
    sizes = ["--vocab", str(args.vocab or CLASSIFIER["vocab"]), "--dim",
             str(CLASSIFIER["dim"]), "--hidden", str(CLASSIFIER["hidden"])] \
        if args.model == "classifier" else (["--vocab", str(args.vocab)] if args.vocab else [])
    model_args = lm_small.arguments(sizes + (["--clip", "0"] if args.mode in NO_CLIP or
                                             args.no_clip else []))
    model_args.model = args.model
    model_args.classes = CLASSIFIER["classes"]
    model_args.optimizer = args.optimizer
    return model_args


def worker(args) -> None:
    from parallax_ng import cluster
    info = cluster.from_env()
    model_args = model_arguments(args)
    if args.mode.split("+")[0] in FIT:    # keras3+fp16 is Keras 3's fit too
        return fit_worker(args, info, model_args)
    runner = None
    if args.mode == "mwms":
        step = mwms_step(info, model_args)
    else:
        step, runner, fetch = parallax_step(args.mode, model_args, json.loads(args.config))
    for _ in range(args.warmup):
        step()
    measure = info.task == 0
    tasks = task_pids(info) if measure else {}
    before = sent_bytes(tasks.values()) if measure else {}
    cpu_before = cpu_seconds(tasks.values())
    emulated = measure and args.out and is_emulated(info)   # the coordinator reads NICs
    if emulated:
        handshake(args.out + ".start", args.out + ".go")
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    after = sent_bytes(tasks.values()) if measure else {}
    cpu_after = cpu_seconds(tasks.values())
    if emulated:
        handshake(args.out + ".stop", args.out + ".stopped")
    model, rows = model_of(runner, fetch, info) if runner is not None else ({}, {})  # every worker
    if measure:
        per_step = {name: (after.get(pid, 0) - before.get(pid, 0)) / args.steps
                    for name, pid in tasks.items()}
        cpu = {name: (cpu_after[pid] - cpu_before[pid]) / args.steps for name, pid in
               tasks.items() if pid in cpu_before and pid in cpu_after}
        plan = runner.plan if runner else None
        methods = {v: vp.method for v, vp in plan.variables.items()} if plan else {}
        with open(args.out, "w") as f:
            json.dump({"steps_per_s": args.steps / seconds, "bytes_per_step": per_step,
                       "cpu_seconds_per_step": cpu, "model_bytes_per_step": model, "methods": methods,
                       "gradient_rows": rows,
                       # the plans hybrid or auto weighed, and the network they assumed
                       "choice": [dict(vars(c)) for c in plan.choice] if plan else [],
                       "network": plan.network if plan else "",
                       "tuned": runner.tuned if runner else {}}, f)


MODEL_STEPS = 20


def handshake(mark: str, answer: str) -> None:
    """Tell the coordinator (file `mark`) and wait for its `answer`."""
    open(mark, "w").close()
    waited = time.monotonic()
    while not os.path.exists(answer) and time.monotonic() - waited < 60:
        time.sleep(0.005)


def model_of(runner, fetch, info) -> tuple[dict, dict]:
    """The traffic model with the distinct rows this worker's sparse
    gradients held over MODEL_STEPS more training steps (the ids its
    lookups asked for are the same rows), and the gradient rows a replica
    sends per step of each sparse variable before coalescing (one per id
    looked up) and as the plan sends them."""
    import numpy as np

    grads = runner.ctx.tg.gradients
    sparse = sorted(v for v in runner.plan.variables if grads[v].sparse)
    names = [f"{grads[v].indices.node}:{grads[v].indices.index}" for v in sparse]
    ahead = [v for v in sparse if runner.plan.variables[v].prefetch]
    steps = [n for f in fetch for n in runner.fetches.fetch(f, False).names]
    prior = [f"parallax/prefetch/{v}/replica_0/split/prior_ids:0" for v in ahead]
    rows = {v: 0.0 for v in sparse}
    ids = {v: 0.0 for v in sparse}
    first = {v: 0.0 for v in ahead}
    index_bytes = {}
    for _ in range(MODEL_STEPS):
        if ahead:    # the rows the step's batch reads of the last step's (replica 0)
            values = runner.session.run(steps + [runner.fetches.fetch(n, False).names[0]
                                                 for n in names] + prior)[len(steps):]
            for v, idx in zip(ahead, values[len(names):]):
                first[v] += len(idx) / MODEL_STEPS
        else:
            values = runner.run(fetch + names)[len(fetch):]
        for v, idx in zip(sparse, values):
            rows[v] += len(np.unique(idx)) / MODEL_STEPS
            ids[v] += len(idx) / MODEL_STEPS
            index_bytes[v] = idx.dtype.itemsize
    plan = runner.plan
    coalesced = {v: rows[v] if plan.variables[v].coalesce else ids[v] for v in sparse}
    looked_up = rows if plan.distinct_lookups else ids
    sent = {v: {"before": ids[v], "after": coalesced[v],
                **({"prior": first[v]} if v in first else {})} for v in sparse}
    return traffic_model(plan, coalesced, index_bytes, looked_up, info), sent


def is_emulated(info) -> bool:
    return info.workers[0].startswith("10.254.0.")


def parallax_step(mode: str, model_args, extra: dict):
    """(one training step, the runner, what a step fetches)."""
    import lm_small

    import parallax_ng as pn
    build = classifier if model_args.model == "classifier" else lm_small.build
    graph, train_op, loss, _, init = build(model_args)
    runner = pn.get_runner(graph, None, {**config_of(mode)[0], **extra})
    runner.run(init)
    fetch = [train_op, loss]
    return (lambda: runner.run(fetch)), runner, fetch


def classifier(a):
    """The dense-heavy model: the mean of the CONTEXT words' embeddings (a
    [vocab, dim] table read by Zipf ids, sparse gradient) -> a hidden layer
    -> logits over `classes` classes (the next word's id modulo classes),
    softmax cross-entropy; Adagrad and global-norm clipping as lm_small.
    Its dense layers hold dim*hidden + hidden*classes weights (2.2 MB at
    128, 256 and 2000): most of a step's bytes."""
    import lm_small
    import tensorflow as tf

    import parallax_ng as pn
    tf1 = tf.compat.v1
    contexts, targets = lm_small.windows(lm_small.corpus(a.vocab, a.words))
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(a.seed)
        ds = tf.data.Dataset.from_tensor_slices((contexts, targets % a.classes))
        ds = pn.shard(ds.shuffle(10000, seed=1))
        words, label = tf1.data.make_one_shot_iterator(
            ds.batch(a.batch, drop_remainder=True).repeat()).get_next()
        emb = tf1.get_variable("embedding", [a.vocab, a.dim],
                               initializer=tf1.random_uniform_initializer(-0.05, 0.05))
        zeros = tf1.zeros_initializer()
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, words), axis=1)
        h = tf.nn.relu(tf.matmul(h, tf1.get_variable("hidden/w", [a.dim, a.hidden])) +
                       tf1.get_variable("hidden/b", [a.hidden], initializer=zeros))
        logits = tf.matmul(h, tf1.get_variable("out/w", [a.hidden, a.classes])) + \
            tf1.get_variable("out/b", [a.classes], initializer=zeros)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=label, logits=logits), name="loss")
        step = tf1.train.get_or_create_global_step()
        opt = tf1.train.AdagradOptimizer(0.2) if a.optimizer == "adagrad" else \
            tf1.train.GradientDescentOptimizer(0.2)
        grads, tvars = zip(*opt.compute_gradients(loss))
        if a.clip:
            grads, _ = tf.clip_by_global_norm(grads, a.clip)
        train_op = opt.apply_gradients(zip(grads, tvars), global_step=step)
        init = tf1.global_variables_initializer()
    return graph, train_op, loss, step, init


def mwms(info):
    """MultiWorkerMirroredStrategy over the job's workers, its coordination
    service (what MWMS configures itself) given 10 minutes without a
    heartbeat before it declares a worker dead: at 100 Mbit/s and 4
    workers the broadcast of the 102 MB table fills the links for longer
    than its default, and the job aborted at its start."""
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy as strategy
    from tensorflow.python.eager import context
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(info.workers)},
                                          "task": {"type": "worker", "index": info.task}})
    context.context().configure_coordination_service(
        service_type="standalone", service_leader="/job:worker/replica:0/task:0",
        heartbeat_timeout_in_ms=600_000,
        coordinated_jobs=[strategy.coordination_config_pb2.CoordinatedJob(
            name="worker", num_tasks=len(info.workers))])
    return tf.distribute.MultiWorkerMirroredStrategy()


def mwms_step(info, model_args):
    """The same model, optimizer and clipping in TensorFlow 2 under
    MultiWorkerMirroredStrategy (a custom training loop)."""
    import lm_small
    import tensorflow as tf
    import tf_keras
    strategy = mwms(info)
    a = model_args
    contexts, targets = lm_small.windows(lm_small.corpus(a.vocab, a.words))
    if a.model == "classifier":
        targets = targets % a.classes

    def dataset(ctx):
        ds = tf.data.Dataset.from_tensor_slices((contexts, targets)).shuffle(10000, seed=1)
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(a.batch, drop_remainder=True).repeat()

    with strategy.scope():
        variables, loss_of = (mwms_classifier if a.model == "classifier" else mwms_lm)(a)
        opt = tf_keras.optimizers.Adagrad(0.2) if a.optimizer == "adagrad" else \
            tf_keras.optimizers.SGD(0.2)
    batches = iter(strategy.distribute_datasets_from_function(dataset))

    def replica_step(words, nxt):
        with tf.GradientTape() as tape:
            loss = loss_of(words, nxt)
        grads = tape.gradient(loss, variables)
        ctx = tf.distribute.get_replica_context()
        grads = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, grads)
        if a.clip:
            grads, _ = tf.clip_by_global_norm(grads, a.clip)
        opt.apply_gradients(zip(grads, variables), skip_gradients_aggregation=True)
        return loss

    @tf.function
    def train(batch):
        return strategy.run(replica_step, args=batch)

    return lambda: train(next(batches))


def mwms_lm(a):
    """lm_small's variables and loss in TensorFlow 2."""
    import lm_small
    import tensorflow as tf
    init = tf.random_uniform_initializer(-0.05, 0.05)
    glorot = tf.keras.initializers.GlorotUniform()
    emb = tf.Variable(init([a.vocab, a.dim]), name="embedding")
    hidden_w = tf.Variable(glorot([lm_small.CONTEXT * a.dim, a.hidden]))
    hidden_b = tf.Variable(tf.zeros([a.hidden]))
    project_w = tf.Variable(glorot([a.hidden, a.dim]))
    project_b = tf.Variable(tf.zeros([a.dim]))
    soft_w = tf.Variable(glorot([a.vocab, a.dim]))
    soft_b = tf.Variable(tf.zeros([a.vocab]))

    def loss(words, nxt):
        h = tf.reshape(tf.nn.embedding_lookup(emb, words), [-1, lm_small.CONTEXT * a.dim])
        h = tf.nn.relu(tf.matmul(h, hidden_w) + hidden_b)
        h = tf.tanh(tf.matmul(h, project_w) + project_b)
        return tf.reduce_mean(tf.nn.sampled_softmax_loss(
            soft_w, soft_b, tf.reshape(nxt, [-1, 1]), h, num_sampled=64,
            num_classes=a.vocab))
    return [emb, hidden_w, hidden_b, project_w, project_b, soft_w, soft_b], loss


def mwms_classifier(a):
    """The classifier's variables and loss in TensorFlow 2."""
    import tensorflow as tf
    init = tf.random_uniform_initializer(-0.05, 0.05)
    glorot = tf.keras.initializers.GlorotUniform()
    emb = tf.Variable(init([a.vocab, a.dim]), name="embedding")
    hidden_w = tf.Variable(glorot([a.dim, a.hidden]))
    hidden_b = tf.Variable(tf.zeros([a.hidden]))
    out_w = tf.Variable(glorot([a.hidden, a.classes]))
    out_b = tf.Variable(tf.zeros([a.classes]))

    def loss(words, label):
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, words), axis=1)
        h = tf.nn.relu(tf.matmul(h, hidden_w) + hidden_b)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=label, logits=tf.matmul(h, out_w) + out_b))
    return [emb, hidden_w, hidden_b, out_w, out_b], loss


def fit_worker(args, info, a) -> None:
    """The classifier as a Keras model trained by `model.fit` on global
    batches (every worker is given the same), worker 0 timing the window
    of --steps batches after --warmup in a callback and counting the bytes
    every task sent in it."""
    import lm_small
    import tensorflow as tf
    contexts, targets = lm_small.windows(lm_small.corpus(a.vocab, a.words))
    global_batch = a.batch * args.devices * len(info.workers)
    if args.mode == "mwms-fit":
        import tf_keras as k
        with mwms(info).scope():
            model = keras_classifier(k, a)
    else:
        import keras as k

        import parallax_ng as pn

        # the window's callback reads only the clock: the model is not written per batch
        model = pn.parallelize(keras_classifier(k, a), None,
                               {**config_of(args.mode)[0], "batch_sync": "never",
                                **json.loads(args.config)})
    measure = info.task == 0
    tasks = {}                     # the servers start with the first step
    emulated = measure and args.out and is_emulated(info)
    window = {}

    class Window(k.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not measure or batch not in (args.warmup - 1, args.warmup + args.steps - 1):
                return
            if batch == args.warmup - 1:
                tasks.update(task_pids(info))
                window["before"] = sent_bytes(tasks.values())
                window["cpu_before"] = cpu_seconds(tasks.values())
                if emulated:
                    handshake(args.out + ".start", args.out + ".go")
                window["start"] = time.perf_counter()
                return
            window["seconds"] = time.perf_counter() - window["start"]
            window["after"] = sent_bytes(tasks.values())
            window["cpu_after"] = cpu_seconds(tasks.values())
            if emulated:
                handshake(args.out + ".stop", args.out + ".stopped")
    ds = tf.data.Dataset.from_tensor_slices((contexts, targets % a.classes))
    model.fit(ds.batch(global_batch, drop_remainder=True).repeat(), epochs=1, verbose=0,
              steps_per_epoch=args.warmup + args.steps, callbacks=[Window()])
    if measure:
        runner = None if args.mode == "mwms-fit" else model._parallax_ng.step.runner
        methods = {v: vp.method for v, vp in runner.plan.variables.items()} if runner else {}
        per_step = {name: (window["after"].get(pid, 0) - window["before"].get(pid, 0))
                    / args.steps for name, pid in tasks.items()}
        before, after = window["cpu_before"], window["cpu_after"]
        cpu = {name: (after[pid] - before[pid]) / args.steps for name, pid in tasks.items()
               if pid in before and pid in after}
        plan = runner.plan if runner else None
        with open(args.out, "w") as f:
            json.dump({"steps_per_s": args.steps / window["seconds"],
                       "bytes_per_step": per_step, "cpu_seconds_per_step": cpu,
                       "methods": methods,
                       "choice": [dict(vars(c)) for c in plan.choice] if plan else [],
                       "network": plan.network if plan else "",
                       "tuned": runner.tuned if runner else {}}, f)


def keras_classifier(k, a):
    """The classifier as a compiled Keras model (`k`: keras or tf_keras):
    the same table, layers, initializers, Adagrad and global-norm clipping."""
    import lm_small
    model = k.Sequential([
        k.Input((lm_small.CONTEXT,), dtype="int32"),
        k.layers.Embedding(a.vocab, a.dim,
                           embeddings_initializer=k.initializers.RandomUniform(-0.05, 0.05)),
        k.layers.GlobalAveragePooling1D(),
        k.layers.Dense(a.hidden, activation="relu"),
        k.layers.Dense(a.classes)])
    kind = k.optimizers.Adagrad if a.optimizer == "adagrad" else k.optimizers.SGD
    model.compile(optimizer=kind(0.2, global_clipnorm=a.clip or None),
                  loss=k.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def task_pids(info) -> dict[str, int]:
    """Each task of the job (by its listening port) -> the pid serving it."""
    ports = {f"worker {i}": a for i, a in enumerate(info.workers)}
    ports.update({f"ps {j}": a for j, a in enumerate(info.ps)})
    listening = subprocess.run(["ss", "-tlnp"], capture_output=True, text=True).stdout
    out = {}
    for name, address in ports.items():
        port = address.rsplit(":", 1)[1]
        for line in listening.splitlines():
            cols = line.split()
            if len(cols) > 3 and cols[3].endswith(f":{port}"):
                pid = re.search(r"pid=(\d+)", line)
                if pid:
                    out[name] = int(pid.group(1))
    return out


def cpu_seconds(pids) -> dict[int, float]:
    """CPU seconds (user and system, every thread) each pid has used."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def sent_bytes(pids) -> dict[int, int]:
    """bytes_sent summed over every TCP socket each pid owns."""
    wanted = set(pids)
    text = subprocess.run(["ss", "-tinp"], capture_output=True, text=True).stdout
    out: dict[int, int] = {}
    owner = None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            m = re.search(r"pid=(\d+)", line)
            owner = int(m.group(1)) if m else None
            continue
        m = re.search(r"bytes_sent:(\d+)", line)
        if owner in wanted and m:
            out[owner] = out.get(owner, 0) + int(m.group(1))
    return out


if __name__ == "__main__":
    main()
