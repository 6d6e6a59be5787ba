"""Program: a step graph and the parts the Runner drives it with.

Requires: what a build made: the graph the data-parallel passes rewrote
(`transformed(ir, ctx, config, records)`) or layer-to-layer execution's
(parallax_ng/l2l/runner.py).
Guarantees: a `Program` holds the tf.Graph to run, the user's
TrainingGraph, the plan to show, the map of the user's fetches and feeds
onto the graph (parallax_ng/runtime/fetches.py), the executor of a step's
session runs and the job's barrier (parallax_ng/runtime/executor.py), the
Checkpointer when `checkpoint.dir` is set, the bound every session run
gets (`options`), and what only the passes' graphs have: input-queue
threads, the ops applying a deferred update, the ops telling parameter
servers this worker is done and those waiting for every worker's end,
and the PassContext (with which the Runner measures and plans again).
One Runner class drives every Program (parallax_ng/runtime/runner.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tensorflow as tf

from .. import compat
from ..graph.queues import QueueThreads
from ..pipeline.results import ColumnParts, CountedDraws, Deferred, PartsWritten
from .checkpoint import Checkpointer, Layout
from .executor import Executor
from .fetches import FetchMap, ReplicaFetchMap
from .serving import done_ops, leave_ops


@dataclass
class Program:
    graph: tf.Graph
    tg: object                      # the user's TrainingGraph
    plan: object                    # what `runner.plan` shows (Plan or L2LPlan)
    fetches: FetchMap
    executor: Executor
    options: tf.compat.v1.RunOptions
    checkpoints: Checkpointer | None = None
    worker: int = 0
    queues: QueueThreads | None = None   # fill every replica's input queues
    flush: list = field(default_factory=list)   # apply the rows a step left pending
    done: list | None = None        # tell the servers this worker is done
    servers_idle: bool = False      # the plan puts nothing on the servers
    ctx: object | None = None       # the PassContext of a data-parallel program
    records: list = field(default_factory=list)   # the passes' records
    start: list = field(default_factory=list)   # run once in a new session, before any step
    leave: list | None = None       # wait for every worker's end: others read this one's parts


def run_options(timeout_seconds: float) -> tf.compat.v1.RunOptions:
    """Every run gives up after the timeout (collective ops have none of
    their own: parallax_ng/comm/collectives.py OP_TIMEOUT_SECONDS)."""
    return tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_seconds * 1000))


def bounded(options, default):
    """The caller's run options with the runner's timeout where they set none."""
    if options is None:
        return default
    if options.timeout_in_ms:
        return options
    bounded = tf.compat.v1.RunOptions()
    bounded.CopyFrom(options)
    bounded.timeout_in_ms = default.timeout_in_ms
    return bounded


def traced(options, run_metadata, target: str = ""):
    """Run options that trace the step in a session on `target` (keeping a
    timeout), and RunMetadata."""
    traced = tf.compat.v1.RunOptions()
    if options is not None:
        traced.CopyFrom(options)
    traced.trace_level = compat.trace_level(target)
    return traced, run_metadata if run_metadata is not None else tf.compat.v1.RunMetadata()


def transformed(ir, ctx, config, records=(), server: bool = False) -> Program:
    """The Program of the graph the passes made (`ir`, with `ctx`);
    `server`: this process is a worker of a job (its session's target is
    its gRPC server), so it tells the plan's servers when it is done."""
    plan = ctx.plan
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(ir.graph_def, name="")
    options = run_options(plan.timeout_seconds)
    checkpoints = Checkpointer(graph, Layout.of(ctx), config.checkpoint.dir,
                               plan.timeout_seconds) if config.checkpoint.dir else None
    queues = None      # threads filling every replica's input queues
    if ctx.tg.queue_runners:
        queues = QueueThreads(graph, ctx.tg.queue_runners,
                              [ctx.replica_name(k, "").rstrip("/")
                               for k in range(plan.num_replicas)])
    deferred, counted = ctx.result(Deferred), ctx.result(CountedDraws)
    written = ctx.result(PartsWritten)
    done = None
    if server and plan.servers:
        done = done_ops(graph, list(plan.servers), plan.num_workers, plan.worker)
    parts, leave = ctx.result(ColumnParts), None
    if server and plan.num_workers > 1 and parts is not None and not parts.gather:
        leave = leave_ops(graph, plan.num_workers, plan.worker)
    return Program(graph, ctx.tg, plan, ReplicaFetchMap(graph, ctx, config),
                   Executor.of(graph, ctx, options), options, checkpoints, plan.worker,
                   queues, list(deferred.flush) if deferred else [], done,
                   done is not None and not plan.uses_servers, ctx, list(records),
                   (list(counted.start) if counted else []) +
                   ([written.start] if written else []), leave)
