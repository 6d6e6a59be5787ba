"""TF1 summaries fetched from the replicas: `tf.compat.v1.summary.scalar`,
`histogram` and `merge_all` give a serialized Summary that each replica
computes over its own rows. `parts` says, per tag, how the replicas'
values make one device's over the global batch, and `merge` makes it: a
scalar as the runner combines its tensor (a mean loss averaged, a count
summed; a value equal on every replica, such as the learning rate, from
replica 0); a histogram of a tensor with the batch's rows (activations)
by adding the replicas' buckets, which is exact because TensorFlow's
histograms share one set of bucket limits; anything else (a histogram of
a weight, an image, an audio clip, a text) from replica 0.

Requires: the user graph's summary tensor and a function that gives the
runner's combination of a tensor ("first", "mean", "sum", "concat").
Guarantees: `merge` returns a serialized tf.compat.v1.Summary with replica
0's values in replica 0's order; a tag the graph does not name statically
comes from replica 0.
"""
from __future__ import annotations

import sys
from functools import lru_cache

import numpy as np
import tensorflow as tf

# the ops of tf.compat.v1.summary that give a serialized Summary
SUMMARY_OPS = ("MergeSummary", "ScalarSummary", "HistogramSummary", "ImageSummary",
               "AudioSummary", "AudioSummaryV2", "TensorSummary", "TensorSummaryV2")


def is_summary(t: tf.Tensor) -> bool:
    return t.op.type in SUMMARY_OPS


def parts(t: tf.Tensor, how_of) -> tuple:
    """((tag, how), ...) for the summary tensor t: how is "mean", "sum",
    "max", "min" or "norm" for a scalar the replicas combine so, "histogram" for a histogram of
    the batch's rows, "first" for the rest. `how_of(tensor)`: the
    runner's combination of a user-graph tensor."""
    out, stack = [], [t.op]
    while stack:
        op = stack.pop()
        if op.type == "MergeSummary":
            stack.extend(x.op for x in reversed(op.inputs))
            continue
        tags = tf.get_static_value(op.inputs[0]) if op.type in (
            "ScalarSummary", "HistogramSummary") else None
        if tags is None:
            continue
        how = how_of(op.inputs[1])
        if op.type == "HistogramSummary":
            how = "histogram" if how == "concat" else "first"
        elif how not in ("mean", "sum", "max", "min", "norm"):
            how = "first"
        out.extend((_text(tag), how) for tag in np.atleast_1d(tags))
    return tuple(out)


def merge(values: list, how: tuple) -> bytes:
    """One serialized Summary from the replicas' (`values`, bytes each),
    each tag combined as `how` ((tag, how), ...) says."""
    summaries = [_parsed(v) for v in values]
    rules, out = dict(how), summaries[0]
    tagged = [{v.tag: v for v in s.value} for s in summaries]
    for value in out.value:
        rule = rules.get(value.tag, "first")
        if rule == "first" or not all(value.tag in t for t in tagged):
            continue
        same = [t[value.tag] for t in tagged]
        if rule == "histogram":
            value.histo.CopyFrom(_added([v.histo for v in same]))
        else:
            numbers = [v.simple_value for v in same]
            value.simple_value = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min,
                                  "norm": np.linalg.norm}[rule](numbers)
    return out.SerializeToString()


def _parsed(value) -> tf.compat.v1.Summary:
    summary = tf.compat.v1.Summary()
    summary.ParseFromString(value)
    return summary


def _text(tag) -> str:
    return tag.decode() if isinstance(tag, bytes) else str(tag)


@lru_cache(maxsize=1)
def _limits() -> np.ndarray:
    """TensorFlow's default histogram bucket limits (tensorflow/core/lib/
    histogram/histogram.cc): 1e-12 times powers of 1.1 up to 1e20, their
    negations, 0 and +-DBL_MAX, in increasing order."""
    up, v = [], 1.0e-12
    while v < 1.0e20:
        up.append(v)
        v *= 1.1
    up.append(sys.float_info.max)
    return np.array([-x for x in reversed(up)] + [0.0] + up)


def _added(histograms) -> tf.compat.v1.HistogramProto:
    """The histogram of the union of the replicas' values: counts added by
    bucket, encoded as TensorFlow encodes one (a run of empty buckets as
    one entry at the run's last limit)."""
    limits = _limits()
    counts = np.zeros(len(limits))
    for h in histograms:
        for limit, count in zip(h.bucket_limit, h.bucket):
            if count:
                counts[int(np.searchsorted(limits, limit))] += count
    out = tf.compat.v1.HistogramProto(     # an empty one's min is +DBL_MAX, its max -DBL_MAX
        min=min(h.min for h in histograms), max=max(h.max for h in histograms),
        num=sum(h.num for h in histograms), sum=sum(h.sum for h in histograms),
        sum_squares=sum(h.sum_squares for h in histograms))
    i = 0
    while i < len(limits):
        end, count = limits[i], counts[i]
        i += 1
        if count <= 0:
            while i < len(limits) and counts[i] <= 0:
                end, count = limits[i], counts[i]
                i += 1
        out.bucket_limit.append(end)
        out.bucket.append(count)
    return out
