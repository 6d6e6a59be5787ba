"""Rows as int32 words (parallax_ng/comm/words.py): the same bits back for
every dtype a gradient or its indices can have; rows that do not fill
whole words are left to cross on their own."""
import numpy as np
import pytest
import tensorflow as tf

from parallax_ng.comm import words


@pytest.mark.parametrize("dtype,width", [("float32", 3), ("float16", 4), ("bfloat16", 2),
                                         ("float64", 3), ("int32", 1), ("int64", 1),
                                         ("float16", 6)])
def test_words_give_back_the_same_bits(dtype, width):
    rng = np.random.RandomState(0)
    raw = rng.randn(5, width) * 1e3
    x = tf.constant(raw.astype(np.int64) if dtype.startswith("int") else raw, tf.float64)
    x = tf.cast(x, dtype)
    assert words.per_row(dtype, width) == tf.as_dtype(dtype).size * width // 4
    w = words.to_words(x, width)
    assert w.dtype == tf.int32 and w.shape == (5, words.per_row(dtype, width))
    back = words.from_words(w, dtype, width)
    assert back.dtype == x.dtype and back.shape == (5, width)
    same = tf.bitcast(back, tf.int16 if x.dtype.size == 2 else tf.int32 if x.dtype.size == 4
                      else tf.int64) == tf.bitcast(x, tf.int16 if x.dtype.size == 2 else
                                                   tf.int32 if x.dtype.size == 4 else tf.int64)
    assert bool(tf.reduce_all(same))


def test_rows_that_do_not_fill_whole_words_are_not_carried():
    assert words.per_row("float16", 3) is None          # 6 bytes
    assert words.per_row("float32", None) is None       # width unknown
    assert words.per_row("float32", 0) is None
    assert words.per_row("int8", 4) == 1


@pytest.mark.parametrize("wire", [None, tf.float16, tf.bfloat16])
def test_slices_cross_as_words_and_come_back_as_they_were_sent(wire):
    """Values [rows, 2, 3] float32 and int64 ids through one copy of their
    words: the ids exactly, the values exactly or rounded to the wire."""
    values = tf.constant(np.random.RandomState(1).randn(4, 2, 3), tf.float32)
    ids = tf.constant([7, 2**40, 0, 3], tf.int64)
    layout = words.slices_layout(tf.float32, tf.int64, values.shape, wire)
    assert layout == (6, 6 if wire is None else 3)
    copies = []
    got_v, got_i = words.moved_slices(lambda t: copies.append(t) or t, values, ids, layout, wire)
    words_a_row = 6 + 2 if wire is None else 3 + 2       # the values', then the id's
    assert len(copies) == 1 and copies[0].dtype == tf.int32 and copies[0].shape == (4, words_a_row)
    want = values if wire is None else tf.cast(tf.cast(values, wire), tf.float32)
    np.testing.assert_array_equal(got_v.numpy(), want.numpy())
    np.testing.assert_array_equal(got_i.numpy(), ids.numpy())
    assert words.slices_layout(tf.float32, tf.int64, [None, None], wire) is None
