"""`shard(ds)`: give every replica a disjoint part of a tf.data pipeline.

Requires: a `tf.data.Dataset` in tf.compat.v1 graph mode, consumed through an
iterator made in the graph (`tf.compat.v1.data.make_initializable_iterator`
or `make_one_shot_iterator`).
Guarantees: the returned dataset is `ds.shard(num_shards, index)` with two
marked constants, 1 and 0 by default, so the single-device graph reads all of
`ds`. The replicate pass gives replica r of N the values (N, r): replica r
reads elements r, r+N, r+2N, ... of `ds` (elements, or file names when `ds`
is a file list), and the N replicas together read what one device reads.
"""
from __future__ import annotations

import tensorflow as tf

from .frontend import SHARD_SCOPE


def shard(ds: tf.data.Dataset) -> tf.data.Dataset:
    if not isinstance(ds, tf.data.Dataset):
        raise TypeError(f"shard() takes a tf.data.Dataset, not {type(ds).__name__}")
    with tf.compat.v1.name_scope(SHARD_SCOPE) as scope:
        num = tf.constant(1, tf.int64, name="num_shards")
        index = tf.constant(0, tf.int64, name="index")
    if not scope.rstrip("/").split("/")[-1].startswith(SHARD_SCOPE):
        raise RuntimeError(f"unexpected shard scope {scope!r}")
    return ds.shard(num, index)
