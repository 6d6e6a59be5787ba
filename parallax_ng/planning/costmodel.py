"""Cost model: the communication time of one variable per step by each
aggregation method, for `run_option: auto`.

Each method's formula is EmbRace's Table 2 with the latency terms of this
implementation's lowering (parallax_ng/methods.py states them); with
beta = 0 and B = 1 the times are the bytes each replica sends (Parallax's
Table 3 for allreduce and ps). The network constants come from the
all-reduce micro-benchmark (parallax_ng/planning/costfit.py), whose fit
a + bM of a ring over N replicas has a = 2(N-1) beta and b = 2(N-1)/(NB);
else from config `network`, else the defaults below.

Requires: VariableInfo (bytes, alpha). Guarantees: `choose` returns the
cheapest allowed method, ties to the earlier of METHODS; the same inputs
give the same answer on every worker.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import methods
from .analysis import VariableInfo

METHODS = tuple(methods.METHODS)
BANDWIDTH = 1.25e9      # bytes/s: 10 Gb/s, when nothing is measured or configured
LATENCY = 50e-6         # seconds per message
FLOPS = 2e10            # float32 multiply-adds x 2 per second of one replica's MatMul,
                        # when not measured (a few CPU cores; method factors' product)


@dataclass(frozen=True)
class Network:
    """B and beta; for whole plans (parallax_ng/planning/traffic.py) also what one
    round of collectives costs besides its bytes (`collective`, the
    all-reduce's a), what one round trip to a server adds to a session
    run (`round_trip`) and what a session run of its own costs
    (`session_run`); unmeasured, 2(N-1) beta, 2 beta and 2 beta."""
    bandwidth: float        # bytes per second (B)
    latency: float          # seconds per message (beta)
    source: str = "default"
    collective: float | None = None
    round_trip: float | None = None
    loopback: float | None = None   # bytes/s between tasks of one host, all together
    session_run: float | None = None
    flops: float | None = None      # a replica's MatMul rate (factors' product), measured

    @classmethod
    def from_allreduce(cls, a: float, b: float, replicas: int,
                       round_trip: float | None = None, one_host: int = 0,
                       session_run: float | None = None) -> "Network":
        """The constants of a ring all-reduce fit T(M) = a + bM over
        `replicas` (a = 2(N-1) beta, b = 2(N-1)/(N B)). `one_host`: the
        benchmark's worker processes all ran on one host (a job on one
        machine), whose bytes between them then cost that host's CPU at
        their sum's rate, `one_host` B (each sent 2(N-1)/N M in b M)."""
        n = max(replicas, 2)
        bandwidth = 2 * (n - 1) / (n * b) if b > 0 else float("inf")
        return cls(bandwidth, a / (2 * (n - 1)),
                   "the all-reduce benchmark" + (" and the server round trip"
                                                 if round_trip is not None else ""),
                   a, round_trip, one_host * bandwidth if one_host > 1 else None,
                   session_run)

    def collective_round(self, replicas: int) -> float:
        """Seconds of one round of collectives over `replicas`, bytes aside."""
        if self.collective is not None:
            return self.collective
        return 2 * (max(replicas, 2) - 1) * self.latency

    def server_round_trip(self) -> float:
        return self.round_trip if self.round_trip is not None else 2 * self.latency

    def product_seconds(self, flop: float) -> float:
        """Seconds of `flop` floating-point operations of a MatMul on one replica."""
        return flop / (self.flops or FLOPS)

    def extra_run(self) -> float:
        """Seconds of one more session run in a step."""
        return self.session_run if self.session_run is not None else 2 * self.latency

    def describe(self) -> str:
        extra = ""
        if self.collective is not None:
            extra += f", {self.collective * 1e3:.3g} ms per round of collectives"
        if self.round_trip is not None:
            extra += f", {self.round_trip * 1e3:.3g} ms per server round trip"
        if self.session_run is not None:
            extra += f", {self.session_run * 1e3:.3g} ms per session run"
        if self.flops is not None:
            extra += f", {self.flops / 1e9:.3g} GFLOP/s of MatMul"
        if self.loopback is not None:
            extra += f", {self.loopback * 8 / 1e9:.3g} Gb/s between the tasks of a host"
        return (f"network {self.bandwidth * 8 / 1e9:.3g} Gb/s, {self.latency * 1e6:.3g} us "
                f"per message{extra} ({self.source})")


def seconds(method: str, info: VariableInfo, replicas: int, servers: int,
            net: Network) -> float:
    """Predicted communication seconds per step of `info`'s gradient (and,
    for alltoall, its lookups) by `method`."""
    return methods.seconds(method, info, replicas, servers, net)


def costs(info: VariableInfo, allowed, replicas: int, servers: int,
          net: Network) -> dict[str, float]:
    """Seconds per step by each allowed method, in METHODS order."""
    return {m: seconds(m, info, replicas, servers, net) for m in METHODS if m in allowed}


def choose(table: dict[str, float]) -> str:
    """The cheapest method (ties: the earlier in METHODS)."""
    return min(table, key=lambda m: (table[m], METHODS.index(m)))
