"""Moves: whether training can go on in another graph's session with the
same state (a plan measured again, a tuned size: runtime/runner.py
`_move_to`), and which state a move carries.

Requires: the pipeline context of the graph training has (its plan and
the user graph's TrainGraph).
Guarantees: `why_not(ctx, plan)` is None when a checkpoint of this
worker's variables, iterator positions and counted random draws
(runtime/checkpoint.py) is all the state a new session needs, else a
sentence saying what would be lost: other tasks' state (a job, unless
`jobs`: every worker moves at the same step), elements in input queues,
entries in mutable tables, or streams of random ops in the step that
would start again. `layout(ctx)` is that state's checkpoint layout, in
one local file.
"""
from __future__ import annotations

from dataclasses import replace

from ..graph import randomness, tables
from ..pipeline.results import CountedDraws
from .checkpoint import Layout


def training_writers(tg) -> frozenset[str]:
    """Writers of trained variables that the gradients feed (not
    initializers or restores)."""
    return frozenset(w for v in tg.gradients for s in tg.owned(v)
                     for w in tg.writers.get(s, ()) if w in tg.after_gradients)


def why_not(ctx, plan, jobs: bool = False) -> str | None:
    """Why training with `plan` cannot go on in a new session with the same
    state (`jobs`: every worker of a job moves at the same step)."""
    if (plan.num_workers > 1 or plan.servers) and not jobs:
        return "a job's servers and other workers hold state of this graph"
    tg = ctx.tg
    mutable = sorted(n.name for n in tg.ir.nodes if n.op in tables.MUTABLE)
    if tg.queue_runners or mutable:
        return ("input queues hold elements" if tg.queue_runners else
                f"mutable tables ({mutable[:3]}) hold entries") + " a new session would lose"
    step = tg.ir.ancestors(training_writers(tg))
    counted = ctx.result(CountedDraws)           # streams a checkpoint holds
    counted = {op for _, op in counted.calls} if counted else set()
    drawn = [op for op, mode in plan.random.items()   # stateless ones keep no stream;
             if op in step and op not in counted       # unseeded ones draw afresh
             and randomness.is_random(tg.ir.node(op))
             and randomness.repeatable(tg.ir.node(op), mode)]
    if drawn:
        return (f"random ops in the step ({drawn[:3]}) would start their streams "
                "again in a new session")
    return None


def layout(ctx) -> Layout:
    """This worker's state, all of it in one local file (every worker of a
    job moves at the same step)."""
    return replace(Layout.of(ctx), workers=1)
