"""`shard(ds)`: give every replica a disjoint part of a tf.data pipeline.

Requires: a `tf.data.Dataset` in tf.compat.v1 graph mode, consumed through an
iterator made in the graph (`tf.compat.v1.data.make_initializable_iterator`
or `make_one_shot_iterator`).
Guarantees: the returned dataset is `ds.shard(num_shards, index)` with two
marked constants, 1 and 0 by default, so the single-device graph reads all of
`ds` (a batched `ds` is sharded by its rows and batched again, `_unbatched`).
The replicate pass gives replica r of N the values (N, r): replica r reads
elements r, r+N, r+2N, ... of `ds` (elements, or file names when `ds` is a
file list), and the N replicas together read what one device reads
(a padded_batch given to `shard` pads the global batch, as one device's).
`set_shard(node, num_shards, index)` sets one of the marked constants (a
NodeDef of the graph or of a dataset function's body) to its value for a
shard; it is how every part of the project that splits inputs (the
shard_inputs pass, layer-to-layer's workers) recognizes and sets them.
`rows_apart(graph)` names the dataset ops between a shard and its batch
that act on each replica's part alone (a filter, a take; an interleave of
each part's files; a padded_batch to each part's longest).
`seeded_shuffles(nodes)` gives a dataset shuffle without seeds (seed and
seed2 both 0: a new order per iterator) seeds of
its own name, so every replica's copy (and every worker's) shuffles alike
and the shards stay disjoint; one device's order was random anyway.
`uneven_ends(graph, N)` names the iterators whose shards end after
unequal numbers of batches (rows of the last step untrained: build.py
prints the lines).
"""
from __future__ import annotations

import re
import zlib

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from .frontend import SHARD_SCOPE


def shard(ds: tf.data.Dataset) -> tf.data.Dataset:
    if not isinstance(ds, tf.data.Dataset):
        raise TypeError(f"shard() takes a tf.data.Dataset, not {type(ds).__name__}")
    with tf.compat.v1.name_scope(SHARD_SCOPE) as scope:
        num = tf.constant(1, tf.int64, name="num_shards")
        index = tf.constant(0, tf.int64, name="index")
    if not scope.rstrip("/").split("/")[-1].startswith(SHARD_SCOPE):
        raise RuntimeError(f"unexpected shard scope {scope!r}")
    inner, again = _unbatched(ds, num)
    return again(inner.shard(num, index))


def _unbatched(ds: tf.data.Dataset, num):
    """(rows, redo): for `rows.batch(...)` or `rows.padded_batch(...)`, each
    maybe prefetched, the rows and the function that batches (and
    prefetches) a dataset of rows again as `ds` does; else (ds, identity).
    Sharding batches would leave the last count-mod-N batches to some
    replicas only, and a step ends where the first replica's shard ends:
    those rows would go untrained, where one device trains them in a
    smaller last batch. Sharded rows, batched per replica, put every row
    in the step one device trains it in. Rows padded to the batch's
    longest are padded as the global batch's (`num` times the batch, then
    its rows sharded and batched per replica), as one device pads them:
    padded per replica, a loss that reads the padding would differ. (So
    every replica reads all the rows before the padded_batch: N times
    that part of the pipeline's work.)"""
    kind = lambda d: getattr(getattr(d, "_variant_tensor", None), "op", None)  # noqa: E731
    layers, d = [], ds
    while kind(d) is not None and kind(d).type == "PrefetchDataset" and \
            hasattr(d, "_buffer_size") and hasattr(d, "_input_dataset"):
        layers.append(lambda x, b=d._buffer_size: x.prefetch(b))
        d = d._input_dataset
    op = kind(d)
    try:
        if op is not None and op.type == "BatchDatasetV2" and not op.get_attr("parallel_copy"):
            layers.append(lambda x, b=d._batch_size, r=d._drop_remainder: x.batch(b, r))
        elif op is not None and op.type == "PaddedBatchDatasetV2":
            b, r = d._batch_size, d._drop_remainder
            layers.append(lambda x: x.batch(b, r))
        else:
            return ds, lambda x: x
        rows = d._input_dataset if op.type == "BatchDatasetV2" else d._input_dataset.padded_batch(
            d._batch_size * num, d._padded_shapes, d._padding_values, d._drop_remainder).unbatch()
    except (AttributeError, ValueError):        # another TensorFlow's private layout
        return ds, lambda x: x

    def again(x):
        for layer in reversed(layers):
            x = layer(x)
        return x
    return rows, again


def shard_constant(name: str) -> str | None:
    """"num_shards" or "index" when node `name` (in the graph or in a
    dataset function's body) is one of `shard`'s marked constants, else None."""
    scope, _, leaf = name.rpartition("/")
    leaf = re.sub(r"_\d+$", "", leaf)     # a dataset function's second copy of one
    if leaf in ("num_shards", "index") and scope.split("/")[-1].startswith(SHARD_SCOPE):
        return leaf
    return None


def set_shard(node, num_shards: int, index: int) -> bool:
    """Give marked constant `node` (a NodeDef, changed in place) its value
    for shard `index` of `num_shards`; False if it is not one."""
    which = shard_constant(node.name)
    if which is None:
        return False
    dtype = tf.as_dtype(node.attr["dtype"].type)
    value = num_shards if which == "num_shards" else index
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=dtype))
    return True


# dataset ops that draw from `seed` and `seed2` inputs: shuffles, their seed
# makers, and the random choice of sample_from_datasets
SHUFFLES = ("ShuffleDataset", "ShuffleDatasetV3", "ShuffleAndRepeatDataset",
            "ShuffleAndRepeatDatasetV2", "AnonymousSeedGenerator",
            "AnonymousRandomSeedGenerator", "RandomDataset", "RandomDatasetV2")


def seeded_shuffles(nodes: dict, user_name=lambda name: name) -> dict:
    """New NodeDefs (by name) that make every copy of `nodes` (name ->
    NodeDef, of the graph or of a function's body) read its dataset in one
    order: the seed inputs of every shuffle (SHUFFLES) whose seed and seed2
    are constants 0 become crc32 of the shuffle's user name (`user_name(node
    name)`, alike for every replica's copy) and of it with "/2"; a parallel
    map or interleave before a shard that may reorder its elements
    (`deterministic="false"`) keeps their order."""
    out = {}
    for node in _before_shards(nodes):
        if "deterministic" in node.attr and node.attr["deterministic"].s == b"false":
            new = type(node)()
            new.CopyFrom(node)
            new.attr["deterministic"].s = b"true"
            out[new.name] = new
    for node in nodes.values():
        if node.op not in SHUFFLES:
            continue
        args = [a.name for a in op_def_registry.get(node.op).input_arg]
        if "seed" not in args or "seed2" not in args:
            continue
        consts = [nodes.get(_source(node.input[args.index(a)])) for a in ("seed", "seed2")]
        if any(c is None or c.op != "Const" or tf.make_ndarray(c.attr["value"].tensor) != 0
               for c in consts):
            continue
        base = user_name(node.name)
        for const, key in zip(consts, (base, base + "/2")):
            new = type(const)()
            new.CopyFrom(const)
            value = np.int64(zlib.crc32(key.encode()) or 1)
            new.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=tf.int64))
            out[new.name] = new
    return out


def _before_shards(nodes: dict) -> list:
    """The nodes a ShardDataset with `shard`'s marked constants reads, directly
    or not."""
    stack = [_source(n.input[0]) for n in nodes.values() if n.op == "ShardDataset" and
             len(n.input) > 1 and shard_constant(_source(n.input[1])) == "num_shards"]
    seen = {}
    while stack:
        node = nodes.get(stack.pop())
        if node is None or node.name in seen:
            continue
        seen[node.name] = node
        stack.extend(_source(x) for x in node.input)
    return list(seen.values())


def _source(text: str) -> str:
    """The node an input names, in a graph's form (`x:1`, `^x`) or a
    function body's (`x:handle:0`)."""
    return text.lstrip("^").split(":")[0]


def uneven_ends(graph: tf.Graph, replicas: int) -> list[str]:
    """A line for each iterator over a `pn.shard` dataset whose replicas'
    parts end after unequal numbers of elements (batches): its count is
    not a multiple of the replicas (times their batch), so at the end of
    an epoch one replica's iterator ends while another's gives a last,
    smaller batch. That step ends the epoch (OutOfRangeError) and the
    rows the others read in it go untrained, where one device trains
    them in a smaller last batch. Counts are TensorFlow's own cardinality
    of each replica's part (initializable and one-shot iterators); a
    pipeline fed by placeholders, or of unknown or infinite count (a
    filter, files, `repeat()`), says nothing."""
    if replicas < 2 or not any(op.type in ("MakeIterator", "OneShotIterator")
                               for op in graph.get_operations()):
        return []
    gd = graph.as_graph_def()
    out = []
    for node in gd.node:
        if node.op == "MakeIterator":
            counts = _part_counts(gd, replicas, dataset=_source(node.input[0]))
        elif node.op == "OneShotIterator":
            counts = _part_counts(gd, replicas, factory=node.attr["dataset_factory"].func.name)
        else:
            continue
        if counts and min(counts) >= 0 and len(set(counts)) > 1:
            out.append(f"iterator {node.name!r}: its pn.shard dataset gives {counts[0]} "
                       f"batches an epoch to replica 0 and {counts[1]} to replica "
                       f"{replicas - 1} (of {replicas}), so the step "
                       "where the first of them ends is the epoch's end (OutOfRangeError), "
                       "and the rows the others read in it go untrained, where one device "
                       "trains them in a last, smaller batch; make the element count a "
                       "multiple of the replicas, batch with drop_remainder=True (as one "
                       "device would), or `repeat()` it")
    return out


# dataset ops that decide which rows go on (or in which groups) from the rows
# they see: after a shard, from each replica's part alone
_ROW_OPS = ("FilterDataset", "TakeDataset", "SkipDataset", "TakeWhileDataset",
            "GroupByWindowDataset", "ScanDataset", "WindowDataset", "UniqueDataset")
# dataset ops that make rows of each element (a file's records): after a
# shard, each replica's step takes rows of its own elements alone
_EXPANDS = ("FlatMapDataset", "InterleaveDataset", "ParallelInterleaveDatasetV2",
            "ParallelInterleaveDatasetV3", "ParallelInterleaveDatasetV4",
            "LegacyParallelInterleaveDatasetV2")
# after a shard: each replica's part reordered alone (a shuffle), or parts
# mixed by each replica's own choices (sample_from_datasets, choose_from_datasets)
_SHUFFLES_ROWS = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
                  "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2",
                  "DirectedInterleaveDataset")
_ANY_INPUT = ("ZipDataset", "DirectedInterleaveDataset")   # (a shard's part at any input)
_BATCHES = ("BatchDataset", "BatchDatasetV2", "PaddedBatchDataset", "PaddedBatchDatasetV2",
            "ParallelBatchDataset")


def rows_apart(graph: tf.Graph) -> list[str]:
    """A line for each dataset op between a `pn.shard` and the batch that
    acts on each replica's part alone where one device's acts on all the
    rows: one that keeps, takes or groups rows by what it has seen (a
    filter, a take), or makes rows of each element (an interleave of a
    file list's files), so a step's rows are not one device's global
    batch; and a padded_batch to each batch's longest row, whose padding (what an
    unmasked loss or the last position reads) differs from one device's."""
    gd, out = graph.as_graph_def(), []
    for nodes in [list(gd.node)] + [list(f.node_def) for f in gd.library.function]:
        by_name = {n.name: n for n in nodes}
        users: dict = {}
        for n in nodes:
            for x in n.input:
                users.setdefault(x.lstrip("^").split(":")[0], []).append(n)
        source = lambda x: by_name.get(x.lstrip("^").split(":")[0])    # noqa: E731
        todo = [n for n in nodes if n.op == "ShardDataset" and source(n.input[1]) is not None
                and shard_constant(source(n.input[1]).name)]
        seen, sharded = set(), _sharded(by_name)
        while todo:
            node = todo.pop()
            for user in users.get(node.name, ()):
                if user.name in seen or user.op not in _ANY_INPUT and \
                        user.input[0].lstrip("^").split(":")[0] != node.name:
                    continue
                seen.add(user.name)
                if user.op in _ROW_OPS or user.op in _SHUFFLES_ROWS:
                    out.append(f"{user.op} {user.name!r} comes after pn.shard() and acts on "
                               "each replica's part alone, so a step's rows are not one "
                               "device's global batch; apply it before pn.shard()")
                if user.op == "ZipDataset" and not all(
                        sharded(x) for x in user.input if not x.startswith("^")):
                    out.append(f"{user.op} {user.name!r} comes after pn.shard() and pairs "
                               "each replica's part with elements not sharded (enumerate's "
                               "counter, another dataset): a replica's row meets the first "
                               "of them, where one device's meets those at its position; "
                               "zip or enumerate before pn.shard(), or shard each part")
                if user.op in _EXPANDS:
                    out.append(f"{user.op} {user.name!r} comes after pn.shard() and makes "
                               "rows of each replica's own elements (whole files of a file "
                               "list), so a step's rows are other rows than one device's "
                               "global batch (each row is still read once an epoch), unless "
                               "every element makes the same number of rows and that divides "
                               "the batch; for one device's steps, shard the rows: "
                               "pn.shard(files.interleave(...)), every replica then reading "
                               "every file")
                if user.op.startswith("PaddedBatch") and _pads_to_longest(user, source):
                    out.append(f"{user.op} {user.name!r} comes after pn.shard(): each replica "
                               "pads its rows to the longest of its own part, where one "
                               "device pads the global batch to its longest, so what reads "
                               "the padding (an unmasked mean, the last position) differs; "
                               "pn.shard(ds.padded_batch(b)) pads as one device does (a "
                               "masked loss is exact either way)")
                if user.op not in _BATCHES:
                    todo.append(user)
    return list(dict.fromkeys(out))     # (a one-shot iterator's: in the graph and its function)


def _sharded(by_name: dict):
    """Whether a dataset (a node's input name) reads a `pn.shard`, by name."""
    memo = {}

    def sharded(x: str) -> bool:
        name = x.lstrip("^").split(":")[0]
        if name not in memo:
            memo[name], node = False, by_name.get(name)
            memo[name] = node is not None and (
                node.op == "ShardDataset" and shard_constant(node.input[1].split(":")[0]) or
                any(sharded(i) for i in node.input if not i.startswith("^")))
        return memo[name]
    return sharded


def _pads_to_longest(node, source) -> bool:
    """Whether padded_batch `node` pads a dimension to its batch's longest
    (a padded shape of -1, or one the graph computes)."""
    count = node.attr["N"].i
    for x in node.input[2:2 + count]:
        shape = source(x)
        if shape is None or shape.op != "Const" or \
                (tf.make_ndarray(shape.attr["value"].tensor) < 0).any():
            return True
    return False


def _part_counts(gd, replicas: int, dataset: str | None = None, factory: str | None = None):
    """The cardinality of replica 0's and of the last replica's part (the
    most and the fewest elements) of the dataset node `dataset` (of the
    graph) or of the one the one-shot function `factory` returns; None
    where the pipeline has no pn.shard, reads a placeholder, holds more
    than 64 MiB (its arrays, copied to count), or cannot run alone."""
    by_name, stack, kept = {n.name: n for n in gd.node}, [dataset] if dataset else [], {}
    while stack:                  # the nodes the dataset reads, directly or not
        name = stack.pop()
        if name in by_name and name not in kept:
            kept[name] = by_name[name]
            stack.extend(_source(x) for x in by_name[name].input)
    sub = tf.compat.v1.GraphDef(library=gd.library, versions=gd.versions)
    sub.node.extend(n for n in gd.node if n.name in kept)
    bodies = [f for f in sub.library.function if not factory or f.signature.name == factory]
    nodes = list(sub.node) + [n for f in bodies for n in f.node_def]
    if not any(shard_constant(n.name) for n in nodes) or sub.ByteSize() > 1 << 26 or \
            any(n.op.startswith("Placeholder") for n in nodes):
        return None
    for body in [sub.node] + [f.node_def for f in bodies]:
        _padded_rows_counted(body)
    counts = []
    for index in (0, replicas - 1):
        part = tf.compat.v1.GraphDef()
        part.CopyFrom(sub)
        for n in list(part.node) + [n for f in part.library.function for n in f.node_def]:
            set_shard(n, replicas, index)
        if factory:
            call = part.node.add(name="parallax_dataset", op="PartitionedCall")
            call.attr["f"].func.name = factory
            call.attr["Tout"].list.type.append(tf.variant.as_datatype_enum)
            call.attr["Tin"].list.SetInParent()
        g = tf.Graph()
        try:
            with g.as_default():
                tf.graph_util.import_graph_def(part, name="")
                count = tf.raw_ops.DatasetCardinality(input_dataset=g.get_tensor_by_name(
                    f"{dataset or 'parallax_dataset'}:0"))
            with tf.compat.v1.Session(graph=g) as session:
                counts.append(int(session.run(count)))
        except (tf.errors.OpError, ValueError, KeyError, TypeError):    # a count it cannot take
            return None
    return counts


def _padded_rows_counted(nodes) -> None:
    """In a copy to count (a GraphDef's nodes, or a function body's): each
    unbatch of a padded_batch (`_unbatched`'s global batches, padded as
    one device pads them) reads the padded_batch's rows instead, which
    TensorFlow counts (an unbatch's count it does not); unless the
    padded_batch drops a remainder (then every part ends alike)."""
    by_name = {n.name: n for n in nodes}
    swap = {}
    for n in nodes:
        inner = by_name.get(_source(n.input[0])) if n.op == "UnbatchDataset" else None
        while inner is not None and inner.op == "MapDataset":       # (its structure's)
            inner = by_name.get(_source(inner.input[0]))
        if inner is None or inner.op != "PaddedBatchDatasetV2":
            continue
        drop = by_name.get(_source([x for x in inner.input if not x.startswith("^")][-1]))
        if drop is not None and drop.op == "Const" and \
                not tf.make_ndarray(drop.attr["value"].tensor):
            swap[n.name] = inner.input[0]
    for n in nodes:
        for i, x in enumerate(n.input):
            if not x.startswith("^") and _source(x) in swap:
                n.input[i] = swap[_source(x)]
