"""Traffic: the bytes a plan moves between a job's tasks per step, what each
link of the job carries, and how long the busiest link takes.

Parallax's data-transfer model (its Table 3), per trained variable, for N
workers of R replicas each (G = N R replicas), flows between tasks:
- allreduce (a ring over the G replicas; TensorFlow's ring keeps a
  worker's replicas together): every worker sends 2(G-1)/G of the
  gradient to the next worker (a sparse gradient summed as dense: the
  table and a count per row);
- bfb (balanced fusion buffers): every worker sends each server its shard
  of every buffer and receives the shard's sum back;
- ps, dense: every worker sends the server its local sum and reads the
  value back for its forward pass;
- ps, sparse: every worker sends its r distinct rows with their indices and
  the r distinct ids its lookups ask for, and receives r rows. Row ranges
  on several servers take their share of the lookups (of the rows a
  measured step touched, else of the rows); the gradient's rows all go to
  the first range's server, where the chief sums the job's, and it sends
  each other range its share of the N workers' rows (with their indices)
  for the update;
- allgather: a ring over the G replicas carrying every replica's rows and
  indices to all others, (G-1) replicas' rows over each worker's link;
- alltoall (EmbRace): each replica's distinct ids and gradient rows to
  every other replica, a part of each row (its columns) with each id.
r is the distinct rows a worker's R replicas touch in a step (the
analysis's alpha, measured or estimated, times the rows, times R, at most
the rows). Scalars (norms, tokens) are left out. Under compression
(`communication.compression`) a float32 gradient's values count 2 bytes an
element (an all-reduce becomes an all-to-all and an all-gather of 16-bit
halves: (G-1)/G of the gradient's float32 bytes in all, half the ring's);
ids, variables read back and rows looked up stay as they are.

Links: the tasks on one host share its network interface; bytes between
them do not cross it but cost the host's CPU (gRPC copies them through
loopback): a job on one machine has no network link, only that. A
link carries its bytes each way at the bandwidth (full duplex); a host
moves the bytes between its tasks, all of them together, at the
network's `loopback` rate (measured where the job's workers share one
host; else free beside the link). A step's communication takes the
busiest end's time (its link's larger direction over the bandwidth, or
its bytes between tasks over the loopback rate, the larger), plus what
its rounds of messages cost besides their bytes,
one after another: a round of collectives (an all-reduce, whatever runs
beside it: 1; an all-gather: 2, its sizes, then rows and indices;
alltoall: 4, ids and rows forward, rows back) costs the all-reduce's
fixed time a; a round trip to the servers (the forward's reads of server
variables: 1; the push, the chief's update and the barrier: 1) costs r;
a step with both runs its collectives in a session run of its own beside
the server work's (transforms/split_step.py): that run's cost s, and one
round trip more for the hand-over between the two. On one host a round
trip to the S servers a plan gives work costs S r: r is measured with
one server, and the S servers' messages share the host's cores, where
on hosts of their own they run side by side (measured: 4 workers and 4
servers on 2 cores ran lm 0.50x the ring without servers). A variable by its
factors adds its product of the gathered factors at the replica's
measured MatMul rate (work the other methods do not add, on the path).
a, r and s are measured on the job (parallax_ng/planning/costfit.py) or follow
from the configured latency.

Requires: a Plan (methods, placements, buffers), the index bytes of sparse
gradients, a Layout. Guarantees: `flows` are (source task, destination
task, bytes, the variable or buffer) per step; `links` sums them per end; `predict` is a pure
function of its inputs (every worker computes the same).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..methods import ID_BYTES, factor_bytes, method, product_flops, reduced_bytes
from .placement import Sharded


def worker(i: int) -> str:
    return f"worker {i}"


def server(j: int) -> str:
    return f"ps {j}"


def server_index(device: str) -> int:
    """The task index of a server device (/job:ps/replica:0/task:J/...)."""
    return int(device.split("/task:")[1].split("/")[0])


@dataclass(frozen=True)
class Layout:
    """Which host each task runs on: `workers[i]`, `servers[j]` are
    addresses (host or host:port)."""
    workers: tuple[str, ...]
    servers: tuple[str, ...] = ()

    @classmethod
    def of(cls, cluster_info) -> "Layout":
        return cls(tuple(cluster_info.workers), tuple(cluster_info.ps))

    @classmethod
    def local(cls, workers: int, servers: int) -> "Layout":
        """Every task on this machine (no link)."""
        return cls(("127.0.0.1",) * workers, ("127.0.0.1",) * servers)

    def end(self, task: str) -> str:
        """The link a task's bytes cross: its host's."""
        kind, index = task.split()
        address = (self.workers if kind == "worker" else self.servers)[int(index)]
        return address.rsplit(":", 1)[0] if address.count(":") == 1 else address

    def describe(self, end: str) -> str:
        tasks = [t for t in self.tasks() if self.end(t) == end]
        return end if tasks == [end] else f"{end} ({', '.join(tasks)})"

    def tasks(self) -> list[str]:
        return ([worker(i) for i in range(len(self.workers))] +
                [server(j) for j in range(len(self.servers))])


@dataclass(frozen=True)
class Links:
    """Bytes per step each end of the job sends and receives over its link,
    and moves between its own tasks (`local`)."""
    sent: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)

    def busiest(self, bandwidth: float = 1.0, loopback: float | None = None
                ) -> tuple[str, float, float, bool]:
        """(end, bytes, seconds, inside) of the end that takes longest: its
        link's larger direction over `bandwidth`, or (inside) its bytes
        between its tasks over `loopback` (None: free)."""
        ends = set(self.sent) | set(self.received) | (set(self.local) if loopback else set())
        load = {}
        for e in ends:
            link = max(self.sent.get(e, 0.0), self.received.get(e, 0.0))
            inside = self.local.get(e, 0.0) if loopback else 0.0
            load[e] = max((link / bandwidth, link, False),
                          (inside / loopback if loopback else 0.0, inside, True))
        if not load:
            return "", 0.0, 0.0, False
        end = max(sorted(load), key=lambda e: load[e][0])
        seconds, nbytes, inside = load[end]
        return end, nbytes, seconds, inside


def flows(plan, index_bytes: dict | None = None, rows: dict | None = None,
          looked_up: dict | None = None) -> list[tuple[str, str, float, str]]:
    """(source task, destination task, bytes, what) per step of `plan`
    (what: the variable, or `buffer K`). `rows`: the rows a worker's sparse
    gradient sends per step (else from the analysis); `looked_up`: the ids
    its lookups ask a server for (else `rows`); `index_bytes`: each sparse
    gradient's index size (else 8)."""
    n, r, g = plan.num_workers, plan.num_replicas, plan.group_size
    index_bytes, rows, looked_up = index_bytes or {}, rows or {}, looked_up or {}
    out: list[tuple[str, str, float, str]] = []
    if n == 1 and not plan.servers:
        return out           # in-process: no link

    def ring(nbytes: float, what: str) -> None:
        for i in range(n if n > 1 else 0):
            out.append((worker(i), worker((i + 1) % n), nbytes, what))

    for var, vp in sorted(plan.variables.items()):
        info, how = vp.info, method(vp.method)
        if how.fused:
            continue            # by buffer, below
        wire = _wire(plan, info)         # of the gradient's values, as sent
        if how.sums_rows:        # a ring all-reduce, of a sparse gradient as dense too
            ring(2 * (g - 1) / g * reduced_bytes(info) * wire, var)
            continue
        if how.factored:         # every replica's factors (and a row id each) to every one
            ring((g - 1) * (factor_bytes(info) * wire + ID_BYTES * (info.factors[0] or 0)), var)
            continue
        if not info.sparse:      # ps: the local sum in, the value back
            for i in range(n):
                out += [(worker(i), server(_home(plan, var)), info.nbytes * wire, var),
                        (server(_home(plan, var)), worker(i), info.nbytes, var)]
            continue
        row = info.nbytes / info.shape[0]
        sent = row * wire
        idx = index_bytes.get(var, 8)
        per_worker = rows.get(var, min(info.shape[0], r * (info.alpha or 1.0) * info.shape[0]))
        per_replica = per_worker / r
        if how.columns:          # ids and rows to the owners of the columns, both ways
            part = row / info.shape[1] * max(s.size for s in plan.placement[var].shards)
            each = r * r * per_replica * (2 * idx + part + part * wire)   # lookup, gradient
            for i in range(n):
                out += [(worker(i), worker(k), each, var) for k in range(n) if k != i]
        elif not how.shared:     # every replica's rows to every replica
            ring((g - 1) * per_replica * (sent + idx), var)
        else:                    # ps: ids out and rows back per range, the gradient's rows
            asked = looked_up.get(var, per_worker)      # to the home server, which sends
            home = _home(plan, var)                     # each range its part of the sum
            for j, share in _shares(plan, var):
                for i in range(n):
                    out += [(worker(i), server(j), share * asked * idx, var),
                            (server(j), worker(i), share * asked * row, var)]
                if j != home:
                    out.append((server(home), server(j), share * n * per_worker * (row + idx),
                                var))
            out += [(worker(i), server(home), per_worker * (sent + idx), var) for i in range(n)]
    for k, buffer in enumerate(plan.buffers):
        size = plan.bytes_of(buffer) * _wire(plan, plan.variables[buffer.segments[0].var].info)
        for s in buffer.placement.shards:
            part = size * s.size / buffer.placement.length
            j = server_index(s.device)
            for i in range(n):
                out += [(worker(i), server(j), part, f"buffer {k}"),
                        (server(j), worker(i), part, f"buffer {k}")]
    return out


def links(flow_list, layout: Layout) -> Links:
    sent: dict[str, float] = {}
    received: dict[str, float] = {}
    local: dict[str, float] = {}
    for src, dst, nbytes, _ in flow_list:
        a, b = layout.end(src), layout.end(dst)
        if a == b:
            local[a] = local.get(a, 0.0) + nbytes
            continue
        sent[a] = sent.get(a, 0.0) + nbytes
        received[b] = received.get(b, 0.0) + nbytes
    return Links(sent, received, local)


def task_bytes(flow_list) -> dict[str, float]:
    """Bytes each task sends per step."""
    out: dict[str, float] = {}
    for src, _, nbytes, _ in flow_list:
        out[src] = out.get(src, 0.0) + nbytes
    return out


def rounds(plan) -> tuple[int, int]:
    """(rounds of collectives, round trips to the servers) one after
    another in a step of `plan` (its variables' methods run side by side)."""
    if plan.num_workers < 2:
        return 0, 0
    used = [method(vp.method) for vp in plan.variables.values()]
    collective = max((m.rounds for m in used), default=0)
    trips = 0
    if plan.servers:
        trips = int(any(m.shared for m in used)) + int(any(m.servers for m in used))
    return collective, trips


@dataclass(frozen=True)
class Prediction:
    """A plan's communication per step on the job's links."""
    links: Links
    end: str             # the busiest end
    nbytes: float        # its bytes in its busier direction (or between its tasks)
    link_seconds: float  # those bytes over the bandwidth
    fixed_seconds: float  # its rounds of messages, bytes aside
    seconds: float
    inside: bool = False  # the busiest load is between the end's tasks


def predict(plan, layout: Layout, network, index_bytes: dict | None = None) -> Prediction:
    """The step's communication time: the busiest end's bytes over its rate
    (the link's bandwidth, or the host's loopback rate), plus its rounds of
    collectives and round trips to servers."""
    flow_list = flows(plan, index_bytes)
    load = links(flow_list, layout)
    end, nbytes, link, inside = load.busiest(network.bandwidth, network.loopback)
    collective, trips = rounds(plan)
    split = collective > 0 and trips > 0
    trip = network.server_round_trip()
    if len({layout.end(t) for t in layout.tasks()}) == 1:   # one host: S servers' messages
        trip *= max(1, len({d for _, d, _, _ in flow_list if d.startswith("ps ")}))
    fixed = (collective * network.collective_round(plan.group_size) +
             (trips + split) * trip + split * network.extra_run() +
             product_seconds(plan, network))
    return Prediction(load, end, nbytes, link, fixed, link + fixed, inside)


def product_seconds(plan, network) -> float:
    """Seconds a replica spends on the products of the factors it gathered
    (method factors), work the step adds to its critical path."""
    if plan.group_size < 2:
        return 0.0
    return sum(network.product_seconds(product_flops(vp.info, plan.group_size))
               for vp in plan.variables.values() if method(vp.method).factored)


def _wire(plan, info) -> float:
    """The share of a gradient's bytes that crosses under the plan's
    compression (float32 values in 16 bits)."""
    float32 = info.dtype.removesuffix("_ref") == "float32"
    return 0.5 if plan.compression != "none" and float32 else 1.0


def _home(plan, var: str) -> int:
    return server_index(plan.server(var))


def _shares(plan, var: str) -> list[tuple[int, float]]:
    """(server index, share of the rows) for a variable on servers: of the
    rows a measured step touched, else of the variable's rows."""
    p = plan.placement[var]
    if isinstance(p, Sharded):
        shares = p.shares(plan.variables[var].info.touched)
        return [(server_index(s.device), share) for s, share in zip(p.shards, shares)]
    return [(_home(plan, var), 1.0)]
