"""Plan: every decision of the transformation, as plain data.

Made by parallax_ng/planning/planner.py from a TrainingGraph's analysis, a Config
and the resources; consumed by the passes; printed by `parallax-ng plan`;
tests assert on it without running TensorFlow.
Holds: an aggregation method per trained variable (allreduce, ps,
allgather, bfb or alltoall); a placement per variable
(parallax_ng/planning/placement.py: mirrored, shared on one device, sharded over
devices, or cut by columns over the replicas); the devices and
the job; random streams and input producers; the step schedule; merged
all-reduce buckets and fusion buffers; which placement rewrites run.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..methods import method
from .analysis import VariableInfo
from .placement import Columns, Mirrored, Sharded, Shared, home


@dataclass(frozen=True)
class VariablePlan:
    name: str
    method: str          # a name in parallax_ng/methods.py METHODS
    info: VariableInfo
    coalesce: bool = False   # duplicate rows summed on the worker before they leave it
    unique_rows: bool = False   # one device's rows are distinct: the job's summed by id
    prefetch: bool = False   # rows the next batch reads sent first, the rest during it
    note: str = ""           # why a setting asked for does not apply

    @property
    def shared(self) -> bool:
        """The variable exists once, on a parameter server."""
        return method(self.method).shared

    def noted(self, note: str) -> "VariablePlan":
        """With `note` added to its notes."""
        return replace(self, note=f"{self.note}; {note}" if self.note else note)


@dataclass(frozen=True)
class Schedule:
    """How a step runs. `split`: a job step with collectives beside
    parameter-server work runs as two session runs at once, one for each
    (parallax_ng/pipeline/step_parts.py). `order`: trained variables in the order
    their gradients became ready in a profiled step (empty: not measured)."""
    split: bool = False
    order: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rewrites:
    """Which placement rewrites run (each a pass; config placement_rewrites)."""
    local_aggregation: bool = True
    colocate_updates: bool = True
    lookups_on_servers: bool = True


@dataclass(frozen=True)
class Bucket:
    """Gradients all-reduced together as one message."""
    variables: tuple[str, ...]


@dataclass(frozen=True)
class Segment:
    """Elements [start, start + size) of `var`'s flattened gradient at
    `offset` in a fusion buffer."""
    var: str
    start: int
    size: int
    offset: int


@dataclass(frozen=True)
class Buffer:
    """A fusion buffer: gradient segments packed flat, the buffer sharded
    over devices at element offsets (`Sharded(axis=None, ...)`)."""
    segments: tuple[Segment, ...]
    placement: Sharded


@dataclass(frozen=True)
class Candidate:
    """A plan the planner weighed by its links (parallax_ng/planning/choice.py): its
    busiest link's end and bytes per step each way, the bytes over all
    links, the seconds those bytes take and those of its rounds of
    messages (parallax_ng/planning/traffic.py), and their sum; `methods`:
    every variable's method, (variable, method) sorted."""
    label: str
    end: str
    sent: float
    received: float
    total: float
    link_seconds: float
    fixed_seconds: float
    seconds: float
    chosen: bool = False
    methods: tuple = ()


@dataclass(frozen=True)
class Plan:
    run_option: str
    average_dense: bool
    average_sparse: bool
    devices: tuple[str, ...]          # one replica per device
    host: str                         # parameter-server device in-process
    variables: dict[str, VariablePlan]  # trainable variables
    placement: dict                   # every variable -> Mirrored | Shared | Sharded
    timeout_seconds: float = 300.0
    num_workers: int = 1              # processes in the job (cluster mode)
    worker: int = 0                   # this process's index among them
    servers: tuple[str, ...] = ()     # parameter-server devices (cluster mode)
    backend: str = "tf"               # collectives across workers: tf | horovod
    compression: str = "none"         # float32 gradients on the wire: none | fp16 | bf16
    random: dict[str, str] = field(default_factory=dict)  # random op -> distinct | identical
    counted: tuple[str, ...] = ()     # seeded random ops whose calls a checkpointed counter keeps
    split_queues: dict[str, tuple] = field(default_factory=dict)  # producer -> its enqueues
    schedule: Schedule = field(default_factory=Schedule)
    buckets: tuple[Bucket, ...] = ()
    buffers: tuple[Buffer, ...] = ()
    # horizontal scheduling: dense variables updated a step later, by layer, in
    # the order the forward reads them (one all-reduce per block)
    blocks: tuple[tuple[str, ...], ...] = ()
    distinct_lookups: bool = False    # each distinct row once: a worker's from a server, a
    #                                   replica's by alltoall
    order_source: str = ""            # where the fusion buffers' packing order came from
    rewrites: Rewrites = field(default_factory=Rewrites)
    costs: dict = field(default_factory=dict)   # run_option auto: var -> {method: seconds}
    network: str = ""                           # the network those costs assume
    choice: tuple[Candidate, ...] = ()          # the plans weighed by their links
    notes: tuple[str, ...] = ()                 # settings asked for that do not apply, why
    # batch_norm synchronized: (tensor, mean) of the statistics and their
    # gradients the replicas exchange (graph/normalization.py)
    norm_points: tuple[tuple[str, bool], ...] = ()
    # TF1 losses' sums scaled by numbers the graph does not show to be a batch
    # size (graph/averaging.py ScaledSum): transforms/scaled_sums.py decides them
    scaled_sums: tuple = ()

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

    def mirrored(self, var: str) -> bool:
        return isinstance(self.placement[var], Mirrored)

    def shared_state(self) -> set[str]:
        """Variables that exist once: shared or sharded."""
        return {v for v, p in self.placement.items() if isinstance(p, (Shared, Sharded))}

    def columns(self) -> dict[str, Columns]:
        """Variables cut by columns over the replicas (method alltoall and
        their slots): every replica holds its own part."""
        return {v: p for v, p in self.placement.items() if isinstance(p, Columns)}

    def job_devices(self) -> list[str]:
        return job_devices(self.devices, self.num_workers, self.worker)

    def sharded(self) -> dict[str, Sharded]:
        return {v: p for v, p in self.placement.items() if isinstance(p, Sharded)}

    def server(self, var: str) -> str:
        """The device of a shared variable (a sharded one's first shard; the
        host for mirrored state)."""
        return home(self.placement[var]) or self.host

    @property
    def reduces_on_servers(self) -> bool:
        """A job whose dense gradients are summed on the servers (fusion
        buffers, or every variable on them): other sums in the step (a
        metric's totals, moving statistics) go there too, so a training run
        has no collective op and is one session.run."""
        return self.num_workers > 1 and bool(self.servers) and (bool(self.buffers) or bool(
            self.variables) and all(method(vp.method).servers for vp in self.variables.values()))

    @property
    def cross_worker_servers(self) -> bool:
        """True when shared state lives on parameter-server processes that
        several workers update: aggregation then goes through the servers."""
        return self.num_workers > 1 and bool(self.shared_state())

    @property
    def uses_servers(self) -> bool:
        """Whether a job's steps touch its parameter servers (variables on
        them, or fusion buffers summed there)."""
        return bool(self.servers) and bool(self.shared_state() or self.buffers)

    def bytes_per_replica(self) -> dict[str, float]:
        """Bytes one replica sends+receives per step (Parallax paper, Table 3)."""
        n = self.group_size
        out = {}
        for name, vp in self.variables.items():
            out[name] = method(vp.method).replica_bytes(vp.info, n)
        return out

    def server_load(self) -> dict[str, float]:
        """Bytes of trained variables on each server (shards pro rata)."""
        load = {s: 0.0 for s in self.servers}
        for var, vp in self.variables.items():
            p = self.placement[var]
            if isinstance(p, Shared) and p.device in load:
                load[p.device] += vp.info.nbytes
            elif isinstance(p, Sharded):
                for s in p.shards:
                    load[s.device] = load.get(s.device, 0.0) + vp.info.nbytes * s.size / p.length
        return load

    def bytes_of(self, buffer: Buffer) -> int:
        var = buffer.segments[0].var
        return buffer.placement.length * self.variables[var].info.nbytes // max(
            1, _elements(self.variables[var].info.shape))

    def buffer_load(self) -> dict[str, float]:
        """Bytes of fusion buffer shards each server receives from one worker
        per step (and sends back to it)."""
        load: dict[str, float] = {}
        for b in self.buffers:
            per = self.bytes_of(b) / b.placement.length
            for s in b.placement.shards:
                load[s.device] = load.get(s.device, 0.0) + s.size * per
        return load

    def methods(self) -> tuple:
        """Every variable's method, (variable, method) sorted: what tells
        the plans the planner weighs apart (Candidate.methods)."""
        return tuple(sorted((v, vp.method) for v, vp in self.variables.items()))

    def decisions(self) -> "Plan":
        """The plan without its measurements (sparsity, factors' rows,
        gradient order): two plans with equal decisions transform a graph
        alike."""
        return replace(self, schedule=replace(self.schedule, order=()), costs={}, network="",
                       choice=(),
                       variables={
            k: replace(vp, info=replace(vp.info, alpha=None, alpha_source="",
                                        factors=vp.info.factors and (None, vp.info.factors[1])))
            for k, vp in self.variables.items()})

    def to_dict(self) -> dict:
        return {
            "run_option": self.run_option, "average_dense": self.average_dense,
            "workers": self.num_workers, "worker": self.worker,
            "average_sparse": self.average_sparse, "devices": list(self.devices),
            "host": self.host,
            "variables": {k: {"method": v.method, "prefetch": v.prefetch, **v.info.to_dict()}
                          for k, v in self.variables.items()},
            "placement": {k: _placement_dict(p) for k, p in self.placement.items()},
            "servers": list(self.servers), "backend": self.backend,
            "compression": self.compression,
            "random": dict(self.random), "counted": list(self.counted),
            "split_queues": {k: list(v) for k, v in self.split_queues.items()},
            "schedule": {"split": self.schedule.split, "order": list(self.schedule.order)},
            "buckets": [list(b.variables) for b in self.buckets],
            "blocks": [list(b) for b in self.blocks],
            "buffers": [{"segments": [[s.var, s.start, s.size, s.offset] for s in b.segments],
                         "placement": _placement_dict(b.placement)} for b in self.buffers],
            "distinct_lookups": self.distinct_lookups, "order_source": self.order_source,
            "rewrites": dict(vars(self.rewrites)),
            "costs": {k: dict(v) for k, v in self.costs.items()}, "network": self.network,
            "choice": [dict(vars(c)) for c in self.choice], "notes": list(self.notes),
            "norm_points": [list(p) for p in self.norm_points],
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
        if any(vp.info.sparse for vp in self.variables.values()):
            rows.append("  (alpha: the share of a sparse variable's rows one replica's step "
                        "touches, measured or estimated from its lookups; MB/step/replica: "
                        "Parallax's traffic model)")
        if self.costs:
            rows.append(f"run_option auto, predicted ms/step by method ({self.network}):")
            for name, table in sorted(self.costs.items(),
                                      key=lambda kv: self.variables[kv[0]].info.order):
                rows.append(f"  {name:38} " + "  ".join(
                    f"{m}{'*' if m == self.variables[name].method else ''} {t * 1e3:.3f}"
                    for m, t in table.items()))
        rows += self._format_choice()
        if self.servers:
            rows.append("servers: " + ", ".join(f"{d} {b / 1e6:.3f} MB"
                                                for d, b in self.server_load().items()))
        if self.compression != "none":
            rows.append(f"compression: float32 gradients travel as {self.compression}, summed "
                        "in float32 (the traffic above is float32's)")
        coalesced = sorted(v for v, vp in self.variables.items() if vp.coalesce)
        if coalesced:
            rows.append("each distinct row sent once (duplicates summed first): "
                        + ", ".join(coalesced))
        unique = sorted(v for v, vp in self.variables.items() if vp.unique_rows)
        if unique and self.group_size > 1:
            rows.append("the replicas' rows summed by id before the update, as one device's "
                        "gradient holds each id once: " + ", ".join(unique))
        ahead = sorted(v for v, vp in self.variables.items() if vp.prefetch)
        if ahead:
            rows.append("prefetch (gradient rows the next batch reads sent first, the rest "
                        "while it runs): " + ", ".join(ahead))
        if self.blocks:
            rows.append("horizontal scheduling (updates a step later, blocks all-reduced in "
                        "forward order): " + "; ".join(", ".join(b) for b in self.blocks))
        if self.norm_points:
            rows.append(f"batch normalization by the global batch's statistics: "
                        f"{len(self.norm_points)} tensors exchanged per step")
        rows += self.unmet()
        off = [k for k, on in vars(self.rewrites).items() if not on]
        if off:
            rows.append("placement rewrites off: " + ", ".join(off))
        if self.buckets:
            sizes = [sum(self.variables[v].info.nbytes for v in b.variables)
                     for b in self.buckets]
            rows.append(f"all-reduce buckets: {len(sizes)}, "
                        + ", ".join(f"{len(b.variables)} variable(s) {n:,} bytes"
                                    for b, n in zip(self.buckets, sizes)))
        if self.distinct_lookups and self.servers:
            rows.append("lookups of rows on servers: each distinct row fetched once per worker")
        if self.distinct_lookups and any(method(vp.method).columns
                                         for vp in self.variables.values()):
            rows.append("alltoall lookups: each distinct id's row exchanged once per replica")
        if self.buffers:
            sizes = [self.bytes_of(b) for b in self.buffers]
            per = self.buffer_load()
            rows.append(f"fusion buffers: {len(sizes)}, {sum(sizes) / 1e6:.3f} MB "
                        f"(largest {max(sizes) / 1e6:.3f} MB); per server per worker and step: "
                        + ", ".join(f"{d} {b / 1e6:.3f} MB" for d, b in per.items())
                        + (f"; gradient order: {self.order_source}" if self.order_source
                           else ""))
        for var, p in sorted({**self.sharded(), **self.columns()}.items()):
            if var in self.variables:
                rows.append(f"{var}: {p.describe()}")
        if self.random:
            modes = list(self.random.values())
            rows.append(f"random ops: {modes.count('distinct')} draw per replica, "
                        f"{modes.count('identical')} the same on every replica"
                        + (f"; {len(self.counted)} seeded with their calls counted (a "
                           "checkpoint holds where their streams are)" if self.counted else ""))
        if self.schedule.split:
            rows.append("schedule: a step with collectives runs them in a session run of "
                        "their own, beside the server work's")
        state = sorted(k for k in self.placement if k not in self.variables)
        if state:
            rows.append("state: " + ", ".join(f"{k}={_short(self.placement[k])}"
                                              for k in state))
        return "\n".join(rows)


    def unmet(self) -> list[str]:
        """One line for each setting the config asks for that the plan does
        not apply, with the reason (the job's, then each variable's)."""
        return list(self.notes) + [f"{v}: {vp.note}" for v, vp in sorted(self.variables.items())
                                   if vp.note]

    def _format_choice(self) -> list[str]:
        if not self.choice:
            return []
        width = max(40, max(len(c.label) + 1 for c in self.choice))
        rows = [f"plans weighed by their busiest link ({self.network}):",
                f"  {'plan':{width}} {'busiest link':24} {'MB out/in':>13} {'MB all':>7} "
                f"{'link ms':>8} {'+ fixed':>8} {'= ms':>8}"]
        for c in self.choice:
            rows.append(f"  {c.label + ('*' if c.chosen else ''):{width}} "
                        f"{(c.end or '-')[:24]:24} "
                        f"{c.sent / 1e6:6.3f}/{c.received / 1e6:<6.3f} {c.total / 1e6:7.3f} "
                        f"{c.link_seconds * 1e3:8.3f} {c.fixed_seconds * 1e3:8.3f} "
                        f"{c.seconds * 1e3:8.3f}")
        won = next(c for c in self.choice if c.chosen)
        rest = [c for c in self.choice if not c.chosen]
        if rest:
            nxt = rest[0]
            bytes_decide = (nxt.link_seconds - won.link_seconds >
                            nxt.fixed_seconds - won.fixed_seconds)
            why = (f"{nxt.label}, next, takes {nxt.seconds / won.seconds:.2f}x its time "
                   + ("(the bytes on the busiest link decide)" if bytes_decide else
                      "(the fixed costs decide: rounds of messages, products of factors)")
                   if nxt.seconds > won.seconds else
                   f"the same predicted time as {nxt.label}, and "
                   + ("fewer bytes over all links" if nxt.total > won.total else
                      "first in the order of preference"))
            rows.append(f"  chosen: {won.label}: {why}")
        return rows


def job_devices(devices, num_workers: int, worker: int) -> list[str]:
    """The device of every replica of the job, in job order: every worker has
    this worker's `devices`, under its own task."""
    if num_workers == 1:
        return list(devices)
    mine = f"/task:{worker}/"
    return [d.replace(mine, f"/task:{w}/") for w in range(num_workers) for d in devices]


def _elements(shape) -> int:
    n = 1
    for d in shape:
        n *= d or 1
    return n


def _placement_dict(p) -> dict:
    if isinstance(p, Shared):
        return {"kind": "shared", "device": p.device}
    if isinstance(p, Sharded):
        return {"kind": "sharded", "axis": p.axis,
                "shards": [[s.device, s.start, s.size] for s in p.shards]}
    if isinstance(p, Columns):
        return {"kind": "columns", "shards": [[s.device, s.start, s.size] for s in p.shards]}
    return {"kind": "mirrored"}


def _short(p) -> str:
    return {Mirrored: "mirrored", Shared: "shared", Sharded: "sharded",
            Columns: "columns"}[type(p)]
