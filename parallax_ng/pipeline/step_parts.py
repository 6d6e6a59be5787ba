"""Step parts: one job step as two session runs at once, one with the
collectives, one with the parameter-server work.

TensorFlow runs a step that has collective ops under a step id that every
worker takes from one sequence (so their collectives meet); when two
workers' such steps both have partitions on the same parameter server, the
first to finish cleans up that step id on the server and aborts the other
(`AbortedError: Cleanup <step_id>`). A step without collectives gets a
random id. So the `split_step` pass gives every node a part: 0 (may touch
parameter servers, no collectives) or 1 (collectives, this worker's
devices only); a tensor that crosses parts goes through a queue of this
worker, and the executor runs both parts' runs at the same time
(parallax_ng/runtime/executor.py): each waits at its queues for what the other
makes, as the ops of one run would wait for their inputs.

Requires: the `StepParts` the split_step pass published, and the runner's
tf.Graph. Guarantees: `split(graph, fetch_ops)` lists the runs (part, ops
to run) that compute `fetch_ops`, at most one per part: every enqueue
whose dequeue is needed runs in its part, nothing runs twice;
`close`/`reset` name the ops that end a step whose other run failed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import FetchError

SERVERS, COLLECTIVES = 0, 1      # the parts


@dataclass
class StepParts:
    part_of: dict[str, int]                  # node -> SERVERS | COLLECTIVES
    floating: frozenset[str] = frozenset()   # handles, constants, queues: either part
    enqueue_of: dict[str, str] = field(default_factory=dict)   # dequeue -> enqueue
    queues: tuple[str, ...] = ()
    close: str | None = None     # closes every queue, cancelling waits
    reset: str | None = None     # drops every queue; the next run makes it anew
    _cache: dict = field(default_factory=dict, repr=False)

    def split(self, graph, fetch_ops: tuple[str, ...]) -> list[tuple[int, list[str]]]:
        """[(part, op names that must run in it)] for a run of `fetch_ops`."""
        if fetch_ops in self._cache:
            return self._cache[fetch_ops]
        targets: dict[int, set[str]] = {}
        seen: set[str] = set()
        read: dict[str, set[int]] = {}       # IdentityN -> the outputs something reads
        todo = [(name, True, None) for name in fetch_ops]
        while todo:
            name, is_target, index = todo.pop()   # index: the output read (None: the op)
            part = self.part_of_op(graph, name)
            if is_target:
                targets.setdefault(part, set()).add(name)
            op = graph.get_operation_by_name(name)
            if op.type == "IdentityN":
                # TensorFlow's pruning keeps only the inputs of the outputs read
                wanted = range(len(op.inputs)) if index is None else (index,)
                new = [i for i in wanted if i not in read.setdefault(name, set())]
                read[name].update(new)
                todo.extend((op.inputs[i].op.name, False, op.inputs[i].value_index)
                            for i in new)
                if name not in seen:
                    seen.add(name)
                    todo.extend((c.name, False, None) for c in op.control_inputs)
                continue
            if name in seen:
                continue
            seen.add(name)
            todo.extend((t.op.name, False, t.value_index) for t in op.inputs)
            todo.extend((c.name, False, None) for c in op.control_inputs)
            if name in self.enqueue_of:
                # both ends are targets: TensorFlow's rewrites may drop the
                # dequeue's reader (a Reshape folded into the next one)
                targets.setdefault(part, set()).add(name)
                todo.append((self.enqueue_of[name], True, None))
        out = [(p, sorted(targets[p])) for p in sorted(targets)]
        self._cache[fetch_ops] = out
        return out

    def part_of_op(self, graph, name: str) -> int:
        """The part of op `name` (ops made after get_runner: their inputs')."""
        if name in self.part_of:
            return self.part_of[name]
        if name in self.floating:
            return SERVERS
        op = graph.get_operation_by_name(name)
        sources = [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs]
        inputs = {self.part_of_op(graph, s) for s in sources if s not in self.floating}
        if len(inputs) > 1:
            raise FetchError(
                f"op {name!r} was made after get_runner and reads from both runs of the "
                "job's step (collectives, and parameter-server work); build it before "
                "calling get_runner")
        self.part_of[name] = inputs.pop() if inputs else SERVERS
        return self.part_of[name]
