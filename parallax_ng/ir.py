"""GraphIR: a read-only view of a GraphDef with the indexes every pass needs.

Requires: a `tf.compat.v1.GraphDef` (the object is never mutated; callers that
want a changed graph build a new one with `GraphIR.from_nodes`).
Guarantees: name -> node, node -> data inputs / control inputs, tensor ->
consumers, and a topological order, all computed once per GraphIR.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from .errors import GraphError


@dataclass(frozen=True, order=True)
class TensorRef:
    """One output of one node: `node:index`."""

    node: str
    index: int = 0

    @property
    def name(self) -> str:
        return f"{self.node}:{self.index}"

    def __str__(self) -> str:
        return self.name


def parse_input(text: str) -> tuple[str, int, bool]:
    """Split a NodeDef input string into (node, output index, is_control).

    `^x` is a control input, `x` means `x:0`, `x:2` is output 2.
    """
    if text.startswith("^"):
        return text[1:], -1, True
    node, sep, idx = text.rpartition(":")
    if sep and idx.isdigit():
        return node, int(idx), False
    return text, 0, False


def parse_tensor(name: str) -> TensorRef:
    """Parse a user-facing tensor name (`x:0` or `x`) into a TensorRef."""
    node, idx, control = parse_input(name)
    if control:
        raise GraphError(f"{name!r} is a control input, not a tensor name")
    return TensorRef(node, idx)


def format_input(node: str, index: int) -> str:
    if index < 0:
        return "^" + node
    return node if index == 0 else f"{node}:{index}"


class GraphIR:
    """Immutable-by-convention wrapper around a GraphDef with lazy indexes."""

    def __init__(self, graph_def, library=None):
        self.graph_def = graph_def
        self._by_name = {}
        for node in graph_def.node:
            if node.name in self._by_name:
                raise GraphError(f"duplicate node name {node.name!r} in graph")
            self._by_name[node.name] = node

    @classmethod
    def from_nodes(cls, nodes: Iterable, template_graph_def) -> "GraphIR":
        """A new GraphIR holding `nodes`, with versions and library of the template."""
        import tensorflow as tf

        gd = tf.compat.v1.GraphDef()
        gd.versions.CopyFrom(template_graph_def.versions)
        gd.library.CopyFrom(template_graph_def.library)
        gd.node.extend(nodes)
        return cls(gd)

    # -- lookup -------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def node(self, name: str):
        try:
            return self._by_name[name]
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph") from None

    def get(self, name: str):
        return self._by_name.get(name)

    @property
    def nodes(self):
        return self.graph_def.node

    def names(self) -> list[str]:
        return [n.name for n in self.graph_def.node]

    def data_inputs(self, name: str) -> list[TensorRef]:
        out = []
        for text in self.node(name).input:
            node, idx, control = parse_input(text)
            if not control:
                out.append(TensorRef(node, idx))
        return out

    def control_inputs(self, name: str) -> list[str]:
        return [t[1:] for t in self.node(name).input if t.startswith("^")]

    # -- derived indexes ----------------------------------------------------
    @cached_property
    def consumers(self) -> dict[TensorRef, list[tuple[str, int]]]:
        """tensor -> [(consumer node, input position)] over data edges."""
        table: dict[TensorRef, list[tuple[str, int]]] = defaultdict(list)
        for node in self.graph_def.node:
            for pos, text in enumerate(node.input):
                src, idx, control = parse_input(text)
                if not control:
                    table[TensorRef(src, idx)].append((node.name, pos))
        return table

    @cached_property
    def node_consumers(self) -> dict[str, set[str]]:
        """node -> names of nodes that use it through data or control edges."""
        table: dict[str, set[str]] = defaultdict(set)
        for node in self.graph_def.node:
            for text in node.input:
                table[parse_input(text)[0]].add(node.name)
        return table

    @cached_property
    def topo_order(self) -> list[str]:
        """Nodes in an order where every input comes first (Kahn's algorithm).

        NextIteration back edges of while loops are ignored, as TensorFlow does.
        """
        indegree = {}
        for node in self.graph_def.node:
            srcs = self._ordering_inputs(node)
            indegree[node.name] = len(srcs)
        ready = deque(n.name for n in self.graph_def.node if indegree[n.name] == 0)
        order = []
        while ready:
            name = ready.popleft()
            order.append(name)
            for user in self.node_consumers.get(name, ()):
                if self._by_name[user].op in ("Merge", "RefMerge") and \
                        self._by_name[name].op in ("NextIteration", "RefNextIteration"):
                    continue
                indegree[user] -= 1
                if indegree[user] == 0:
                    ready.append(user)
        if len(order) != len(indegree):
            stuck = sorted(set(indegree) - set(order))[:5]
            raise GraphError(f"graph has a cycle through {stuck}")
        return order

    def _ordering_inputs(self, node) -> set[str]:
        srcs = set()
        for text in node.input:
            src = parse_input(text)[0]
            if src not in self._by_name:
                continue
            if node.op in ("Merge", "RefMerge") and \
                    self._by_name[src].op in ("NextIteration", "RefNextIteration"):
                continue
            srcs.add(src)
        return srcs

    @cached_property
    def topo_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.topo_order)}

    def ancestors(self, names: Iterable[str], stop=lambda name: False) -> set[str]:
        """All nodes reachable backwards from `names` (data and control edges)."""
        seen: set[str] = set()
        todo = [n for n in names]
        while todo:
            name = todo.pop()
            if name in seen or name not in self._by_name:
                continue
            seen.add(name)
            if stop(name):
                continue
            todo.extend(parse_input(t)[0] for t in self._by_name[name].input)
        return seen

    def descendants(self, names: Iterable[str]) -> set[str]:
        """All nodes reachable forwards from `names` (data and control edges)."""
        seen: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo.extend(self.node_consumers.get(name, ()))
        return seen

    def verify(self) -> None:
        """Every input names an existing node; the graph has no cycle."""
        for node in self.graph_def.node:
            for text in node.input:
                src = parse_input(text)[0]
                if src not in self._by_name:
                    raise GraphError(
                        f"node {node.name!r} ({node.op}) has input {text!r} "
                        "that names no node in the graph")
        _ = self.topo_order
