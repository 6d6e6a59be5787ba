"""Step executor: one user run as an ordered list of session runs.

Requires: the runner's tf.Graph and Session, and what the passes published
for the runtime (parallax_ng/results.py: `Barrier`; parallax_ng/stages.py:
`Stages`).
Guarantees: `runs(names)` is the ordered list of `SessionRun`s that compute
`names` (fetched tensors and ops): one run, or one per stage when the step
is staged (no run mixes collectives with parameter-server work);
`run(session, names, feeds)` performs them and returns the values in the
order of `names`; `end_step(session)` runs the job's barrier after a run
that initialized, or trained when the training run does not hold the
barrier itself (`ends_with_barrier`). A micro-batch loop
or a layer-by-layer schedule is a different list of session runs built on
the same two calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from .results import Barrier
from .stages import Stages


@dataclass(frozen=True)
class SessionRun:
    """One session.run: the positions of the caller's names it fetches, and
    further ops it must run."""
    fetched: tuple[int, ...]
    targets: tuple[str, ...] = ()


class Executor:
    def __init__(self, graph: tf.Graph, ctx, options=None):
        self.graph = graph
        self.stages = ctx.result(Stages)
        self.barrier = ctx.result(Barrier)
        self.worker = ctx.plan.worker
        self.options = options          # every run gives up after the timeout

    def runs(self, names: list) -> list[SessionRun]:
        if self.stages is None:
            return [SessionRun(tuple(range(len(names))))]
        nodes = [_node(n) for n in names]
        out = []
        for stage, targets in self.stages.split(self.graph, tuple(sorted(set(nodes)))):
            mine = tuple(i for i, node in enumerate(nodes)
                         if self.stages.stage_of_op(self.graph, node) == stage)
            out.append(SessionRun(mine, tuple(targets)))
        return out

    def run(self, session, names: list, feeds: dict, options=None, run_metadata=None) -> list:
        """The values of `names`; `run_metadata` collects every run's step stats."""
        values: list = [None] * len(names)
        runs = self.runs(names)
        for r in runs:
            ops = [self.graph.get_operation_by_name(t) for t in r.targets]
            meta = run_metadata if len(runs) == 1 or run_metadata is None else \
                tf.compat.v1.RunMetadata()
            got = session.run([names[i] for i in r.fetched] + ops, feeds,
                              options=options or self.options, run_metadata=meta)
            if meta is not run_metadata:
                run_metadata.step_stats.dev_stats.extend(meta.step_stats.dev_stats)
            for i, value in zip(r.fetched, got):
                values[i] = value
        return values

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


def _node(name) -> str:
    return name.name if isinstance(name, tf.Operation) else name.split(":")[0]
