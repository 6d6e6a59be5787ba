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

from ..errors import GraphError


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


def copy_node(node):
    """A NodeDef a pass may edit (passes never edit the ones they were given)."""
    nd = type(node)()
    nd.CopyFrom(node)
    return nd


class GraphIR:
    """An immutable list of NodeDefs plus the graph's versions and function library.

    Passes never mutate a NodeDef they were given: `replace` returns a new
    GraphIR that shares every unchanged NodeDef with this one (and the parsed
    form of its inputs), so a pass costs what it changes, not the graph size.
    """

    def __init__(self, graph_def=None, *, nodes=None, versions=None, library=None,
                 parent: "GraphIR | None" = None):
        if graph_def is not None:
            nodes, versions, library = list(graph_def.node), graph_def.versions, graph_def.library
        self._nodes = nodes
        self._versions, self._library = versions, library
        self._by_name = {}
        for node in nodes:
            if node.name in self._by_name:
                raise GraphError(f"duplicate node name {node.name!r} in graph")
            self._by_name[node.name] = node
        # parsed inputs of NodeDefs shared with the parent stay valid
        self._parsed_cache = parent._parsed_cache if parent is not None else {}

    @classmethod
    def from_nodes(cls, nodes: Iterable, template: "GraphIR") -> "GraphIR":
        """A new GraphIR holding `nodes`, with versions and library of `template`."""
        return cls(nodes=list(nodes), versions=template._versions,
                   library=template._library, parent=template)

    def replace(self, changed: dict | None = None, added: Iterable = (), library=None):
        """A new GraphIR: nodes named in `changed` swapped, `added` appended."""
        changed = changed or {}
        nodes = [changed.get(n.name, n) for n in self._nodes] if changed else list(self._nodes)
        nodes.extend(added)
        return GraphIR(nodes=nodes, versions=self._versions,
                       library=library if library is not None else self._library, parent=self)

    def rewire(self, rewires: dict, added: Iterable = ()) -> "GraphIR":
        """A new GraphIR plus `added`, with input slots replaced: `rewires` maps
        (node name, input position) to the tensor name it should read."""
        changed = {}
        for (name, pos), tensor in rewires.items():
            nd = changed.get(name)
            if nd is None:
                nd = changed[name] = copy_node(self.node(name))
            if parse_input(nd.input[pos])[2]:
                raise GraphError(f"input {pos} of {name} is a control input")
            nd.input[pos] = tensor
        added = list(added)
        if not changed and not added:
            return self
        return self.replace(changed, added)

    @cached_property
    def graph_def(self):
        """The nodes as a tf GraphDef (built once, on demand)."""
        import tensorflow as tf

        gd = tf.compat.v1.GraphDef()
        if self._versions is not None:
            gd.versions.CopyFrom(self._versions)
        if self._library is not None:
            gd.library.CopyFrom(self._library)
        gd.node.extend(self._nodes)
        return gd

    @property
    def library(self):
        return self._library

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
    def nodes(self) -> list:
        return self._nodes

    def names(self) -> list[str]:
        return list(self._by_name)

    def parsed_inputs(self, node) -> list[tuple[str, int, bool]]:
        """[(source node, output index, is_control)] of a NodeDef, cached."""
        key = id(node)
        hit = self._parsed_cache.get(key)
        if hit is None or hit[0] is not node:
            hit = (node, [parse_input(t) for t in node.input])
            self._parsed_cache[key] = hit
        return hit[1]

    def data_inputs(self, name: str) -> list[TensorRef]:
        return [TensorRef(src, idx) for src, idx, control
                in self.parsed_inputs(self.node(name)) if not control]

    def past_identities(self, ref: TensorRef) -> TensorRef:
        """The tensor `ref` passes on through Identity ops (the autodiff's
        tuples of gradients)."""
        while self.node(ref.node).op == "Identity" and ref.index == 0:
            ref = self.data_inputs(ref.node)[0]
        return ref

    def control_inputs(self, name: str) -> list[str]:
        return [src for src, _, control in self.parsed_inputs(self.node(name)) if control]

    # -- derived indexes ----------------------------------------------------
    @cached_property
    def consumers(self) -> dict[TensorRef, list[tuple[str, int]]]:
        """tensor -> [(consumer node, input position)] over data edges."""
        table: dict[TensorRef, list[tuple[str, int]]] = defaultdict(list)
        for node in self._nodes:
            for pos, (src, idx, control) in enumerate(self.parsed_inputs(node)):
                if not control:
                    table[TensorRef(src, idx)].append((node.name, pos))
        return table

    @cached_property
    def node_consumers(self) -> dict[str, set[str]]:
        """node -> names of nodes that use it through data or control edges."""
        table: dict[str, set[str]] = defaultdict(set)
        for node in self._nodes:
            for src, _, _ in self.parsed_inputs(node):
                table[src].add(node.name)
        return table

    @cached_property
    def topo_order(self) -> list[str]:
        """Nodes in an order where every input comes first (Kahn's algorithm).

        NextIteration -> Merge back edges of while loops are ignored, as
        TensorFlow does.
        """
        index = {name: i for i, name in enumerate(self._by_name)}
        names = list(self._by_name)
        users: list[list[int]] = [[] for _ in names]
        indegree = [0] * len(names)
        loop_ops = {i for i, n in enumerate(self._nodes)
                    if n.op in ("NextIteration", "RefNextIteration")}
        for i, node in enumerate(self._nodes):
            merge = node.op in ("Merge", "RefMerge")
            for src in {s for s, _, _ in self.parsed_inputs(node)}:
                j = index.get(src)
                if j is None or (merge and j in loop_ops):
                    continue
                users[j].append(i)
                indegree[i] += 1
        ready = deque(i for i, d in enumerate(indegree) if d == 0)
        order = []
        while ready:
            i = ready.popleft()
            order.append(i)
            for u in users[i]:
                indegree[u] -= 1
                if indegree[u] == 0:
                    ready.append(u)
        if len(order) != len(names):
            stuck = sorted(names[i] for i, d in enumerate(indegree) if d > 0)[:5]
            raise GraphError(f"graph has a cycle through {stuck}")
        return [names[i] for i in order]

    @cached_property
    def topo_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.topo_order)}

    def ancestors(self, names: Iterable[str], stop=lambda name: False,
                  data_only: bool = False) -> set[str]:
        """All nodes reachable backwards from `names` (data and control edges,
        or data edges only)."""
        seen: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in seen or name not in self._by_name:
                continue
            seen.add(name)
            if stop(name):
                continue
            todo.extend(src for src, _, control in self.parsed_inputs(self._by_name[name])
                        if not (data_only and control))
        return seen

    def descendants(self, names: Iterable[str], stop=lambda name: False,
                    data_only: bool = False) -> set[str]:
        """All nodes reachable forwards from `names` (data and control edges,
        or data edges only), not past those `stop` holds for."""
        seen: set[str] = set()
        todo = list(names)
        users = self._data_users if data_only else self.node_consumers
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if not stop(name):
                todo.extend(users.get(name, ()))
        return seen

    def ends(self, names: Iterable[str], keep=lambda name: True) -> dict[str, frozenset[str]]:
        """Each of `names`: the nodes at or below it that no node reads
        (through data or control edges: what a script fetches to run it)
        and `keep` holds for; each node's once, in reverse topological
        order (a while loop's back edges are not followed)."""
        names = list(names)
        below, users, out = self.descendants(names), self.node_consumers, {}
        for name in reversed(self.topo_order):
            if name in below:
                after = [out[u] for u in users.get(name, ()) if u in out]
                out[name] = frozenset().union(*after) if users.get(name) else \
                    frozenset({name} if keep(name) else ())
        return {name: out.get(name, frozenset()) for name in names}

    @cached_property
    def _data_users(self) -> dict[str, set[str]]:
        """node -> names of nodes that read one of its outputs."""
        table: dict[str, set[str]] = defaultdict(set)
        for ref, users in self.consumers.items():
            table[ref.node].update(name for name, _ in users)
        return table

    def verify(self, acyclic: bool = True) -> None:
        """Every input names an existing node; with `acyclic`, no cycle."""
        known = self._by_name
        for node in self._nodes:
            for src, _, _ in self.parsed_inputs(node):
                if src not in known:
                    raise GraphError(
                        f"node {node.name!r} ({node.op}) has an input from {src!r}, "
                        "which names no node in the graph")
        if acyclic:
            _ = self.topo_order
