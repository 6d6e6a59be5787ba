"""All-gathers of sparse gradients (IndexedSlices) over the replicas by
TensorFlow's collectives, whose instances each keep one shape.

- `counts`: the row counts of several gradients, one gather for all;
- `slices`: a gradient's rows and indices from every replica, padded to the
  longest replica's count and gathered under the key of that count (its
  range's first plus the count), in one gather of int32 words where its
  rows fill whole words (parallax_ng/comm/words.py), else values and
  indices apart; the padding dropped after;
- `longest`: the largest count, checked against a range's keys.

Requires: a `gather(t, n, key)` that builds the collective (collectives.py
gives TensorFlow's). Guarantees: every replica gets the same rows, in
replica order.
"""
from __future__ import annotations

import tensorflow as tf

from . import compression, words
from .keys import RANGE_KEYS


def counts(indices, n: int, gather) -> list:
    """Each of `indices`' row counts on every one of the `n` replicas, from
    one `gather(t)`."""
    mine = tf.stack([tf.shape(i, out_type=tf.int32)[0] for i in indices])
    every = tf.reshape(gather(mine), [n, len(indices)])
    return [tf.identity(every[:, j], name=f"counts_{j}") for j in range(len(indices))]


def slices(values, indices, n: int, keys, mean: bool, gather, wire=None, sizes=None,
           together=None):
    """IndexedSlices gathered from every replica: sizes first, every part
    padded to the longest, the padding dropped after. TensorFlow fixes a
    collective instance's shape at its first run, and the longest part
    changes from step to step (a last short batch, coalesced rows), so the
    padded parts are gathered under the instance key of their range plus
    the longest size: every key always sees one shape. With `wire`, the
    values travel in that dtype (compression). Values and indices cross
    in one gather as int32 words laid out as `together` says (words.py
    `slices_layout`; `keys[2]` None), else in two. `sizes`: every replica's row count,
    gathered already (`counts`; `keys[0]` None). `gather(t, n, key)`:
    the collective, under instance `key`."""

    def all_gather(t, key):
        return gather(t, n, key)

    size = tf.shape(indices, out_type=tf.int32)[:1]
    if sizes is None:
        sizes = all_gather(size, keys[0])
    most = longest(sizes)
    pad = most - size[0]
    rest = tf.zeros(tf.stack([tf.rank(values) - 1, 2]), tf.int32)
    padded_v = tf.pad(values, tf.concat([[[0, pad]], rest], 0))
    padded_i = tf.pad(indices, [[0, pad]])
    mask = tf.reshape(tf.sequence_mask(sizes, most), [-1])
    if together:
        gathered_v, gathered_i = words.moved_slices(
            lambda t: tf.boolean_mask(all_gather(t, keys[1] + most), mask),
            padded_v, padded_i, together, wire)
    elif wire is not None:
        gathered_v = compression.carried(lambda t: all_gather(t, keys[1] + most),
                                         padded_v, wire)
    else:
        gathered_v = all_gather(padded_v, keys[1] + most)
    if not together:
        gathered_v = tf.boolean_mask(gathered_v, mask)
        gathered_i = tf.boolean_mask(all_gather(padded_i, keys[2] + most), mask)
    if mean:
        gathered_v = gathered_v * tf.cast(1.0 / n, values.dtype)
    return tf.identity(gathered_v, "values"), tf.identity(gathered_i, "indices")


def longest(sizes):
    """The largest of the replicas' row counts (at least 1: a collective of
    no elements crashes TensorFlow's CPU kernels), checked against the keys
    a range has (one per count)."""
    most = tf.maximum(tf.reduce_max(sizes), 1)
    check = tf.debugging.assert_less(most, RANGE_KEYS, message=(
        f"an all-gathered or exchanged tensor has more than {RANGE_KEYS} rows on a "
        "replica"))
    with tf.control_dependencies([check]):
        return tf.identity(most)
