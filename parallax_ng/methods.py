"""Communication methods: every way a trained variable's gradient can
travel, in one table.

For each method, in one place: what it takes (dense or sparse gradients,
and why not when it cannot take a variable), its cost model (EmbRace's
Table 2 for the predicted seconds per step, Parallax's Table 3 for the
bytes one replica sends and receives), where it puts the variable (once on
a parameter server, in fusion buffers on the servers, cut by columns over
the replicas, or a copy per replica), what a step of it runs one after
another (rounds of collectives, trips to the servers) and the passes that
build it (transforms/). The planner, the cost model, the traffic model, the
config and the passes ask this table; a new method is one entry here plus
its pass (docs/architecture.md, "How to add a method").

The cost formulas, with N replicas, S parameter servers, a variable of M
bytes of which one replica's step touches the share alpha of the rows
(1 for a dense one), a network of bandwidth B bytes/s and latency beta per
message:
- allreduce (a ring; a sparse gradient summed as dense):  2(N-1)(M/(NB) + beta)
- ps, bfb (push, pull; balanced over the servers):         2N(alpha M/(SB) + beta)
- allgather (every replica's rows to every replica):       (N-1)(alpha M/B + 3 beta)
- alltoall (rows by columns, forward and backward):        (N-1)(2 alpha M/(NB) + 4 beta)
- factors (a MatMul gradient's factors, F bytes a replica, and an id a row):
                                                      (N-1)((F + 4r)/B + 3 beta) + P/C
  (P = 2 N r E floating-point operations, E the variable's elements and r
  a replica's rows: the product of the gathered factors, which every
  replica makes at C per second, work no other method adds)
The latency terms count the messages of this implementation's lowering
(comm/collectives.py): an all-gather of rows is three ring gathers (sizes,
rows, indices); alltoall gathers sizes and ids and exchanges the rows, and
exchanges the gradient's rows back (reusing the gathered ids). With
beta = 0 and B = 1 the times are the bytes each replica sends.

Needs nothing but plain numbers: a variable's info (nbytes, alpha, sparse,
shape: planning/analysis.py VariableInfo) and the network's bandwidth and
latency (planning/costmodel.py Network).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

GATHERS = 3             # collectives of one all-gather of rows
EXCHANGES = 4           # collectives of a table's alltoall lookup and gradient
ID_BYTES = 4            # a gathered row's id (method factors)


@dataclass(frozen=True)
class Method:
    name: str
    what: str                     # what it does, for messages
    dense: bool                   # takes a dense gradient
    sparse: bool                  # takes a sparse gradient (IndexedSlices)
    seconds: Callable             # (info, N, S, network) -> seconds per step, N >= 2
    replica_bytes: Callable       # (info, N) -> bytes one replica sends + receives
    shared: bool = False          # the variable exists once, on a parameter server
    fused: bool = False           # dense gradients summed in fusion buffers on the servers
    columns: bool = False         # the table is cut by columns over the replicas
    sums_rows: bool = False       # a sparse gradient is summed as a dense one
    all_reduced: bool = False     # all-reduced: a dense gradient may share a bucket
    coalesces: bool = False       # with coalesce_rows, a worker sums duplicate rows first
    rounds: int = 0               # rounds of collectives one after another in a step
    servers: bool = False         # a step sends its gradients to the job's servers
    horizontal: bool = False      # a dense variable's update may wait for its first read
    factored: bool = False        # takes only a gradient that is a product of two factors
    passes: tuple = ("aggregate",)   # the passes that build it (transforms/)

    def refusal(self, var: str, sparse: bool, can_sum_rows: bool = True,
                factors: bool = True) -> str | None:
        """Why config `variable_methods.<var>: <this method>` cannot be (None:
        it can). `can_sum_rows`: whether duplicate rows of the variable's
        sparse gradient may be summed (planning/coalescing.py); `factors`:
        whether its dense gradient is a product of two factors
        (planning/analysis.py `factors`)."""
        if sparse and not self.sparse or not sparse and not self.dense:
            kind = "sparse" if sparse else "dense"
            return (f"config key 'variable_methods.{var}' is {self.name} ({self.what}), but "
                    f"{var} has a {kind} gradient; use {', '.join(taking(sparse))}")
        if self.factored and not factors:
            return (f"config key 'variable_methods.{var}' is {self.name} ({self.what}), but "
                    f"{var}'s gradient is not MatMul(a, b, transpose_a=True) of two 2-D "
                    "tensors whose columns the graph knows; use "
                    + ", ".join(m for m in taking(False) if not METHODS[m].factored))
        if sparse and self.sums_rows and not can_sum_rows:
            return (f"config key 'variable_methods.{var}' is {self.name}, which sums {var}'s "
                    "sparse gradient as a dense one (duplicate rows summed), but a use of "
                    "its rows sees them one by one; use "
                    + ", ".join(m for m in taking(True) if m != self.name))
        return None


def reduced_bytes(info) -> float:
    """Bytes all-reduced for a variable: its own, and for a sparse gradient
    summed as dense a count per row besides (a second column for a 1-D
    variable, one more in D for a [V, D] table)."""
    if not info.sparse or not info.shape:
        return float(info.nbytes)
    width = 1
    for d in info.shape[1:]:
        width *= d or 1
    return info.nbytes * (width + 1) / width


def _alpha(info) -> float:
    return (info.alpha or 1.0) if info.sparse else 1.0


def _on_servers(info, n: int, servers: int, net) -> float:
    return 2 * n * (_alpha(info) * info.nbytes / (max(servers, 1) * net.bandwidth)
                    + net.latency)


def factor_bytes(info) -> float:
    """Bytes of one replica's two factors (`VariableInfo.factors`; 0 while
    their rows are unknown: neither the graph nor a measured step gave them)."""
    width = (info.factors or (0, 0))[1]
    return _rows(info) * width * info.nbytes / _elements(info)


def _rows(info) -> int:
    return (info.factors or (0, 0))[0] or 0


def _elements(info) -> int:
    elements = 1
    for d in info.shape:
        elements *= d or 1
    return elements


def product_flops(info, n: int) -> float:
    """Floating-point operations of the product every replica makes of the
    gathered factors of `n` replicas: 2 n rows times the variable's elements."""
    return 2.0 * n * _rows(info) * _elements(info)


def _pushed_and_pulled(info, n: int) -> float:
    return 2 * _alpha(info) * info.nbytes if info.sparse else 2.0 * info.nbytes


ALLREDUCE = Method(
    "allreduce", "ring all-reduce, a sparse gradient summed as a dense one", True, True,
    lambda info, n, s, net: 2 * (n - 1) * (reduced_bytes(info) / (n * net.bandwidth)
                                           + net.latency),
    lambda info, n: 2 * (n - 1) * reduced_bytes(info) / n,
    sums_rows=True, all_reduced=True, rounds=1, horizontal=True,
    passes=("aggregate", "horizontal"))
ALLTOALL = Method(
    "alltoall", "rows of a sparse gradient, by columns", False, True,
    lambda info, n, s, net: (n - 1) * (2 * _alpha(info) * info.nbytes / (n * net.bandwidth)
                                       + EXCHANGES * net.latency),
    lambda info, n: 2 * (n - 1) * _alpha(info) * info.nbytes / n,
    columns=True, coalesces=True, rounds=4, passes=("columns", "aggregate", "prefetch"))
ALLGATHER = Method(
    "allgather", "every replica's rows to every replica", False, True,
    lambda info, n, s, net: (n - 1) * (_alpha(info) * info.nbytes / net.bandwidth
                                       + GATHERS * net.latency),
    lambda info, n: 2 * (n - 1) * _alpha(info) * info.nbytes,
    coalesces=True, rounds=2)
BFB = Method(
    "bfb", "balanced fusion buffers, for dense gradients", True, False, _on_servers,
    _pushed_and_pulled, fused=True, servers=True)
PS = Method(
    "ps", "the variable on a parameter server", True, True, _on_servers, _pushed_and_pulled,
    shared=True, coalesces=True, servers=True, passes=("aggregate", "server_sync"))

FACTORS = Method(
    "factors", "a MatMul gradient's two factors gathered from every replica, multiplied on "
    "each", True, False,
    lambda info, n, s, net: (n - 1) * ((factor_bytes(info) + ID_BYTES * _rows(info))
                                       / net.bandwidth + GATHERS * net.latency)
    + net.product_seconds(product_flops(info, n)),
    lambda info, n: 2 * (n - 1) * factor_bytes(info),
    factored=True, rounds=2)

# in the order the cost model breaks ties
METHODS: dict[str, Method] = {m.name: m for m in (ALLREDUCE, ALLTOALL, ALLGATHER, BFB, PS,
                                                  FACTORS)}


def method(name: str) -> Method:
    return METHODS[name]


def taking(sparse: bool) -> tuple[str, ...]:
    """The methods that take a sparse (or a dense) gradient."""
    return tuple(m.name for m in METHODS.values() if (m.sparse if sparse else m.dense))


def seconds(name: str, info, replicas: int, servers: int, net) -> float:
    """Predicted communication seconds per step of `info`'s gradient (and,
    for alltoall, its lookups) by method `name`."""
    if replicas < 2:
        return 0.0
    return METHODS[name].seconds(info, replicas, servers, net)
