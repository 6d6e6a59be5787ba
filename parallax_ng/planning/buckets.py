"""Buckets: which gradients are all-reduced together, and what a step costs.

The MG-WFBP paper's model of one iteration with wait-free backpropagation:
the forward pass takes `forward_time`; the backward pass then runs the
layers from the last to the first, and a layer's gradients are ready when
its backward time has passed. The gradients are all-reduced in buckets of
consecutive layers (in backward order); one all-reduce of M bytes costs
a + b*M (`Cost`). A bucket starts when its last layer's gradients are ready
and the bucket before it is done; the iteration ends when the backward pass
and every bucket are done (`iteration_time`). The simulator and the planner
use this one model.

Bucketings (each a list of buckets, a bucket a list of layer indices in
backward order): `wfbp` (one bucket per layer), `single` (one bucket after
the backward pass), `threshold` (a bucket closes once it holds at least that
many bytes) and `mgwfbp`: the bucketing with the least iteration time. The
paper finds it by merging a layer into the one before it whenever the
earlier layer's gradients would be ready before the later one's all-reduce
could start plus the startup cost a (its Algorithm 1, O(L^2)); here the same
problem is solved by dynamic programming over the last bucket, also O(L^2),
and exact for any profile: the best bucketing of the first j layers (in
backward order) ends with a bucket i..j after the best bucketing of the
layers before i, since a bucket's end only grows with its predecessor's.

The same timeline with parameter servers (`server_timeline`): N workers,
S servers on nodes of their own, every node one NIC of latency alpha and
beta seconds per byte. A message goes to its servers (push) and comes back
(pull); a phase takes alpha + beta * max(bytes the worker sends, the most
one server receives: N times its share), starts when the message is ready
and its servers are free in that direction, and a pull starts once its push
is done (pushes of later messages go on meanwhile). `bfb:S`: the planner's
balanced fusion buffers (packed in backward order, each spread evenly over
all S servers); `ps:S`: a message per layer, the layers on servers placed
as the planner places whole variables (largest first, least-loaded server).
A worker's NIC limits one message, not concurrent messages to different
servers: a server's NIC carries N times a worker's share.

With a network the all-reduce is a ring: a = 2(N-1) alpha, b = 2(N-1)/N beta
(MG-WFBP's Table I).

Requires: nothing but a profile (parallax_ng/planning/profile.py `Layer`s or the
simulator's JSON). Guarantees: pure functions of their inputs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layer:
    name: str
    bytes: int               # gradient bytes
    backward_time: float     # seconds


@dataclass(frozen=True)
class Cost:
    """One all-reduce of M bytes takes a + b*M seconds."""
    a: float
    b: float

    def __call__(self, nbytes: float) -> float:
        return self.a + self.b * nbytes


@dataclass(frozen=True)
class Network:
    """N nodes; a message of M bytes between two takes alpha + beta*M seconds."""
    nodes: int
    alpha: float
    beta: float

    def ring(self) -> Cost:
        """The ring all-reduce's a + b*M among the nodes."""
        n = self.nodes
        return Cost(2 * (n - 1) * self.alpha, 2 * (n - 1) / n * self.beta)

    def phase(self, shares: dict) -> float:
        """One push (or pull) of a message: {server: bytes} from every node."""
        worker = sum(shares.values())
        server = max(shares.values()) * self.nodes
        return self.alpha + self.beta * max(worker, server)


def ready_times(forward_time: float, layers: list[Layer]) -> list[float]:
    """When each layer's gradients are ready, in backward order (the last
    layer of `layers`, listed input to output, first)."""
    out, t = [], forward_time
    for layer in reversed(layers):
        t += layer.backward_time
        out.append(t)
    return out


def iteration_time(forward_time: float, layers: list[Layer], buckets, cost: Cost) -> float:
    """The model's iteration time with `buckets` (lists of backward-order
    layer indices, consecutive, covering every layer once)."""
    ready = ready_times(forward_time, layers)
    backward = list(reversed(layers))
    done = 0.0
    for bucket in buckets:
        start = max(ready[max(bucket)], done)
        done = start + cost(sum(backward[i].bytes for i in bucket))
    return max(ready[-1] if ready else forward_time, done)


def wfbp(layers: list[Layer]) -> list[list[int]]:
    return [[i] for i in range(len(layers))]


def single(layers: list[Layer]) -> list[list[int]]:
    return [list(range(len(layers)))] if layers else []


def threshold(layers: list[Layer], nbytes: int) -> list[list[int]]:
    """Buckets closed once they hold at least `nbytes` (the last may hold less)."""
    out, bucket, size = [], [], 0
    for i, layer in enumerate(reversed(layers)):
        bucket.append(i)
        size += layer.bytes
        if size >= nbytes:
            out.append(bucket)
            bucket, size = [], 0
    return out + ([bucket] if bucket else [])


def mgwfbp(forward_time: float, layers: list[Layer], cost: Cost) -> list[list[int]]:
    """The bucketing with the least iteration time (ties: fewer buckets)."""
    ready = ready_times(forward_time, layers)
    sizes = [layer.bytes for layer in reversed(layers)]
    n = len(layers)
    best = [(0.0, 0)] + [None] * n      # j -> (end of the last bucket, buckets)
    cut = [0] * (n + 1)                  # j -> where the last bucket of layers < j starts
    for j in range(1, n + 1):
        size = 0
        for i in range(j, 0, -1):       # last bucket: layers i-1 .. j-1
            size += sizes[i - 1]
            end = max(ready[j - 1], best[i - 1][0]) + cost(size)
            candidate = (end, best[i - 1][1] + 1)
            if best[j] is None or candidate < best[j]:
                best[j], cut[j] = candidate, i - 1
    out, j = [], n
    while j > 0:
        out.append(list(range(cut[j], j)))
        j = cut[j]
    return out[::-1]


def fusion_messages(layers: list[Layer], servers: int, size: int):
    """Balanced fusion buffers over the layers in backward order: (backward
    indices of the layers in the buffer, {server: bytes}) per buffer of
    `size` bytes (the last may be smaller), a layer maybe in two."""
    out, members, used = [], [], 0
    for i, layer in enumerate(reversed(layers)):
        members.append(i)
        left = layer.bytes
        while left:
            take = min(left, size - used)
            left, used = left - take, used + take
            if used == size:
                out.append((members, _even(used, servers)))
                members, used = ([i] if left else []), 0
    if used:
        out.append((members, _even(used, servers)))
    elif members and out:          # layers without bytes after the last buffer
        out[-1][0].extend(members)
    return out


def _even(nbytes: int, servers: int) -> dict:
    return {s: nbytes / servers for s in range(servers)}


def placed_messages(layers: list[Layer], servers: int):
    """A message per layer (backward order), each layer on one server:
    largest first to the least-loaded one (ties: lower index)."""
    load, home = [0] * servers, {}
    backward = list(reversed(layers))
    for i in sorted(range(len(backward)), key=lambda i: (-backward[i].bytes, i)):
        home[i] = min(range(servers), key=lambda s: (load[s], s))
        load[home[i]] += backward[i].bytes
    return [([i], {home[i]: layer.bytes}) for i, layer in enumerate(backward)]


def server_timeline(forward_time: float, layers: list[Layer], messages,
                    network: Network) -> float:
    """The iteration time with `messages` ((backward layer indices, {server:
    bytes})) pushed to and pulled from parameter servers (module docstring)."""
    ready = ready_times(forward_time, layers)
    push_free, pull_free, end = {}, {}, 0.0
    for members, shares in messages:
        took = network.phase(shares)
        start = max([ready[max(members)]] + [push_free.get(s, 0.0) for s in shares])
        pushed = start + took
        push_free.update(dict.fromkeys(shares, pushed))
        start = max([pushed] + [pull_free.get(s, 0.0) for s in shares])
        end = max(end, start + took)
        pull_free.update(dict.fromkeys(shares, start + took))
    return max(ready[-1] if ready else forward_time, end)


MIN_SHARD_BYTES = 256 * 1024     # smaller messages: per-message cost dominates
MAX_BUFFER_BYTES = 64 * 2**20


def fusion_buffer_size(total: int, servers: int) -> int:
    """Fusion buffer size from model and cluster size: four buffers (so the
    first ones travel while the backward pass goes on), each shard at least
    256 KB, no buffer over 64 MB; a model smaller than that is one buffer."""
    size = max(-(-total // 4), servers * MIN_SHARD_BYTES)
    return min(size, MAX_BUFFER_BYTES, total) if total else 0


STRATEGIES = ("wfbp", "single", "threshold:BYTES", "mgwfbp", "bfb:SERVERS", "ps:SERVERS")


def load_profile(data: dict) -> tuple[float, list[Layer]]:
    """(forward time, layers input to output) from the simulator's profile
    format: {"forward_time": s, "layers": [{"name", "bytes", "backward_time"}]}."""
    from ..errors import ConfigError
    if not isinstance(data, dict) or "layers" not in data:
        raise ConfigError('a profile is {"forward_time": s, "layers": [{"name": str, '
                          '"bytes": int, "backward_time": s}, ...]} (layers input to output)')
    layers = []
    for i, layer in enumerate(data["layers"]):
        missing = {"name", "bytes", "backward_time"} - set(layer)
        if missing:
            raise ConfigError(f"profile layer {i} lacks {sorted(missing)}")
        layers.append(Layer(str(layer["name"]), int(layer["bytes"]),
                            float(layer["backward_time"])))
    return float(data.get("forward_time", 0.0)), layers


def simulate(forward_time: float, layers: list[Layer], strategies, cost: Cost | None = None,
             network: Network | None = None) -> dict:
    """{strategy: {"iteration_time": s, "buckets": [[layer names]]}} by the
    model, for `strategies` named as in STRATEGIES. All-reduces cost `cost`,
    else the ring's on `network`; bfb and ps need the network."""
    from ..errors import ConfigError
    cost = cost or (network.ring() if network else None)
    backward = [layer.name for layer in reversed(layers)]
    out = {}
    for name in strategies:
        kind, _, arg = name.partition(":")
        known = kind in ("wfbp", "single", "mgwfbp") and not arg or \
            kind in ("threshold", "bfb", "ps") and arg.isdigit() and int(arg) > 0
        if not known:
            raise ConfigError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
        if kind in ("bfb", "ps"):
            if network is None:
                raise ConfigError(f"strategy {name!r} needs a network (nodes, alpha, beta), "
                                  "not only an all-reduce cost a + b*M")
            servers = int(arg)
            messages = (fusion_messages(layers, servers,
                                        fusion_buffer_size(sum(x.bytes for x in layers), servers))
                        if kind == "bfb" else placed_messages(layers, servers))
            out[name] = {"iteration_time": server_timeline(forward_time, layers, messages,
                                                           network),
                         "buckets": [[backward[i] for i in m] for m, _ in messages]}
            continue
        if cost is None:
            raise ConfigError(f"strategy {name!r} needs an all-reduce cost (a, b) or a network")
        chosen = {"wfbp": lambda: wfbp(layers), "single": lambda: single(layers),
                  "threshold": lambda: threshold(layers, int(arg or 0)),
                  "mgwfbp": lambda: mgwfbp(forward_time, layers, cost)}[kind]()
        out[name] = {"iteration_time": iteration_time(forward_time, layers, chosen, cost),
                     "buckets": [[backward[i] for i in b] for b in chosen]}
    return out
