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

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..cluster import CHECKPOINT_ENV, CONFIG_ENV, ENV, ClusterInfo
from ..errors import REFUSED_SAID, ResourceError
from ..resources import ResourceInfo, load_resources
from ..runtime import heartbeat, timeline
from ..runtime.preemption import EXIT_CODE as PREEMPTED
from ..runtime.preemption import GRACE_ENV, RUN_ENV
from .forking import Forker
from .tasks import Job, Outcome, Task, Terminated, say, stop, thread_share

LOCAL = ("127.", "localhost", "::1")


STALE = 5.0           # seconds without a heartbeat that make a task suspect when another fails
TIMEOUT = 300.0       # a silent task's limit until a task says the job's timeout
EXITING = 120.0       # how long a task whose interpreter ends may take to be gone


def plan_cluster(resources: ResourceInfo) -> tuple[list[str], list[str]]:
    """host:port for every worker and parameter server (free ports if unset)."""
    counts = {len(h.devices) for h in resources.hosts}
    if len(counts) != 1:
        raise ResourceError("every worker must list the same number of devices; "
                            f"got {[len(h.devices) for h in resources.hosts]}")
    workers = [_with_port(h.address) for h in resources.hosts]
    ps = [_with_port(p) for p in resources.ps]
    return workers, ps


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
RESERVED_SECONDS = 300.0     # how long a picked port stays another launcher's to skip


def free_port() -> int:
    """A port no process of this machine listens on, below the kernel's
    range of ephemeral ports: a port from that range that is free now may
    be taken by any outgoing connection (the job's own, to the tasks that
    started first) before the task that is to listen on it starts. Never
    the same twice in this process, nor one another launcher of this
    machine picked in the last RESERVED_SECONDS (`_reserve`: two jobs
    starting together had picked one port, still free, for both)."""
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
        if not _reserve(port):
            continue
        _PICKED.add(port)
        return port
    raise ResourceError(f"no free port below {low} on this machine; give the tasks' ports "
                        "in the resource file (address:port)")


def _reserve(port: int) -> bool:
    """Whether `port` is this process's to take: a file named for it, made
    exclusively in a directory of the machine's temp dir, marks it picked
    (for RESERVED_SECONDS, after which its task listens or never will)."""
    folder = os.path.join(tempfile.gettempdir(), "parallax_ng_ports")
    path = os.path.join(folder, str(port))
    try:
        os.makedirs(folder, exist_ok=True)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            if time.time() - os.stat(path).st_mtime < RESERVED_SECONDS:
                return False
            os.utime(path)               # an old pick: this process's now
            return True
    except OSError:                      # no temp dir to write: the bind check alone
        return True


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
           grace_seconds: float = 30.0, timeline_file: str | None = None,
           fork: bool = True) -> int:
    """Run the job; its exit code: 0 when every worker ended well, else
    the failing task's (128 + N for a task ended by signal N), 1 for a task
    that stopped making progress, 130 on Ctrl-C, 143 on SIGTERM. `runner`:
    a module each worker runs the script with (`python -m runner script
    ...`), else the script runs as itself. `restarts`: how many times a job
    whose task died, hung or was preempted starts again from its last
    checkpoint (the config's `checkpoint.dir`, else `<run_dir>/checkpoints`).
    `grace_seconds`: how long the workers have to checkpoint and stop after
    SIGTERM. `grace`: how long a killed task's end is waited for.
    `timeline_file`: every worker traces its steps (runtime/timeline.py) and
    the parts are merged there when the job ends. `fork`: tasks on this
    machine are forked from one process that imported TensorFlow
    (tools/forking.py), else each starts as a process of its own."""
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
    if timeline_file:
        timeline_file = base_env[timeline.ENV] = os.path.abspath(timeline_file)
    if restarts and not job_config.checkpoint.dir:
        run_dir = os.path.abspath(run_dir or time.strftime("parallax_ng_run-%Y%m%d-%H%M%S"))
        base_env[CHECKPOINT_ENV] = os.path.join(run_dir, "checkpoints")
        say(f"checkpoints go to {base_env[CHECKPOINT_ENV]} (a restart resumes from the "
            "last; the script's config may name another checkpoint.dir)")
    job = Job(grace_seconds=grace_seconds, grace=grace, resources=resources)
    local = [h for h in resources.hosts if not is_remote(h.address, h.launch)] + [
        p for p in resources.ps if not is_remote(p)]
    forker = (Forker.shared(base_env) or Forker(base_env)) if fork and local else None
    shares = thread_share(len(local), base_env)     # for the tasks on this machine
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
                         chief_only, verbose, forker, shares)
            outcome = _watch(job, poll)
            job.heard()
            if outcome.code == 0 or not outcome.retry or attempt == restarts:
                return outcome.code
            job.restart(outcome, attempt + 1, restarts)
        raise AssertionError("unreachable")
    except KeyboardInterrupt:
        say("interrupted; stopping every task")
        stop(job.tasks, grace)
        return 130
    except Terminated:
        say("SIGTERM again; stopping every task now")
        stop(job.tasks, grace)
        return 143
    finally:
        stop(job.tasks, grace)
        if forker is not None:
            forker.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if timeline_file and any(os.path.exists(timeline.part_path(timeline_file, w))
                                 for w in range(len(workers))):
            say(f"timeline of the job in {timeline.merge(timeline_file, len(workers))}")


def _start_tasks(job: Job, script, resources, workers, ps, base_env, args, runner,
                 chief_only, verbose, forker=None, shares=None) -> None:
    """Every task of one start of the job, into `job.tasks` as each starts
    (those of this machine with `shares` in their environment)."""
    tasks, here = job.tasks, {**base_env, **(shares or {})}
    for j, address in enumerate(resources.ps):
        info = ClusterInfo(tuple(workers), tuple(ps), "ps", j, (("CPU", 0),))
        command = [sys.executable, "-m", "parallax_ng.tools.launch", "serve"]
        remote = is_remote(address)
        tasks.append(_start(f"ps {j}", command, info, base_env if remote else here,
                            resources.ssh if remote else None,
                            shown=not chief_only, verbose=verbose, forker=forker))
    for i, host in enumerate(resources.hosts):
        info = ClusterInfo(tuple(workers), tuple(ps), "worker", i, host.devices)
        command = [sys.executable, *(['-m', runner] if runner else []),
                   os.path.abspath(script), *args]
        remote = is_remote(host.address, host.launch)
        tasks.append(_start(f"worker {i}", command, info, base_env if remote else here,
                            resources.ssh if remote else None,
                            shown=i == 0 or not chief_only, verbose=verbose,
                            forker=forker))
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
           ssh: str | None = None, shown: bool = True, verbose: bool = False,
           forker: Forker | None = None) -> Task:
    env = dict(env, **{ENV: info.to_env(), heartbeat.ENV: name})
    address = (info.ps if info.task_type == "ps" else info.workers)[info.task]
    process = None
    if ssh is not None:
        command = remote_command(ssh, address, command, env)
    elif forker is not None:       # [python, -m, module, args...] or [python, script, args...]
        module = command[2] if command[1] == "-m" else ""
        process = forker.spawn([module, *command[3:]] if module else command[1:], env,
                               script="" if module else command[1], module=module)
        if process is None and not forker.said:
            forker.said = True
            say(f"tasks start as processes of their own: {forker.failed}")
    if process is None:
        process = subprocess.Popen(command, env=env, start_new_session=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
    say(f"started {name} (pid {process.pid}) at {address}")
    task = Task(name, process, shown, verbose)
    task.relay()
    return task


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
                say(f"workers still running {job.grace_seconds:g} s after SIGTERM; stopping "
                    "every task")
                stop(tasks, job.grace)
                return Outcome(143, job.preempted_by, not job.signalled)
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
                say(f"{_stalled(held_by, now)}; {t.name} failed waiting for it "
                    f"({t.error or f'exit code {code}'}); stopping the job")
                held_by.show_tail()
            elif mistake:
                say(f"{t.name}: {t.error}")
            else:
                died = f"signal {-rc}" if rc < 0 else f"code {rc}"
                say(f"{t.name} (pid {t.process.pid}) exited with {died}"
                    f"{f': {t.error}' if t.error else ''}; stopping the job")
                t.show_tail()
            stop(tasks, job.grace)
            job.preempted_by = ""
            if held_by is not None:
                return Outcome(1, held_by.name, True)
            return Outcome(code, t.name, not mistake and not job.signalled,
                           hosts_fault=REFUSED_SAID not in (t.error or ""))
        limit = _limit(tasks, workers)
        for t in tasks:
            if t.process.poll() is None and t.silent(now) > (
                    max(limit, EXITING) if t.exiting else limit):
                say(f"{_stalled(t, now)}; stopping the job")
                t.show_tail()
                stop(tasks, job.grace)
                job.preempted_by = ""
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
    silent = [u for u in live if u.silent(now) > STALE and not u.exiting]
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
    if task.exiting:
        return (f"{task.name} (pid {task.process.pid}) did not end {task.silent(now):.0f} s "
                "after its program did (hung in TensorFlow's teardown?)")
    if task.silent(now) > STALE:
        return (f"{task.name} (pid {task.process.pid}) stopped making progress: no "
                f"heartbeat for {task.silent(now):.0f} s (stopped, e.g. by SIGSTOP, or hung)")
    return (f"{task.name} (pid {task.process.pid}) stopped making progress: outside its "
            f"training steps for {task.idle(now):.0f} s (blocked, e.g. in I/O)")


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
