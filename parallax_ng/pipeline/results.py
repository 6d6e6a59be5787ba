"""Typed facts passes hand on: to later passes and to the runtime.

A pass publishes a result with `ctx.publish(result)`; a reader asks for it
by type with `ctx.result(Kind)` (None when no pass made one). The runtime
reads these, never a pass module's names.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LocalAggregates:
    """For each variable aggregated on a parameter server: this worker's sum
    of its replicas' gradients, (values or dense sum, indices or None),
    already scaled for a mean (made by `aggregate`, read by `server_sync`);
    `norms`: for a variable whose duplicate rows were summed, the L2Loss of
    its rows before that, which stands for the user's L2Loss of the values
    (its job value is the sum over the workers); `nodes`: the nodes that
    make each of them, on the variable's server (`local_aggregation` moves
    them to the worker's host)."""
    of: dict
    norms: dict = field(default_factory=dict)
    nodes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Barrier:
    """The ops that end a step of a job with parameter servers (made by
    `server_sync`): the chief runs `release` once its writes are done, the
    other workers run `wait` before they read a server variable again. After
    initialisation they are runs of their own; with `folded`, a training run
    holds its barrier already (the chief puts a token after each shared
    write, the others' training writers take it), so it needs no extra run."""
    release: str | None = None
    wait: str | None = None
    folded: bool = False

    def op(self, worker: int) -> str | None:
        return self.release if worker == 0 else self.wait


@dataclass(frozen=True)
class ColumnParts:
    """For each variable cut by columns over the replicas (and each slot cut
    with it): a handle of every job replica's part, in job order, in this
    worker's graph (made by `columns`; the checkpoint reads and writes
    through them). With `gather`, the backend reaches other processes by
    collectives only: `handles` are this process's parts, and the whole
    value is their all-gather (parallax_ng/comm/horovod.py `join_columns`)."""
    handles: dict
    gather: bool = False


@dataclass(frozen=True)
class PartsWritten:
    """In a job that reads other workers' parts of tables cut by columns
    directly (made by `part_writes`): every replica counts its writes to
    its parts. `counts`: an op reading each job replica's count, in job
    order (this worker's first at `mine`); `start`: sets this worker's
    counts to 0, once per session; `reads`: the variables (and slots) cut
    so. Before a run other than a training step that reaches one (a
    fetch, a Saver; and before a checkpoint), a worker waits until no count is below its own:
    every worker has then made the writes it made. `meet`: an all-reduce
    every worker runs after writing its parts outside the graph (the
    checkpoint's restore)."""
    counts: tuple
    mine: int
    start: str
    reads: frozenset
    meet: str


@dataclass(frozen=True)
class ExchangedLookups:
    """Lookups of tables cut by columns whose exchange `aggregate` built
    beside the gradient's (which reuses its gathered ids): gather op ->
    the rows per replica; `columns` puts them in the gathers' place.
    `gathered`: gather op -> (sizes, padded ids) every replica's lookup
    gathered, per replica (`prefetch` splits the next step's rows by them);
    `reads`: gather op -> per replica the ResourceGather of its own part's
    rows in the exchange (`prefetch` orders its updates around them)."""
    rows: dict
    gathered: dict = field(default_factory=dict)
    reads: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CoalescedRows:
    """For each table cut by columns whose gradient rows leave a replica
    coalesced (made by `aggregate`): per local replica, the (summed rows,
    distinct ids) tensors it sends (`prefetch` keeps them for the next
    step)."""
    of: dict


@dataclass(frozen=True)
class Deferred:
    """Tables whose update waits, in part, for the next step (made by
    `prefetch`): `flush`, ops that apply a pending step in full (every
    replica's, so all run together); `clear`, ops that forget it (run with
    every restore of the table)."""
    flush: tuple
    clear: tuple


@dataclass(frozen=True)
class CountedDraws:
    """Random ops whose stream is a counter in a variable (made by
    `counted_draws`): (job replica, user op) -> the counter's handle, and
    the ops that set every counter to 0 (run once per session, before
    anything draws); candidate samplers kept stateful, whose calls are made
    again after a restore: (counter's handle, sampler op, its classes
    tensor)."""
    calls: dict
    start: tuple = ()
    replays: tuple = ()


@dataclass(frozen=True)
class SyncedInputs:
    """(user node, input position) of the inputs the state-sync pass gave a
    value reduced over the replicas (a state write's, a count's, a mean's):
    equal on every replica, as what reads only them and state is
    (PassContext.synced_variant; a fetch of a metric's update op is replica
    0's value)."""
    inputs: frozenset


@dataclass(frozen=True)
class WidenedMeans:
    """The divisions of a mean by a count that the state-sync pass made
    each replica take over N times the count (a mean added to a sum over the
    batch): a scalar that is such a mean is one device's as the replicas'
    sum, not their mean (the runtime combines a fetch of it so)."""
    divisions: frozenset


@dataclass(frozen=True)
class ScaledInputs:
    """The scopes of a TF1 graph's gradient calls of its inputs that are one
    device's on each replica (of a sum, or of a mean whose seed the
    input-gradients pass scaled to 1/N): a tensor of such a call is one
    device's share, summed (its rows joined), not averaged."""
    scopes: tuple

    def holds(self, name: str) -> bool:
        return name.startswith(self.scopes)


@dataclass(frozen=True)
class PerExampleState:
    """Mirrored variables the step writes with rows of its batch's examples
    (an RNN's state kept in a variable across steps), by the axis that holds
    them: each replica keeps the rows of its own examples, never synced
    (their mean would mix examples), and a fetch of one joins the
    replicas' rows along that axis, as one device with the global batch
    holds them."""
    axes: tuple          # ((variable, axis), ...)

