"""Rows carried as int32 words, so that tensors of different dtypes cross
in one collective.

TensorFlow's collectives take one tensor of one dtype each (and only
bfloat16, float16, float32, float64, int32 and int64). A sparse
gradient's rows and their indices are two tensors of two dtypes: gathered
apart they cost two collectives a step, each with its own fixed cost (on
one host about 0.6 ms of a worker's CPU; on a network a round of
messages). Bitcast to int32 words and put side by side, each row's values
then its index, they cross in one, and are bitcast back on arrival:
the same bits, so nothing changes but the count of collectives.

Requires: rows whose element count is known (`width`) and whose bytes fill
whole words (`per_row`; `slices_layout` for an IndexedSlices). Guarantees:
`from_words(to_words(x, w), x.dtype, w)` has x's bits, as [rows, w];
`moved_slices` moves values and indices in one call of its collective.
"""
from __future__ import annotations

import tensorflow as tf

WORD = 4            # bytes of an int32


def per_row(dtype, width: int | None) -> int | None:
    """int32 words of one row of `width` elements of `dtype`; None when the
    width is unknown or the row's bytes are not whole words."""
    nbytes = tf.as_dtype(dtype).size * (width or 0)
    return nbytes // WORD if nbytes and nbytes % WORD == 0 else None


def slices_layout(value_type, index_type, value_shape, wire=None
                  ) -> tuple[int, int] | None:
    """(elements, int32 words) of an IndexedSlices row whose values (in
    `wire` under compression) and index both fill whole words, so they can
    cross in one collective (`moved_slices`); else None."""
    shape = tf.TensorShape(value_shape)
    width = shape[1:].num_elements() if shape.rank else None
    moved = per_row(wire or value_type, width)
    return (width, moved) if moved and per_row(index_type, 1) else None


def moved_slices(move, values: tf.Tensor, indices: tf.Tensor, layout: tuple[int, int],
                 wire=None) -> tuple[tf.Tensor, tf.Tensor]:
    """`move` (a collective that only copies rows, e.g. a gather) of the
    rows of `values` and `indices` at once, as int32 words laid out as
    `slices_layout` says, back as values (through `wire` under compression)
    and indices."""
    width, split = layout
    sent = values if wire is None else tf.cast(values, wire)
    got = move(tf.concat([to_words(sent, width), to_words(indices, 1)], 1))
    rows = from_words(got[:, :split], sent.dtype, width)
    rows = tf.reshape(rows, tf.concat([[-1], tf.shape(values)[1:]], 0))
    return (tf.cast(rows, values.dtype),
            tf.reshape(from_words(got[:, split:], indices.dtype, 1), [-1]))


def to_words(x: tf.Tensor, width: int) -> tf.Tensor:
    """`x` ([rows, ...], `width` elements a row) as [rows, per_row] int32."""
    size = x.dtype.size
    rows = tf.reshape(x, [-1, width])
    if x.dtype == tf.int32:
        return rows
    if size < WORD:                  # several elements a word
        return tf.bitcast(tf.reshape(rows, [-1, width * size // WORD, WORD // size]), tf.int32)
    return tf.reshape(tf.bitcast(rows, tf.int32), [-1, width * size // WORD])


def from_words(words: tf.Tensor, dtype, width: int) -> tf.Tensor:
    """[rows, per_row] int32 back to [rows, `width`] of `dtype`."""
    dtype = tf.as_dtype(dtype)
    if dtype == tf.int32:
        return words
    if dtype.size < WORD:
        return tf.reshape(tf.bitcast(words, dtype), [-1, width])
    return tf.bitcast(tf.reshape(words, [-1, width, dtype.size // WORD]), dtype) \
        if dtype.size > WORD else tf.bitcast(words, dtype)
