"""Replicate: one copy of the user's graph per replica.

Requires: a PassContext whose plan says which variables are shared.
Guarantees:
- replica 0 keeps the user's node names; replica k > 0 is `parallax/replica_k/<name>`;
- shared variables, their writers and ops with effects outside the graph
  (checkpoint writes) exist once, and every replica's references lead to them;
- copies get their own resource names (`shared_name`), loop frames and
  colocation groups, so replicas never alias each other's state;
- replicas that read shared state keep the single-device order of reads and
  writes: a shared writer runs after every replica's copy of each read of the
  same variable that precedes it in the user's graph (otherwise replica k
  could read a value that replica 0's step already advanced).
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng import rules
from parallax_ng.ir import GraphIR, format_input


@dataclass(frozen=True)
class ReplicatePass:
    name: str = "replicate"

    def run(self, ir: GraphIR, ctx):
        n = ctx.plan.num_replicas
        once = ctx.unreplicated
        out = []
        for node in ir.nodes:
            out.append(node)
            if node.name in once:
                continue
            parsed = ir.parsed_inputs(node)
            for k in range(1, n):
                out.append(_copy(node, k, ctx, parsed))
        extra = _order_shared_writers(ir, ctx, n)
        nodes = []
        for node in out:
            if node.name in extra:
                node = _with_controls(node, extra[node.name])
            nodes.append(node)
        report = {"replicas": n, "copied": (len(ir) - len(once)) * (n - 1),
                  "once": len(once), "ordering_edges": sum(map(len, extra.values()))}
        return GraphIR.from_nodes(nodes, ir), report


def _copy(node, k: int, ctx, parsed):
    nd = type(node)()
    nd.CopyFrom(node)
    nd.name = ctx.replica_name(k, node.name)
    if parsed:
        del nd.input[:]
        nd.input.extend(format_input(ctx.replica_name(k, src), idx) for src, idx, _ in parsed)
    if "shared_name" in nd.attr and nd.attr["shared_name"].s:
        nd.attr["shared_name"].s = nd.name.encode()
    if "frame_name" in nd.attr:
        nd.attr["frame_name"].s = (ctx.replica_name(k, "") +
                                   nd.attr["frame_name"].s.decode()).encode()
    if "_class" in nd.attr:
        locs = []
        for loc in nd.attr["_class"].list.s:
            target = loc.decode().removeprefix("loc:@")
            if target not in ctx.unreplicated:
                locs.append(("loc:@" + ctx.replica_name(k, target)).encode())
        del nd.attr["_class"]
        if locs:
            nd.attr["_class"].list.s.extend(locs)
    return nd


def _order_shared_writers(ir: GraphIR, ctx, n: int) -> dict[str, list[str]]:
    """Control inputs that make each shared writer wait for replicas' reads."""
    if n == 1:
        return {}
    topo = ir.topo_index
    extra: dict[str, list[str]] = {}
    for var in sorted(ctx.plan.shared_state()):
        reads = [r for r in ctx.tg.readers.get(var, ())
                 if ir.node(r).op in rules.CHEAP_READERS and r not in ctx.unreplicated]
        for w in ctx.tg.writers.get(var, ()):
            before = [r for r in reads if topo[r] < topo[w]]
            extra.setdefault(w, []).extend(
                "^" + ctx.replica_name(k, r) for r in before for k in range(1, n))
    return {w: c for w, c in extra.items() if c}


def _with_controls(node, controls: list[str]):
    nd = type(node)()
    nd.CopyFrom(node)
    have = set(nd.input)
    nd.input.extend(c for c in controls if c not in have)
    return nd
