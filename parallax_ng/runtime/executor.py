"""Step executor: one user run as the session runs that compute it.

Requires: the runner's tf.Graph and Session, and what the passes published
for the runtime (parallax_ng/pipeline/results.py: `Barrier`; parallax_ng/pipeline/step_parts.py:
`StepParts`).
Guarantees: `runs(names)` is the list of `SessionRun`s that compute `names`
(fetched tensors and ops): one run, or, in a job whose step has collectives
beside parameter-server work, one per part of the step;
`run(session, names, feeds)` performs them (two parts at the same time,
each in its own thread) and returns the values in the order of `names`.
When one part's run fails, the other's waits at the step's queues are
cancelled and the queues made anew, so the error (the end of the input,
say) reaches the caller at once and the next step starts clean.
`end_step(session)` runs the job's barrier after a run that initialized,
or trained when the training run does not hold the barrier itself
(`ends_with_barrier`). Layer-to-layer execution's step is one run; its
barrier is the collective that gives every worker worker 0's initial
values (parallax_ng/l2l/runner.py). A micro-batch loop is a different list
of session runs built on the same two calls. `wait_for_parts(session)`,
in a job that reads other workers' parts of tables cut by columns
(`PartsWritten`), returns once every replica has written its parts as
often as this worker's (polling their counts; bounded by the run timeout).
A run that times out says which it was, and, where it meets the other
replicas in an exchange, that every worker must make the same runs; so
does one that lost a task it meets in an exchange (a worker that ended).
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import tensorflow as tf

from ..pipeline.results import Barrier, PartsWritten
from ..pipeline.step_parts import StepParts
from . import one_replica


_TASK = re.compile(r"remote target /job:(\w+)/replica:\d+/task:(\d+)")   # the lost task


@dataclass(frozen=True)
class SessionRun:
    """One session.run: the positions of the caller's names it fetches, and
    further ops it must run."""
    fetched: tuple[int, ...]
    targets: tuple[str, ...] = ()


class Executor:
    def __init__(self, graph: tf.Graph, options=None, parts: StepParts | None = None,
                 barrier: Barrier | None = None, worker: int = 0,
                 written: PartsWritten | None = None):
        self.graph = graph
        self.parts, self.barrier, self.worker = parts, barrier, worker
        self.written = written
        self.options = options          # every run gives up after the timeout

    @classmethod
    def of(cls, graph: tf.Graph, ctx, options=None) -> "Executor":
        """The executor of a graph the passes made (their StepParts and Barrier)."""
        return cls(graph, options, ctx.result(StepParts), ctx.result(Barrier), ctx.plan.worker,
                   ctx.result(PartsWritten))

    def runs(self, names: list) -> list[SessionRun]:
        if self.parts is None:
            return [SessionRun(tuple(range(len(names))))]
        nodes = [_node(n) for n in names]
        out = []
        for part, targets in self.parts.split(self.graph, tuple(sorted(set(nodes)))):
            mine = tuple(i for i, node in enumerate(nodes)
                         if self.parts.part_of_op(self.graph, node) == part)
            out.append(SessionRun(mine, tuple(targets)))
        return out

    def run(self, session, names: list, feeds: dict, options=None, run_metadata=None) -> list:
        """The values of `names`; `run_metadata` collects every run's step stats."""
        runs = self.runs(names)
        options = options or self.options
        if len(runs) == 1:
            got = self._run(session, runs[0], names, feeds, options, run_metadata)
        else:
            got = self._together(session, runs, names, feeds, options, run_metadata)
        values: list = [None] * len(names)
        for r, vals in zip(runs, got):
            for i, value in zip(r.fetched, vals):
                values[i] = value
        return values

    def _run(self, session, r: SessionRun, names, feeds, options, run_metadata) -> list:
        ops = [self.graph.get_operation_by_name(t) for t in r.targets]
        fetched = [names[i] for i in r.fetched] + ops
        try:
            return [session.run(fetched, feeds, options=options, run_metadata=run_metadata)]
        except tf.errors.DeadlineExceededError as e:
            raise type(e)(e.node_def, e.op, e.message + self._timed_out(fetched, options)) \
                from None
        except tf.errors.UnavailableError as e:
            lost = _TASK.search(e.message or "")
            if lost is None or not one_replica.reaches(self.graph, fetched):
                raise
            raise type(e)(e.node_def, e.op, e.message + self._said(fetched) + (
                f" lost {lost[1]} {lost[2]}, which it meets in an exchange: that task ended or "
                "failed. A worker that ends after fewer runs than the others leaves their "
                "exchanges without it: every worker must make the same runs, in the same "
                "order")) from None

    def _said(self, fetched: list) -> str:
        """The line a failed run adds to TensorFlow's message, up to what it says."""
        return f"\nparallax_ng: worker {self.worker}'s run of " \
            f"{[getattr(f, 'name', f) for f in fetched][:4]}"

    def _timed_out(self, fetched: list, options) -> str:
        """What a run that timed out says besides TensorFlow's message."""
        seconds = options.timeout_in_ms / 1000 if options is not None else 0
        said = self._said(fetched) + " did not end within " \
            f"communication.timeout_seconds ({seconds:g} s)"
        if not one_replica.reaches(self.graph, fetched):
            return said + "; raise it if a step takes that long"
        return said + ". It meets the other replicas in an exchange (a collective or a " \
            "server's queue), which waits for every replica, and in a job for every " \
            "worker: every worker must make the same runs, in the same order (a run one " \
            "worker makes alone, as `if worker == 0: runner.run(...)`, of a value computed " \
            "from the exchanged gradients or synced state, waits for the others)"

    def _together(self, session, runs, names, feeds, options, run_metadata) -> list:
        """Both parts' runs at once; the first failure cancels the other's waits.
        A traced step traces the server part's run only: it holds the
        forward and backward pass, and TensorFlow traces one run at a time
        in a process ("Another profiling session active")."""
        got: list = [None] * len(runs)
        quiet = tf.compat.v1.RunOptions()
        quiet.CopyFrom(options)
        quiet.trace_level = tf.compat.v1.RunOptions.NO_TRACE
        settings = [(options, run_metadata), (quiet, None)]
        failed: list[Exception] = []
        lock = threading.Lock()

        def one(k: int) -> None:
            try:
                got[k] = self._run(session, runs[k], names, feeds, *settings[k])[0]
            except Exception as e:             # noqa: BLE001  (raised below, first one)
                with lock:
                    failed.append(e)
                    first = len(failed) == 1
                if first:
                    session.run(self.graph.get_operation_by_name(self.parts.close),
                                options=options)

        other = threading.Thread(target=one, args=(1,), daemon=True,
                                 name="parallax_ng step part")
        other.start()
        one(0)
        other.join()
        if failed:
            session.run(self.graph.get_operation_by_name(self.parts.reset), options=options)
            raise failed[0]
        return got

    def ends_with_barrier(self, initialized: bool, trained: bool) -> bool:
        """Whether a run that did this needs the job's barrier as a run of its
        own (a training run holds it when the barrier is folded)."""
        if self.barrier is None:
            return False
        return initialized or trained and not self.barrier.folded

    def end_step(self, session) -> None:
        """Chief: release the other workers; others: wait for that."""
        if self.barrier is not None:
            op = self.graph.get_operation_by_name(self.barrier.op(self.worker))
            session.run(op, options=self.options)

    def wait_for_parts(self, session) -> None:
        """Until no replica of the job has written its parts fewer times
        than this worker's (a count not yet made is 0). Between this
        worker's runs no other worker can write ahead: its next step's
        writes wait for this worker's collectives."""
        if self.written is None:
            return
        timeout = self.options.timeout_in_ms / 1000 if self.options is not None and \
            self.options.timeout_in_ms else 300.0
        deadline, pause = time.monotonic() + timeout, 0.0005
        while True:
            counts = self._counts(session)
            mine = counts[self.written.mine]
            behind = [j for j, c in enumerate(counts) if c < mine]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise tf.errors.DeadlineExceededError(
                    None, None, f"worker {self.worker} waited {timeout:g} s for replica "
                    f"{behind[0]} of the job to write its part of a table cut by columns "
                    f"({counts[behind[0]]} writes against this worker's {mine}); is that "
                    "worker running the same runs?")
            time.sleep(pause)
            pause = min(2 * pause, 0.02)

    def _counts(self, session) -> list[int]:
        reads = [self.graph.get_tensor_by_name(f"{r}:0") for r in self.written.counts]
        try:
            return [int(c) for c in session.run(reads, options=self.options)]
        except tf.errors.FailedPreconditionError:   # a worker's session is not up yet
            out = []
            for r in reads:
                try:
                    out.append(int(session.run(r, options=self.options)))
                except tf.errors.FailedPreconditionError:
                    out.append(0)
            return out


def _node(name) -> str:
    return name.name if isinstance(name, tf.Operation) else name.split(":")[0]
