"""Pass contract and PassManager.

A pass is an object with a `name`, `requires` and `after` (names of passes
that must run before it: always, or whenever they run) and
`run(ir, ctx) -> (ir, report)`; it never mutates its input GraphIR. The
manager checks the order first, then runs passes in order, times them,
verifies the graph after each one (naming the failing pass and the passes
before it), and can dump every intermediate graph for `parallax-ng diff`.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from ..comm.keys import InstanceKeys
from ..comm.lowering import lowering
from ..errors import GraphError, ParallaxError
from ..graph import branches, rules
from ..graph.frontend import TrainingGraph
from ..graph.ir import GraphIR, format_input
from ..graph.variance import Variant, replica_variant
from ..planning.facts import Facts
from ..planning.plan import Plan
from .results import SyncedInputs

REPLICA_PREFIX = "parallax/replica_{}/"


def replica_of(name: str) -> tuple[int, str]:
    """(replica index, user node name) of a node of the replicated graph."""
    if name.startswith("parallax/replica_"):
        _, k, rest = name.split("/", 2)
        return int(k.removeprefix("replica_")), rest
    return 0, name


class Pass(Protocol):
    name: str
    requires: tuple     # passes that must run before this one
    after: tuple        # passes that, when they run, must run before this one

    def run(self, ir: GraphIR, ctx: "PassContext") -> tuple[GraphIR, dict]:
        ...


@dataclass
class PassContext:
    """What every pass may read: the analysed user graph, the plan and the
    graph's analyses the planner asked too (`facts`, planning/facts.py).

    `instance_keys` is the state passes share: each collective they add
    takes a fresh key from it. Passes publish typed results
    (parallax_ng/pipeline/results.py, parallax_ng/pipeline/step_parts.py)
    for later passes and the runtime.
    """

    tg: TrainingGraph
    plan: Plan
    instance_keys: InstanceKeys = field(default_factory=InstanceKeys)
    results: dict = field(default_factory=dict)   # result type -> result
    facts: Facts | None = None

    def __post_init__(self):
        if self.facts is None:
            self.facts = Facts(self.tg)

    def publish(self, result) -> None:
        self.results[type(result)] = result

    def result(self, kind):
        """The published result of type `kind`, or None."""
        return self.results.get(kind)

    @cached_property
    def comm(self):
        """The plan's backend's collectives (parallax_ng/comm/collectives.py)."""
        return lowering(self.plan, self.instance_keys)

    def replica_name(self, k: int, name: str) -> str:
        """Name of replica k's copy of user node `name` (replica 0 keeps names)."""
        if k == 0 or name in self.unreplicated:
            return name
        return REPLICA_PREFIX.format(k) + name

    def replica_tensor(self, k: int, ref) -> str:
        return format_input(self.replica_name(k, ref.node), ref.index)

    @cached_property
    def variant(self) -> Variant:
        """User nodes whose values differ between replicas (random ops the
        plan draws alike on every replica are not sources)."""
        identical = self._identical
        return replica_variant(self.tg, identical) if identical else self.tg.variant

    @cached_property
    def _identical(self) -> frozenset[str]:
        return frozenset(op for op, mode in self.plan.random.items() if mode == "identical")

    @cached_property
    def synced_variant(self) -> frozenset[str]:
        """`variant` once the passes have run: a write whose varying input the
        state-sync pass replaced by the replicas' reduction (a metric's total)
        is the same on every replica, and so is what reads it (the metric's
        update op), unless it reads varying values besides."""
        synced = self.result(SyncedInputs)
        return replica_variant(self.tg, self._identical, synced.inputs) if synced \
            else self.variant

    def varies(self, ref) -> bool:
        """True if tensor `ref` differs between replicas after aggregation."""
        return ref not in self.tg.gradient_tensors and self.variant.varies(ref)

    @cached_property
    def unreplicated(self) -> frozenset[str]:
        """User nodes that exist once: shared variables, their writers, and ops
        with effects outside the graph (checkpoint writes)."""
        shared = self.plan.shared_state()
        out = set(shared)
        for var in shared:
            out.update(self.tg.writers.get(var, ()))
        out.update(n.name for n in self.tg.ir.nodes if n.op in rules.EXTERNAL_EFFECT_OPS)
        return frozenset(out)


def check_order(passes) -> None:
    """Raise if a pass runs before one it `requires` or comes `after`."""
    index = {p.name: i for i, p in enumerate(passes)}
    for i, p in enumerate(passes):
        for name in getattr(p, "requires", ()):
            if index.get(name, len(passes)) >= i:
                raise GraphError(f"pass {p.name!r} requires pass {name!r} before it; "
                                 f"the pipeline is {[q.name for q in passes]}")
        for name in getattr(p, "after", ()):
            if index.get(name, -1) > i:
                raise GraphError(f"pass {p.name!r} must run after pass {name!r}; "
                                 f"the pipeline is {[q.name for q in passes]}")


@dataclass
class PassRecord:
    name: str
    seconds: float
    nodes: int
    report: dict = field(default_factory=dict)


class PassManager:
    def __init__(self, passes, verify: str = "structure", dump_dir: str | None = None,
                 keep_graphs: bool = False):
        self.passes = list(passes)
        check_order(self.passes)
        self.verify = verify
        self.dump_dir = dump_dir
        self.keep_graphs = keep_graphs
        self.records: list[PassRecord] = []
        self.graphs: list[tuple[str, GraphIR]] = []   # with keep_graphs: input, each pass

    def run(self, ir: GraphIR, ctx: PassContext) -> GraphIR:
        self.records, self.graphs = [], []
        self._dump(0, "input", ir)
        for i, p in enumerate(self.passes, start=1):
            start = time.perf_counter()
            try:
                ir, report = p.run(ir, ctx)
                self._check(ir, last=i == len(self.passes))
            except ParallaxError as e:
                raise type(e)(f"{self._where(i)} failed: {e}") from e
            except Exception as e:     # a bug or TensorFlow's: its type kept, the pass named
                e.add_note(f"parallax_ng: raised in {self._where(i)}")
                raise
            self.records.append(PassRecord(p.name, time.perf_counter() - start,
                                           len(ir), report))
            self._dump(i, p.name, ir)
        if self.dump_dir:
            with open(os.path.join(self.dump_dir, "passes.json"), "w") as f:
                json.dump([r.__dict__ for r in self.records], f, indent=1, default=str)
        return ir

    def _where(self, i: int) -> str:
        """The i-th pass (from 1) and the ones before it, for an error."""
        before = [q.name for q in self.passes[:i - 1]]
        return f"pass {self.passes[i - 1].name!r} (after {before or 'none'})"

    def _check(self, ir: GraphIR, last: bool) -> None:
        # "structure": inputs after every pass, acyclicity once at the end
        ir.verify(acyclic=last or self.verify != "structure")
        if last:
            branches.check_no_exchange_in_loops(ir)
        if self.verify == "import":
            import tensorflow as tf
            try:
                with tf.Graph().as_default():
                    tf.graph_util.import_graph_def(ir.graph_def, name="")
            except (ValueError, TypeError) as e:
                raise GraphError(f"TensorFlow rejects the graph: {e}") from None

    def _dump(self, i: int, name: str, ir: GraphIR) -> None:
        if self.keep_graphs:
            self.graphs.append((name, ir))
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        with open(os.path.join(self.dump_dir, f"{i:02d}_{name}.pb"), "wb") as f:
            f.write(ir.graph_def.SerializeToString())

    def summary(self) -> str:
        return "\n".join(f"{r.name:12} {r.seconds * 1e3:9.1f} ms {r.nodes:8d} nodes {r.report}"
                         for r in self.records)
