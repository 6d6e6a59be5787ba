"""Graph diff: what the transformation and each of its passes changed.

Requires: the graphs the PassManager dumped (or GraphIRs in memory) and the
TrainingGraph of the user's graph (for tensor shapes).
Guarantees: per pass the nodes added, removed, re-placed (device changed)
and re-wired (inputs changed); for the final graph the nodes per device and
the bytes per step that cross device boundaries (tensor sizes from static
shapes; an unknown batch dimension takes `batch` if given, otherwise the
edge is counted as unknown). Renders as text, Graphviz dot (one box per
device and name scope, coloured by the pass that made it) and a
self-contained HTML report, with the SVG inlined when Graphviz is installed.
"""
from __future__ import annotations

import html
import shutil
import subprocess
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import tensorflow as tf

from ..graph.frontend import SHARD_SCOPE
from ..graph.ir import GraphIR, TensorRef
from ..pipeline.passes import replica_of

COLOURS = {"user": "#d9d9d9", "replicate": "#9ecae1", "aggregate": "#fdae6b",
           "state_sync": "#bcbddc", "shard_inputs": "#a1d99b", "other": "#fcbba1"}


@dataclass
class PassDiff:
    name: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    rewired: list[tuple[str, list[str], list[str]]] = field(default_factory=list)
    modified: list[tuple[str, list[str]]] = field(default_factory=list)  # attrs changed
    seconds: float | None = None

    def counts(self) -> dict:
        return {"added": len(self.added), "removed": len(self.removed),
                "re-placed": len(self.replaced), "re-wired": len(self.rewired),
                "attrs": len(self.modified)}


def diff_pass(name: str, before: GraphIR, after: GraphIR, seconds=None) -> PassDiff:
    d = PassDiff(name, seconds=seconds)
    d.added = [n.name for n in after.nodes if n.name not in before]
    d.removed = [n.name for n in before.nodes if n.name not in after]
    for node in after.nodes:
        old = before.get(node.name)
        if old is None:
            continue
        if old.device != node.device:
            d.replaced.append((node.name, old.device, node.device))
        if list(old.input) != list(node.input):
            d.rewired.append((node.name, list(old.input), list(node.input)))
        if old.attr != node.attr:
            keys = sorted(k for k in set(old.attr) | set(node.attr)
                          if k not in old.attr or k not in node.attr
                          or old.attr[k] != node.attr[k])
            d.modified.append((node.name, keys))
    return d


def diff_pipeline(graphs: list[tuple[str, GraphIR]], seconds=None) -> list[PassDiff]:
    seconds = seconds or {}
    return [diff_pass(name, graphs[i][1], ir, seconds.get(name))
            for i, (name, ir) in enumerate(graphs[1:])]


def nodes_per_device(ir: GraphIR) -> Counter:
    return Counter(n.device or "(unplaced)" for n in ir.nodes)


def boundary_bytes(ir: GraphIR, tg, batch: int | None = None):
    """Bytes per step over each (source device, destination device) pair."""
    sizes: dict[TensorRef, int | None] = {}
    traffic: dict[tuple[str, str], int] = defaultdict(int)
    unknown = 0
    for node in ir.nodes:
        for ref in ir.data_inputs(node.name):
            src = ir.node(ref.node)
            if not src.device or not node.device or src.device == node.device:
                continue
            if ref not in sizes:
                sizes[ref] = _tensor_bytes(ir, tg, ref, batch)
            if sizes[ref] is None:
                unknown += 1
            else:
                traffic[(src.device, node.device)] += sizes[ref]
    return dict(traffic), unknown


def collective_bytes(ir: GraphIR, tg, batch: int | None = None) -> dict[str, int]:
    """Bytes each replica sends per step inside collectives (ring algorithms):
    all-reduce 2(N-1)/N of the tensor, all-gather (N-1) times its share."""
    out: dict[str, int] = defaultdict(int)
    for node in ir.nodes:
        if node.op not in ("CollectiveReduce", "CollectiveGatherV2"):
            continue
        size = _tensor_bytes(ir, tg, ir.data_inputs(node.name)[0], batch)
        if size is None:
            out["unknown"] += 1
            continue
        if node.op == "CollectiveReduce":
            n = node.attr["group_size"].i
            out[node.device] += 2 * (n - 1) * size // max(n, 1)
        else:
            out[node.device] += size   # times (N-1): N not an attr of the V2 op
    return dict(out)


def _tensor_bytes(ir: GraphIR, tg, ref: TensorRef, batch, depth: int = 0) -> int | None:
    _, user = replica_of(ref.node)
    if user in tg.ir:
        t = tg.tensor(TensorRef(user, ref.index))
        if t.dtype == tf.resource or t.dtype == tf.variant:
            return 0
        dims = t.shape.as_list() if t.shape.rank is not None else None
        if dims is None:
            return None
        if dims and dims[0] is None and batch:
            dims[0] = batch
        if any(d is None for d in dims):
            return None
        n = t.dtype.size
        for d in dims:
            n *= d
        return n
    node = ir.node(ref.node)
    if depth >= 8:
        return None
    if node.op in ("CollectiveReduce", "Identity", "Mul", "AddN", "Reshape"):
        return _tensor_bytes(ir, tg, ir.data_inputs(node.name)[0], batch, depth + 1)
    if node.op == "ConcatV2":            # a bucket packed flat: its parts (the axis last)
        parts = [_tensor_bytes(ir, tg, r, batch, depth + 1)
                 for r in ir.data_inputs(node.name)[:-1]]
        return None if None in parts else sum(parts)
    return None


def origin_of(diffs: list[PassDiff]) -> dict[str, str]:
    """Node name -> the pass that added it (absent: the user's node)."""
    out = {}
    for d in diffs:
        for name in d.added:
            out[name] = d.name
    return out


def render_text(diffs: list[PassDiff], final: GraphIR, tg, batch=None) -> str:
    width = max([len(d.name) for d in diffs] + [4])
    lines = [f"{'pass':{width}} {'added':>6} {'removed':>8} {'re-placed':>10} "
             f"{'re-wired':>9} {'attrs':>6} {'ms':>7}"]
    for d in diffs:
        c = d.counts()
        ms = "" if d.seconds is None else f"{d.seconds * 1e3:7.1f}"
        lines.append(f"{d.name:{width}} {c['added']:6d} {c['removed']:8d} {c['re-placed']:10d} "
                     f"{c['re-wired']:9d} {c['attrs']:6d} {ms:>7}")
    lines.append(f"\nnodes: {len(tg.ir)} in the user's graph, {len(final)} after the passes")
    lines.append("\nnodes per device:")
    for dev, n in sorted(nodes_per_device(final).items()):
        lines.append(f"  {dev:50} {n:7d}")
    traffic, unknown = boundary_bytes(final, tg, batch)
    lines.append("\nbytes on graph edges that cross devices (each edge runs at most once "
                 "a step)" + (f", batch dimension = {batch}" if batch else "") + ":")
    for (src, dst), b in sorted(traffic.items()):
        lines.append(f"  {src} -> {dst}: {b:,d}")
    lines.append(f"  total: {sum(traffic.values()):,d} bytes; "
                 f"{unknown} crossing edges of unknown size")
    lines.append("bytes sent per step inside collectives (ring model), per device:")
    for dev, b in sorted(collective_bytes(final, tg, batch).items()):
        lines.append(f"  {dev}: {b:,d}" + (" ops" if dev == "unknown" else ""))
    for d in diffs:
        lines.append(f"\n== {d.name}: {describe(d)}")
        lines += _listed("+", [f"{name} ({final.get(name).op if final.get(name) else '?'})"
                              for name in d.added], 20)
        lines += _listed("@", [f"{name}: {old or '(none)'} -> {new}"
                              for name, old, new in d.replaced], 10)
        lines += _listed("~", [f"{name}: " + "; ".join(
            [f"{a} -> {b}" for a, b in zip(old, new) if a != b] +
            ["+" + e for e in new[len(old):]]) for name, old, new in d.rewired], 10)
        lines += _listed("*", [f"{name}: attrs {', '.join(keys)}"
                              for name, keys in d.modified], 10)
    return "\n".join(lines)


def _listed(mark: str, items: list[str], limit: int) -> list[str]:
    out = [f"  {mark} {item}" for item in items[:limit]]
    if len(items) > limit:
        out.append(f"  {mark} ... {len(items) - limit} more (diff.html lists every one)")
    return out


def describe(d: PassDiff) -> str:
    """`12 added, 3 re-wired`: the pass's non-zero counts, in words."""
    words = [f"{n} {what}" for what, n in d.counts().items() if n]
    return ", ".join(words) or "no change"


def roles(tg) -> dict[str, str]:
    """User node -> its role in training, for the condensed picture."""
    from ..graph import rules
    var_scopes = set(tg.variables)
    update_scopes = {w.split("/")[0] for ws in tg.writers.values() for w in ws
                     if w not in {v.initializer for v in tg.variables.values()}}
    out = {}
    for node in tg.ir.nodes:
        name = node.name
        top = name.split("/")[0]
        parts = name.split("/")
        if node.op in rules.VARIABLE_OPS or "/".join(parts[:-1]) in var_scopes \
                or "/".join(parts[:-2]) in var_scopes:
            out[name] = "variables"    # a variable's initializer, assign, read
        elif rules.is_host_only(node.op) or top == SHARD_SCOPE:
            out[name] = "save/restore" if top == "save" else "input"
        elif rules.is_autodiff(name):
            out[name] = "backward"
        elif top in update_scopes:
            out[name] = "update"
        else:
            out[name] = "forward"
    return out


def _group(name: str, role: dict[str, str]) -> str:
    _, user = replica_of(name)
    if user.startswith("parallax/"):
        return "/".join(user.split("/")[:2])
    return role.get(user, "forward")


def render_dot(final: GraphIR, diffs: list[PassDiff], tg) -> str:
    """One box per (device, role); colour = the pass that made the nodes."""
    origin = origin_of(diffs)
    role = roles(tg)
    boxes: dict[tuple[str, str, str], int] = Counter()
    key_of = {}
    for node in final.nodes:
        k = (node.device or "(unplaced)", _group(node.name, role),
             origin.get(node.name, "user"))
        boxes[k] += 1
        key_of[node.name] = k
    ids = {k: f"n{i}" for i, k in enumerate(sorted(boxes))}
    edges = Counter()
    for node in final.nodes:
        for ref in final.data_inputs(node.name):
            a, b = key_of.get(ref.node), key_of[node.name]
            if a and a != b:
                edges[(ids[a], ids[b])] += 1
    out = ["digraph parallax {", "  rankdir=LR; node [shape=box, style=filled, fontsize=10];"]
    by_device = defaultdict(list)
    for k in sorted(boxes):
        by_device[k[0]].append(k)
    for i, (dev, keys) in enumerate(sorted(by_device.items())):
        out.append(f'  subgraph cluster_{i} {{ label="{dev}"; fontsize=11;')
        for k in keys:
            colour = COLOURS.get(k[2], COLOURS["other"])
            out.append(f'    {ids[k]} [label="{k[1]}\\n{boxes[k]} ops ({k[2]})", '
                       f'fillcolor="{colour}"];')
        out.append("  }")
    for (a, b), n in sorted(edges.items()):
        out.append(f'  {a} -> {b} [label="{n}", fontsize=8];')
    out.append("}")
    return "\n".join(out)


def render_svg(dot: str) -> str | None:
    exe = shutil.which("dot")
    if not exe:
        return None
    done = subprocess.run([exe, "-Tsvg"], input=dot.encode(), capture_output=True, timeout=120)
    return done.stdout.decode() if done.returncode == 0 else None


def render_html(diffs: list[PassDiff], final: GraphIR, tg, batch=None) -> str:
    dot = render_dot(final, diffs, tg)
    svg = render_svg(dot)
    esc = html.escape
    rows = "".join(
        f"<tr><td>{esc(d.name)}</td>" + "".join(f"<td>{v}</td>" for v in d.counts().values())
        + f"<td>{'' if d.seconds is None else f'{d.seconds * 1e3:.1f}'}</td></tr>" for d in diffs)
    devices = "".join(f"<tr><td>{esc(dev)}</td><td>{n}</td></tr>"
                      for dev, n in sorted(nodes_per_device(final).items()))
    traffic, unknown = boundary_bytes(final, tg, batch)
    cross = "".join(f"<tr><td>{esc(s)}</td><td>{esc(d)}</td><td>{b:,d}</td></tr>"
                    for (s, d), b in sorted(traffic.items()))
    details = []
    for d in diffs:
        items = [f"<li class=add>+ {esc(n)}</li>" for n in d.added]
        items += [f"<li class=move>@ {esc(n)}: {esc(o or '(none)')} &rarr; {esc(w)}</li>"
                  for n, o, w in d.replaced]
        items += [f"<li class=wire>~ {esc(n)}: {esc(', '.join(new))}</li>"
                  for n, _, new in d.rewired]
        items += [f"<li class=move>* {esc(n)}: attrs {esc(', '.join(k))}</li>"
                  for n, k in d.modified]
        details.append(f"<details><summary>{esc(d.name)}: {esc(describe(d))}</summary>"
                       f"<ul>{''.join(items)}</ul></details>")
    picture = svg or (f"<p>Install Graphviz for a picture; dot source:</p>"
                      f"<pre>{esc(dot)}</pre>")
    legend = " ".join(f'<span style="background:{c};padding:2px 6px">{esc(k)}</span>'
                      for k, c in COLOURS.items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>parallax_ng diff</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}td:first-child{{text-align:left}}
li.add{{color:#256029}}li.move{{color:#8a5a00}}li.wire{{color:#1f4e8c}}
ul{{font-family:monospace;font-size:12px;max-height:30em;overflow:auto}}</style></head><body>
<h1>What parallax_ng changed</h1>
<p>{len(tg.ir)} nodes in the user's graph, {len(final)} after the passes.</p>
<h2>Passes</h2><table><tr><th>pass</th><th>added</th><th>removed</th><th>re-placed</th>
<th>re-wired</th><th>attrs</th><th>ms</th></tr>{rows}</table>
<h2>Nodes per device</h2><table>{devices}</table>
<h2>Bytes per step across devices</h2><table><tr><th>from</th><th>to</th><th>bytes</th></tr>
{cross}</table><p>total {sum(traffic.values()):,d} bytes; {unknown} crossing edges of unknown
size{'' if batch else ' (give --batch to size the batch dimension)'}</p>
<h2>Picture</h2><p>{legend}</p>{picture}
<h2>Changes per pass</h2>{''.join(details)}</body></html>"""
