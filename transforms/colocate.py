"""Colocate updates: update math runs with the parameter it updates
(Parallax 5.3.2, "operations after aggregation placed with the process that
needs their result").

Requires: `place` (shared variables and the ops that take their handles are
on their servers). Runs when the plan's `rewrites.colocate_updates` is on.
Guarantees: every user op whose every consumer is a writer of a shared
variable, or an op already moved there, runs on that variable's server (the
worker's host CPU when its consumers are on several servers), every
replica's copy alike; gradients and ops computed from a replica's own data
stay where they are. So a learning-rate schedule, Adam's bias correction or
the scaling by a clipping factor travels as its result's bytes, once, not
as every input the math reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from transforms.place import move, server_side


@dataclass(frozen=True)
class ColocateUpdatesPass:
    name: str = "colocate_updates"
    requires: tuple = ("place",)
    after: tuple = ("lookups_on_servers",)

    def run(self, ir, ctx):
        targets = server_side(ctx, ctx.plan.rewrites.lookups_on_servers, updates=True)
        out, moved = move(ir, ctx, targets)
        return out, {"moved": moved}
