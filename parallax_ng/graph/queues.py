"""Queue-based input (tf.compat.v1.train input producers, readers, batchers).

TF1 scripts fill FIFO/shuffle queues from `QueueRunner`s in the graph's
QUEUE_RUNNERS collection (`range_input_producer`, `string_input_producer`,
`tf.train.batch`, ...). Every replica gets its own copy of each queue, so
each copy needs its own runner, and a producer's elements must be dealt out
over the replicas as `pn.shard` deals out a dataset's.

Requires: a TrainingGraph (its `queue_runners`, as `RunnerDef`s).
Guarantees:
- `find(tg)` lists every queue a runner fills, and which of them are
  *producers*: queues whose enqueued values are the same on every replica
  (a range, a list of file names), filled by enqueue_many. The `shard_inputs`
  pass gives replica r of N the elements r, r+N, r+2N, ... of each batch a
  producer enqueues; the random ops a producer enqueues from (its shuffle)
  draw the same on every replica, so the replicas' parts are disjoint.
  Queues filled from per-replica data (`tf.train.batch` after a reader)
  need only their runners.
- `readers_apart(tg)` names the producers a reader reads files from:
  each replica reads whole files of its own.
- A queue that a training op reads but no runner fills, and a producer
  filled one element at a time, are errors at get_runner that name the
  queue and what to use instead: nothing waits on a queue nobody fills.
- `QueueThreads` starts every replica's copy of every runner, once, on
  the first run that reads a queue (the initialisers have run by then, as
  with `start_queue_runners` on one device), stops them on close, and turns
  a runner's failure (the queue closes and a read ends with OutOfRange)
  into the runner's own error.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from ..errors import GraphError
from . import randomness, rules
from .variance import is_input_source

QUEUE_OPS = frozenset({
    "FIFOQueueV2", "FIFOQueue", "RandomShuffleQueueV2", "RandomShuffleQueue",
    "PaddingFIFOQueueV2", "PaddingFIFOQueue", "PriorityQueueV2", "PriorityQueue"})
ENQUEUE_MANY = frozenset({"QueueEnqueueManyV2", "QueueEnqueueMany"})
ADVICE = ("or read the data with tf.data and pn.shard(dataset), which splits it "
          "over replicas")


@dataclass(frozen=True)
class RunnerDef:
    """A QueueRunner by its ops' names. (TensorFlow's QueueRunnerDef keeps
    only the last component of the queue's name, so the queue is taken from
    the enqueue op's first input.)"""
    queue: str
    enqueues: tuple[str, ...]
    close: str
    cancel: str
    closed_errors: tuple = (tf.errors.OutOfRangeError,)

    @classmethod
    def of(cls, qr) -> "RunnerDef":
        queue = qr.enqueue_ops[0].inputs[0].op.name
        return cls(queue, tuple(op.name for op in qr.enqueue_ops), qr.close_op.name,
                   qr.cancel_op.name, tuple(qr.queue_closed_exception_types))

    def build(self, graph: tf.Graph, scope: str) -> tf.compat.v1.train.QueueRunner:
        """The runner of replica `scope`'s copy (scope "" for replica 0)."""
        def op(name):
            return graph.get_operation_by_name(f"{scope}/{name}" if scope else name)
        handle = op(self.queue).outputs[0]
        types = [tf.as_dtype(t) for t in handle.op.get_attr("component_types")]
        queue = tf.queue.QueueBase(types, None, None, handle)
        return tf.compat.v1.train.QueueRunner(
            queue, [op(e) for e in self.enqueues], op(self.close), op(self.cancel),
            self.closed_errors)


@dataclass(frozen=True)
class QueueInput:
    queue: str                    # the queue node
    enqueues: tuple[str, ...]     # the enqueue ops its runner runs
    producer: bool                # values equal on every replica: split them
    random: tuple[str, ...] = ()  # random ops a producer enqueues from


def find(tg) -> list[QueueInput]:
    """Every queue a runner fills, classified; raises for unfillable queues."""
    runners = {r.queue: r for r in tg.queue_runners}
    out = []
    for node in tg.ir.nodes:
        if node.op not in QUEUE_OPS:
            continue
        qr = runners.get(node.name)
        if qr is None:
            readers = sorted(c for c in tg.ir.node_consumers.get(node.name, ())
                             if tg.ir.node(c).op.startswith(rules.READ_PREFIXES))
            if readers:
                raise GraphError(
                    f"queue {node.name!r} is read by {readers[:3]} but no QueueRunner in the "
                    "graph's QUEUE_RUNNERS collection fills it, so every replica would wait "
                    "on it forever. Fill it with a runner (tf.compat.v1.train."
                    f"add_queue_runner), {ADVICE}")
            continue
        out.append(_classify(tg, node.name, list(qr.enqueues)))
    return out


def readers_apart(tg) -> list[str]:
    """A line for each producer a reader reads (a file list's names): each
    replica reads whole files of its own, so a step's rows are not one
    device's global batch."""
    out = []
    for q in find(tg):
        readers = sorted(c for c in tg.ir.node_consumers.get(q.queue, ())
                         if tg.ir.node(c).op.startswith("ReaderRead"))
        if q.producer and readers:
            out.append(f"queue {q.queue!r} deals its names out to the replicas and "
                       f"{readers[0]!r} reads whole files from it, so each replica's steps "
                       "take rows of its own files: a step's rows are other rows than one "
                       "device's global batch (each row is still read once an epoch); for "
                       "one device's steps, shard the records: pn.shard(tf.data."
                       "TFRecordDataset(files)), every replica then reading every file")
    return out


def _classify(tg, queue: str, enqueues: list[str]) -> QueueInput:
    values = [r.node for e in enqueues for r in tg.ir.data_inputs(e)[1:]]
    upstream = tg.ir.ancestors(values, data_only=True)
    if any(is_input_source(tg, tg.ir.node(n)) for n in upstream):
        return QueueInput(queue, tuple(enqueues), producer=False)
    single = [e for e in enqueues if tg.ir.node(e).op not in ENQUEUE_MANY]
    if single:
        raise GraphError(
            f"queue {queue!r} is filled by {single[0]!r} ({tg.ir.node(single[0]).op}), one "
            "element at a time, from values that are the same on every replica; "
            "parallax_ng splits only queues filled by enqueue_many (the tf.compat.v1.train "
            f"input producers) over replicas. Use an input producer, {ADVICE}")
    random = tuple(sorted(n for n in upstream if randomness.is_random(tg.ir.node(n))))
    return QueueInput(queue, tuple(enqueues), producer=True, random=random)


class QueueThreads:
    """Every replica's queue runners, in threads of one session."""

    def __init__(self, graph: tf.Graph, runner_defs, scopes: list[str]):
        with graph.as_default():
            self._runners = [r.build(graph, scope) for r in runner_defs for scope in scopes]
        self._coord = tf.train.Coordinator()
        self._threads = None

    def start(self, session) -> None:
        if self._threads is None and self._runners:
            self._threads = [t for qr in self._runners
                             for t in qr.create_threads(session, coord=self._coord,
                                                        daemon=True, start=True)]

    def raise_failure(self) -> None:
        """Raise the error a runner stopped with, if any."""
        self._coord.raise_requested_exception()

    def stop(self, grace_seconds: float = 10.0) -> None:
        if not self._threads:
            return
        self._coord.request_stop()
        try:
            self._coord.join(self._threads, stop_grace_period_secs=grace_seconds,
                             ignore_live_threads=True)
        except Exception:   # noqa: BLE001 - a runner's error was reported by run()
            pass
        self._threads = []
