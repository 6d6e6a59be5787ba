"""Compressed gradients (`communication.compression: fp16 | bf16`): float32
gradients cross the network in 16 bits and are summed in float32.

An all-reduce becomes a reduce-scatter and an all-gather: each replica cuts
its gradient into N chunks and sends chunk j, in 16 bits, to replica j
(all-to-all); replica j adds the N chunks it got in float32 (in replica
order, so every replica's sum has the same bits), scales it for a mean,
and the sums go round in 16 bits (all-gather); each replica widens the
result back to float32. Every replica sends and receives (N-1)/N of the
gradient's 16-bit bytes each way: (N-1)/N x 4 bytes per float32 element in
all, half of a float32 ring all-reduce's 2(N-1)/N x 4. Where a server
sums (fusion buffers' shards, sparse rows), the pieces travel in 16 bits
and the server widens them before adding. Ids and every other tensor stay
exact.

Error: each replica's contribution is rounded once to 16 bits and so is
the sum: relative error about 2^-11 per element with fp16 (whose range
ends at 65504: larger gradients overflow to inf), 2^-8 with bf16 (float32's
range). Gradients of other dtypes (float64, float16 under a user's mixed
precision) are sent as they are.

Requires: TensorFlow. Guarantees: `wire_for(plan, dtype)`, the 16-bit
dtype a gradient travels in, or None; `scattered_sum`, TensorFlow code that all-reduces one replica's tensor
given the backend's all-to-all and all-gather; `carried`, any exchange of
a float32 tensor in 16 bits.
"""
from __future__ import annotations

import tensorflow as tf

WIRES = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}


def wire_for(plan, dtype):
    """The dtype a gradient of `dtype` travels in under `plan`'s compression
    (config `communication.compression`), or None (as it is: not float32,
    or no compression)."""
    if tf.as_dtype(dtype).base_dtype != tf.float32:
        return None
    return WIRES[plan.compression]


def scattered_sum(t: tf.Tensor, n: int, wire_dtype, mean: bool, all_to_all, all_gather):
    """The sum (or mean) over the n replicas of `t`, with 16-bit traffic:
    `all_to_all([n, m])` gives row j to replica j and returns the rows the
    replicas sent this one, in replica order; `all_gather([m])` returns every
    replica's [m], concatenated in replica order."""
    shape = tf.shape(t)
    flat = tf.reshape(t, [-1])
    size = tf.size(flat)
    padded = tf.pad(flat, [[0, (n - size % n) % n]])
    chunks = tf.reshape(padded, [n, -1])
    got = carried(all_to_all, chunks, wire_dtype)
    mine = tf.reduce_sum(got, 0)              # float32, in replica order
    if mean:
        mine = mine / n
    every = carried(all_gather, mine, wire_dtype)
    return tf.reshape(every[:size], shape)


def carried(move, t: tf.Tensor, wire_dtype) -> tf.Tensor:
    """`move(x)` (an exchange that only copies bytes) of float32 `t` in
    `wire_dtype`, back in float32. bfloat16 rides as float16's bits: the
    collectives take no bfloat16."""
    narrow = tf.cast(t, wire_dtype)
    if wire_dtype == tf.bfloat16:
        return tf.cast(tf.bitcast(move(tf.bitcast(narrow, tf.float16)), tf.bfloat16),
                       tf.float32)
    return tf.cast(move(narrow), tf.float32)
