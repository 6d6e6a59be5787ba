"""Batch: which placeholders a feed fills with a batch of examples (split
over the replicas) and which with a value every replica needs whole (a
keep probability per layer, a class-weight vector, a mask of the model).

A placeholder's first dimension is the batch when it meets the batch
dimension of the data: the first dimensions of the tensors an op lines up
(the operands of an element-wise op of equal rank, the inputs of a
concatenation along another axis, logits and labels of a loss) are one
dimension. Following the first dimension of every tensor forward from the
placeholders and the input pipeline's batches (a rule per op type: kept,
joined, taken from an input, or gone), a placeholder is
- `batch` when its first dimension joins another placeholder's or the
  input pipeline's, or goes through a layer (a product with weights, a
  convolution) and is summed or averaged away (a loss over examples);
- `whole` when it fills an input pipeline (`Dataset.from_tensor_slices` of
  placeholders an initializable iterator is fed with: the pipeline, sharded
  by `pn.shard`, gives each replica its examples), or every use of its
  first dimension (none summing it away) picks entries by
  constants (`keep[0]`, an unstack) or by other data (a gather from it), or
  broadcasts it along a later axis of a tensor of higher rank (a weight per
  class times the logits), or is only written into variables (fed updates);
- `unknown` otherwise (an op this table does not know, say): the runner
  splits it, as a batch, and says so.
Only placeholders of rank 1 or more whose first dimension is unknown are
classified; a fixed one is the runner's business (parallax_ng/runtime/fetches.py).

Requires: a TrainingGraph. Guarantees: `kinds(tg)` maps each such
placeholder to (kind, reason); a pure function of the graph, the same on
every worker. Gradient ops (which mirror the forward pass) are not read.
"""
from __future__ import annotations

import re

import tensorflow as tf

from .. import compat
from . import rules, selections
from .ir import TensorRef
from .rows import reading
from .rules import CTC, ELEMENTWISE, FIRST, LOSSES, REDUCTIONS, SPARSE_LAYERS
from .shape_vectors import const, counted, leading, shape_head, shape_of
from .tracing import INPUT

BATCH, WHOLE, UNKNOWN = "batch", "whole", "unknown"
TF2_ARGUMENT = INPUT.format("")           # placeholders of a traced TF2 step's arguments

# inputs that read a tensor's shape only: no use of its first dimension
SHAPE_ONLY = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastArgs",
                        "BroadcastGradientArgs"})
_DATASET = re.compile(r"Dataset(V\d+)?$")     # TensorSliceDataset, BatchDatasetV2, ...
SOURCES = frozenset({"IteratorGetNext", "IteratorGetNextSync", "QueueDequeueManyV2",
                     "QueueDequeueUpToV2", "QueueDequeueMany", "QueueDequeueUpTo"})


class _Dims:
    """Union-find over first dimensions, each class with what happened to it."""

    def __init__(self):
        self.parent: dict[int, int] = {}
        self.facts: dict[int, set] = {}
        self.placeholders: dict[int, set] = {}

    def new(self, placeholder: str | None = None, fact: str | None = None) -> int:
        d = len(self.parent)
        self.parent[d] = d
        self.facts[d] = {fact} if fact else set()
        self.placeholders[d] = {placeholder} if placeholder else set()
        return d

    def find(self, d: int) -> int:
        while self.parent[d] != d:
            self.parent[d] = self.parent[self.parent[d]]
            d = self.parent[d]
        return d

    def join(self, dims) -> int | None:
        roots = list(dict.fromkeys(self.find(d) for d in dims if d is not None))
        if not roots:
            return None
        first = roots[0]
        for r in roots[1:]:
            self.parent[r] = first
            self.facts[first] |= self.facts.pop(r)
            self.placeholders[first] |= self.placeholders.pop(r)
        if len(roots) > 1:
            self.facts[first].add("joined")
        return first

    def note(self, d: int | None, fact: str) -> None:
        if d is not None:
            self.facts[self.find(d)].add(fact)


def split_as_parts(graph: tf.Graph) -> bool:
    """Whether a split of the batch's rows into equal parts may be read as
    micro-batches (graph/rows.py `reading(parts=True)`): no TF1 placeholder
    of a batch's shape (rank 1 or more, its first dimension open) feeds
    `graph`. `kinds` gives such a placeholder whole to every replica where
    its rows are only picked by position (a split), so a part there is one
    device's part, not examples of a replica's rows."""
    return not any(op.type in ("Placeholder", "PlaceholderWithDefault") and
                   not op.name.startswith(TF2_ARGUMENT) and op.outputs[0].shape.rank and
                   compat.dim(op.outputs[0].shape, 0) is None
                   for op in graph.get_operations())


def kinds(tg, fixed: bool = False) -> dict[str, tuple[str, str]]:
    """{placeholder: (batch | whole | unknown, why)} for every placeholder
    of rank 1 or more whose first dimension is unknown (with `fixed`, every
    placeholder of rank 1 or more: the runner splits one of a fixed first
    dimension d that is fed N times d rows)."""
    dims = _Dims()
    first: dict[TensorRef, int | None] = {}
    asked = {}
    for name in tg.ir.topo_order:
        node = tg.ir.node(name)
        if rules.is_autodiff(name):
            continue
        if node.op in ("Placeholder", "PlaceholderWithDefault"):
            shape = tg.tensor(TensorRef(name, 0)).shape
            if shape.rank:
                unknown = compat.dim(shape, 0) is None
                first[TensorRef(name, 0)] = dims.new(name if unknown or fixed else None,
                                                     None if unknown else "fixed")
                if unknown or fixed:
                    asked[name] = first[TensorRef(name, 0)]
            continue
        if node.op in SOURCES:
            data = dims.new(fact="data")
            for k in range(len(tg.graph.get_operation_by_name(name).outputs)):
                first[TensorRef(name, k)] = data
            continue
        _rule(tg, name, node, first, dims)
    out = {}
    for name, d in asked.items():
        if name.startswith(TF2_ARGUMENT):
            out[name] = (BATCH, "it is an argument of a TF2 step, a batch by pn.function's "
                                "contract")
            continue
        if not tg.ir.node_consumers.get(name):
            out[name] = (WHOLE, "nothing in the graph reads it")
            continue
        root = dims.find(d)
        facts, others = dims.facts[root], dims.placeholders[root] - {name}
        if "data" in facts or others:
            out[name] = (BATCH, "its first dimension meets the input data's" + (
                f" (with {sorted(others)[0]!r})" if others else ""))
        elif "reduced" in facts and "modeled" in facts:
            out[name] = (BATCH, "its rows go through the model's layers and are summed "
                                "or averaged over, as a loss over examples is")
        elif facts - {"fixed"} == {"dataset"}:
            out[name] = (WHOLE, "it fills an input pipeline (tf.data), which gives each "
                                "replica its examples (pn.shard)")
        elif facts - {"fixed"} == {"written"}:
            out[name] = (WHOLE, "it is written into a variable (an update the script "
                                "feeds), which every replica holds whole")
        elif facts & {"indexed", "broadcast"} and not facts & {"unknown", "kept", "reduced"}:
            out[name] = (WHOLE, "its entries are picked by index, or broadcast along a "
                                "later axis, not lined up with examples")
        else:
            out[name] = (UNKNOWN, "the graph does not show whether its first dimension "
                                  "is the batch")
    batch = [n for n, (kind, _) in out.items() if kind == BATCH] + \
        [op for op in tg.ir.topo_order if tg.ir.node(op).op in SOURCES]
    unknown = [n for n, (kind, _) in out.items() if kind == UNKNOWN]
    for name in unknown:        # as a first dimension joined with another placeholder's
        if _meets_batch(tg.graph, name, batch + [n for n in unknown if n != name],
                        tg.ir.descendants({name}, data_only=True)):
            out[name] = (BATCH, "its rows meet the batch's in a loss or an element-wise op "
                                "(read through loops over time and transposes)")
    return out


def _meets_batch(graph: tf.Graph, name: str, batch: list, reached: set) -> bool:
    """Whether placeholder `name`'s rows, as graph/rows.py follows them
    (through a time-major loop's transposes and TensorArrays, which the
    rules here do not), line up with the rows of `batch` (placeholders
    and sources of the batch) on one axis of a loss (logits and labels) or
    of an element-wise op of operands of one rank (a mask of lengths
    transposed to [time, batch] times the losses of time-major data).
    Only the ops `reached` from it by data edges can meet with it."""
    return bool(batch) and len(reached) > 1 and \
        _meet(graph, reading([name], graph), reading(batch, graph), within=reached)


def _meet(graph: tf.Graph, mine, theirs, depth: int = 0, within=None) -> bool:
    """`_meets_batch` in `graph` (its ops `within`, where given) and in the
    bodies of its functional ops (a TF2 while loop's body: the placeholder
    read only there)."""
    for op in graph.get_operations():
        if rules.is_autodiff(op.name) or within is not None and op.name not in within:
            continue
        if depth < 4 and any(_meet(a.graph, a, b, depth + 1) for a, b in
                             zip(mine.bodies(op), theirs.bodies(op))):
            return True
        if len(op.inputs) < 2 or not (op.type in LOSSES or op.type in ELEMENTWISE and
                                      len({x.shape.rank for x in op.inputs}) == 1):
            continue
        ours = {x.name: a for x in op.inputs if (a := mine.axis(x)) is not None}
        if ours and any(theirs.axis(x) in ours.values() for x in op.inputs
                        if x.name not in ours):
            return True
    return False


def _where_rows(tg, name: str, first: dict) -> int | None:
    """The first dimension of the dense tensor x whose rows sparse layer
    `name` gives, where its rows are column 0 of `tf.where(x)` (a
    SparseTensor made in the graph: `tf.sparse.from_dense`)."""
    source = rules.row_source(tg.graph.get_operation_by_name(name))
    if source is None or source.op.type == "Placeholder":
        return None
    return first.get(TensorRef(source.op.name, source.value_index))


def _rule(tg, name: str, node, first: dict, dims: _Dims) -> None:
    """The first dimension of `name`'s outputs from its inputs' (rule table
    by op type; an op it does not know takes its inputs' as unknown uses)."""
    ins = [(ref, first.get(ref)) for ref in tg.ir.data_inputs(name)]
    carried = [(ref, d) for ref, d in ins if d is not None]
    op = tg.graph.get_operation_by_name(name)
    outs = [TensorRef(name, k) for k in range(len(op.outputs))]
    if node.op in SPARSE_LAYERS:     # a sparse batch's rows through a layer (fed as a
        rows = dims.new(fact="modeled")     # SparseTensorValue: split by rows), or a dense
        first[outs[0]] = dims.join([rows, _where_rows(tg, name, first)])  # tensor's made sparse
        return
    if not carried and node.op not in ("Reshape", "SparseToDense") or node.op in SHAPE_ONLY:
        return
    if _DATASET.search(node.op):         # a tf.data dataset made of it (not any variant:
        for _, d in carried:            # a While's gradient accumulators, a TensorList)
            dims.note(d, "dataset")
        return
    kind = node.op
    if rules.writes_state(kind):
        for _, d in carried:        # a value written into a variable (an update fed from
            dims.note(d, "written")     # outside, a gradient summed in Python): whole
        return
    if kind == "IdentityN":         # each input passed on (tf.custom_gradient's op)
        first.update({out: d for out, (_, d) in zip(outs, ins) if d is not None})
        return
    if kind in CTC and len(ins) > CTC[kind][0]:    # a row per sequence, its length's
        rows = [ins[CTC[kind][0]][1], _untransposed(tg, ins[0][0], first)]
        dims.note(rows[0], "modeled")
        first[outs[CTC[kind][1]]] = dims.join(rows)
        return
    if kind in ELEMENTWISE or kind in LOSSES:
        rank = _rank(tg, outs[0]) if outs else None
        lined = [d for ref, d in carried if kind in LOSSES or _lines_up(tg, ref, rank)]
        if kind in LOSSES:          # labels lined up with the model's predictions
            for d in lined:
                dims.note(d, "modeled")
        if kind in ("Select",) and len(ins) == 3 and _rank(tg, ins[0][0]) == 1:
            lined = [d for _, d in carried]        # a condition per row
        joined = dims.join(lined)
        for ref, d in carried:
            if d not in lined:      # of lower rank: its first dimension lines up with
                low = kind not in LOSSES and (_rank(tg, ref) or 0) < (rank or 0)
                dims.note(d, "broadcast" if low else "unknown")    # a later axis's
        for out in outs:
            first[out] = joined
        return
    if kind == "MatMul" and node.attr["transpose_a"].b and not node.attr["transpose_b"].b:
        dims.note(dims.join([d for _, d in ins]), "reduced")    # a gram matrix: each
        return                                                   # row's outer product summed
    if kind in ("ArgMax", "ArgMin", "TopKV2") and len(ins) > 1:
        rank = _rank(tg, ins[0][0])     # an index among the rows (the last axis of TopK's)
        axis = const(tg, ins[1][0]) if kind != "TopKV2" else -1
        if isinstance(axis, int) and rank and axis % rank == 0:
            dims.note(ins[0][1], "reduced")
            return
    if kind in FIRST:
        lead = ins[0][1] if ins else None
        if kind == "MatMul" and node.attr["transpose_a"].b:
            lead = None
        for ref, d in carried:
            if d is not lead:
                dims.note(d, "unknown")
        dims.note(lead, "modeled")      # rows through a layer (weights, a convolution)
        for out in outs[:1] if kind.startswith("FusedBatchNorm") else outs:
            first[out] = lead
        return
    if kind == "L2Loss":        # tf.nn.l2_loss: a sum over every axis
        dims.note(ins[0][1], "reduced")
        return
    if kind in REDUCTIONS:
        axes = const(tg, ins[1][0]) if len(ins) > 1 else None
        rank = _rank(tg, ins[0][0])
        if axes is None or rank is None:
            dims.note(ins[0][1], "unknown")
            return
        axes = {a % rank for a in (axes if isinstance(axes, list) else [axes])}
        if 0 in axes:
            dims.note(ins[0][1], "reduced")
        elif ins[0][1] is not None:
            for out in outs:
                first[out] = ins[0][1]
        return
    _index_rules(tg, name, node, ins, outs, first, dims)


def _index_rules(tg, name, node, ins, outs, first, dims) -> None:
    """Ops that pick along the first dimension, move it, or reshape."""
    kind = node.op
    if kind == "GatherV2" and node.attr["batch_dims"].i > 0 and len(ins) > 1:
        first[outs[0]] = dims.join([ins[0][1], ins[1][1]])   # each row's picks from its row
        return
    if kind in ("GatherV2", "Gather", "ResourceGather"):
        axis = const(tg, ins[2][0]) if kind == "GatherV2" and len(ins) > 2 else 0
        if axis != 0:
            _unknown(ins, dims)
            return
        mask = selections.mask_of(tg.tensor(ins[1][0])) if len(ins) > 1 else None
        if mask is not None and mask.shape.rank == 1:   # the rows a mask of rows picks
            # (tf.boolean_mask, which flattens both): one dimension
            picked = dims.join([ins[0][1], first.get(TensorRef(mask.op.name, mask.value_index))])
            for out in outs:
                first[out] = picked
            return
        dims.note(ins[0][1], "indexed")            # rows picked from the table
        for out in outs:
            first[out] = ins[1][1] if len(ins) > 1 else None
        if len(ins) > 1 and ins[1][1] is not None:
            dims.note(ins[1][1], "kept")
        return
    if kind == "SparseToDense":     # of a shape (a feature column's tf.shape(x)): x's rows
        head = shape_head(tg, ins[1][0])
        first[outs[0]] = first.get(head) if head else None
        return
    if kind == "GatherNd":      # an element per row of the indices
        if _rank(tg, ins[1][0]) == 2 and counted(tg, ins[1][0]):
            joined = dims.join([ins[0][1], ins[1][1]])  # tf.stack([tf.range(n), a], 1):
            first[outs[0]] = joined                     # each row picks from its row
            return
        dims.note(ins[0][1], "unknown")     # other coordinates: rows of anything
        first[outs[0]] = ins[1][1] if (_rank(tg, ins[1][0]) or 0) >= 2 else None
        return
    if kind == "StridedSlice":
        begin, end, strides = (const(tg, ins[k][0]) for k in (1, 2, 3))
        masks = {k: node.attr[k].i for k in ("begin_mask", "end_mask", "shrink_axis_mask",
                                            "ellipsis_mask", "new_axis_mask")}
        if masks["ellipsis_mask"] & 1 or masks["new_axis_mask"] & 1 or strides is None:
            _unknown(ins, dims)
            return
        whole = masks["begin_mask"] & 1 and masks["end_mask"] & 1 and strides[0] == 1
        if whole and not masks["shrink_axis_mask"] & 1:
            dims.note(ins[0][1], "kept")
            for out in outs:
                first[out] = ins[0][1]
            return
        dims.note(ins[0][1], "indexed" if begin is not None and end is not None else "unknown")
        return
    if kind in ("Unpack", "Split", "SplitV"):
        axis = node.attr["axis"].i if kind == "Unpack" else const(
            tg, ins[0 if kind == "Split" else 2][0])
        data = ins[1][1] if kind == "Split" else ins[0][1]
        if axis == 0:
            dims.note(data, "indexed")
            return
        for out in outs:
            first[out] = data
        return
    if kind in ("ConcatV2", "Pack"):
        values = ins[:-1] if kind == "ConcatV2" else ins
        axis = const(tg, ins[-1][0]) if kind == "ConcatV2" else node.attr["axis"].i
        if axis is None or axis == 0 or (kind == "ConcatV2" and axis < 0 and
                                         _rank(tg, outs[0]) == -axis):
            _unknown(ins, dims)
            return
        joined = dims.join([d for _, d in values])
        for out in outs:
            first[out] = joined
        return
    if kind in ("Reshape", "ExpandDims", "Squeeze", "Transpose", "Tile", "OneHot"):
        _moves(tg, node, ins, outs, first, dims)
        return
    if kind == "DynamicPartition" and len(ins) == 2:   # a part per row: the parts' rows are
        joined = dims.join([d for _, d in ins])         # the data's and the partitions'
        for out in outs:
            first[out] = joined
        return
    _unknown(ins, dims)


def _moves(tg, node, ins, outs, first, dims) -> None:
    """Reshape to [-1, ...], ExpandDims/Squeeze off axis 0, a transpose that
    keeps axis 0, a tile that repeats it once, one-hot of ids: kept."""
    kind, data = node.op, ins[0][1]
    keep = False
    if kind == "Reshape":
        shaped, rows = shape_of(tg, ins[1][0], first)
        if shaped is not None:   # to a batch tensor's shape (a loss's values, as labels
            dims.note(data, "kept")          # were), or to its rows by -1
            for out in outs:
                first[out] = dims.join([data, shaped]) if rows else shaped
            return
        keep = leading(tg, ins[1][0]) == -1
    elif kind == "ExpandDims":
        axis = const(tg, ins[1][0])
        keep = axis is not None and axis != 0 and axis != -(_rank(tg, outs[0]) or 0)
    elif kind == "Squeeze":
        axes = list(node.attr["squeeze_dims"].list.i)
        keep = bool(axes) and 0 not in axes and all(a > 0 for a in axes)
    elif kind == "Transpose":
        perm = const(tg, ins[1][0])
        keep = isinstance(perm, list) and bool(perm) and perm[0] == 0
    elif kind == "Tile":
        multiples = const(tg, ins[1][0])
        keep = isinstance(multiples, list) and bool(multiples) and multiples[0] == 1
    elif kind == "OneHot":
        keep = node.attr["axis"].i != 0
    if not keep:
        _unknown(ins, dims)
        return
    dims.note(data, "kept")
    for out in outs:
        first[out] = data


def _unknown(ins, dims) -> None:
    for _, d in ins:
        dims.note(d, "unknown")


def _rank(tg, ref: TensorRef) -> int | None:
    shape = tg.tensor(ref).shape
    return shape.rank


def _lines_up(tg, ref: TensorRef, rank: int | None) -> bool:
    """Whether input `ref` of an element-wise op lines its first dimension
    up with the output's (equal rank, and not a broadcast 1). Where a rank
    is unknown (an operand fed without a shape, as tutorials feed a keep
    probability), the operand is taken to line up, as graph/rows.py reads it."""
    shape = tg.tensor(ref).shape
    return (None in (rank, shape.rank) or shape.rank == rank) and shape.rank != 0 and \
        compat.dim(shape, 0) != 1


def _untransposed(tg, ref: TensorRef, first: dict):
    """The first dimension of the batch-major tensor that time-major `ref`
    transposes (perm [1, 0, ...]: CTC's logits), else None."""
    node = tg.ir.node(ref.node)
    if node.op != "Transpose":
        return None
    ins = tg.ir.data_inputs(ref.node)
    perm = const(tg, ins[1])
    return first.get(ins[0]) if isinstance(perm, list) and perm[1:2] == [0] else None
