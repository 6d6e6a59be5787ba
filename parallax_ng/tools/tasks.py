"""A job's processes as the launcher sees them, and the job across its starts.

Requires: processes started by parallax_ng/tools/launch.py, each telling
its launcher what parallax_ng/runtime/heartbeat.py describes.
Guarantees: a `Task` copies its process's output line by line, prefixed
(whole lines, quiet ones dropped, a hidden task's last lines kept for when
it fails), and keeps what the task told: heartbeats, its error, the last
checkpoint it reported, its first training step, a SIGTERM it got, the step
it stopped at for one. A `Job` remembers across restarts: the resource
file as the next start uses it (a spare in the place of a host whose task
failed twice), the last checkpoint, when the last failure came (to say how
long the job took to train again), and a preemption under way (SIGTERM
passed on to every worker once, its deadline). `stop` kills every live
task's process group; `say` prints one line of the launcher's.
`thread_share` gives each of the tasks a machine runs its share of the
cores for TensorFlow's thread pools.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from ..resources import ResourceInfo
from ..runtime import heartbeat

TAIL_LINES = 40        # lines of a hidden task's output shown when it fails
_WRITE = threading.Lock()
_LIVE: list = [None]   # the task whose unfinished line (a progress bar) is on the terminal

# Harmless lines every task prints (README, "Messages"); `verbose` keeps them.
# - TensorFlow ends every distributed step by aborting that step's
#   rendezvous ("Cleanup <step id>"), and logs the 1st, 2nd, 4th, 8th, ...
#   of these aborts (LOG_EVERY_POW_2 in local_rendezvous.cc);
# - the start-up block of a CPU-only process and of a gRPC server;
# - the four lines of every profiler session TensorFlow opens for a traced
#   run (a job times its first steps and its plans' trials with traced
#   runs: some 25 sessions a worker, 100 lines), and the note such a run
#   logs where no GPU is to trace.
QUIET = re.compile(
    rb"local_rendezvous\.cc:\d+\] Local rendezvous is aborting with status: "
    rb"ABORTED: Cleanup \d+"
    rb"|^WARNING: All log messages before absl::InitializeLog\(\) is called"
    rb"|cudart_stub\.cc:\d+\] Could not find cuda drivers"
    rb"|cuda_platform\.cc:\d+\] failed call to cuInit"
    rb"|cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized"
    rb"|^To enable the following instructions: .* rebuild TensorFlow"
    rb"|mlir_graph_optimization_pass\.cc:\d+\] MLIR V1 optimization pass is not enabled"
    rb"|grpc_server_lib\.cc:\d+\] Started server with target"
    rb"|master\.cc:\d+\] Scanning workers for devices"
    rb"|coordination_service\.cc:\d+\] Initializing CoordinationService"
    rb"|profiler_session\.cc:\d+\] Profiler session "
    rb"(initializing|started|collecting data|tear down)\."
    rb"|xplane_to_step_stats\.cc:\d+\] GPU trace was not collected")
# A session closed after another task of the job ended (a worker's process
# exits while another still closes its sessions, which tell every task they
# used): its warning, then gRPC's two lines naming the call. Dropped together
# where the call is the session's teardown (DeleteWorkerSession).
TEARDOWN = (re.compile(rb"master_session\.cc:\d+\] UNAVAILABLE: failed to connect"),
            re.compile(rb"^Additional GRPC error information from remote target .* while "
                       rb"calling /tensorflow\.WorkerService/DeleteWorkerSession:"),
            re.compile(rb"^:UNKNOWN:Error received from peer"))


def _shown_part(text: bytes) -> bytes:
    """What a terminal shows of a line rewritten by carriage returns: its
    last part that is not empty."""
    parts = [p for p in text.split(b"\r") if p]
    return parts[-1] if parts else b""


class Terminated(Exception):
    """SIGTERM reached the launcher."""


@dataclass
class Task:
    name: str                 # "worker 0", "ps 1"
    process: subprocess.Popen
    shown: bool = True        # its lines go to the launcher's output
    verbose: bool = False     # keep the QUIET lines too
    tail: collections.deque = field(default_factory=lambda: collections.deque(
        maxlen=TAIL_LINES))
    readers: list = field(default_factory=list)
    beat: float | None = None   # when its last heartbeat came (monotonic)
    state: tuple = ("idle", 0.0)   # in a runner's step or not, and for how long
    timeout: float = 0.0        # the job's timeout, as the task said it
    error: str | None = None    # the exception that ended it, in one line
    saved: tuple | None = None  # (step, path) of the last checkpoint it reported
    job: object = None          # the Job it belongs to, told of its first training step
    preempted: int | None = None  # the step it saved and stopped at after SIGTERM
    exiting: bool = False       # its interpreter is ending (no heartbeat from then on)

    def silent(self, now: float) -> float:
        """Seconds since its last heartbeat (0 before the first)."""
        return now - self.beat if self.beat is not None else 0.0

    def idle(self, now: float) -> float:
        """Seconds it has stayed out of its runner's steps (0 inside one)."""
        state, held = self.state
        return held + self.silent(now) if state == "idle" else 0.0

    def relay(self) -> None:
        """Copy the task's stdout and stderr to ours, line by line, prefixed."""
        for pipe, out in ((self.process.stdout, sys.stdout), (self.process.stderr, sys.stderr)):
            t = threading.Thread(target=self._copy, args=(pipe, out), daemon=True)
            t.start()
            self.readers.append(t)

    def _copy(self, pipe, out) -> None:
        """Whole lines, prefixed; a line the task rewrites by carriage
        returns (Keras's progress bar) as what a terminal would show of it:
        its last part, and on a terminal its parts as they come."""
        prefix, pending, held = f"[{self.name}] ".encode(), b"", []
        while chunk := os.read(pipe.fileno(), 1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                held = self._teardown(held + [line], prefix, out)
            if b"\r" in pending and self.shown and out.isatty():
                self._live(_shown_part(pending), prefix, out)
        for line in held + ([pending] if pending else []):
            self._line(line + b"\n", prefix, out)
        pipe.close()

    def _teardown(self, lines: list, prefix: bytes, out) -> list:
        """`lines` shown but TEARDOWN's: a start of them is held back (and
        returned) until it is whole (dropped) or a line shows it is not."""
        while lines:
            k = next((k for k in (0, 1) if TEARDOWN[k].search(lines[0])), None)
            group = lines[:3 - k] if k is not None else []
            if self.verbose or k is None or not all(
                    TEARDOWN[k + j].search(x) for j, x in enumerate(group)):
                self._line(lines.pop(0) + b"\n", prefix, out)
            elif len(group) < 3 - k:
                return lines        # more to come
            else:
                del lines[:3 - k]
        return []

    def _line(self, line: bytes, prefix: bytes, out) -> None:
        mark = line.find(heartbeat.MARK.encode())
        if mark >= 0:
            self._told(line[mark:].decode(errors="replace"))
            if not line[:mark].strip():
                return
            line = line[:mark] + b"\n"     # the task's unfinished line before it
        rewritten = b"\r" in line          # the end of a line shown in place
        if rewritten:
            line = _shown_part(line[:-1]) + b"\n"
        if not self.verbose and QUIET.search(line):
            return
        if not self.shown:
            self.tail.append(line)
            return
        with _WRITE:
            out.flush()
            live, _LIVE[0] = _LIVE[0], None
            start = b"\r" if live is self and rewritten else b"\n" if live is not None else b""
            out.buffer.write(start + prefix + line)
            out.buffer.flush()

    def _live(self, part: bytes, prefix: bytes, out) -> None:
        """The unfinished line's part a terminal shows now, in place."""
        with _WRITE:
            out.flush()
            live, _LIVE[0] = _LIVE[0], self
            out.buffer.write((b"\n" if live not in (None, self) else b"") + b"\r" + prefix + part)
            out.buffer.flush()

    def _told(self, text: str) -> None:
        """A line the task wrote for the launcher (parallax_ng/runtime/heartbeat.py)."""
        kind, rest = heartbeat.parse(text) or ("", "")
        if kind == "heartbeat":
            state, held, timeout = rest.split()
            self.beat, self.state = time.monotonic(), (state, float(held))
            self.timeout = max(self.timeout, float(timeout))
        elif kind == "error":
            self.error = self.error or rest.split(": ", 1)[-1]
        elif kind == "saved":
            step, _, path = rest.partition(" ")
            self.saved = (int(step), path.strip())
        elif kind == "trained" and self.job is not None:
            self.job.training(self, rest.strip())
        elif kind == "stopping" and self.job is not None:
            self.job.preempt(self)
        elif kind == "preempted":
            self.preempted = int(rest)
        elif kind == "exiting":
            self.exiting = True

    def finish(self, timeout: float = 5.0) -> None:
        """Wait until the task's output is copied (its process has ended)."""
        for t in self.readers:
            t.join(timeout)

    def show_tail(self) -> None:
        if self.shown or not self.tail:
            return
        with _WRITE:
            _end_live()
            sys.stderr.write(f"parallax-ng run: last lines of {self.name}:\n")
            sys.stderr.flush()
            sys.stderr.buffer.write(b"".join(f"[{self.name}] ".encode() + line
                                             for line in self.tail))
            sys.stderr.flush()


@dataclass
class Outcome:
    """How one start of the job ended: its exit code, the task that ended
    it, whether a restart may help (not a user's mistake, not a SIGTERM to
    the launcher), and whether the task's host is to blame (not a run
    TensorFlow's runtime refused as a repeated request, which any host
    meets by chance: parallax_ng/errors.py)."""
    code: int
    task: str = ""
    retry: bool = False
    hosts_fault: bool = True


@dataclass
class Job:
    """The launcher's memory across restarts: the live start's tasks, the
    last checkpoint worker 0 reported, when the last failure came, and a
    preemption under way."""
    grace_seconds: float = 30.0
    grace: float = 10.0
    resources: ResourceInfo | None = None    # as the next start uses it (spares in place)
    tasks: list = field(default_factory=list)
    failures: dict = field(default_factory=dict)   # host address -> its tasks' failures
    spares_used: int = 0
    saved: tuple[int, str] | None = None     # (step, path) of the job's last checkpoint
    failed_at: float | None = None           # monotonic time of the failure restarted from
    stopping: float | None = None            # a preemption's deadline (monotonic)
    signalled: bool = False                  # the launcher itself got SIGTERM
    preempted_by: str = ""                   # the task (or "the launcher") SIGTERM reached

    def heard(self) -> None:
        for t in self.tasks:
            if t.saved is not None and (self.saved is None or t.saved[0] >= self.saved[0]):
                self.saved = t.saved

    def restart(self, outcome: Outcome, count: int, limit: int) -> None:
        self.failed_at, self.stopping = time.monotonic(), None
        if not self.preempted_by and outcome.hosts_fault:   # a failure of its host
            self._replace(outcome.task)
        where = (f"resumes from step {self.saved[0]} ({self.saved[1]})" if self.saved else
                 "starts from its last checkpoint if it has one (none was reported)")
        what = (f"{self.preempted_by} got SIGTERM" if self.preempted_by else
                f"{outcome.task} failed")
        say(f"restart {count} of {limit}: {what}; every task starts again and the job {where}")
        self.preempted_by = ""

    def _replace(self, task: str) -> None:
        """Count a failure of `task`'s host; a host that failed twice gives
        its place to the next spare (same devices, so the same replicas)."""
        res = self.resources
        kind, _, index = task.partition(" ")
        if kind not in ("worker", "ps") or not index.isdigit():
            return
        i = int(index)
        address = res.hosts[i].address if kind == "worker" else res.ps[i]
        self.failures[address] = self.failures.get(address, 0) + 1
        if self.failures[address] < 2:
            return
        if self.spares_used >= len(res.spares):
            if res.spares:
                say(f"{task}'s host {address} failed {self.failures[address]} times; no "
                    "spare is left, it stays")
            return
        spare = res.spares[self.spares_used]
        self.spares_used += 1
        if kind == "worker":
            hosts = list(res.hosts)
            hosts[i] = spare
            self.resources = replace(res, hosts=tuple(hosts))
        else:
            ps = list(res.ps)
            ps[i] = spare.address
            self.resources = replace(res, ps=tuple(ps))
        say(f"{task}'s host {address} failed {self.failures[address]} times; spare "
            f"{spare.address} takes its place")

    def training(self, task: "Task", step: str) -> None:
        """A task's first training step after a restart (said once: each
        task's output has a thread of its own)."""
        with _WRITE:
            failed_at, self.failed_at = self.failed_at, None
        if failed_at is not None:
            say(f"training again (step {step}, {task.name}) "
                f"{time.monotonic() - failed_at:.1f} s after the failure")

    def terminated(self, signum, frame) -> None:
        """SIGTERM to the launcher: the workers checkpoint and stop; a second
        one stops every task now."""
        if self.signalled:
            raise Terminated()
        self.signalled = True
        self.preempt()

    def preempt(self, source: "Task | None" = None) -> None:
        """Pass SIGTERM on to every worker that runs but `source`, the task
        that got it (None: the launcher did), once per start."""
        if self.stopping is not None:
            return
        self.stopping = time.monotonic() + self.grace_seconds
        self.preempted_by = source.name if source is not None else "the launcher"
        say(f"{self.preempted_by} got SIGTERM: passed on to every worker, which saves a "
            f"checkpoint at a step they all reach and stops (given {self.grace_seconds:g} s)")
        for t in self.tasks:
            if t.name.startswith("worker") and t is not source and t.process.poll() is None:
                send(t.process, signal.SIGTERM)

    def stopped(self) -> Outcome:
        """Every worker has ended during a preemption."""
        workers = [t for t in self.tasks if t.name.startswith("worker")]
        if all(t.process.returncode == 0 for t in workers):
            return Outcome(0)
        steps = {t.preempted for t in workers}
        if len(steps) == 1 and None not in steps:
            say(f"the job stopped at step {steps.pop()} with a checkpoint of it")
        elif steps == {None}:
            say("every worker stopped; none saved a checkpoint (a job saves one when its "
                "config sets checkpoint.dir)")
        else:
            say("the job stopped; not every worker saved a step with the others "
                "(a rerun resumes from the last complete checkpoint)")
        return Outcome(143, self.preempted_by, not self.signalled)


def say(text: str) -> None:
    with _WRITE:
        _end_live()
        print(f"parallax-ng run: {text}", file=sys.stderr, flush=True)


def _end_live() -> None:
    """End a task's unfinished line on the terminal (with _WRITE held)."""
    if _LIVE[0] is not None:
        _LIVE[0] = None
        sys.stdout.write("\n")
        sys.stdout.flush()


def stop(tasks: list[Task], grace: float) -> None:
    """SIGKILL every live task's process group (SIGTERM is a task's notice
    to checkpoint and stop, parallax_ng/runtime/preemption.py), and wait
    up to `grace` seconds for each to end."""
    live = [t for t in tasks if t.process.poll() is None]
    for t in live:
        send(t.process, signal.SIGKILL)
    for t in live:
        try:
            t.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def send(process: subprocess.Popen, sig) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


THREADS = ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS")   # read when a session makes pools


def thread_share(tasks: int, env: dict, cores: int | None = None) -> dict:
    """The environment that sizes TensorFlow's two thread pools in each of
    `tasks` processes on one machine to its share of the cores (at least
    one), where the tasks are more than one and `env` sizes neither pool.
    Each process would otherwise make pools of every core: two workers (and
    a server) on 2 cores ran 1.15x-1.18x slower (docs/benchmarks.md)."""
    cores = cores or os.cpu_count() or 1
    if tasks <= 1 or any(k in env for k in THREADS):
        return {}
    return dict.fromkeys(THREADS, str(max(1, cores // tasks)))
