"""Plan: every decision of the transformation, as plain data.

Requires: a TrainingGraph's analysis, a Config and the resources.
Guarantees: for each trainable variable an aggregation method (allreduce,
ps or allgather); for every variable whether it is mirrored (one copy per
replica, all kept equal) or shared (one copy on the parameter server, the
host CPU in-process); the devices. The plan prints, serialises to a dict and
is what the passes consume; tests assert on it without running TensorFlow.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import queues, randomness
from .analysis import VariableInfo
from .config import Config
from .errors import ConfigError
from .frontend import TrainingGraph


@dataclass(frozen=True)
class VariablePlan:
    name: str
    method: str          # allreduce | ps | allgather
    info: VariableInfo

    @property
    def shared(self) -> bool:
        return self.method == "ps"


@dataclass(frozen=True)
class Plan:
    run_option: str
    average_dense: bool
    average_sparse: bool
    devices: tuple[str, ...]          # one replica per device
    host: str                         # parameter-server device in-process
    variables: dict[str, VariablePlan]  # trainable variables
    placement: dict[str, str]         # every variable -> "mirrored" | "shared"
    timeout_seconds: float = 300.0
    num_workers: int = 1              # processes in the job (cluster mode)
    worker: int = 0                   # this process's index among them
    servers: tuple[str, ...] = ()     # parameter-server devices (cluster mode)
    server_of: dict[str, str] = field(default_factory=dict)  # shared state -> device
    backend: str = "tf"               # collectives across workers: tf | horovod
    row_split: dict[str, tuple] = field(default_factory=dict)  # state -> ((server, start, rows), ...)
    random: dict[str, str] = field(default_factory=dict)  # random op -> distinct | identical
    split_queues: dict[str, tuple] = field(default_factory=dict)  # producer -> its enqueues

    @property
    def num_replicas(self) -> int:
        """Replicas in this process's graph (one per local device)."""
        return len(self.devices)

    @property
    def group_size(self) -> int:
        """Replicas in the whole job; every worker has the same device count."""
        return self.num_replicas * self.num_workers

    @property
    def replica_offset(self) -> int:
        """Job-wide index of this process's replica 0."""
        return self.worker * self.num_replicas

    def shared_state(self) -> set[str]:
        return {v for v, p in self.placement.items() if p == "shared"}

    def server(self, var: str) -> str:
        """The device that holds shared variable `var` (the host in-process)."""
        return self.server_of.get(var, self.host)

    @property
    def cross_worker_servers(self) -> bool:
        """True when shared state lives on parameter-server processes that
        several workers update: aggregation then goes through the servers."""
        return self.num_workers > 1 and bool(self.shared_state())

    def bytes_per_replica(self) -> dict[str, float]:
        """Bytes one replica sends+receives per step (Parallax paper, Table 3)."""
        n = self.group_size
        out = {}
        for name, vp in self.variables.items():
            b, alpha = vp.info.nbytes, vp.info.alpha or 1.0
            if vp.method == "allreduce":
                out[name] = 2 * (n - 1) * b / n
            elif vp.method == "allgather":
                out[name] = 2 * (n - 1) * alpha * b
            else:
                out[name] = 2 * alpha * b if vp.info.sparse else 2 * b
        return out

    def to_dict(self) -> dict:
        return {
            "run_option": self.run_option, "average_dense": self.average_dense,
            "workers": self.num_workers, "worker": self.worker,
            "average_sparse": self.average_sparse, "devices": list(self.devices),
            "host": self.host,
            "variables": {k: {"method": v.method, **v.info.to_dict()}
                          for k, v in self.variables.items()},
            "placement": dict(self.placement),
            "servers": list(self.servers), "server_of": dict(self.server_of),
            "backend": self.backend,
            "row_split": {k: [list(p) for p in v] for k, v in self.row_split.items()},
            "random": dict(self.random),
            "split_queues": {k: list(v) for k, v in self.split_queues.items()},
        }

    def format(self) -> str:
        rows = [f"run_option={self.run_option} replicas={self.group_size} "
                f"({self.num_workers} worker(s) x {self.num_replicas}) host={self.host}",
                f"{'variable':40} {'shape':>16} {'kind':6} {'alpha':>6} "
                f"{'method':9} {'MB/step/replica':>15}"]
        traffic = self.bytes_per_replica()
        for name, vp in sorted(self.variables.items(), key=lambda kv: kv[1].info.order):
            i = vp.info
            alpha = "-" if i.alpha is None else f"{i.alpha:.3f}"
            rows.append(f"{name:40} {str(list(i.shape)):>16} "
                        f"{'sparse' if i.sparse else 'dense':6} {alpha:>6} "
                        f"{vp.method:9} {traffic[name] / 1e6:15.3f}")
        if self.server_of:
            load = {s: 0 for s in self.servers}
            for var, device in self.server_of.items():
                load[device] += self.variables[var].info.nbytes if var in self.variables else 0
            rows.append("servers: " + ", ".join(f"{d} {b / 1e6:.3f} MB"
                                                for d, b in load.items()))
        for var in sorted(v for v in self.row_split if v in self.variables):
            rows.append(f"row ranges: {var} -> " + ", ".join(
                f"{d} rows {start}..{start + n - 1}" for d, start, n in self.row_split[var]))
        if self.random:
            modes = list(self.random.values())
            rows.append(f"random ops: {modes.count('distinct')} draw per replica, "
                        f"{modes.count('identical')} the same on every replica")
        state = sorted(k for k in self.placement if k not in self.variables)
        if state:
            rows.append("state: " + ", ".join(f"{k}={self.placement[k]}" for k in state))
        return "\n".join(rows)


def make_plan(tg: TrainingGraph, info: dict[str, VariableInfo], config: Config,
              devices: list[str], host: str, num_workers: int = 1, worker: int = 0,
              servers: list[str] = ()) -> Plan:
    unknown = set(config.variable_methods) - set(info)
    if unknown:
        raise ConfigError(f"config key 'variable_methods' names {sorted(unknown)}, which "
                          f"are not trained variables; trained: {sorted(info)}")
    variables = {}
    for name, vi in info.items():
        method = config.variable_methods.get(name) or _default_method(config.run_option, vi)
        if method == "allgather" and not vi.sparse:
            raise ConfigError(f"config key 'variable_methods.{name}' is allgather, but "
                              f"{name} has a dense gradient; use allreduce or ps")
        variables[name] = VariablePlan(name, method, vi)
    placement = {}
    for name, var in tg.variables.items():
        root = name if var.trainable else var.owner
        shared = root in variables and variables[root].shared
        placement[name] = "shared" if shared else "mirrored"
    server_of = {}
    backend = config.communication.backend
    if backend == "horovod" and num_workers > 1 and "shared" in placement.values():
        shared = sorted(v for v, p in placement.items() if p == "shared")
        raise ConfigError(
            f"run_option {config.run_option!r} puts {shared[:5]} on parameter servers, which "
            "communication.backend horovod does not have; use run_option: allreduce "
            "(sparse gradients by Horovod's allgather), or backend tf with `ps:` servers")
    if "shared" in placement.values() and (num_workers > 1 or servers):
        if not servers:
            shared = sorted(v for v, p in placement.items() if p == "shared")
            raise ConfigError(
                f"run_option {config.run_option!r} puts {shared[:5]} on parameter servers, "
                "but the job has none; list `ps: [address]` in the resource file, or use "
                "run_option: allreduce (sparse gradients by AllGather)")
        server_of, row_split = balance(
            tg, [v for v in variables if variables[v].shared], servers,
            [v for v in variables if variables[v].shared and variables[v].info.sparse])
    else:
        row_split = {}
    producers = [q for q in queues.find(tg) if q.producer]
    random = randomness.decide(randomness.random_ops(tg.ir.nodes, tg.ir.library),
                               config.random, config.random_ops,
                               pinned={op for q in producers for op in q.random})
    return Plan(config.run_option, config.average_dense, config.average_sparse,
                tuple(devices), host, variables, placement,
                config.communication.timeout_seconds, num_workers, worker,
                tuple(servers), server_of, backend, row_split, random,
                {q.queue: q.enqueues for q in producers})


def balance(tg: TrainingGraph, shared: list[str], servers: list[str],
            sparse: list[str] = ()) -> tuple[dict[str, str], dict[str, tuple]]:
    """Each shared variable (with the state it owns) on one server, spread
    evenly by bytes: largest first, each to the least-loaded server; ties go
    to the lower index, so every worker computes the same map.

    A sparse variable bigger than a server's fair share (total / servers),
    whose every use can be split by rows (`splittable`), is cut into one row
    range per server first: (server, first row, rows) per range for it and
    each of its same-shape slots; its other state and its gradient's
    aggregation stay with range 0.
    """
    size = {v: sum(tg.variables[s].nbytes for s in tg.owned(v)) for v in shared}
    load = [0] * len(servers)
    out, row_split = {}, {}
    fair = sum(size.values()) / len(servers)
    for var in sorted(sparse, key=lambda v: (-size[v], v)):
        state = splittable(tg, var) if len(servers) > 1 and size[var] > fair else None
        if not state:
            continue
        rows = tg.variables[var].shape[0]
        bounds = [rows * k // len(servers) for k in range(len(servers) + 1)]
        ranges = tuple((servers[k], bounds[k], bounds[k + 1] - bounds[k])
                       for k in range(len(servers)) if bounds[k + 1] > bounds[k])
        for s in state:
            row_split[s] = ranges
        for k, (_, _, n) in enumerate(ranges):
            load[k] += size[var] * n // rows
        for s in tg.owned(var):
            out[s] = servers[0]
    for var in sorted(shared, key=lambda v: (-size[v], v)):
        if var in out:
            continue
        j = min(range(len(servers)), key=lambda i: (load[i], i))
        load[j] += size[var]
        for s in tg.owned(var):
            out[s] = servers[j]
    return out, row_split


SPLIT_READS = frozenset({"ReadVariableOp", "ResourceGather", "VarIsInitializedOp",
                         "VariableShape"})
SPLIT_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"} |
                         {f"ResourceScatter{k}" for k in
                          ("Add", "Sub", "Mul", "Div", "Min", "Max", "Update")})


def splittable(tg: TrainingGraph, var: str) -> list[str] | None:
    """`var` and its slots of the same shape, if every op on them takes the
    handle straight from the variable and is one `split_rows` can cut by
    rows; else None."""
    shape = tg.variables[var].shape
    if not shape or any(d is None for d in shape):
        return None
    state = [s for s in tg.owned(var) if tg.variables[s].shape == shape]
    for s in state:
        for op in set(tg.readers.get(s, ())) | set(tg.writers.get(s, ())):
            node = tg.ir.node(op)
            known = node.op in SPLIT_READS or node.op in SPLIT_WRITES or \
                node.op.startswith("ResourceSparseApply")
            handles = [r for r in tg.ir.data_inputs(op) if r.node in tg.variables]
            batched = "batch_dims" in node.attr and node.attr["batch_dims"].i
            if not known or not handles or any(r.node not in state for r in handles) or \
                    batched:
                return None
    return state


def _default_method(run_option: str, vi: VariableInfo) -> str:
    if run_option == "ps":
        return "ps"
    if run_option == "allreduce":
        return "allgather" if vi.sparse else "allreduce"
    return "ps" if vi.sparse else "allreduce"
