"""Timeline: a Chrome trace (Perfetto, chrome://tracing) of training steps.

Config `timeline: FILE` (or `parallax-ng run --timeline FILE`, which sets
PARALLAX_NG_TIMELINE for every task) traces `timeline.steps` training runs
after the first `timeline.skip` (traced: compat.trace_level) and writes every op
TensorFlow ran in them as an event: one process per task (`worker 1`,
`ps 0`: a server's ops come in the traces of the workers whose steps ran
them, one thread per worker), one thread per device, and a `steps` thread
with each step's span on the worker. Events are `compute` (`forward`,
`backward`: ops under the autodiff's scope, `update`: parallax's own and the
rest) or `communication` (collectives, Horovod ops, queue puts and takes,
transfers between tasks) with the bytes they moved (their outputs, else
their inputs' outputs in the same step) in `args`, what they carry (the
variable, bucket or buffer: the `parallax/<method>/<name>` scope) and,
the time the link model predicts for those bytes (at the rate the plan
weighed its links with, else `network.bandwidth`, else the assumed one). In a job each worker writes `FILE.worker-<i>.json` at the end
and the launcher merges the parts into FILE (`merge`).

Tracing costs: a traced step runs slower (TensorFlow times every op); the
steps outside the window are not traced.

`summary(trace)` gives, per task and step, the step's time split into
compute, communication not hidden behind compute ("exposed"), and idle;
`parallax-ng timeline FILE --png OUT` draws it (matplotlib).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import sys
from dataclasses import dataclass

from ..errors import ParallaxError

ENV = "PARALLAX_NG_TIMELINE"
COMMUNICATION = ("Collective", "Horovod", "QueueEnqueue", "QueueDequeue", "_Send", "_Recv",
                 "_HostSend", "_HostRecv", "Send", "Recv")
# the end of a transfer that holds what arrived (the other end's bytes are the same)
RECEIVING = ("Collective", "Horovod", "QueueDequeue", "_Recv", "_HostRecv", "Recv")


def task_of(device: str) -> tuple[str, str]:
    """(task, device) names of a TensorFlow device string: `worker 1`,
    `CPU:0`; an in-process device is worker 0's."""
    job = re.search(r"/job:([^/]+)", device)
    task = re.search(r"/task:(\d+)", device)
    kind = re.search(r"/device:([^/]+)", device) or re.search(r"/(cpu|gpu):(\d+)", device, re.I)
    name = kind.group(1) if kind and kind.lastindex == 1 else \
        f"{kind.group(1).upper()}:{kind.group(2)}" if kind else device
    if not job or job.group(1) == "localhost":
        return "worker 0", name
    return f"{job.group(1)} {task.group(1) if task else 0}", name


def op_type(node_stats) -> str:
    """The op type from a node's timeline label (`name = Op(inputs)`)."""
    label = node_stats.timeline_label
    if " = " in label:
        return label.split(" = ", 1)[1].split("(", 1)[0].strip()
    return label.split(" ", 1)[0] if label else node_stats.node_name


_STOP = re.compile(r"^(replica_\d+|to_server|from_server|(from|to|take|push|result)_\d+(_\d+)?|"
                   r"sum|total|narrow|put|take|reduce|norm|own|done|back|wide.*|"
                   r"Collective.*|Horovod.*|queue_\d+(_\d+)?)$")


def carried(name: str) -> str:
    """What a communication op carries, from its `parallax/<method>/...`
    scope: `allreduce dense/w`, `bfb buffer_0/shard_1`, `buckets bucket_2`,
    `server_sync queue_0`; else its node name."""
    parts = name.split("/")
    if parts[0] != "parallax" or len(parts) < 3:
        return name
    what = []
    for part in parts[2:]:
        if _STOP.match(part) and what:
            break
        what.append(part)
    return f"{parts[1]} {'/'.join(what)}"


class Timeline:
    """The traced steps of one worker."""

    @classmethod
    def of(cls, config, plan, graph) -> "Timeline | None":
        """The timeline config `timeline` (or PARALLAX_NG_TIMELINE) asks for,
        written by this worker of `plan` (a job's worker: its part), of the
        steps of `graph`."""
        path = config.timeline.file or os.environ.get(ENV)
        if not path:
            return None
        worker, workers = getattr(plan, "worker", 0), getattr(plan, "num_workers", 1)
        if workers > 1 or os.environ.get(ENV):
            path = part_path(path, worker)
        # seconds a byte takes by the link model: the rate the plan weighed
        # its links with, else the configured network, else the assumed one
        chosen = [c for c in getattr(plan, "choice", ()) if c.chosen and c.link_seconds > 0]
        if chosen:
            rate = chosen[0].link_seconds / max(chosen[0].sent, chosen[0].received, 1.0)
        else:
            from ..planning.costmodel import BANDWIDTH
            rate = 1.0 / (config.network.bandwidth or BANDWIDTH)
        out = cls(path, f"worker {worker}", config.timeline.steps, config.timeline.skip,
                  graph.as_graph_def(), rate)
        atexit.register(out.finish)     # written at the runner's close, or when the process ends
        return out

    def __init__(self, path: str, task: str, steps: int, skip: int, graph_def=None,
                 seconds_per_byte: float | None = None):
        self.path, self.task, self.steps, self.skip = path, task, steps, skip
        self.seconds_per_byte = seconds_per_byte
        self.events: list[dict] = []
        self.runs = 0              # training runs seen
        self.traced = 0
        self.written = False
        self._kept: list[tuple] = []
        self._inputs = {}
        for node in (graph_def.node if graph_def is not None else ()):
            self._inputs[node.name] = [i.split(":")[0] for i in node.input
                                       if not i.startswith("^")]

    def wants(self) -> bool:
        """Whether the next training run is traced."""
        return self.skip <= self.runs < self.skip + self.steps

    def record(self, run_metadata, start: float, end: float) -> None:
        """One training run: its step span (wall seconds) and, if traced, its
        ops (kept as they are; made events when the trace is written)."""
        step = self.runs
        self.runs += 1
        if run_metadata is None or not run_metadata.step_stats.dev_stats:
            return
        self.traced += 1
        kept = type(run_metadata)()
        kept.step_stats.CopyFrom(run_metadata.step_stats)
        self._kept.append((step, kept, start, end))

    def _events(self, step: int, run_metadata, start: float, end: float) -> None:
        self.events.append({"name": f"step {step}", "ph": "X", "cat": "step",
                            "pid": self.task, "tid": "steps", "ts": start * 1e6,
                            "dur": (end - start) * 1e6, "args": {"step": step}})
        produced = {}
        stats = []
        for dev in run_metadata.step_stats.dev_stats:
            task, device = task_of(dev.device)
            for ns in dev.node_stats:
                nbytes = sum(o.tensor_description.allocation_description.requested_bytes
                             for o in ns.output)
                produced[ns.node_name] = produced.get(ns.node_name, 0) + nbytes
                stats.append((task, device, ns, nbytes))
        for task, device, ns, nbytes in stats:
            kind = op_type(ns)
            if kind in ("NoOp", "_SOURCE", "_SINK") or ns.node_name in ("_SOURCE", "_SINK"):
                continue
            duration = max(ns.all_end_rel_micros, ns.op_end_rel_micros, 1)
            tid = device if task == self.task else f"{device} ({self.task}'s steps)"
            event = {"name": ns.node_name, "ph": "X", "pid": task, "tid": tid,
                     "ts": float(ns.all_start_micros), "dur": float(duration),
                     "args": {"op": kind, "step": step}}
            if kind.startswith(COMMUNICATION):
                if not nbytes:
                    nbytes = sum(produced.get(i, 0) for i in self._inputs.get(ns.node_name, ()))
                event["cat"] = "communication"
                event["args"].update(bytes=int(nbytes), carries=carried(ns.node_name))
                if self.seconds_per_byte:
                    event["args"]["predicted_ms"] = nbytes * self.seconds_per_byte * 1e3
            else:
                event["cat"] = "compute"
                event["args"]["phase"] = ("backward" if re.search(r"(^|/)gradients(_\d+)?/",
                                                                  ns.node_name)
                                          else "update" if ns.node_name.startswith("parallax/")
                                          else "forward")
            self.events.append(event)

    def finish(self) -> None:
        """Write the trace once, if a step was traced, and say where."""
        if self.traced and not self.written:
            self.written = True
            self.write()
            if self.task == "worker 0":
                print(f"parallax_ng: timeline of {self.traced} step(s) in {self.path}",
                      file=sys.stderr, flush=True)

    def write(self, path: str | None = None) -> str:
        """This worker's events as a trace file (`path`, else the timeline's)."""
        path = path or self.path
        for kept in self._kept:
            self._events(*kept)
        self._kept = []
        with open(path, "w") as f:
            json.dump(trace(self.events), f)
        return path


def trace(events: list[dict]) -> dict:
    """A Chrome trace of `events` whose pid/tid are names: numbered, with
    the names as metadata."""
    pids, tids, out = {}, {}, []
    for e in events:
        pid = pids.setdefault(e["pid"], len(pids) + 1)
        tid = tids.setdefault((e["pid"], e["tid"]), len(tids) + 1)
        out.append({**e, "pid": pid, "tid": tid})
    meta = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": name}}
            for name, p in pids.items()]
    meta += [{"name": "thread_name", "ph": "M", "pid": pids[pname], "tid": t,
              "args": {"name": tname}} for (pname, tname), t in tids.items()]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def named_events(data: dict) -> list[dict]:
    """The events of a trace with their process and thread names back."""
    procs, threads = {}, {}
    for e in data["traceEvents"]:
        if e.get("ph") == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return [{**e, "pid": procs.get(e["pid"], str(e["pid"])),
             "tid": threads.get((e["pid"], e["tid"]), str(e["tid"]))}
            for e in data["traceEvents"] if e.get("ph") != "M"]


def part_path(path: str, worker: int) -> str:
    return f"{path}.worker-{worker}.json"


def merge(path: str, workers: int) -> str:
    """The workers' parts of a job's trace merged into `path` (parts removed)."""
    events = []
    for w in range(workers):
        part = part_path(path, w)
        if os.path.exists(part):
            with open(part) as f:
                events += named_events(json.load(f))
            os.remove(part)
    with open(path, "w") as f:
        json.dump(trace(events), f)
    return path


@dataclass(frozen=True)
class StepShare:
    task: str
    step: int
    seconds: float
    compute: float
    exposed: float          # communication while no compute ran
    idle: float


def received(data: dict) -> dict[str, float]:
    """Bytes that arrived in the traced steps, by what they carry (the
    receiving end of each transfer: collectives' results, queue takes,
    receives between tasks)."""
    out: dict[str, float] = {}
    for e in named_events(data):
        if e.get("cat") == "communication" and e["args"]["op"].startswith(RECEIVING):
            what = e["args"].get("carries", "?")
            out[what] = out.get(what, 0.0) + e["args"].get("bytes", 0)
    return out


def summary(data: dict) -> list[StepShare]:
    """Per task (a worker and the servers its steps ran on) and step: the
    step's time split into compute, exposed communication and idle."""
    events = named_events(data)
    spans = {(e["pid"], e["args"]["step"]): (e["ts"], e["ts"] + e["dur"])
             for e in events if e.get("cat") == "step"}
    out = []
    for (task, step), (start, end) in sorted(spans.items()):
        mine = [e for e in events if e.get("args", {}).get("step") == step
                and e.get("cat") in ("compute", "communication")
                and (e["pid"] == task or f"({task}'s steps)" in e["tid"])]
        compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in mine
                          if e["cat"] == "compute"], start, end)
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in mine], start, end)
        total = (end - start) / 1e6
        out.append(StepShare(task, step, total, compute / 1e6, (busy - compute) / 1e6,
                             max(0.0, total - busy / 1e6)))
    return out


def _union(intervals, start: float, end: float) -> float:
    """Length of the union of `intervals` clipped to [start, end]."""
    total, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def draw(shares: list[StepShare], out: str) -> None:
    """A bar per task: mean seconds per step in compute, exposed
    communication and idle (matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ParallaxError(f"drawing a timeline needs matplotlib ({e}); pip install "
                            "matplotlib (or parallax_ng[timeline])") from None
    tasks = sorted({s.task for s in shares})
    means = {t: [sum(getattr(s, k) for s in shares if s.task == t) /
                 max(1, sum(1 for s in shares if s.task == t))
                 for k in ("compute", "exposed", "idle")] for t in tasks}
    fig, ax = plt.subplots(figsize=(6, 1 + 0.6 * len(tasks)))
    left = [0.0] * len(tasks)
    for i, (label, color) in enumerate([("compute", "tab:blue"),
                                        ("exposed communication", "tab:red"),
                                        ("idle", "tab:gray")]):
        widths = [means[t][i] * 1e3 for t in tasks]
        ax.barh(tasks, widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("ms per step (mean over the traced steps)")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
