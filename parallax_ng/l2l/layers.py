"""The layers of a stacked model: how layer-by-layer execution cuts its forward pass.

Requires: a TrainingGraph (parallax_ng/graph/frontend.py) and a regex whose first
group is a layer index (`l2l.layers`, e.g. `encoder/layer_(\\d+)/`); a name
where the group takes no part is layer 0 (`^dense(?:_(\\d+))?/` numbers
Keras's dense, dense_1, dense_2 ... as 0, 1, 2).
Guarantees: `split(tg, pattern, loss=None)` returns a Layering whose
segments, in execution order, are: what comes before the first layer (the
"pre" segment: embeddings, input processing), one segment per layer index
(sorted by value), and what comes after the last (the "post" segment:
head and loss); empty ones are left out. Every forward op (an ancestor of
the loss that is not a data source, a variable or a read of one) is in
exactly one segment, and never in an earlier segment than an op it reads
from, so running the segments in order with the tensors that cross their
boundaries (a segment's `inputs`) computes the forward pass.

An op's segment is the largest of: the layer its name matches, the layers of
the variables it reads (a variable whose name matches the regex belongs to
that layer; any other variable to "pre", or to "post" when an op that reads
it also depends on a layer), and the segments of its inputs. An op after the
last layer that neither matches the regex nor reads its variables goes to
"post". Stateless ops that depend on nothing but constants are in no
segment: every segment that uses them has its own copy.

The forward's random ops of the kinds in STATELESS (dropout's uniform
draw, normal and truncated normal noise, uniform integers) are listed in
`random`, by name: the layers' copies draw them from stateless ops, so a
recomputation draws the same numbers (parallax_ng/l2l/builder.py).

Raises GraphError, naming the op, for a forward that cannot be recomputed
layer by layer: other random ops (a recomputation would draw other numbers),
variable writes, tf.compat.v1 control flow, input queues.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import tensorflow as tf

from ..errors import GraphError
from ..graph import forms, rules

SOURCE_TYPES = ("IteratorGetNext", "IteratorGetNextSync", "Placeholder")
_V1_CONTROL_FLOW = ("Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
                    "RefExit", "NextIteration", "RefNextIteration", "LoopCond")
_READ_ONLY_STATEFUL = ("ResourceGather", "ResourceGatherNd", "VariableShape", "Assert",
                       "PrintV2", "Print")
# random op -> the stateless op that draws the same distribution from a seed input
STATELESS = {"RandomUniform": "StatelessRandomUniform",
             "RandomStandardNormal": "StatelessRandomNormal",
             "TruncatedNormal": "StatelessTruncatedNormal",
             "RandomUniformInt": "StatelessRandomUniformInt"}


@dataclass
class Segment:
    name: str                                   # "pre", "layer_<i>" or "post"
    ops: list[str] = field(default_factory=list)        # in topological order
    inputs: list[str] = field(default_factory=list)     # tensors from earlier segments/sources
    outputs: list[str] = field(default_factory=list)    # tensors later segments read
    weights: dict[str, list[str]] = field(default_factory=dict)  # variable -> its read ops
    handles: list[str] = field(default_factory=list)    # variables resource ops use directly


@dataclass
class Layering:
    loss: str                                   # tensor name
    sources: list[str]                          # data source ops (iterators, placeholders)
    segments: list[Segment]
    free: set[str]                              # constant-only ops, copied where used
    segment_of: dict[str, int]                  # forward op -> segment position
    random: list[str] = field(default_factory=list)     # forward random ops, sorted

    @property
    def forward(self) -> set[str]:
        return set(self.segment_of)

    def segment_of_tensor(self, name: str) -> int | None:
        return self.segment_of.get(name.rsplit(":", 1)[0])


def find_loss(graph: tf.Graph, name: str | None = None) -> tf.Tensor:
    """The tensor whose gradients trained the variables: `name`, or the one
    tensor tf.gradients was called on (its `grad_ys` fill)."""
    if name is not None:
        try:
            return graph.get_tensor_by_name(name if ":" in name else name + ":0")
        except (KeyError, ValueError):
            raise GraphError(f"config key 'l2l.loss' names {name!r}, which is not a tensor "
                             "of the graph") from None
    found = forms.autodiff_losses(graph)
    if len(found) != 1:
        which = ", ".join(t.name for t in found) or "none"
        raise GraphError(f"cannot tell which tensor is the loss (tf.gradients was taken of: "
                         f"{which}); name it with config key 'l2l.loss'")
    return found[0]


def split(tg, pattern: str, loss: str | None = None) -> Layering:
    graph = tg.graph
    regex = re.compile(pattern)
    loss_t = find_loss(graph, loss)
    forward, sources = _forward(loss_t)
    var_layer = {}
    for var in tg.variables:
        m = regex.search(var)
        if m:
            var_layer[var] = _index(m, var, "variable")
    if not var_layer:
        raise GraphError(f"config key 'l2l.layers' ({pattern!r}) matches no variable; "
                         f"variables are named like {sorted(tg.variables)[:4]}")
    order = sorted(set(var_layer.values()))
    position = {layer: i + 1 for i, layer in enumerate(order)}
    last, post = len(order), len(order) + 1
    free = _free(forward)
    ops = [op for op in forward if op.name not in free]

    def reads(op):      # variables `op` reads, directly or as a read op
        out = []
        for t in op.inputs:
            if t.op.type in rules.VARIABLE_OPS:
                out.append(t.op.name)
        return out

    # which variables outside the layers are read after a layer ran
    depends = {}
    for op in ops:
        depends[op.name] = max([depends.get(t.op.name, 0) for t in op.inputs] +
                               [position[var_layer[v]] for v in reads(op) if v in var_layer]
                               + [0])
    late = set()
    for op in ops:
        for v in reads(op):
            if v not in var_layer and (depends[op.name] > 0 or any(
                    depends.get(c.name, 0) > 0 for out in op.outputs for c in out.consumers()
                    if _is_read(op))):
                late.add(v)
    segment_of = {}
    for op in ops:
        _check(op)
        m = regex.search(op.name)
        named = position[_index(m, op.name, "op")] if m and _index(
            m, op.name, "op") in position else None
        own = [position[var_layer[v]] if v in var_layer else (post if v in late else 0)
               for v in reads(op)]
        s = max([segment_of.get(t.op.name, 0) for t in op.inputs] + own + [named or 0])
        if s == last and named is None and not any(
                v in var_layer and position[var_layer[v]] == last for v in reads(op)) \
                and not _is_read(op):
            s = post
        segment_of[op.name] = s
    # a read belongs with its consumers: it is copied to each segment using it
    names = ["pre"] + [f"layer_{i}" for i in order] + ["post"]
    segments = [Segment(n) for n in names]
    for op in ops:
        if _is_read(op):
            continue
        seg = segments[segment_of[op.name]]
        seg.ops.append(op.name)
        for t in op.inputs:
            src = t.op
            if src.name in free:
                continue
            if _is_read(src):
                var = src.inputs[0].op.name
                reads_of = seg.weights.setdefault(var, [])
                if src.name not in reads_of:
                    reads_of.append(src.name)
            elif src.type in rules.VARIABLE_OPS:
                if src.name not in seg.handles:
                    seg.handles.append(src.name)
            elif src.name not in seg.ops and t.name not in seg.inputs:
                seg.inputs.append(t.name)
    for op in ops:
        if _is_read(op):        # its segment is the latest one using it (for ordering only)
            users = [segment_of[c.name] for out in op.outputs for c in out.consumers()
                     if c.name in segment_of]
            segment_of[op.name] = max(users, default=0)
    for pos, seg in enumerate(segments):
        for t in seg.inputs:
            producer = segment_of.get(t.rsplit(":", 1)[0])
            if producer is not None and t not in segments[producer].outputs:
                segments[producer].outputs.append(t)
    keep = [s for s in segments if s.ops]
    renumber = {id(s): i for i, s in enumerate(keep)}
    old = {i: renumber[id(s)] for i, s in enumerate(segments) if id(s) in renumber}
    segment_of = {n: old.get(p, 0) for n, p in segment_of.items()}
    source_ops = sorted({op.name for op in sources}, key=lambda n: graph.get_operation_by_name(
        n)._id)  # noqa: SLF001
    random = sorted(op.name for op in ops if op.type in STATELESS)
    return Layering(loss_t.name, source_ops, keep, free, segment_of, random)


# ops whose output's first dimension is their first input's (element by
# element, or reducing/reshaping other dimensions)
def _index(match, name: str, what: str) -> int:
    if match.re.groups and match.group(1) is None:
        return 0        # an optional number left out: Keras names its first Dense "dense"
    try:
        return int(match.group(1))
    except (TypeError, ValueError):
        raise GraphError(f"config key 'l2l.layers': the first group must capture a layer "
                         f"number; in {what} {name!r} it captured {match.group(1)!r}") from None


def _is_read(op: tf.Operation) -> bool:
    return (op.type == "ReadVariableOp" and op.inputs[0].op.type == "VarHandleOp") or (
        op.type == "Identity" and op.inputs[0].op.type in ("VariableV2", "Variable"))


def _forward(loss: tf.Tensor) -> tuple[list[tf.Operation], list[tf.Operation]]:
    """The loss's ancestors (topological order) short of data sources and
    variables; and the sources met."""
    seen, sources, order = set(), [], []
    stack = [(loss.op, False)]
    while stack:
        op, expanded = stack.pop()
        if expanded:
            order.append(op)
            continue
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in SOURCE_TYPES:
            sources.append(op)
            continue
        if op.type in rules.VARIABLE_OPS:
            continue
        if op.type.startswith("QueueDequeue"):
            raise GraphError(f"layer-by-layer execution reads its data from tf.data iterators "
                             f"or fed placeholders; {op.name!r} ({op.type}) dequeues from a "
                             "queue")
        stack.append((op, True))
        for t in list(op.inputs)[::-1]:
            stack.append((t.op, False))
    return order, sources


def _free(forward: list[tf.Operation]) -> set[str]:
    free = set()
    for op in forward:
        if op.op_def.is_stateful or op.control_inputs:
            continue
        if all(t.op.name in free for t in op.inputs):
            free.add(op.name)
    return free


def _check(op: tf.Operation) -> None:
    if op.type in _V1_CONTROL_FLOW:
        raise GraphError(
            f"op {op.name!r} ({op.type}) is tf.compat.v1 control flow, which layer-by-layer "
            "execution cannot recompute; call tf.compat.v1.enable_control_flow_v2() before "
            "building the model, or keep the loop out of the layers")
    if not op.op_def.is_stateful or op.type in _READ_ONLY_STATEFUL or _is_read(op):
        return
    if op.type in STATELESS:
        return
    if "Random" in op.type or "Multinomial" in op.type or "Shuffle" in op.type:
        raise GraphError(
            f"op {op.name!r} ({op.type}) draws random numbers in the forward pass; "
            "layer-by-layer execution recomputes each layer in the backward pass and can "
            f"redraw the same numbers only for {', '.join(sorted(STATELESS))} (dropout, "
            "noise); draw this one outside the loss's ancestors, or use a stateless op")
    if op.type.startswith(("Assign", "ResourceScatter", "Scatter", "ResourceApply", "Apply")):
        raise GraphError(
            f"op {op.name!r} ({op.type}) writes a variable in the forward pass (batch "
            "statistics?); layer-by-layer execution runs each layer several times a step")
