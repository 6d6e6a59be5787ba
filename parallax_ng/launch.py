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
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from .cluster import CONFIG_ENV, ENV, ClusterInfo
from .errors import ResourceError
from .resources import ResourceInfo, load_resources

LOCAL = ("127.", "localhost", "::1")


@dataclass
class Task:
    name: str                 # "worker 0", "ps 1"
    process: subprocess.Popen


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
    with socket.socket() as s:
        s.bind((address if address != "localhost" else "127.0.0.1", 0))
        return f"{address}:{s.getsockname()[1]}"


def launch(script: str, resource_info, config: str | None = None, args=(),
           grace: float = 10.0, poll: float = 0.2) -> int:
    resources = load_resources(resource_info)
    workers, ps = plan_cluster(resources)
    tasks: list[Task] = []
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    base_env.pop("TF_CONFIG", None)
    if config:
        base_env[CONFIG_ENV] = os.path.abspath(config)
    try:
        for j, address in enumerate(resources.ps):
            info = ClusterInfo(tuple(workers), tuple(ps), "ps", j, (("CPU", 0),))
            command = [sys.executable, "-m", "parallax_ng.launch", "serve"]
            tasks.append(_start(f"ps {j}", command, info, base_env,
                                resources.ssh if is_remote(address) else None))
        for i, host in enumerate(resources.hosts):
            info = ClusterInfo(tuple(workers), tuple(ps), "worker", i, host.devices)
            command = [sys.executable, os.path.abspath(script), *args]
            tasks.append(_start(f"worker {i}", command, info, base_env,
                                resources.ssh if is_remote(host.address, host.launch)
                                else None))
        return _watch(tasks, grace, poll)
    except KeyboardInterrupt:
        print("parallax-ng run: interrupted; stopping every task", file=sys.stderr)
        _stop(tasks, grace)
        return 130
    finally:
        _stop(tasks, grace)


def remote_command(ssh: str, address: str, command: list[str], env: dict) -> list[str]:
    """argv that runs `command` with the parallax_ng part of `env` on `address`."""
    host = address.rpartition(":")[0] or address
    keep = {k: v for k, v in env.items()
            if k.startswith("PARALLAX_NG_") or k in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")}
    line = " ".join([f"cd {shlex.quote(os.getcwd())} && env"]
                    + [shlex.quote(f"{k}={v}") for k, v in sorted(keep.items())]
                    + [shlex.quote(c) for c in command])
    return shlex.split(ssh) + [host, line]


def _start(name: str, command: list[str], info: ClusterInfo, env: dict,
           ssh: str | None = None) -> Task:
    env = dict(env, **{ENV: info.to_env()})
    address = (info.ps if info.task_type == "ps" else info.workers)[info.task]
    if ssh is not None:
        command = remote_command(ssh, address, command, env)
    process = subprocess.Popen(command, env=env, start_new_session=True)
    print(f"parallax-ng run: started {name} (pid {process.pid}) at {address}",
          file=sys.stderr, flush=True)
    return Task(name, process)


def _watch(tasks: list[Task], grace: float, poll: float) -> int:
    workers = [t for t in tasks if t.name.startswith("worker")]
    while True:
        for t in tasks:
            rc = t.process.poll()
            if rc is None:
                continue
            if rc != 0 or t not in workers:
                print(f"parallax-ng run: {t.name} (pid {t.process.pid}) exited with code "
                      f"{rc}; stopping the job", file=sys.stderr)
                _stop(tasks, grace)
                return rc or 1
        if all(t.process.poll() == 0 for t in workers):
            return 0
        time.sleep(poll)


def _stop(tasks: list[Task], grace: float) -> None:
    """SIGTERM every live task's process group, SIGKILL what is left after `grace`."""
    live = [t for t in tasks if t.process.poll() is None]
    for t in live:
        _signal(t.process, signal.SIGTERM)
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
    """A parameter-server process: run a gRPC server until stopped."""
    from .cluster import from_env
    info = from_env()
    if info is None:
        raise SystemExit(f"parallax_ng.launch serve needs {ENV}")
    info.start_server().join()


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
