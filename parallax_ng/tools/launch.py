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
is stopped (SIGTERM, then SIGKILL after `grace` seconds) and the launcher
exits non-zero naming the task that failed. No process outlives it.
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
from dataclasses import dataclass, field

from ..cluster import CONFIG_ENV, ENV, ClusterInfo
from ..errors import ResourceError
from ..resources import ResourceInfo, load_resources
from ..runtime import heartbeat

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
           verbose: bool = False, env: dict | None = None, runner: str = "") -> int:
    """Run the job; its exit code: 0 when every worker ended well, else
    the failing task's (128 + N for a task ended by signal N), 1 for a task
    that stopped making progress, 130 on Ctrl-C, 143 on SIGTERM. `runner`:
    a module each worker runs the script with (`python -m runner script
    ...`), else the script runs as itself."""
    from ..config import load_config
    if not os.path.isfile(script):
        raise ResourceError(f"script {script!r} does not exist")
    if config:
        load_config(config)            # its mistakes before any task starts
    resources = load_resources(resource_info)
    workers, ps = plan_cluster(resources)
    for name, address, given in _addresses(resources, workers, ps):
        if given and not is_remote(address):
            _check_free(name, address)
    tasks: list[Task] = []
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    base_env.pop("TF_CONFIG", None)
    base_env.update(env or {})
    if verbose:
        base_env[heartbeat.VERBOSE_ENV] = "1"
    if config:
        base_env[CONFIG_ENV] = os.path.abspath(config)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
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
                                else None, shown=i == 0 or not chief_only,
                                verbose=verbose))
        return _watch(tasks, grace, poll)
    except KeyboardInterrupt:
        _say("interrupted; stopping every task")
        _stop(tasks, grace)
        return 130
    except Terminated:
        _say("terminated (SIGTERM); stopping every task")
        _stop(tasks, grace)
        return 143
    finally:
        _stop(tasks, grace)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise Terminated()


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


def _watch(tasks: list[Task], grace: float, poll: float) -> int:
    workers = [t for t in tasks if t.name.startswith("worker")]
    while True:
        now = time.monotonic()
        for t in tasks:
            rc = t.process.poll()
            if rc not in (None, 0):   # 0: a worker that finished, a server whose workers did
                t.finish()
                held_by = _holding(tasks, t, now)
                code = 128 - rc if rc < 0 else rc
                if held_by is not None:
                    _say(f"{_stalled(held_by, now)}; {t.name} failed waiting for it "
                         f"({t.error or f'exit code {code}'}); stopping the job")
                    held_by.show_tail()
                elif t.error and _users_mistake(t.error):
                    _say(f"{t.name}: {t.error}")
                else:
                    died = f"signal {-rc}" if rc < 0 else f"code {rc}"
                    _say(f"{t.name} (pid {t.process.pid}) exited with {died}"
                         f"{f': {t.error}' if t.error else ''}; stopping the job")
                    t.show_tail()
                _stop(tasks, grace)
                return 1 if held_by is not None else code
            limit = _limit(tasks, workers)
            if rc is None and t.silent(now) > limit:
                _say(f"{_stalled(t, now)}; stopping the job")
                t.show_tail()
                _stop(tasks, grace)
                return 1
        if all(t.process.poll() == 0 for t in workers):
            for t in workers:
                t.finish()
            return 0
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
    """SIGTERM every live task's process group, SIGKILL what is left after `grace`."""
    live = [t for t in tasks if t.process.poll() is None]
    for t in live:
        _signal(t.process, signal.SIGTERM)
        _signal(t.process, signal.SIGCONT)     # a stopped task takes its SIGTERM
    deadline = time.monotonic() + grace
    for t in live:
        try:
            t.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(t.process, signal.SIGKILL)
            t.process.wait(timeout=grace)


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
