"""Launcher: start a job's parameter servers and workers, and stop them all.

    parallax-ng run script.py -r resources.yaml [-c config.yaml] [-- script args]

Requires: a resource file whose hosts are the workers (one process per host
entry; every worker lists the same number of devices) and whose `ps` entries
are parameter servers ("address" or "address:port"). Tasks on loopback
addresses start here (a free port is picked when none is given); others start
through the resource file's `ssh` command (`ssh HOST 'cd DIR && env ... python
SCRIPT ARGS'`, same paths as here; their port must be given).
Guarantees: every process gets PARALLAX_NG_CLUSTER (its task, the cluster,
its devices) and, with -c, PARALLAX_NG_CONFIG; the job ends when all workers
exit 0. If any process dies, or on Ctrl-C, every other process started here
is stopped (SIGKILL) and the launcher exits non-zero naming the task that
failed. No process outlives it. SIGTERM is a preemption's notice: to the
launcher, or to any task (a task tells the launcher), it is passed on to
every worker, which save a checkpoint at a step they all reach and stop
(parallax_ng/runtime/preemption.py); a worker still running `grace_seconds`
later is killed. The launcher then exits 143 (a second SIGTERM stops every
task at once).
With `restarts` N, a job whose task died, stopped making progress or was
preempted (not one that failed on a user's mistake, not Ctrl-C or a SIGTERM
to the launcher) is started again, every task, up to N times; a host whose
task failed twice gives its place to a spare of the resource file. Each
start resumes from the job's last checkpoint (the config's
`checkpoint.dir`, else a directory under a run directory the launcher names
and gives every task as the default), so it ends with the variables of an
uninterrupted job. The launcher says which
task failed, the step the job resumes from (worker 0 reports each
checkpoint it completes), the restart count, and how long after the failure
the job trained again. Tasks whose port the resource file does not give get
fresh ports on each start.
Every line a task prints comes out whole, on the launcher's stdout or
stderr as the task wrote it, prefixed with the task (`[worker 1] ...`); with
`chief_only` only worker 0's lines are shown, and a task that fails has its
last lines printed after the message that names it.
"""
from __future__ import annotations

import collections
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from ..cluster import CHECKPOINT_ENV, CONFIG_ENV, ENV, ClusterInfo
from ..errors import ResourceError
from ..resources import ResourceInfo, load_resources
from ..runtime import heartbeat
from ..runtime.preemption import EXIT_CODE as PREEMPTED
from ..runtime.preemption import GRACE_ENV, RUN_ENV

LOCAL = ("127.", "localhost", "::1")


TAIL_LINES = 40        # lines of a hidden task's output shown when it fails
_WRITE = threading.Lock()

# Harmless lines every task prints (README, "Messages"); `verbose` keeps them.
# - TensorFlow ends every distributed step by aborting that step's
#   rendezvous ("Cleanup <step id>"), and logs the 1st, 2nd, 4th, 8th, ...
#   of these aborts (LOG_EVERY_POW_2 in local_rendezvous.cc);
# - the start-up block of a CPU-only process and of a gRPC server.
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
    rb"|coordination_service\.cc:\d+\] Initializing CoordinationService")


STALE = 5.0           # seconds without a heartbeat that make a task suspect when another fails
TIMEOUT = 300.0       # a silent task's limit until a task says the job's timeout


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
        prefix = f"[{self.name}] ".encode()
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            mark = line.find(heartbeat.MARK.encode())
            if mark >= 0:
                self._told(line[mark:].decode(errors="replace"))
                if not line[:mark].strip():
                    continue
                line = line[:mark] + b"\n"     # the task's unfinished line before it
            if not self.verbose and QUIET.search(line):
                continue
            if not self.shown:
                self.tail.append(line)
                continue
            with _WRITE:
                out.flush()
                out.buffer.write(prefix + line)
                out.buffer.flush()
        pipe.close()

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
            self.job.preempt(f"{self.name} got {rest.strip() or 'SIGTERM'}", self)
        elif kind == "preempted":
            self.preempted = int(rest)

    def finish(self, timeout: float = 5.0) -> None:
        """Wait until the task's output is copied (its process has ended)."""
        for t in self.readers:
            t.join(timeout)

    def show_tail(self) -> None:
        if self.shown or not self.tail:
            return
        with _WRITE:
            sys.stderr.write(f"parallax-ng run: last lines of {self.name}:\n")
            sys.stderr.flush()
            sys.stderr.buffer.write(b"".join(f"[{self.name}] ".encode() + line
                                             for line in self.tail))
            sys.stderr.flush()


def plan_cluster(resources: ResourceInfo) -> tuple[list[str], list[str]]:
    """host:port for every worker and parameter server (free ports if unset)."""
    counts = {len(h.devices) for h in resources.hosts}
    if len(counts) != 1:
        raise ResourceError("every worker must list the same number of devices; "
                            f"got {[len(h.devices) for h in resources.hosts]}")
    workers = [_with_port(h.address) for h in resources.hosts]
    ps = [_with_port(p) for p in resources.ps]
    return workers, ps


def tf_config(resources: ResourceInfo, task: str) -> dict:
    """The TF_CONFIG of task `task` ("worker:I" or "ps:J") of the job a
    resource file describes, for an orchestrator that starts each task
    itself (Kubernetes, Slurm): the process joins the same cluster, in the
    same place, as under `parallax-ng run` (parallax_ng/cluster.py reads
    it). Every address needs its port (no free one can be picked for
    another machine, nor agreed on by separate calls)."""
    kind, _, index = task.partition(":")
    count = {"worker": len(resources.hosts), "ps": len(resources.ps)}
    if kind not in count or not index.isdigit() or int(index) >= count[kind]:
        raise ResourceError(f"--task must be worker:I (I < {count['worker']}) or ps:J "
                            f"(J < {count['ps']}) for this resource file, not {task!r}")
    workers, ps = [h.address for h in resources.hosts], list(resources.ps)
    for address in workers + ps:
        host, sep, port = address.rpartition(":")
        if not (sep and port.isdigit()):
            raise ResourceError(f"address {address!r} has no port: an orchestrator's tasks "
                                "need every address as host:port")
    cluster = {"worker": workers, **({"ps": ps} if ps else {})}
    return {"cluster": cluster, "task": {"type": kind, "index": int(index)}}


def is_remote(address: str, launch: str = "auto") -> bool:
    return launch == "ssh" or (launch == "auto" and not address.startswith(LOCAL))


def _with_port(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit() and not address.startswith("["):
        return address
    if is_remote(address):
        raise ResourceError(f"address {address!r} is another machine's: give its port "
                            "(address:port); free ports are only picked on this machine")
    return f"{address}:{free_port()}"


_PICKED: set[int] = set()


def free_port() -> int:
    """A port no process of this machine listens on, below the kernel's
    range of ephemeral ports: a port from that range that is free now may
    be taken by any outgoing connection (the job's own, to the tasks that
    started first) before the task that is to listen on it starts. Never
    the same twice in this process."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _PICKED:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))       # TensorFlow's server listens on every interface
            except OSError:
                continue
        _PICKED.add(port)
        return port
    raise ResourceError(f"no free port below {low} on this machine; give the tasks' ports "
                        "in the resource file (address:port)")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def launch(script: str, resource_info, config: str | None = None, args=(),
           grace: float = 10.0, poll: float = 0.2, chief_only: bool = False,
           verbose: bool = False, env: dict | None = None, runner: str = "",
           restarts: int = 0, run_dir: str | None = None,
           grace_seconds: float = 30.0) -> int:
    """Run the job; its exit code: 0 when every worker ended well, else
    the failing task's (128 + N for a task ended by signal N), 1 for a task
    that stopped making progress, 130 on Ctrl-C, 143 on SIGTERM. `runner`:
    a module each worker runs the script with (`python -m runner script
    ...`), else the script runs as itself. `restarts`: how many times a job
    whose task died, hung or was preempted starts again from its last
    checkpoint (the config's `checkpoint.dir`, else `<run_dir>/checkpoints`).
    `grace_seconds`: how long the workers have to checkpoint and stop after
    SIGTERM. `grace`: how long a killed task's end is waited for."""
    from ..config import load_config
    if not os.path.isfile(script):
        raise ResourceError(f"script {script!r} does not exist")
    if not isinstance(restarts, int) or restarts < 0:
        raise ResourceError(f"--restarts must be a count of 0 or more, not {restarts!r}")
    if not grace_seconds > 0:
        raise ResourceError(f"--grace-seconds must be positive, not {grace_seconds!r}")
    job_config = load_config(config)   # its mistakes before any task starts
    resources = load_resources(resource_info)
    workers, ps = plan_cluster(resources)
    for name, address, given in _addresses(resources, workers, ps):
        if given and not is_remote(address):
            _check_free(name, address)
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    base_env.pop("TF_CONFIG", None)
    base_env.update(env or {})
    if verbose:
        base_env[heartbeat.VERBOSE_ENV] = "1"
    if config:
        base_env[CONFIG_ENV] = os.path.abspath(config)
    if restarts and not job_config.checkpoint.dir:
        run_dir = os.path.abspath(run_dir or time.strftime("parallax_ng_run-%Y%m%d-%H%M%S"))
        base_env[CHECKPOINT_ENV] = os.path.join(run_dir, "checkpoints")
        _say(f"checkpoints go to {base_env[CHECKPOINT_ENV]} (a restart resumes from the "
             "last; the script's config may name another checkpoint.dir)")
    job = Job(grace_seconds=grace_seconds, grace=grace, resources=resources)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, job.terminated)
    try:
        for attempt in range(restarts + 1):
            if attempt:          # fresh ports where none is given; spares in their places
                workers, ps = plan_cluster(job.resources)
            # each start's preemption files apart (parallax_ng/runtime/preemption.py)
            base_env[RUN_ENV] = f"{os.getpid()}-{int(time.time())}-{attempt}"
            base_env[GRACE_ENV] = f"{grace_seconds:g}"
            job.tasks = []
            _start_tasks(job, script, job.resources, workers, ps, base_env, args, runner,
                         chief_only, verbose)
            outcome = _watch(job, poll)
            job.heard()
            if outcome.code == 0 or not outcome.retry or attempt == restarts:
                return outcome.code
            job.restart(outcome, attempt + 1, restarts)
        raise AssertionError("unreachable")
    except KeyboardInterrupt:
        _say("interrupted; stopping every task")
        _stop(job.tasks, grace)
        return 130
    except Terminated:
        _say("SIGTERM again; stopping every task now")
        _stop(job.tasks, grace)
        return 143
    finally:
        _stop(job.tasks, grace)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@dataclass
class Outcome:
    """How one start of the job ended: its exit code, the task that ended
    it, and whether a restart may help (not a user's mistake, not a
    SIGTERM to the launcher)."""
    code: int
    task: str = ""
    retry: bool = False


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
    why: str = ""                            # who got the SIGTERM

    def heard(self) -> None:
        for t in self.tasks:
            if t.saved is not None and (self.saved is None or t.saved[0] >= self.saved[0]):
                self.saved = t.saved

    def restart(self, outcome: Outcome, count: int, limit: int) -> None:
        self.failed_at, self.stopping = time.monotonic(), None
        if not self.why:           # a failure, not a preemption
            self._replace(outcome.task)
        where = (f"resumes from step {self.saved[0]} ({self.saved[1]})" if self.saved else
                 "starts from its last checkpoint if it has one (none was reported)")
        _say(f"restart {count} of {limit}: {self.why or f'{outcome.task} failed'}; every "
             f"task starts again and the job {where}")
        self.why = ""

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
                _say(f"{task}'s host {address} failed {self.failures[address]} times; no "
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
        _say(f"{task}'s host {address} failed {self.failures[address]} times; spare "
             f"{spare.address} takes its place")

    def training(self, task: "Task", step: str) -> None:
        """A task's first training step after a restart (said once: each
        task's output has a thread of its own)."""
        with _WRITE:
            failed_at, self.failed_at = self.failed_at, None
        if failed_at is not None:
            _say(f"training again (step {step}, {task.name}) "
                 f"{time.monotonic() - failed_at:.1f} s after the failure")

    def terminated(self, signum, frame) -> None:
        """SIGTERM to the launcher: the workers checkpoint and stop; a second
        one stops every task now."""
        if self.signalled:
            raise Terminated()
        self.signalled = True
        self.preempt("the launcher got SIGTERM")

    def preempt(self, why: str, source: "Task | None" = None) -> None:
        """Pass SIGTERM on to every worker that runs but `source`, which got
        it (once per start)."""
        if self.stopping is not None:
            return
        self.stopping = time.monotonic() + self.grace_seconds
        self.why = why
        _say(f"{why}: passed on to every worker, which saves a checkpoint at a step they "
             f"all reach and stops (given {self.grace_seconds:g} s)")
        for t in self.tasks:
            if t.name.startswith("worker") and t is not source and t.process.poll() is None:
                _signal(t.process, signal.SIGTERM)

    def stopped(self) -> Outcome:
        """Every worker has ended during a preemption."""
        workers = [t for t in self.tasks if t.name.startswith("worker")]
        if all(t.process.returncode == 0 for t in workers):
            return Outcome(0)
        steps = {t.preempted for t in workers}
        if len(steps) == 1 and None not in steps:
            _say(f"the job stopped at step {steps.pop()} with a checkpoint of it")
        elif steps == {None}:
            _say("every worker stopped; none saved a checkpoint (a job saves one when its "
                 "config sets checkpoint.dir)")
        else:
            _say("the job stopped; not every worker saved a step with the others "
                 "(a rerun resumes from the last complete checkpoint)")
        return Outcome(143, self.why.split(" got ")[0], not self.signalled)


def _start_tasks(job: Job, script, resources, workers, ps, base_env, args, runner,
                 chief_only, verbose) -> None:
    """Every task of one start of the job, into `job.tasks` as each starts."""
    tasks = job.tasks
    for j, address in enumerate(resources.ps):
        info = ClusterInfo(tuple(workers), tuple(ps), "ps", j, (("CPU", 0),))
        command = [sys.executable, "-m", "parallax_ng.tools.launch", "serve"]
        tasks.append(_start(f"ps {j}", command, info, base_env,
                            resources.ssh if is_remote(address) else None,
                            shown=not chief_only, verbose=verbose))
    for i, host in enumerate(resources.hosts):
        info = ClusterInfo(tuple(workers), tuple(ps), "worker", i, host.devices)
        command = [sys.executable, *(['-m', runner] if runner else []),
                   os.path.abspath(script), *args]
        tasks.append(_start(f"worker {i}", command, info, base_env,
                            resources.ssh if is_remote(host.address, host.launch)
                            else None, shown=i == 0 or not chief_only, verbose=verbose))
    for t in tasks:
        t.job = job


def _addresses(resources: ResourceInfo, workers: list[str], ps: list[str]):
    """(task, host:port, whether the resource file gave the port) of every task."""
    given = [h.address for h in resources.hosts] + list(resources.ps)
    names = [f"worker {i}" for i in range(len(workers))] + [f"ps {j}" for j in range(len(ps))]
    return [(n, a, a == g) for n, a, g in zip(names, workers + ps, given)]


def _check_free(name: str, address: str) -> None:
    """A ResourceError naming the task when its port on this machine is taken."""
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        try:
            s.bind((host if host != "localhost" else "127.0.0.1", int(port)))
        except OSError as e:
            raise ResourceError(f"{name}'s address {address} cannot be used: {e.strerror} "
                                "(another process holds the port, or the address is not "
                                "this machine's); give another port in the resource file, "
                                "or none to have a free one picked") from None


def remote_command(ssh: str, address: str, command: list[str], env: dict) -> list[str]:
    """argv that runs `command` with the parallax_ng part of `env` on `address`."""
    host = address.rpartition(":")[0] or address
    keep = {k: v for k, v in env.items()
            if k.startswith("PARALLAX_NG_") or k in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL",
                                                      "PYTHONUNBUFFERED")}
    line = " ".join([f"cd {shlex.quote(os.getcwd())} && env"]
                    + [shlex.quote(f"{k}={v}") for k, v in sorted(keep.items())]
                    + [shlex.quote(c) for c in command])
    return shlex.split(ssh) + [host, line]


def _start(name: str, command: list[str], info: ClusterInfo, env: dict,
           ssh: str | None = None, shown: bool = True, verbose: bool = False) -> Task:
    env = dict(env, **{ENV: info.to_env(), heartbeat.ENV: name})
    address = (info.ps if info.task_type == "ps" else info.workers)[info.task]
    if ssh is not None:
        command = remote_command(ssh, address, command, env)
    process = subprocess.Popen(command, env=env, start_new_session=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    _say(f"started {name} (pid {process.pid}) at {address}")
    task = Task(name, process, shown, verbose)
    task.relay()
    return task


def _say(text: str) -> None:
    with _WRITE:
        print(f"parallax-ng run: {text}", file=sys.stderr, flush=True)


def _watch(job: Job, poll: float) -> Outcome:
    tasks = job.tasks
    workers = [t for t in tasks if t.name.startswith("worker")]
    while True:
        now = time.monotonic()
        if job.stopping is not None:
            if all(t.process.poll() is not None for t in workers):
                for t in workers:
                    t.finish()
                return job.stopped()
            if now > job.stopping:
                _say(f"workers still running {job.grace_seconds:g} s after SIGTERM; stopping "
                     "every task")
                _stop(tasks, job.grace)
                return Outcome(143, job.why.split(" got ")[0], not job.signalled)
        # 0: a worker that finished, a server whose workers did; a worker's end
        # during a preemption is not a failure; of several that failed, one a
        # signal ended (the others may have failed for it)
        failed = sorted((t for t in tasks if t.process.poll() not in (None, 0) and not (
            job.stopping is not None and t in workers and
            t.process.returncode in (PREEMPTED, -signal.SIGTERM))),
            key=lambda t: t.process.returncode >= 0)
        if failed:
            t = failed[0]
            rc = t.process.returncode
            t.finish()
            held_by = _holding(tasks, t, now)
            code = 128 - rc if rc < 0 else rc
            mistake = held_by is None and bool(t.error) and _users_mistake(t.error)
            if held_by is not None:
                _say(f"{_stalled(held_by, now)}; {t.name} failed waiting for it "
                     f"({t.error or f'exit code {code}'}); stopping the job")
                held_by.show_tail()
            elif mistake:
                _say(f"{t.name}: {t.error}")
            else:
                died = f"signal {-rc}" if rc < 0 else f"code {rc}"
                _say(f"{t.name} (pid {t.process.pid}) exited with {died}"
                     f"{f': {t.error}' if t.error else ''}; stopping the job")
                t.show_tail()
            _stop(tasks, job.grace)
            job.why = ""
            if held_by is not None:
                return Outcome(1, held_by.name, True)
            return Outcome(code, t.name, not mistake and not job.signalled)
        limit = _limit(tasks, workers)
        for t in tasks:
            if t.process.poll() is None and t.silent(now) > limit:
                _say(f"{_stalled(t, now)}; stopping the job")
                t.show_tail()
                _stop(tasks, job.grace)
                job.why = ""
                return Outcome(1, t.name, not job.signalled)
        if job.stopping is None and all(t.process.poll() == 0 for t in workers):
            for t in workers:
                t.finish()
            return Outcome(0)
        time.sleep(poll)


def _limit(tasks: list[Task], workers: list[Task]) -> float:
    """How long a task may stay silent: the job's timeout as the workers
    said it (their script's config; a server knows only the launcher's
    `-c`), else as any task said it, else TIMEOUT."""
    said = [u.timeout for u in workers if u.timeout] or [u.timeout for u in tasks if u.timeout]
    return max(said or [TIMEOUT])


def _users_mistake(error: str) -> bool:
    """Whether a task's error is a ParallaxError (config, resources, graph)."""
    return error.split(":", 1)[0] in ("ConfigError", "ResourceError", "GraphError",
                                      "FetchError", "ParallaxError")


def _holding(tasks: list[Task], failed: Task, now: float) -> Task | None:
    """The live task that stopped the job's progress when `failed` failed:
    one silent for STALE seconds (stopped or hung), else, when `failed`
    timed out waiting, a worker that stayed out of its runner's steps for
    the job's timeout (blocked elsewhere, e.g. in I/O)."""
    live = [u for u in tasks if u is not failed and u.process.poll() is None]
    silent = [u for u in live if u.silent(now) > STALE]
    if silent:
        return max(silent, key=lambda u: u.silent(now))
    if failed.error and failed.error.startswith("DeadlineExceededError"):
        limit = max([u.timeout for u in tasks if u.timeout] or [TIMEOUT])
        # (most of) the timeout: `failed` began to wait about when the other left its step
        idle = [u for u in live if u.name.startswith("worker") and u.idle(now) >= 0.8 * limit]
        if idle:
            return max(idle, key=lambda u: u.idle(now))
    return None


def _stalled(task: Task, now: float) -> str:
    if task.silent(now) > STALE:
        return (f"{task.name} (pid {task.process.pid}) stopped making progress: no "
                f"heartbeat for {task.silent(now):.0f} s (stopped, e.g. by SIGSTOP, or hung)")
    return (f"{task.name} (pid {task.process.pid}) stopped making progress: outside its "
            f"training steps for {task.idle(now):.0f} s (blocked, e.g. in I/O)")


def _stop(tasks: list[Task], grace: float) -> None:
    """SIGKILL every live task's process group (SIGTERM is a task's notice
    to checkpoint and stop, parallax_ng/runtime/preemption.py), and wait
    up to `grace` seconds for each to end."""
    live = [t for t in tasks if t.process.poll() is None]
    for t in live:
        _signal(t.process, signal.SIGKILL)
    for t in live:
        try:
            t.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def _signal(process: subprocess.Popen, sig) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def serve() -> None:
    """A parameter-server process: serve until the workers are done."""
    from ..cluster import from_env
    from ..config import load_config
    from ..runtime.serving import serve
    info = from_env()
    if info is None:
        raise SystemExit(f"parallax_ng.tools.launch serve needs {ENV}")
    config = load_config(os.environ.get(CONFIG_ENV))
    raise SystemExit(serve(info, config.communication.timeout_seconds))


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
