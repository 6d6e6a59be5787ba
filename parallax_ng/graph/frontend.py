"""Front end: a user's single-device training graph as a `TrainingGraph`.

Requires: a `tf.Graph` built with tf.compat.v1 ops and resource or reference
variables, trained by an optimizer (or code that writes variables from
`tf.gradients` outputs), or a MetaGraphDef (object or file) of one.
Guarantees: every variable, its writers and readers, the state it owns (slots,
moving averages), and for every trained variable the raw gradient tensors the
autodiff produced (dense tensor, or values+indices of an IndexedSlices); the
user's graph unmodified (copies: cond_lowering, generators, fused_norm, input_calls)."""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

import tensorflow as tf

from .. import compat
from ..errors import GraphError
from . import (accumulation, branches, cond_lowering, distinct, fused_norm, generators,
               input_calls, queues, rules, time_major, variance)
from .ir import GraphIR, TensorRef

SHARD_SCOPE = "parallax_shard"
NO_UPDATE = "found no optimizer update in the graph"     # the error's start (tf2.py)


@dataclass(frozen=True)
class Variable:
    name: str                   # VarHandleOp node name
    dtype: tf.DType
    shape: tuple                # None entries for unknown dims
    trainable: bool
    initializer: str | None     # op that assigns the initial value
    owner: str | None = None    # trainable variable this state belongs to
    known: bool = True          # the shape is fully defined (its rank and every dim)

    @property
    def nbytes(self) -> int:
        n = self.dtype.size
        for d in self.shape:
            n *= d or 1
        return n


@dataclass(frozen=True)
class Gradient:
    variable: str
    values: TensorRef               # dense gradient, or IndexedSlices values
    indices: TensorRef | None = None  # IndexedSlices indices (sparse only)

    @property
    def sparse(self) -> bool:
        return self.indices is not None


@dataclass
class TrainingGraph:
    ir: GraphIR
    graph: tf.Graph                       # shapes, dtypes; a measuring step of its own
    variables: dict[str, Variable]
    writers: dict[str, list[str]]         # variable -> writer op names
    readers: dict[str, list[str]]         # variable -> reader op names
    gradients: dict[str, Gradient]        # trainable variable -> gradient
    shard_consts: list[tuple[str, str]] = field(default_factory=list)  # (num, index)
    queue_runners: list = field(default_factory=list)   # queues.RunnerDef
    # variable the script accumulates gradients in -> the variable they train
    accumulators: dict[str, str] = field(default_factory=dict)
    user_graph: tf.Graph | None = None   # the graph given, where `graph` lowers its conds
    time_major: dict[str, int] = field(default_factory=dict)   # placeholder -> batch axis
    batch_feeds: dict = field(default_factory=dict)     # config's (graph/variance.py)

    # -- tensor facts -----------------------------------------------------
    def tensor(self, ref: TensorRef) -> tf.Tensor:
        return self.graph.get_operation_by_name(ref.node).outputs[ref.index]

    def owned(self, var: str) -> list[str]:
        """`var` and the state it owns (slots, moving averages, beta powers)."""
        return [var] + [v.name for v in self.variables.values() if v.owner == var]

    def reads(self, var: str) -> list[str]:
        """The ops whose completion ends every read of `var` in a step. A
        resource variable's reads are its readers (ReadVariableOp is a
        snapshot: a later write copies the buffer first). A reference
        variable's `read` Identity aliases the variable's buffer, which
        Assign, AssignAdd and AssignSub write in place; so every op that
        dereferences what a pass-through read hands on is a read too."""
        readers = list(self.readers.get(var, ()))
        if self.ir.node(var).op == "VarHandleOp":
            return readers
        out, todo = [], readers
        while todo:
            r = todo.pop()
            if r in out:
                continue
            out.append(r)
            if self.ir.node(r).op in ("Identity", *rules.REF_PASSTHROUGH):
                todo.extend(sorted(c for c, _ in self.ir.consumers.get(TensorRef(r, 0), ())))
        return out

    @cached_property
    def gradient_tensors(self) -> frozenset[TensorRef]:
        """Every autodiff output the transformation aggregates."""
        return frozenset(r for g in self.gradients.values()
                         for r in (g.values, g.indices) if r is not None)

    @cached_property
    def before_gradients(self) -> frozenset[str]:
        """Nodes the gradients come from: the forward and backward passes."""
        return frozenset(self.ir.ancestors({r.node for r in self.gradient_tensors}))

    @cached_property
    def after_gradients(self) -> frozenset[str]:
        """Nodes the gradients feed (data or control): the training step's
        update side (writers here are training writers, not initializers)."""
        return frozenset(self.ir.descendants({r.node for r in self.gradient_tensors}))

    @cached_property
    def function_writes(self) -> list[tuple[str, str]]:
        """(variable, functional op) where the op's function writes the
        variable's handle (graph/branches.py), read once per graph."""
        return branches.function_writes(self)

    @cached_property
    def variant(self) -> variance.Variant:
        """User nodes whose outputs differ between replicas (see analysis)."""
        return variance.replica_variant(self)

    @cached_property
    def fixed_batches(self) -> frozenset[str]:
        """Placeholders of a fixed first dimension d that the graph shows to
        be a batch (graph/batch.py): fed N times d rows, as a script built
        for one replica's batch feeds the global batch, each replica gets
        its own d rows (runtime/fetches.py), so they differ by replica."""
        from .batch import BATCH, kinds
        shapes = {node.name: self.tensor(TensorRef(node.name, 0)).shape for node in self.ir.nodes
                  if node.op in ("Placeholder", "PlaceholderWithDefault")}
        if not any(s.rank and compat.dim(s, 0) is not None for s in shapes.values()):
            return frozenset()
        return frozenset(n for n, (kind, _) in kinds(self, fixed=True).items()
                         if kind == BATCH and compat.dim(shapes[n], 0) is not None)

    @cached_property
    def rows_alike(self) -> frozenset[str]:
        """Variables whose sparse gradient has the same indices on every
        replica (a lookup of positions, not of the batch's ids): row i of
        one device's gradient is the sum of row i of the replicas', so the
        aggregation sums the values row for row and keeps the indices
        (concatenating them would hand the update every row N times, which
        a use that sees rows one by one, such as Keras 3's Adam squaring
        the values, tells apart)."""
        return frozenset(v for v, g in self.gradients.items()
                         if g.sparse and g.indices.node not in self.variant)

    @cached_property
    def rows_unique(self) -> frozenset[str]:
        """Variables whose sparse gradient holds each row once on one device:
        its indices are a Unique's ids (through Identity, Reshape, Cast), as
        embedding_lookup_sparse gathers each distinct id once, or the
        distinct ids a sparse segment reduction's gradient gives. The replicas'
        rows of such a gradient repeat the ids they share, which one device's
        rows sum; a use that sees rows one by one (a global norm's L2Loss,
        Keras 3's Adagrad squaring them) tells the two apart, so the job's
        rows are summed by id before any use (transforms/aggregate.py)."""
        return frozenset(v for v, g in self.gradients.items()
                         if g.sparse and v not in self.rows_alike and
                         distinct.holds_each_id_once(self, g.indices))

    @property
    def trainable(self) -> list[str]:
        return [v.name for v in self.variables.values() if v.trainable]

    def variable_of_handle(self, ref: TensorRef) -> str | None:
        """The variable whose handle (or reference) `ref` carries, if any.

        Follows pass-through ops and, for reference variables, writers whose
        output is the reference they wrote through.
        """
        start, seen = ref, set()
        while ref.node not in seen:
            seen.add(ref.node)
            node = self.ir.get(ref.node)
            if node is None:
                return None
            if node.op in rules.VARIABLE_OPS:
                if node.name not in self.variables:
                    return None
                dtype = self.tensor(start).dtype
                return node.name if dtype == tf.resource or compat.is_ref_dtype(dtype) else None
            if node.input and (node.op in rules.HANDLE_PASSTHROUGH or
                               node.op in rules.REF_PASSTHROUGH or
                               (compat.outputs_ref(node.op) and ref.index == 0)):
                ref = self.ir.data_inputs(node.name)[0]
                continue
            return None
        return None


def load(source, batch_norm: str = "per_replica", batch_feeds=None) -> TrainingGraph:
    """A TrainingGraph of a tf.Graph, a MetaGraphDef or a file path (under
    `batch_norm: synchronized` fused batch normalization lowered; placeholders
    fed time-major, by config `batch_feeds` or found, fed by batch-major twins)."""
    if isinstance(source, (str, os.PathLike)):
        source = _read_meta_graph(os.fspath(source))
    if isinstance(source, tf.compat.v1.MetaGraphDef):
        graph = tf.Graph()
        with graph.as_default():
            cond_lowering.imported(source)
        source = graph
    if not isinstance(source, tf.Graph):
        raise GraphError(f"cannot parallelize a {type(source).__name__}; pass a tf.Graph, a "
                         "tf.compat.v1.MetaGraphDef or the path of an exported .meta file")
    norms = fused_norm.edit(source) if batch_norm == "synchronized" else None
    major = time_major.axes(source, batch_feeds or {})
    tg = _from_graph(cond_lowering.lowered(
        source, generators.edit(source), norms, time_major.edit(major),
        also=(fused_norm.training_ifs,) if norms is not None else ()), batch_feeds or {})
    tg.user_graph, tg.time_major = source, major
    input_calls.note(tg)          # gradients of the inputs: not losses (a copy notes them)
    return tg


def _read_meta_graph(path: str):
    if not os.path.exists(path):
        raise GraphError(f"meta graph file {path!r} does not exist")
    meta = tf.compat.v1.MetaGraphDef()
    with open(path, "rb") as f:
        data = f.read()
    try:
        meta.ParseFromString(data)
    except Exception:  # text format
        from google.protobuf import text_format
        text_format.Merge(data.decode(), meta)
    return meta


def _from_graph(graph: tf.Graph, feeds: dict) -> TrainingGraph:
    ir = GraphIR(graph.as_graph_def())
    variables = _variables(graph, ir)
    tg = TrainingGraph(ir, graph, variables, {}, {}, {}, user_graph=graph, batch_feeds=feeds)
    tg.writers, tg.readers = _resource_uses(tg)
    autodiff = _autodiff(ir)
    tg.gradients = {v: g for v in tg.trainable
                    if (g := _find_gradient(tg, v, autodiff)) is not None}
    for acc in tg.accumulators:         # replica-local state, not the trained variable's
        tg.variables[acc] = Variable(**{**tg.variables[acc].__dict__, "owner": None})
    branches.check_updates(tg)
    if not tg.gradients and not accumulation.fed_updates(tg, autodiff):
        raise GraphError(f"{NO_UPDATE}: {rules.why_no_update(ir)}")
    tg.shard_consts = _shard_consts(ir)
    tg.queue_runners = [queues.RunnerDef.of(qr) for qr in
                        graph.get_collection(tf.compat.v1.GraphKeys.QUEUE_RUNNERS)]
    return tg


def _variables(graph: tf.Graph, ir: GraphIR) -> dict[str, Variable]:
    keys = (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
    pyvars = {v.op.name: v for key in keys for v in graph.get_collection(key)}
    trainable = {v.op.name for v in graph.get_collection(
        tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)}
    out = {}
    for node in ir.nodes:
        if node.op not in rules.VARIABLE_OPS:
            continue
        op = graph.get_operation_by_name(node.name)
        py = pyvars.get(node.name)
        static = tf.TensorShape(op.get_attr("shape"))
        shape = tuple(static.as_list()) if static.rank is not None else ()
        out[node.name] = Variable(
            name=node.name, dtype=tf.as_dtype(op.get_attr("dtype")), shape=shape,
            trainable=node.name in trainable,
            initializer=None if py is None else   # (init_from_checkpoint's is a tensor)
            getattr(py.initializer, "op", py.initializer).name,
            known=static.is_fully_defined())
    for name, var in list(out.items()):
        if not var.trainable:
            owner = _owner(ir.node(name), trainable)
            out[name] = Variable(**{**var.__dict__, "owner": owner})
    return out


def _owner(node, trainable: set[str]) -> str | None:
    """The trainable variable a state variable was created for.

    TensorFlow creates slots, moving averages and beta powers under
    `colocate_with(var)`, which records `loc:@var`; the name prefix
    `var/...` is the fallback.
    """
    if "_class" in node.attr:
        for loc in node.attr["_class"].list.s:
            target = loc.decode().removeprefix("loc:@")
            if target in trainable and target != node.name:
                return target
    return max((t for t in trainable if node.name.startswith(t + "/")), key=len, default=None)


def _resource_uses(tg: TrainingGraph):
    writers: dict[str, list[str]] = defaultdict(list)
    readers: dict[str, list[str]] = defaultdict(list)
    for node in tg.ir.nodes:
        for pos, ref in enumerate(tg.ir.data_inputs(node.name)):
            var = tg.variable_of_handle(ref)
            if var is None:
                continue
            if tg.ir.node(var).op == "VarHandleOp":
                use = rules.classify_resource_use(node.op, node.name, var)
            else:
                use = rules.classify_ref_use(node.op, pos)
            if use == "write":
                writers[var].append(node.name)
            elif use == "read":
                readers[var].append(node.name)
    return dict(writers), dict(readers)


def _autodiff(ir: GraphIR) -> frozenset[str]:
    """Ops of the autodiff: those in its scopes, and the sums a GradientTape
    adds outside them where a variable is read more than once: a ConcatV2
    along axis 0 of autodiff rows (two lookups of one table: their values,
    and their indices), an AddN of autodiff tensors (an IndexedSlices among
    them made dense first by an UnsortedSegmentSum of its values and
    indices: a lookup plus a regularizer on the whole table); and the
    step's own sums of gradients (accumulation.sums)."""
    out = {n.name for n in ir.nodes if rules.is_autodiff(n.name)}
    for name in ir.topo_order:
        node = ir.node(name)
        if name in out or node.op not in ("AddN", "ConcatV2"):
            continue
        ins = ir.data_inputs(name)
        if node.op == "ConcatV2":
            axis = ir.node(ins[-1].node)
            if axis.op == "Const" and tf.make_ndarray(axis.attr["value"].tensor) == 0 \
                    and all(r.node in out for r in ins[:-1]):
                out.add(name)
            continue
        dense = [r.node for r in ins if r.node not in out and
                 ir.node(r.node).op == "UnsortedSegmentSum" and
                 all(i.node in out for i in ir.data_inputs(r.node)[:2])]
        if all(r.node in out or r.node in dense for r in ins):
            out.update([name, *dense])
    return frozenset(out | accumulation.sums(ir, out))


def _find_gradient(tg: TrainingGraph, var: str, autodiff: frozenset[str]) -> Gradient | None:
    """Walk back from the writers of `var` and its state to the autodiff output
    (`autodiff`: `_autodiff`'s ops). Where `var`'s writers (or its slots')
    reach it only through reads of variables the script accumulates the gradient in
    (graph/accumulation.py), such a read is the gradient (aggregated when
    the update reads it). The walk follows only tensors that can carry the
    gradient: float tensors shaped like the variable (or its rows) and
    rank-1 integer tensors (IndexedSlices indices). The nearest autodiff
    tensors of each kind win; ties, and several updates a step, are errors."""
    v = tg.variables[var]
    reads = accumulation.reader(tg, var, lambda refs: _walk(tg, refs, v, autodiff)["values"])
    for states in ([var], tg.owned(var)):   # its own writers, then its slots' (Adam's moments)
        starts = [ref for state in states for w in tg.writers.get(state, ())
                  for ref in tg.ir.data_inputs(w)]
        found = _walk(tg, starts, v, autodiff, reads)["values"]
        if found and not any(ref.node in autodiff for ref in found):
            values = _nearest(found, var, "accumulated gradient")
            tg.accumulators[accumulation.read_variable(tg, values)] = var
            return Gradient(var, values)
    found = _walk(tg, starts, v, autodiff)
    updates = [w for w in tg.writers.get(var, ()) if len(found["values"]) > 1 and
               autodiff & tg.ir.ancestors([w])]
    if len(updates) > 1:
        raise GraphError(f"the graph updates variable {var!r} {len(updates)} times "
                         f"({updates[:3]}), each by a gradient of its own (an optimizer applied "
                         "several times in a step, as a critic trained several times a step, "
                         "or two train ops that both train it); the replicas aggregate one "
                         "gradient per variable and step: run one step per update, or sum "
                         "the gradients into one update")
    if len(found["values"]) > 1:
        raise GraphError(f"the update of variable {var!r} combines gradients computed apart, "
                         f"{sorted(map(str, found['values']))}, other than by a sum: add them "
                         "(each times a constant), or take one loss under one tape")
    values = _nearest(found["values"], var, "gradient")
    if values is None:
        return None
    indices = _nearest(found["indices"], var, "gradient indices")
    return Gradient(var, values, indices)


# a cond's routing of a gradient into a branch (named after the gradient, so
# in the autodiff's scope): the gradient is what it routes, which both
# branches then read aggregated (Keras 3's gradient accumulation: add to the
# accumulators in one branch, update with them in the other)
_ROUTES = ("Switch", "RefSwitch")


def _walk(tg: TrainingGraph, starts, v: Variable, autodiff, ends=None) -> dict:
    """{"values": {ref: distance}, "indices": {...}}: the autodiff tensors
    (or those `ends(ref)` accepts) nearest back from `starts`."""
    found = {"values": {}, "indices": {}}
    seen = set()
    frontier = [(ref, 0) for ref in starts]
    while frontier:
        nxt = []
        for ref, dist in frontier:
            if ref in seen:
                continue
            seen.add(ref)
            kind = _grad_kind(tg.tensor(ref), v)
            if kind is None:
                continue
            if ref.node in autodiff and tg.ir.node(ref.node).op not in _ROUTES or \
                    kind == "values" and ends is not None and ends(ref):
                found[kind].setdefault(ref, dist)
                continue
            inputs = tg.ir.data_inputs(ref.node)
            used = rules.inputs_of_output(tg.ir.node(ref.node).op, ref.index, len(inputs))
            nxt.extend((inputs[i], dist + 1) for i in used)
        frontier = nxt
    return found


def _grad_kind(t: tf.Tensor, v: Variable) -> str | None:
    if t.dtype.base_dtype == v.dtype.base_dtype:
        shape = t.shape
        if shape.is_compatible_with(v.shape):
            return "values"
        if shape.rank == len(v.shape) and len(v.shape) >= 1 and \
                shape[1:].is_compatible_with(v.shape[1:]):
            return "values"
        return None
    if t.dtype in (tf.int32, tf.int64) and t.shape.rank == 1:
        return "indices"
    return None


def _nearest(found: dict[TensorRef, int], var: str, what: str) -> TensorRef | None:
    if not found:
        return None
    best = min(found.values())
    winners = sorted(str(r) for r, d in found.items() if d == best)
    if len(winners) > 1:
        raise GraphError(
            f"cannot tell which of {winners} is the {what} of variable {var!r}: "
            "each is equally close to its update ops")
    return next(r for r, d in found.items() if d == best)


def _shard_consts(ir: GraphIR) -> list[tuple[str, str]]:
    """Pairs of (num_shards, index) Const nodes that `pn.shard` created."""
    parts = (node.name.rpartition("/") for node in ir.nodes)
    return [(f"{scope}/{leaf}", scope + "/index") for scope, _, leaf in parts
            if leaf == "num_shards" and scope.split("/")[-1].startswith(SHARD_SCOPE)]
