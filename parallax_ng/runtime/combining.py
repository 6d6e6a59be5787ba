"""How the replicas' values of one fetch make one value: a `Fetch` names
what to run in the step graph and how its values combine (`combine`);
`default_reduction` reads from the user's graph how a tensor's replicas'
values make one device's (the batch's rows joined, a mean loss averaged,
a count summed, a largest value's max, a SparseTensor's rows joined).

Requires: numpy values, in the order of a Fetch's names; user-graph
tf.Tensors and the graph's data sources for `default_reduction`.
Guarantees: `combine` is a pure function of its arguments;
`default_reduction` reads the graph only (graph/forms.py, graph/rows.py).
Used by the fetch maps (parallax_ng/runtime/fetches.py,
parallax_ng/l2l/runner.py) and the runner.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from .. import compat
from ..config import FETCH_REDUCTIONS
from ..graph import batch_sums, forms, rules
from ..graph.batch import split_as_parts
from ..graph.mixing import extreme
from ..graph.orders import order
from ..graph.rows import batch_axis, reading
from . import summaries
from .batch_parts import joined_rows


@dataclass(frozen=True)
class Fetch:
    names: tuple            # tensor names or tf.Operations to run
    how: str    # none | first | list | mean | sum | concat | concat mean | any | all |
    #             max | min | shape | norm | summary | handles |
    #             sparse rows | sparse first | sparse list | slices | slices list
    user: str               # the user's node
    replicas: tuple = ()    # for "list": index into `names` of each replica's value
    axis: int = 0           # for "concat" and "shape": the axis of the batch's examples
    parts: tuple = ()       # for "summary": (tag, how) (parallax_ng/runtime/summaries.py);
    #                         for "sparse ...": the Fetches of indices, values, dense shape;
    #                         for "slices ...": of values, indices (and dense shape)


class ReplicaHandles(bytes):
    """A feedable iterator's string handle (`iterator.string_handle()`):
    replica 0's, as the program sees it, with every replica's (`each`),
    which a feed of it gives each replica's copy of the handle placeholder
    (`tf.compat.v1.data.Iterator.from_string_handle`)."""

    def __new__(cls, each: list):
        handle = super().__new__(cls, each[0])
        handle.each = list(each)
        return handle


def combine(values: list, f: Fetch):
    """One value from the values of a fetch's names."""
    if f.how == "none":
        return None
    if f.how == "handles":
        return ReplicaHandles([values[i] for i in f.replicas])
    if f.how == "first":
        return values[0]
    if f.how == "list":
        return [values[i] for i in f.replicas]
    if f.how == "summary":
        return summaries.merge([values[i] for i in f.replicas], f.parts)
    if f.how == "concat mean":       # the rows of each replica's mean, of the job's mean
        return (np.concatenate(values, axis=f.axis) / len(values)).astype(values[0].dtype)
    if f.how == "mean":
        return np.mean(np.stack(values), axis=0).astype(np.asarray(values[0]).dtype)
    if f.how == "sum":               # in the fetch's own type, as one device gives it
        return np.sum(np.stack(values), axis=0).astype(np.asarray(values[0]).dtype)
    if f.how.startswith("slices"):   # an IndexedSlices' values, indices (and dense shape)
        got = _parts(values, f.parts) + [None] * (3 - len(f.parts))
        if f.how == "slices list":
            return [compat.indexed_slices_value(v, i, s) for v, i, s in
                    zip(got[0], got[1], got[2] or [None] * len(got[0]))]
        return compat.indexed_slices_value(*got)
    if f.how.startswith("sparse"):   # each part every replica's: their SparseTensorValues
        triples = _parts(values, f.parts)
        each = [tf.compat.v1.SparseTensorValue(*t) for t in zip(*triples)]
        return {"sparse list": each, "sparse first": each[0]}.get(f.how) or joined_rows(each)
    if f.how == "shape":             # each replica's rows, added, in a batch's shape
        shape = np.array(values[0])
        shape[f.axis] = sum(int(v[f.axis]) for v in values)
        return shape
    if f.how == "norm":
        return np.sqrt(np.sum(np.square(np.stack(values)), axis=0)).astype(values[0].dtype)
    if f.how in ("any", "all", "max", "min"):    # a boolean or an extreme over the batch
        return getattr(np, f.how)(np.stack(values), axis=0)
    return np.concatenate([np.atleast_1d(v) for v in values], axis=f.axis)


def _parts(values: list, parts: tuple) -> list:
    """Each part's value, combined from its run of `values`."""
    out, i = [], 0
    for part in parts:
        out.append(combine(values[i:i + len(part.names)], part))
        i += len(part.names)
    return out


def default_reduction(t: tf.Tensor, sources: list[str], widened=frozenset(),
                      averaged: bool = True, losses=frozenset()) -> tuple:
    """(how, axis, shown): the replicas' parts joined along the batch's axis
    (a time-major output's second; booleans and strings too; not shown where
    the rows are reordered, graph/orders.py); a scalar or a
    tensor reduced over the batch is a mean (a loss) unless graph/forms.py
    shows a sum (correct examples counted, a summed loss, a count per class
    by tf.math.bincount or confusion_matrix) or the state-sync pass widened
    its division; a boolean reduced by tf.reduce_any or reduce_all is the
    replicas' any or all, a largest or smallest value over the batch
    (tf.reduce_max) their max or min, a norm over it (tf.norm) the norm of
    their norms, the shape of a batch (tf.shape(logits)) theirs with the
    batch's dimension added; other booleans and strings are replica 0's.
    `shown` is False where the graph does not show which (a mean, or the
    parts joined, is a guess). An autodiff tensor (a second tf.gradients,
    of the weights or the inputs, or an IndexedSlices one made dense) is
    each replica's of its own loss: the
    replicas' mean where the gradients are `averaged` (else their sum), a
    gradient per example joined by rows (and divided by N). A TF1 sum
    scaled by a number the graph does not show to be the batch size is a
    mean, or a sum where the config sums the gradients (`averaged` False);
    so is a loss the graph differentiates (named in `losses`) whose form
    it does not show."""
    axis = batch_axis(t, sources) if t.shape.rank != 0 else None
    if _autodiff(t) and t.dtype.is_floating:
        if axis is None and t.shape.rank and compat.dim(t.shape, 0) is None:
            axis = 0        # rows the autodiff's shapes hide (a weight's has a static shape)
        if axis is None:
            return ("mean" if averaged else "sum"), 0, True
        return ("concat mean" if averaged else "concat"), axis, True
    if axis is not None:    # (per-example booleans or strings too) in the data's order
        return "concat", axis, not reading(sources, t.graph).guarded(lambda r: order(t, r))
    if not (t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_complex):
        return ({"Any": "any", "All": "all"}.get(t.op.type, "first")), 0, True
    op = forms.through(t.op)
    if op.type == "Shape" and (rows := batch_axis(op.inputs[0], sources)) is not None:
        return "shape", rows, True
    if op.type in _COUNTS and batch_axis(op.inputs[0], sources) is not None:
        return "sum", 0, True
    if per_class := batch_sums.per_class(op, sources):
        return per_class, 0, True
    if op.type == "Sqrt" and forms.scalar_kind(op.inputs[0], sources) == "sum":
        return "norm", 0, True
    if largest := extreme(t, sources):
        return largest, 0, True
    # a sum or mean over micro-batches (tf.split's parts of the rows) is the batch's
    kind, guessed, _ = forms.scalar_form(t, reading(sources, t.graph,
                                                    parts=split_as_parts(t.graph)))
    if t.shape.rank != 0 and kind is None:
        return "concat", 0, False
    if (guessed or kind is None and t.name in losses) and not averaged:
        kind = "sum"    # a scaled TF1 sum or a loss the config sums the gradients of
    summed = kind == "sum" or forms.over_widened(t, sources, widened)
    return ("sum" if summed else "mean"), 0, kind is not None


def _autodiff(t: tf.Tensor) -> bool:
    """An autodiff tensor, or an IndexedSlices gradient made dense
    (`tf.convert_to_tensor`'s UnsortedSegmentSum of its values at its indices)."""
    return rules.is_autodiff(t.op.name) or t.op.type == "UnsortedSegmentSum" and \
        all(rules.is_autodiff(x.op.name) for x in t.op.inputs[:2])


# (tensor name, how the program names it) of a TF2 step's outputs (tf2.py)
OUTPUT_NAMES = "parallax_ng_output_names"


def name_outputs(graph: tf.Graph, outputs, path: str = "") -> None:
    """Name a traced step's outputs (a structure of tensor names) in
    `graph` by their keys in it ('loss', 'metrics/0'), for `unread`."""
    if isinstance(outputs, (dict, list, tuple)):
        items = outputs.items() if isinstance(outputs, dict) else enumerate(outputs)
        for key, value in items:
            name_outputs(graph, value, f"{path}/{key}" if path else str(key))
    elif outputs is not None:
        graph.add_to_collection(OUTPUT_NAMES, (outputs, f"the step's output {path!r}"
                                               if path else "the step's output"))


def unread(name: str, t: tf.Tensor, how: str) -> str:
    """The warning for fetch `name` whose combination the graph does not show."""
    label = dict(t.graph.get_collection(OUTPUT_NAMES)).get(name)
    what = f"{label} (tensor {name!r}, {forms.through(t.op).type})" if label else \
        f"{name!r} ({t.op.type})"
    return (f"parallax_ng: the graph does not show how the replicas' values of {what} make "
            f"one device's; they are {'averaged' if how == 'mean' else 'joined'}. If that is "
            f"not one device's value, set config `fetch_reduction: {{{name}: "
            f"{'|'.join(FETCH_REDUCTIONS)}}}`" +
            (", or take every replica's value: step(..., per_replica=True)" if label else ""))


# ops that count the batch's values into a tensor per class (tf.math.bincount,
# tf.math.confusion_matrix's ScatterNd): the replicas' counts add up
_COUNTS = ("Bincount", "DenseBincount", "ScatterNd", "HistogramFixedWidth")
