"""Resource information: which hosts and devices train, and where servers run.

Accepted forms (YAML path or dict)::

    hosts:
      - address: 127.0.0.1        # default 127.0.0.1; "address:port" to fix the port
        devices: [cpu:0, cpu:1]   # or gpu:0 ... ; "cpu:N"/"gpu:N" strings
        launch: auto              # auto (ssh unless the address is loopback), local, ssh
    ps: []                        # parameter-server addresses (cluster mode), or
                                  # per_host: one server on each host's address
    ssh: ssh                      # command that runs a command on a host (parallax-ng run)
    spares:                       # hosts that take the place of one whose task failed
      - address: 10.0.0.9         # twice (parallax-ng run --restarts); same devices
        devices: [cpu:0, cpu:1]

`None` means this machine: all its GPUs, or, without GPUs, one CPU device per
core, at most MAX_DEFAULT_CPU_DEVICES (made with
ConfigProto(device_count={"CPU": n})).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .config import read_yaml
from .errors import ResourceError

MAX_DEFAULT_CPU_DEVICES = 8   # replicas of a whole graph cost memory; list more explicitly
_DEVICE = re.compile(r"^(?:/device:)?(cpu|gpu):(\d+)$", re.IGNORECASE)


LAUNCH_MODES = ("auto", "local", "ssh")


@dataclass(frozen=True)
class Host:
    address: str
    devices: tuple[tuple[str, int], ...]   # (kind, index), kind in {"CPU", "GPU"}
    launch: str = "auto"


@dataclass(frozen=True)
class ResourceInfo:
    hosts: tuple[Host, ...]
    ps: tuple[str, ...] = ()
    ssh: str = "ssh"
    spares: tuple[Host, ...] = ()

    @property
    def num_replicas(self) -> int:
        return sum(len(h.devices) for h in self.hosts)

    def local_device_strings(self) -> list[str]:
        """TensorFlow device names of the single host's devices (in-process mode)."""
        host = self.hosts[0]
        return [f"/job:localhost/replica:0/task:0/device:{kind}:{i}"
                for kind, i in host.devices]

    @property
    def num_cpu_devices(self) -> int:
        cpus = [i for kind, i in self.hosts[0].devices if kind == "CPU"]
        return max(cpus, default=0) + 1


def session_config(devices, group_leader: str | None = None):
    """The ConfigProto a process with these (kind, index) devices needs: enough
    CPU devices, soft placement only for GPUs (ops without GPU kernels), and
    the collective group leader in a multi-process job."""
    import tensorflow as tf

    cpus = 1 + max([i for kind, i in devices if kind == "CPU"], default=0)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus},
                                      allow_soft_placement=any(k == "GPU" for k, _ in devices))
    if group_leader:
        config.experimental.collective_group_leader = group_leader
    return config


def check_devices(devices, where: str = "this machine") -> None:
    """Fail at once if `devices` names a GPU TensorFlow does not see here.

    (TensorFlow would quietly put such a replica on CPU:0, and its first
    collective would wait out the whole timeout.) CPU devices are made as
    many as listed.
    """
    import tensorflow as tf

    gpus = len(tf.config.list_physical_devices("GPU"))
    missing = [f"gpu:{i}" for kind, i in devices if kind == "GPU" and i >= gpus]
    if missing:
        seen = f"{gpus} GPU(s) (gpu:0..gpu:{gpus - 1})" if gpus else "no GPU"
        raise ResourceError(
            f"the resource info lists {', '.join(missing)} on {where}, but TensorFlow "
            f"sees {seen} there; list the devices it has (cpu:N makes N+1 CPU devices), "
            "or give None for this machine's devices")


def load_resources(resource_info) -> ResourceInfo:
    if resource_info is None:
        return local_resources()
    if isinstance(resource_info, ResourceInfo):
        return resource_info
    if isinstance(resource_info, (str, os.PathLike)):
        resource_info = read_yaml(os.fspath(resource_info), "resource", ResourceError)
    if not isinstance(resource_info, dict):
        raise ResourceError("resource info must be a path, a dict or None, "
                            f"not {type(resource_info).__name__}")
    return _parse(resource_info)


def local_resources() -> ResourceInfo:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        devices = tuple(("GPU", i) for i in range(len(gpus)))
    else:
        n = min(max(1, os.cpu_count() or 1), MAX_DEFAULT_CPU_DEVICES)
        devices = tuple(("CPU", i) for i in range(n))
    return ResourceInfo((Host("127.0.0.1", devices),))


def _parse(data: dict) -> ResourceInfo:
    unknown = set(data) - {"hosts", "ps", "ssh", "spares"}
    if unknown:
        raise ResourceError(f"unknown resource key(s) {sorted(unknown)}; known: hosts, ps, "
                            "ssh, spares")
    hosts_data = data.get("hosts")
    if not hosts_data or not isinstance(hosts_data, list):
        raise ResourceError("resource info names no devices: give 'hosts', a list of "
                            "{address: ..., devices: [cpu:0, gpu:0, ...]}")
    hosts = [_host(h, f"hosts[{i}]") for i, h in enumerate(hosts_data)]
    spares_data = data.get("spares") or []
    if not isinstance(spares_data, list):
        raise ResourceError("resource key 'spares' must be a list of hosts "
                            "({address: ..., devices: [...]}), like 'hosts'")
    spares = tuple(_host(h, f"spares[{i}]") for i, h in enumerate(spares_data))
    for i, spare in enumerate(spares):
        if len(spare.devices) != len(hosts[0].devices):
            raise ResourceError(f"spares[{i}] ({spare.address}) lists {len(spare.devices)} "
                                f"devices; a spare takes a host's place, so it lists as many "
                                f"as every host ({len(hosts[0].devices)})")
    return ResourceInfo(tuple(hosts), _servers(data.get("ps"), hosts),
                        str(data.get("ssh") or "ssh"), spares)


def _host(h, where: str) -> Host:
    """One entry of `hosts` or `spares`."""
    if not isinstance(h, dict):
        raise ResourceError(f"{where} must be a mapping with 'address' and 'devices'")
    extra = set(h) - {"address", "devices", "launch"}
    if extra:
        raise ResourceError(f"unknown key(s) {sorted(extra)} in {where}; "
                            "known: address, devices, launch")
    launch = h.get("launch", "auto")
    if launch not in LAUNCH_MODES:
        raise ResourceError(f"{where}.launch is {launch!r}; allowed: " + ", ".join(LAUNCH_MODES))
    devices = h.get("devices") or []
    if not devices:
        raise ResourceError(f"{where} ({h.get('address', '127.0.0.1')}) names no "
                            "devices; list them as devices: [cpu:0, gpu:0, ...]")
    parsed = []
    for d in devices:
        m = _DEVICE.match(str(d).strip())
        if not m:
            raise ResourceError(f"device {d!r} in {where} is not understood; "
                                "write cpu:N or gpu:N")
        parsed.append((m.group(1).upper(), int(m.group(2))))
    if len(set(parsed)) != len(parsed):
        raise ResourceError(f"{where} lists a device twice: {devices}")
    return Host(str(h.get("address", "127.0.0.1")), tuple(parsed), launch)


def _servers(ps, hosts) -> tuple[str, ...]:
    """`ps`: a list of addresses, or `per_host` (a server process beside
    every host's worker, on its address: on the next port when the host
    gives its worker's port, else on a free one)."""
    if ps == "per_host":
        out = []
        for h in hosts:
            m = re.match(r"^(.*):(\d+)$", h.address)
            out.append(f"{m.group(1)}:{int(m.group(2)) + 1}" if m else h.address)
        return tuple(out)
    if isinstance(ps, str) or not isinstance(ps, (list, tuple, type(None))):
        raise ResourceError(f"resource key 'ps' is {ps!r}; give a list of addresses "
                            "([10.0.0.5, ...]) or per_host (one server on every host)")
    return tuple(str(p) for p in (ps or []))
