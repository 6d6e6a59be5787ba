"""Stages: one user step as several session runs, none mixing collectives
with parameter-server work.

TensorFlow runs a step that has collective ops under a step id shared by
every worker; when two workers' steps both have partitions on the same
parameter server, the first to finish cleans up that step id on the server
and aborts the other (`AbortedError: Cleanup <step_id>`). The `stage` pass
therefore numbers every node: even stages may touch parameter servers,
odd stages may run collectives, and a tensor that crosses stages goes
through a worker-local buffer variable.

Requires: the `Stages` the stage pass published, and the runner's tf.Graph.
Guarantees: `Stages.split(graph, fetch_ops)` lists, in order, the runs
(stage, ops to run) that compute `fetch_ops`: every buffer write and every
op a cut control edge named runs in the stage before its readers, nothing
runs twice (parallax_ng/executor.py runs them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import FetchError


@dataclass
class Stages:
    stage_of: dict[str, int]                 # node -> stage
    floating: frozenset[str] = frozenset()   # handles and constants: any stage
    buffer_write: dict[str, str] = field(default_factory=dict)   # buffer read -> write
    after: dict[str, list[str]] = field(default_factory=dict)    # node -> cut controls
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def count(self) -> int:
        return 1 + max(self.stage_of.values(), default=0)

    def split(self, graph, fetch_ops: tuple[str, ...]) -> list[tuple[int, list[str]]]:
        """[(stage, op names that must run in it)] for a run of `fetch_ops`."""
        if fetch_ops in self._cache:
            return self._cache[fetch_ops]
        targets: dict[int, set[str]] = {}
        seen: set[str] = set()
        todo = [(name, True) for name in fetch_ops]
        while todo:
            name, is_target = todo.pop()
            stage = self.stage_of_op(graph, name)
            if is_target:
                targets.setdefault(stage, set()).add(name)
            if name in seen:
                continue
            seen.add(name)
            op = graph.get_operation_by_name(name)
            todo.extend((t.op.name, False) for t in op.inputs)
            todo.extend((c.name, False) for c in op.control_inputs)
            if name in self.buffer_write:
                todo.append((self.buffer_write[name], True))
            todo.extend((u, True) for u in self.after.get(name, ()))
        out = [(s, sorted(targets[s])) for s in sorted(targets)]
        self._cache[fetch_ops] = out
        return out

    def stage_of_op(self, graph, name: str) -> int:
        """The stage of op `name` (ops made after get_runner: their inputs')."""
        if name in self.stage_of:
            return self.stage_of[name]
        if name in self.floating:
            return 0
        op = graph.get_operation_by_name(name)
        sources = [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs]
        inputs = {self.stage_of_op(graph, s) for s in sources if s not in self.floating}
        if len(inputs) > 1:
            raise FetchError(
                f"op {name!r} was made after get_runner and reads from several stages of "
                "the job's step (collectives and parameter servers); build it before "
                "calling get_runner")
        self.stage_of[name] = inputs.pop() if inputs else 0
        return self.stage_of[name]
