"""Typed facts passes hand on: to later passes and to the runtime.

A pass publishes a result with `ctx.publish(result)`; a reader asks for it
by type with `ctx.result(Kind)` (None when no pass made one). The runtime
reads these, never a pass module's names.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalAggregates:
    """For each variable aggregated on a parameter server: this worker's sum
    of its replicas' gradients, (values or dense sum, indices or None),
    already scaled for a mean (made by `aggregate`, read by `server_sync`)."""
    of: dict


@dataclass(frozen=True)
class Barrier:
    """The ops that end a step of a job with parameter servers (made by
    `server_sync`): the chief runs `release` once its writes are done, the
    other workers run `wait` before they read a server variable again."""
    release: str | None = None
    wait: str | None = None

    def op(self, worker: int) -> str | None:
        return self.release if worker == 0 else self.wait
