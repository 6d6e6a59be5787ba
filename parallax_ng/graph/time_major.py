"""Time-major feeds: placeholders whose batch is not their first axis.

A script written for a recurrent network run time-major feeds its
sequences as `[time, batch, ...]` (`tf.compat.v1.nn.dynamic_rnn(...,
time_major=True)`, `static_rnn` over `tf.unstack(x)`, the seq2seq tutorials'
`encoder_inputs`). Feeds are split over the replicas along their first
axis, which is time there: each replica would run half of every sequence,
from a zero state, and train on what one device never computes. So the
front end gives each such placeholder P of batch axis a > 0 a batch-major
twin and makes P the twin's transpose, in its copy of the graph:

    P/parallax_batch_major  Placeholder   [batch, the other axes in order]
    P                       Transpose(P/parallax_batch_major, axes back)

Every analysis then reads a source whose first axis is the batch (the
transpose carries it to axis a, as the graph/rows.py reading follows), and
the runner moves a feed of P's axis a first and splits it as any batch
(`batch_major`). Fetches of P's rows are joined along axis a.

Which placeholders: config `batch_feeds: {P: a}` names one; else a
placeholder of rank 2 or more whose second dimension is unknown is
time-major where its first axis is read step by step and its second is
the batch: unstacked (`tf.unstack`, static_rnn: only a time axis of fixed
length can be), reversed per sequence with the batch beside it
(`tf.reverse_sequence`, bidirectional_dynamic_rnn), or scattered into a
TensorArray or TensorList (dynamic_rnn's loop) while the graph fills a
state whose first dimension is its second one (dynamic_rnn's zero state
and outputs; `tf.map_fn` over a batch fills none). Where one is found,
the other placeholders laid out alike (rank 2 or more, the same first
dimension, an unknown second) are taken as time-major too (the targets of
a time-major decoder are read by nothing that shows it); `get_runner`
prints one line naming them all, and `batch_feeds: {P: true}` keeps one
batch-major. A traced TF2 step's arguments are split by its own rules and
never taken here.

Requires: a tf.Graph. Guarantees: `axes` is a pure function of the graph
and the config; `edit` changes a meta graph's copy only.
"""
from __future__ import annotations

import sys

import numpy as np
import tensorflow as tf

from ..errors import ConfigError
from . import emit, rules
from .rows import reading
from .shape_vectors import shape_entry
from .tracing import INPUT

SUFFIX = "parallax_batch_major"
_STEPPED = ("TensorArrayScatterV3", "TensorListFromTensor")   # input read step by step
_VALUE = {"TensorArrayScatterV3": 2, "TensorListFromTensor": 0}


def twin(node: str) -> str:
    """The batch-major placeholder that feeds time-major placeholder `node`."""
    return f"{node}/{SUFFIX}"


def axes(graph: tf.Graph, batch_feeds: dict) -> dict[str, int]:
    """Placeholder name -> its batch axis (> 0), for the placeholders fed
    with their batch on a later axis: named by `batch_feeds` (an int), or
    found in `graph` (printed once)."""
    placeholders = {op.name for op in graph.get_operations() if op.type == "Placeholder"}
    candidates = [op for op in graph.get_operations() if _candidate(op, placeholders)]
    out = {n: a for n, a in batch_feeds.items() if _axis_value(a)}
    for name in set(out) - placeholders:
        raise ConfigError(f"config key 'batch_feeds.{name}' gives an axis, but the graph has "
                          f"no placeholder {name!r} (tf.compat.v1.placeholder) to feed along it")
    chosen = set(batch_feeds)
    found = [op for op in candidates if op.name not in chosen and _stepped(op, graph)]
    if found:
        firsts = {_dim(op, 0) for op in found}
        found += [op for op in candidates if op.name not in chosen and op not in found
                  and _dim(op, 0) in firsts]
        found.sort(key=lambda op: op.name)
        names, one = ", ".join(repr(op.name) for op in found), len(found) == 1
        print(f"parallax_ng: placeholder{'' if one else 's'} {names} {'is' if one else 'are'} "
              f"fed time-major ({'its' if one else 'their'} batch is axis 1: a recurrent loop "
              "reads axis 0 step by step); each feed is split over the replicas along axis 1. "
              "Config `batch_feeds: {NAME: true}` splits one along axis 0",
              file=sys.stderr, flush=True)
        out.update((op.name, 1) for op in found)
    return out


def _axis_value(a) -> bool:
    return not isinstance(a, bool) and isinstance(a, int) and a > 0


def _candidate(op, placeholders: set) -> bool:
    """A placeholder of rank 2 or more whose second dimension is unknown,
    not a TF2 step's argument nor a sparse placeholder's indices (split
    by their rows' numbers: runtime/batch_parts.py)."""
    base, _, part = op.name.rpartition("/")
    if op.type != "Placeholder" or op.name.startswith(INPUT.format("")) or \
            part == "indices" and {f"{base}/values", f"{base}/shape"} <= placeholders:
        return False
    shape = op.outputs[0].shape
    return shape.rank is not None and shape.rank >= 2 and _dim(op, 1) is None


def _dim(op, k: int):
    return tf.compat.dimension_value(op.outputs[0].shape[k])


def _stepped(op, graph: tf.Graph) -> bool:
    """Whether placeholder `op`'s first axis is read step by step by a
    recurrence whose batch is its second axis: unstacked, reversed per
    sequence, or scattered into a TensorArray (TensorList) where the graph
    fills a state whose first dimension is its second one (`tf.zeros([
    tf.shape(x)[1], units])`, as recurrent layers start; a tf.map_fn over
    a batch's rows reading their length, `tf.shape(x)[1]`, fills none)."""
    r = reading({op.name}, graph)
    scattered = sized = False
    for user in graph.get_operations():
        if rules.is_autodiff(user.name):
            continue
        kind = user.type
        if kind == "Unpack" and user.inputs[0].shape.rank and \
                user.get_attr("axis") % user.inputs[0].shape.rank == 0 and \
                r.guarded(lambda x: x.axis(user.inputs[0])) == 0:
            return True
        if kind == "ReverseSequence" and user.get_attr("seq_dim") == 0 and \
                user.get_attr("batch_dim") == 1 and \
                r.guarded(lambda x: x.axis(user.inputs[0])) == 0:
            return True
        if kind in _STEPPED and \
                r.guarded(lambda x: x.axis(user.inputs[_VALUE[kind]])) == 0:
            scattered = True
        if kind == "Fill" and (size := _head(user.inputs[0])) is not None and \
                r.guarded(lambda x: x.axis(size.op.inputs[0].op.inputs[0])) == 0:
            sized = True
    return scattered and sized


def _head(shape):
    """The first entry of shape vector `shape` where it is `tf.shape(t)[1]`
    (through stacks, concatenations, casts), else None."""
    op = shape.op
    for _ in range(8):
        if op.type == "StridedSlice" and op.inputs[0].op.type == "Shape" and shape_entry(op, 1):
            return op.outputs[0]
        if op.type not in ("Pack", "ConcatV2", "ExpandDims", "Reshape", "Identity", "Cast") \
                or not op.inputs:
            return None
        op = op.inputs[0].op
    return None


def edit(found: dict[str, int]):
    """The edit of a meta graph that feeds each placeholder of `found`
    through its batch-major twin, or None where there is none."""
    if not found:
        return None
    return lambda meta: _edit(meta.graph_def, found)


def _edit(graph_def, found: dict[str, int]) -> None:
    out = []
    for node in graph_def.node:
        a = found.get(node.name)
        if a is None or node.op != "Placeholder":
            out.append(node)
            continue
        dims = list(node.attr["shape"].shape.dim)
        if a >= len(dims):
            raise ConfigError(f"config key 'batch_feeds.{node.name}' is {a}, but the "
                              f"placeholder has {len(dims)} axes; give an axis below "
                              f"{len(dims)} (true: the first)")
        major = tf.compat.v1.NodeDef()
        major.CopyFrom(node)
        major.name = twin(node.name)
        if "_output_shapes" in major.attr:      # the export's, in P's order
            del major.attr["_output_shapes"]
        order = [a] + [k for k in range(len(dims)) if k != a]
        del major.attr["shape"].shape.dim[:]
        major.attr["shape"].shape.dim.extend(dims[k] for k in order)
        back = [order.index(k) for k in range(len(dims))]
        perm = emit.const(f"{major.name}/axes", back, tf.int32, node.device)
        dtype = tf.as_dtype(node.attr["dtype"].type)
        out += [major, perm, emit.node_def(node.name, "Transpose", [major.name, perm.name],
                                           node.device, T=dtype, Tperm=tf.int32)]
    del graph_def.node[:]
    graph_def.node.extend(out)


def batch_major(value, axis: int):
    """A feed of a time-major placeholder, its batch axis moved first."""
    return np.moveaxis(np.asarray(value), axis, 0)


def analysed(tg, name: str) -> tf.Tensor:
    """User tensor `name` as the analyses read it: in the front end's copy
    where placeholders are fed time-major (their twins are its sources),
    else (or for an op made after get_runner) in the user's graph."""
    if tg.time_major:
        try:
            return tg.graph.get_tensor_by_name(name)
        except KeyError:
            pass
    return tg.user_graph.get_tensor_by_name(name)
