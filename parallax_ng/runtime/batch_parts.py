"""A global batch's parts: the rows a replica gets of a dense or a sparse
batch. A sparse batch is fed as a `sparse_placeholder`'s three tensors
(indices, values, dense shape); a replica's part is its rows' entries,
numbered from 0, under a dense shape of its rows, as one device would see
that part of the batch; `joined_rows` joins the replicas' sparse rows again
(a fetched SparseTensor, parallax_ng/runtime/combining.py).

Requires: numpy values (a sparse batch's indices with the row first).
Guarantees: pure functions of their arguments (`sparse_feeds` reads the
fetch map's names and config only); used by the fetch map's
feeds (parallax_ng/runtime/fetches.py), a TF2 step's batches
(parallax_ng/tf2.py) and the first step's sample (parallax_ng/build.py).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..errors import FetchError, UnevenFeed
from ..graph.ir import parse_tensor


def sparse_tensors(base: str) -> list[str]:
    """The three tensors of sparse placeholder `base` (`sparse_placeholder`'s
    name scope), in SparseTensor order: indices, values, dense shape."""
    return [f"{base}/{part}:0" for part in ("indices", "values", "shape")]


def sparse_placeholders(names: set) -> list[str]:
    """The sparse placeholders whose three tensors (`sparse_tensors`) are
    all among tensor `names`."""
    bases = (n[:-len("/indices:0")] for n in names if n.endswith("/indices:0"))
    return sorted(b for b in bases if set(sparse_tensors(b)) <= names)


def sparse_rows(indices, values, shape, first: int, count: int) -> tuple:
    """A sparse batch's rows first .. first + count - 1 as a sparse batch of
    `count` rows (numbered from 0): (indices, values, dense_shape) arrays."""
    indices, values, shape = np.asarray(indices), np.asarray(values), np.asarray(shape)
    mine = (indices[:, 0] >= first) & (indices[:, 0] < first + count)
    part = indices[mine].copy()
    part[:, 0] -= first
    return part, values[mine], np.concatenate([[count], shape[1:]]).astype(shape.dtype)


def joined_rows(parts: list):
    """The sparse batches `parts` as one: each part's rows after the rows of
    the parts before it (its dense shape's first dimension), the other
    dimensions the largest of the parts' (`sparse_rows` undone): a
    tf.compat.v1.SparseTensorValue."""
    offsets = np.cumsum([0] + [int(p.dense_shape[0]) for p in parts])
    indices = np.concatenate([np.asarray(p.indices).reshape(-1, len(p.dense_shape))
                              + np.eye(len(p.dense_shape), dtype=np.int64)[0] * offset
                              for p, offset in zip(parts, offsets)])
    shape = np.max([p.dense_shape for p in parts], axis=0)
    shape[0] = offsets[-1]
    return tf.compat.v1.SparseTensorValue(indices.astype(np.int64),
                                          np.concatenate([p.values for p in parts]),
                                          shape.astype(np.int64))


def first_part(batch: dict, parts: int) -> dict:
    """The first of `parts` equal parts of a global batch's feeds (tensor
    name -> value): a dense value's rows, a sparse placeholder's rows
    (its three tensors, `sparse_placeholders`); scalars whole."""
    out = {name: value[:len(value) // parts] if getattr(value, "ndim", 0) else value
           for name, value in batch.items()}
    for base in sparse_placeholders(set(batch)):
        names = sparse_tensors(base)
        triple = [batch[n] for n in names]
        out.update(zip(names, sparse_rows(*triple, 0, int(triple[2][0]) // parts)))
    return out


def sparse_feeds(fmap, feed_dict: dict, n: int) -> tuple[dict, dict]:
    """(the other feeds, the step graph's feeds of the sparse ones) of a fetch
    map's (parallax_ng/runtime/fetches.py) `feed_dict` over `n` replicas: a
    SparseTensor key (a `sparse_placeholder`), or its three tensors fed one by one, is a
    batch of rows: each replica gets its rows' entries (row numbers from 0, dense shape
    its rows), as one device would see its part; config `batch_feeds: {NAME/indices:
    false}` gives it whole to every replica."""
    triples = []
    for key in list(feed_dict):
        if isinstance(key, tf.SparseTensor):
            value = feed_dict.pop(key)
            if isinstance(value, tf.SparseTensor):
                raise FetchError(f"feed {key.indices.name.rsplit('/', 1)[0]!r} is given "
                                 "a SparseTensor; feed a tf.compat.v1.SparseTensorValue "
                                 "or (indices, values, dense_shape) of numpy arrays")
            triples.append(((key.indices, key.values, key.dense_shape), tuple(value)))
    names = {(n if ":" in n else n + ":0"): k
             for k, n in ((k, fmap.user_name(k)) for k in feed_dict)}
    for base in sparse_placeholders(set(names)):
        parts = sparse_tensors(base)
        triples.append((tuple(parts), tuple(feed_dict.pop(names[p]) for p in parts)))
    out = {}
    for tensors, (indices, values, shape) in triples:
        names = [fmap.user_name(t) for t in tensors]
        refs = [parse_tensor(t if ":" in t else t + ":0") for t in names]
        copies = [[f"{fmap.copy_name(k, r.node)}:{r.index}" for k in range(n)]
                  for r in refs]
        indices, values, shape = (np.asarray(indices), np.asarray(values),
                                  np.asarray(shape))
        whole = n == 1 or len(set(copies[0])) < n or \
            not fmap.config.batch_feeds.get(refs[0].node, True)
        if whole:
            for c, v in zip(copies, (indices, values, shape)):
                out.update(dict.fromkeys(c, v))
            continue
        rows = int(shape[0])
        if rows % n:
            raise UnevenFeed(
                f"sparse feed {refs[0].node.rpartition('/')[0]!r} has {rows} rows (its "
                f"dense_shape[0]), which do not split evenly over {n} replicas; feed a "
                f"multiple of {n}, or set config `batch_feeds: {{{refs[0].node}: false}}` "
                "if every replica needs it whole")
        each = rows // n
        for k in range(n):
            for c, v in zip(copies, sparse_rows(indices, values, shape, k * each, each)):
                out[c[k]] = v
    return feed_dict, out
