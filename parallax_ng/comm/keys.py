"""Collective group and instance keys. TensorFlow matches a collective op
across workers by its group key (which devices take part) and instance key
(which operation), so every group the project forms has its own key, here,
and every collective op of one graph takes its own instance key from one
InstanceKeys.

Guarantees: the group keys below are distinct; InstanceKeys gives single
keys counting up from `start` (`graph_keys`: a process's later graphs start
past its earlier ones', since a job's worker keeps what a key meant for as
long as it runs), and ranges of RANGE_KEYS keys above
RANGES_START for a collective whose shape changes from step to step; a
GraphError when the ranges run out.
"""
from __future__ import annotations

from ..errors import GraphError

JOB_GROUP = 1               # every replica of the job
WORKERS_GROUP = 2           # replica 0 of every worker (broadcasts)
HOSTS_GROUP = 3             # one host device per worker (layer-to-layer's EPS)
BENCHMARK_GROUP = 4         # the all-reduce benchmark's own (planning/costfit.py)

RANGE_KEYS = 1 << 22        # instance keys in a range (one per shape)
RANGES_START = 1 << 30      # ranges above the single keys, up to 2**31
GRAPH_KEYS = 1 << 20        # single keys of one graph of a process, in turn


class InstanceKeys:
    """Collective instance keys, unique within one transformed graph: single
    keys, and ranges of RANGE_KEYS keys for a collective whose shape changes
    from step to step (its key is the range's first plus its size). A
    range is taken for `what` the collective is (its scope and what fixes
    its shape but the size): `ranges`, shared by the graphs of one process
    (graph_keys), gives the same collective in a later graph the same range
    and another collective another (TensorFlow keeps a key's shape for as
    long as the process runs)."""

    def __init__(self, start: int = 1, graph: int = 0, ranges: dict | None = None):
        self._next = start
        self._ranges = {} if ranges is None else ranges     # what -> range index
        self._taken: set[str] = set()                     # this graph's
        self.graph = graph

    def shared(self, name: str) -> str:
        """The shared name of a queue on a server in this graph: a process's
        later graphs (a tuned size's or plan's) take their own, since the
        server keeps a queue for as long as it runs and another graph's may
        carry other components."""
        return f"{name}@graph{self.graph}" if self.graph else name

    def take(self) -> int:
        self._next += 1
        return self._next - 1

    def take_range(self, what: str) -> int:
        """The first key of `what`'s range (a collective this graph has
        not taken one for)."""
        while what in self._taken:       # two alike in one graph: each its own
            what += "'"
        self._taken.add(what)
        index = self._ranges.setdefault(what, len(self._ranges))
        first = RANGES_START + index * RANGE_KEYS
        if first + RANGE_KEYS > 2**31:
            raise GraphError(f"more than {(2**31 - RANGES_START) // RANGE_KEYS} collectives "
                             "of changing shape (all-gathered sparse gradients) in the graphs "
                             "of one process")
        return first


def graph_keys(graph: int, ranges: dict | None = None) -> InstanceKeys:
    """The InstanceKeys of a process's graph built after `graph` others (a
    tuned size's or plan's, parallax_ng/runtime/tuning.py); `ranges`: the
    ranges the process's graphs took (what -> index), shared."""
    return InstanceKeys(1 + graph % (RANGES_START // GRAPH_KEYS) * GRAPH_KEYS, graph, ranges)
