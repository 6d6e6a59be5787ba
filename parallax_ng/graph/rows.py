"""The batch's axis of a tensor: which of its dimensions, if any, holds the batch's
examples (`batch_axis`), and whether it is the first (`batch_rows`), read through the
ops a step is made of: transposes, stacks, scatters into a tensor, the elements of
TensorArrays and TensorLists (recurrent layers run time-major), while loops in
TensorFlow's three forms and called functions (graph/row_loops.py), a traced step's
gradients of its inputs (graph/recorders.py), rows reordered (graph/orders.py), the
places a mask of rows is true (tf.where). Requires: tf.Tensors of a graph and the names
of its data sources (the ops whose first dimension is the batch). Guarantees: reads the
graph only; None where the ops do not show the axis, never a guess (a reshape that keeps
its first dimension free keeps the batch there). Read by graph/forms.py."""
from __future__ import annotations

import sys

import numpy as np
import tensorflow as tf

from .. import compat
from .orders import permutation
from .recorders import input_rows
from .row_loops import PASS, Flow
from .rules import (CTC, ELEMENTWISE, FIRST, LOSSES, REDUCTIONS, SHAPED, SPARSE_LAYERS,
                    TRANSPOSED_CONVOLUTIONS, slice_axis, sparse_batch, sparse_rows)
from .shape_vectors import restored_lead


def batch_rows(t: tf.Tensor, sources) -> bool:
    """Whether t's first dimension is the batch (`batch_axis` 0). `sources`:
    the data sources' names, or a `reading` that answers several questions."""
    return batch_axis(t, sources) == 0


def batch_axis(t: tf.Tensor, sources) -> int | None:
    """The dimension of t that holds the batch's examples, or None."""
    return reading(sources, t.graph).guarded(lambda r: r.axis(t))


def counts_rows(op, sources) -> bool:
    """Whether `op` counts a batch's rows: `tf.shape(x)[0]` or `tf.size(x)`
    of a tensor whose first dimension is the batch."""
    return bool(reading(sources, op.graph).guarded(lambda r: r.counts_rows(op)))


def reading(sources, graph: tf.Graph, parts: bool = False) -> _Axes:
    """A reading of `graph` for the data sources (`sources`, if already one,
    and one of parts where `parts` asks). `parts`: a tf.split of the
    batch's rows into equal parts (micro-batches) keeps the batch's axis in
    each part, whose rows are examples of the batch; a loss's form is read
    so. Elsewhere a part has no batch's axis: one device's part m holds
    other rows than a replica's (a fetched part is not the replicas' parts
    joined)."""
    if isinstance(sources, _Axes) and (sources.parts or not parts):
        return sources
    sources = sources.sources if isinstance(sources, _Axes) else sources
    return _Parts(sources, graph) if parts else _Axes(sources, graph)


_LAST_AXIS = {"Softmax", "LogSoftmax"}      # mix their last axis
_ROW_WISE = ELEMENTWISE - PASS - _LAST_AXIS - {"Merge"} | {"BroadcastTo"}   # (same rank)
# ops that keep input 0's rows and change the rest (convolutions, pools, norms, top k)
_KEEP_FIRST = FIRST - {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "ArgMax",
                       "ArgMin", "InTopKV2", "Cumsum", "Cumprod", "Pad", "PadV2", "MirrorPad",
                       "ReverseV2"}
# slices put into a tensor at the indices' coordinates (a scan fills its output so)
_SCATTERS = {"TensorScatterAdd", "TensorScatterUpdate", "TensorScatterSub", "TensorScatterMax",
             "TensorScatterMin"}
_SPLITS = ("StringSplit", "StringSplitV2")    # strings split into a sparse batch of words
FED = ("Placeholder", "PlaceholderWithDefault")     # fed whole where scalar: not the batch's
_DEPTH = 20000      # recursion enough for a deep model's chain of ops


def _int(value) -> int:
    """A constant axis as an int (TensorFlow folds some to arrays of one)."""
    return int(np.ravel(value)[0])


def _equal(sizes) -> bool:
    """Whether SplitV's `sizes` are equal: constants, or one tensor packed
    (`tf.split(x, [tf.shape(x)[0] // m] * m)`)."""
    value = tf.get_static_value(sizes)
    if value is not None:
        return np.size(value) > 0 and bool(np.all(np.ravel(value) == np.ravel(value)[0]))
    return sizes.op.type == "Pack" and len({t.name for t in sizes.op.inputs}) == 1


class _Axes(Flow):
    """One reading of a graph (or of a function's body, its inputs `bound`
    to the caller's tensors): the batch's axis of tensors, and of the
    elements of lists and arrays, memoized; a cycle (a loop) reads None
    where it meets itself."""

    parts = False       # a split of the batch's rows keeps the axis (`reading`)

    def __init__(self, sources, graph, bound=None, root=None):
        self.sources, self.graph, self.root = set(sources), graph, root or graph
        # body input name -> (caller's _Axes, tensor); an input's gradient: its source's
        self.bound = bound or {op: (self, t) for op, t in input_rows(graph).items()}
        self.memo: dict = {}

    def guarded(self, ask):
        """`ask(self)`, with recursion for a deep model; None past it."""
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, _DEPTH))
        try:
            return ask(self)
        except RecursionError:
            return None
        finally:
            sys.setrecursionlimit(limit)

    def rows(self, t) -> bool:
        return self.axis(t) == 0

    def axis(self, t) -> int | None:
        return self._memo(("axis", t.name), self._axis, t)

    def elements(self, t) -> int | None:
        """The batch's axis in each element of the list or array `t`
        (a TensorList's variant, a TensorArray's handle)."""
        return self._memo(("elements", t.name), self._elements, t)

    def _memo(self, key, read, t):
        if key not in self.memo:
            self.memo[key] = None
            self.memo[key] = read(t)
        return self.memo[key]

    def _axis(self, t):
        op, kind = t.op, t.op.type
        if op.name in self.sources:
            return None if t.shape.rank == 0 and op.type in FED else 0   # (a flag, a rate)
        if op.name in self.bound:
            caller, outer = self.bound[op.name]
            return caller.axis(outer)
        if (rank := t.shape.rank) == 0 or t.dtype in (tf.resource, tf.variant):
            return None
        if kind in SPARSE_LAYERS:       # a row per row of a sparse batch
            return 0 if sparse_rows(op, self.rows) else None
        if kind == "EditDistance":      # a distance per row of a sparse batch
            return 0 if any(sparse_batch(op.inputs[i]) for i in (2, 5)) else None
        if kind in CTC:     # a loss (a decoding's log probability) per sequence
            lengths, out = CTC[kind]
            return 0 if t.value_index == out % len(op.outputs) and \
                self.rows(op.inputs[lengths]) else None
        if kind.startswith("FusedBatchNorm") and t.value_index == 0:
            return self.axis(op.inputs[0])      # y as x is laid out (NCHW: rows on C, per row)
        if kind in LOSSES or kind in _KEEP_FIRST and (t.value_index == 0 or kind == "TopKV2"):
            top = kind == "TopKV2" and op.inputs[0].shape.rank in (None, 1)   # k of the batch
            mine = self.rows(op.inputs[0]) or kind in LOSSES and self.rows(op.inputs[1])
            return 0 if mine and not top else None   # a loss per example (or per label)
        if kind in PASS or kind in ("Roll", "RandomShuffle"):    # (rows reordered: orders.py)
            return self.axis(op.inputs[t.value_index if kind == "IdentityN" else 0])
        if kind in ("Merge", "RefMerge"):     # a loop's variable, a cond's result
            return None if t.value_index else self._merged(t, "axis")
        if kind in _ROW_WISE or kind in _LAST_AXIS:
            a = self._first(self.axis, [x for x in op.inputs if None in (x.shape.rank, rank)
                                        or x.shape.rank == rank])
            return None if kind in _LAST_AXIS and a == rank - 1 else a
        if kind == "MatMul":
            return 0 if not op.get_attr("transpose_a") and self.rows(op.inputs[0]) else None
        if kind in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
            a = self._first(self.axis, op.inputs)
            return a if a is not None and rank and a < rank - 2 else None
        if kind in ("LookupTableFindV2", "LookupTableFind"):   # a value per key (StringLookup)
            return self.axis(op.inputs[1])
        if kind == "RaggedTensorToTensor":
            return self._padded(op)
        if kind == "DenseBincount":     # counts per row of a matrix (CategoryEncoding's)
            return 0 if op.inputs[0].shape.rank == 2 and self.rows(op.inputs[0]) else None
        if kind == "OneHot":
            a = self.axis(op.inputs[0])
            at = op.get_attr("axis")
            return None if a is None else a + 1 if 0 <= at <= a else a
        if kind in REDUCTIONS or kind in ("ArgMax", "ArgMin"):
            return self._reduced(op, t, keep=kind in REDUCTIONS and op.get_attr("keep_dims"))
        if kind in ("Cumsum", "Cumprod", "ReverseV2", "Pad", "PadV2", "MirrorPad", "Tile",
                    "Split", "SplitV"):
            return self._along(op)
        if kind == "Slice":
            return self._slice(op)
        if kind in TRANSPOSED_CONVOLUTIONS:         # input 2 is the data, 0 the shape
            return 0 if self.rows(op.inputs[2]) else None
        if kind in ("GatherV2", "ResourceGather", "Gather"):
            return self._gathered(op)
        if kind == "GatherNd" and (i := self.axis(op.inputs[1])) is not None:  # the indices'
            return i if i < (op.inputs[1].shape.rank or 0) - 1 else None   # rows (not coordinates)
        if kind in ("InTopK", "InTopKV2", "Where"):     # a row's target among its top k;
            return 0 if any(self.axis(x) == 0 for x in op.inputs) else None   # a mask's places
        if kind == "Einsum":
            return self._einsum(op)
        if kind in _SCATTERS:
            return self._scattered(op)
        if kind == "Transpose":
            perm, a = tf.get_static_value(op.inputs[1]), self.axis(op.inputs[0])
            return list(perm).index(a) if perm is not None and a in list(perm) else None
        if kind == "ConcatV2":
            return self._concatenated(op, t)
        if kind == "Pack":
            a = self._first(self.axis, op.inputs)
            at = op.get_attr("axis") % rank if rank else None
            return None if a is None or at is None else a + 1 if at <= a else a
        if kind == "Unpack":
            a, x = self.axis(op.inputs[0]), op.inputs[0]
            at = op.get_attr("axis") % x.shape.rank if x.shape.rank else None
            return None if a is None or at is None or a == at else a - 1 if a > at else a
        if kind in SHAPED:
            return 0 if self._first_counts(op.inputs[0]) else None
        if kind == "StridedSlice":
            return self._sliced(op)
        if kind in ("Reshape", "ExpandDims", "Squeeze"):
            return self._reshaped(op, t)
        if kind in ("TensorListStack", "TensorListGather", "TensorArrayGatherV3"):
            e = self.elements(op.inputs[0])
            return None if e is None else e + 1
        if kind in ("TensorListGetItem", "TensorArrayReadV3", "TensorListPopBack"):
            return self.elements(op.inputs[0])
        return self._called(op, t, "axis")

    def counts_rows(self, op) -> bool:
        """Whether the scalar `op` gives counts the batch's examples: the
        size of a tensor that has them, its dimension that holds them, or a
        product of its dimensions with that one (as tf.tensordot merges them)."""
        while op.type in ("Cast", "Identity"):
            op = op.inputs[0].op
        if op.type == "Size":
            return self.axis(op.inputs[0]) is not None
        if op.type == "Prod":
            return self._first_counts(op.inputs[0])
        shape = op.inputs[0] if op.type == "StridedSlice" else None
        if shape is None or not (shape.op.type == "Shape" or shape.op.type in _SPLITS and
                                 shape.value_index == 2):   # a split's [rows, longest]
            return False
        begin, strides = (tf.get_static_value(op.inputs[i]) for i in (1, 3))
        return (begin is not None and strides is not None and len(begin) == 1
                and list(strides) == [1] and op.get_attr("shrink_axis_mask") == 1
                and self.axis(shape.op.inputs[0]) == int(begin[0]))

    def _padded(self, op):
        """A ragged batch padded to a tensor (TextVectorization's tokens):
        its rows are the batch's where the first partition is their count
        (a split of a batch of strings) and the shape leaves them open."""
        kinds = op.get_attr("row_partition_types")
        shape = tf.get_static_value(op.inputs[0])
        if not kinds or kinds[0] != b"FIRST_DIM_SIZE" or shape is None or \
                np.ndim(shape) and (not len(shape) or shape[0] != -1):
            return None
        return 0 if self.counts_rows(op.inputs[3].op) else None

    def _first_counts(self, shape) -> bool:
        """Whether the first entry of the shape vector `shape` counts the
        batch's examples (`counts_rows`)."""
        op = shape.op
        if op.type in ("Cast", "Identity"):
            return self._first_counts(op.inputs[0])
        if op.type == "Shape":
            return self.rows(op.inputs[0])
        if op.type in ("Pack", "ExpandDims"):
            return bool(op.inputs) and self.counts_rows(op.inputs[0].op)
        if op.type == "ConcatV2" and len(op.inputs) > 1:
            return self._first_counts(op.inputs[0])
        if op.type in ("GatherV2", "StridedSlice", "Slice") and op.inputs[0].op.type == "Shape":
            first = tf.get_static_value(op.inputs[1])
            if op.type == "StridedSlice" and (op.get_attr("shrink_axis_mask") or
                                              op.get_attr("begin_mask") & 1):
                first = None if op.get_attr("shrink_axis_mask") else [0]
            return first is not None and np.ndim(first) == 1 and len(first) > 0 and \
                self.axis(op.inputs[0].op.inputs[0]) == int(first[0])
        return False

    @staticmethod
    def _first(read, tensors):
        return next((a for a in map(read, tensors) if a is not None), None)

    def _reduced(self, op, t, keep):
        x = op.inputs[0]
        rank, a = x.shape.rank, self.axis(x)
        axes = tf.get_static_value(op.inputs[1])
        if a is None or axes is None or not rank:
            return None
        axes = {int(v) % rank for v in np.atleast_1d(axes)}
        return None if a in axes else a if keep else a - sum(v < a for v in axes)

    def _along(self, op):
        """The batch's axis stays through a scan, split or reversal along other
        axes, and a padding, tiling or slice that adds or drops none of its rows."""
        data, at = (1, 0) if op.type == "Split" else (0, 2 if op.type == "SplitV" else 1)
        x = op.inputs[data]
        a, at = self.axis(x), tf.get_static_value(op.inputs[at], partial=op.type == "Tile")
        rank = x.shape.rank
        if a is None or at is None or not rank:
            return None
        if op.type.startswith("Cum") or op.type.startswith("Split"):
            whole = self.parts and (op.type == "Split" or _equal(op.inputs[1]))   # parts
            return None if _int(at) % rank == a and not whole else a
        if op.type == "ReverseV2":
            return a            # reversed rows are the same rows
        if op.type == "Tile":
            return a if np.shape(at) == (rank,) and at[a] == 1 else None
        return a if np.shape(at) == (rank, 2) and not np.any(at[a]) else None

    def _slice(self, op):       # of every row (tf.image's crops compute other entries)
        a = self.axis(op.inputs[0])
        begin, size = (tf.get_static_value(op.inputs[k], partial=True) for k in (1, 2))
        if a is None or begin is None or len(begin) <= a or begin[a] != 0:
            return None
        return a if size is not None and len(size) > a and size[a] == -1 or \
            a == 0 and self._free_first(op.inputs[2]) else None

    def _gathered(self, op):
        if op.type != "GatherV2":
            return self.axis(op.inputs[1])
        at, rank = tf.get_static_value(op.inputs[2]), op.inputs[0].shape.rank
        if at is None or (_int(at) < 0 and not rank):
            return None
        at = _int(at) % rank if rank else _int(at)
        a = self.axis(op.inputs[0])
        if a is not None and (a < at or a == at and permutation(op.inputs[1], self)):
            return a            # gathered along a later axis, or the rows reordered
        i = self.axis(op.inputs[1])
        return at + i if i is not None and op.get_attr("batch_dims") == 0 else None

    def _einsum(self, op):      # "bsd,de->bse": the batch's letter where the output has it
        spec = op.get_attr("equation").decode().replace(" ", "")
        ins, _, result = spec.partition("->")
        for term, x in zip(ins.split(","), op.inputs):
            a = self.axis(x)
            if "." in term and a != 0:
                continue
            if a is not None and a < len(term) and term[a].isalpha() and term[a] in result:
                return result.index(term[a])
        return None

    def _scattered(self, op):
        """A TensorScatter's rows: on an axis past those the indices address
        (their last dimension, d), the tensor's, and the updates' slices'
        (the updates hold the indices' leading dimensions, then the slices:
        axis u of them is d + u - leading there); both, where known, agree."""
        x, at, up = op.inputs[:3]
        lead = (at.shape.rank or 0) - 1
        d = compat.dim(at.shape, lead) if lead >= 0 else None
        a, u = self.axis(x), self.axis(up)
        if d is None or a is not None and a < d or u is not None and u < lead:
            return None
        known = {a, None if u is None else u - lead + d} - {None}
        return known.pop() if len(known) == 1 else None

    def _concatenated(self, op, t):     # along the batch's axis all must have it
        at = tf.get_static_value(op.inputs[-1])
        axes = [self.axis(x) for x in op.inputs[:-1]]
        known = [a for a in axes if a is not None]
        if at is None or not t.shape.rank or not known:
            return None
        along = _int(at) % t.shape.rank == known[0]
        return known[0] if not along or len(known) == len(axes) else None

    def _sliced(self, op):
        strides = tf.get_static_value(op.inputs[3])
        a, rank = self.axis(op.inputs[0]), op.inputs[0].shape.rank
        if a is None or strides is None:
            return None
        masks = [op.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask",
                                          "new_axis_mask", "shrink_axis_mask")]
        if rank is None and masks[2] | masks[3]:
            moved = (masks[2] | masks[3] | masks[4]) & 1
            return 0 if a == 0 and masks[0] & masks[1] & 1 and not moved and len(strides) and \
                strides[0] == 1 else None           # x[:, ...]: every row kept
        return slice_axis(a, rank, [int(v) for v in strides], *masks)

    def _reshaped(self, op, t):
        x = op.inputs[0]
        a = self.axis(x)
        before, after = x.shape, t.shape
        if a is None and op.type == "Reshape" and x.op.type in LOSSES:
            return self._unflattened(x.op, op.inputs[1], after.rank)
        if a is None and op.type == "Reshape" and (lead := restored_lead(op)):  # tensordot
            b = self.axis(lead[0])
            return b if b is not None and b < lead[1] and self.axis(lead[2]) == b else None
        if a is None or not after.rank:
            return None
        if op.type == "ExpandDims" and before.rank is not None:
            at = tf.get_static_value(op.inputs[1])
            return None if at is None else a + 1 if _int(at) % after.rank <= a else a
        if op.type == "Squeeze" and before.rank is not None:
            dims = [d % before.rank for d in op.get_attr("squeeze_dims")] or \
                [i for i in range(before.rank) if compat.dim(before, i) == 1]
            return None if a in dims else a - sum(d < a for d in dims)
        shape = op.inputs[1]
        if a and before.rank and all(compat.dim(before, i) == 1 for i in range(a)):
            # the rows behind leading ones, back to the shape of a tensor of the batch's rows
            return 0 if shape.op.type == "Shape" and self.rows(shape.op.inputs[0]) else None
        if a != 0:
            return None
        if before.rank and compat.dim(before, 0) == compat.dim(after, 0) is not None:
            return 0
        if shape.op.type == "Shape" and self.rows(shape.op.inputs[0]):
            return 0            # to the shape of a tensor of the batch's rows
        free = compat.dim(after, 0) is None and (not before.rank or compat.dim(before, 0) is None)
        return 0 if free and self._free_first(shape) else self._behind_ones(shape, x)

    def _behind_ones(self, shape, x):
        """The axis of a reshape of `x` (its rows first) to leading ones and
        then x's leading dimensions merged, rows outermost (tf_keras's
        LayerNormalization: [1, prod(shape[:k]), prod(shape[k:]), 1])."""
        if shape.op.type != "Pack":
            return None
        values = [tf.get_static_value(v) for v in shape.op.inputs]
        k = next((i for i, v in enumerate(values) if v is None or int(v) != 1), None)
        if not k:
            return None
        op = shape.op.inputs[k].op
        while op.type in ("Cast", "Identity"):
            op = op.inputs[0].op
        part = op.inputs[0].op if op.type == "Prod" else op
        if part.type not in ("StridedSlice", "Slice") or part.inputs[0].op.type != "Shape":
            return None
        begin = tf.get_static_value(part.inputs[1])
        first = part.type == "StridedSlice" and part.get_attr("begin_mask") & 1
        from_zero = first or (begin is not None and np.size(begin) > 0 and not np.ravel(begin)[0])
        return k if from_zero and part.inputs[0].op.inputs[0] is x else None

    def _unflattened(self, loss, shape, rank):
        """A softmax loss over more than two dimensions flattens its logits
        and labels (z) to rows, and its losses go back to z's shape, or to
        z's shape without its last dimension: z's batch axis."""
        whole = shape.op.type == "Shape"
        if shape.op.type == "Slice" and shape.op.inputs[0].op.type == "Shape":
            begin = tf.get_static_value(shape.op.inputs[1])
            whole, shape = begin is not None and not np.any(begin), shape.op.inputs[0]
        z = shape.op.inputs[0] if whole else None
        flat = [x.op.inputs[0].name for x in loss.inputs if x.op.type == "Reshape"]
        a = self.axis(z) if z is not None and z.name in flat else None
        return a if a is not None and rank and a < rank else None

    def _free_first(self, shape) -> bool:
        """Whether a shape's first entry is -1 or counts the batch's rows."""
        value = tf.get_static_value(shape)
        if value is not None:
            return np.ndim(value) == 1 and len(value) > 0 and int(value[0]) == -1
        op = shape.op
        if op.type in ("Pack", "ConcatV2") and len(op.inputs) > 1 and \
                (first := tf.get_static_value(op.inputs[0])) is not None:
            return np.size(first) > 0 and int(np.ravel(first)[0]) == -1
        return self._first_counts(shape)


class _Parts(_Axes):
    """A reading where each of equal parts of the batch's rows has them."""

    parts = True
