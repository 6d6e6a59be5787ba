"""Lookup tables a TF2 step reads (Keras's StringLookup, IntegerLookup and
TextVectorization, tf.lookup.StaticHashTable, StaticVocabularyTable),
rebuilt in the training graph that graph/tracing.py makes.

Requires: a traced step's inlined GraphDef and one of its captured
resources that is not a variable. Guarantees: `contents` gives the
table's keys and values as they are at capture (read with
LookupTableExportV2) when the step only reads it (finds, sizes, exports;
through Identity ops); a table the step changes (inserts, removes,
imports) or that cannot be exported is a GraphError naming it and what is
accepted (a tf.summary file writer that the step writes through, one
saying to write outside the step). `make` builds, in the current graph, a hash table of those
entries and the op that fills it, which runs with the variables'
initializer (filling it again is harmless): each replica's copy of the
step finds in its own copy of the table what the program's finds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from ..errors import GraphError

READS = frozenset({"LookupTableFindV2", "LookupTableSizeV2", "LookupTableExportV2"})
# ops that fill an immutable table once, in a TF1 graph (tables_initializer; a
# StaticHashTable's KeyValueTensorInitializer imports) or by `make`
FILLS = frozenset({"InitializeTableV2", "InitializeTableFromTextFileV2", "InitializeTable",
                   "InitializeTableFromTextFile", "LookupTableImportV2"})
MUTABLE = frozenset({"MutableHashTableV2", "MutableHashTable", "MutableHashTableOfTensorsV2",
                     "MutableHashTableOfTensors", "MutableDenseHashTableV2",
                     "MutableDenseHashTable"})
PASS = frozenset({"Identity", "IdentityN"})
# ops that write through a tf.summary file writer
_WRITES = frozenset({"WriteSummary", "WriteScalarSummary", "WriteHistogramSummary",
                     "WriteImageSummary", "WriteAudioSummary", "WriteRawProtoSummary",
                     "WriteGraphSummary", "FlushSummaryWriter"})


@dataclass
class Table:
    keys: np.ndarray
    values: np.ndarray
    key_dtype: tf.DType
    value_dtype: tf.DType


def contents(handle, name: str, graph_def) -> Table:
    """The entries of the table whose resource `handle` (eager) the step
    takes as the placeholder `name` of `graph_def`."""
    users = _users(graph_def, name)
    finds = [n for n in users if n.op == "LookupTableFindV2"]
    changes = sorted({n.op for n in users} - READS)
    if {n.op for n in users} & _WRITES:
        raise GraphError(f"the step writes summaries through {name!r} (tf.summary.scalar "
                         "and the like under a file writer, inside the step): each replica "
                         "would write its own part's values. Write them outside the step "
                         "from what it returns, which is one device's over the global batch "
                         "(`loss = step(x, y)`, then `with writer.as_default(): "
                         "tf.summary.scalar('loss', loss, step=...)`), or from a Keras "
                         "metric the step updates")
    if any(op.startswith("IteratorGetNext") for op in changes):
        raise GraphError(f"the step reads a dataset iterator ({name!r}: `next(iterator)` "
                         "inside the step), whose batches it cannot split among the "
                         "replicas: take the batch out of the iterator outside the step and "
                         "pass it as the step's arguments (`for x, y in dataset: loss = "
                         "step(x, y)`); each call's global batch is split among the replicas")
    if changes or not finds:
        what = (f"changes it ({', '.join(changes)})" if changes else
                "does not look keys up in it")
        raise GraphError(f"the step captures resource {name!r}, which is not a variable, and "
                         f"{what}: a lookup table the step only reads (StringLookup, "
                         "IntegerLookup, TextVectorization, tf.lookup.StaticHashTable) is "
                         "rebuilt in the training graph; a table it changes, a dataset "
                         "iterator or another resource is not")
    key_dtype = tf.as_dtype(finds[0].attr["Tin"].type)
    value_dtype = tf.as_dtype(finds[0].attr["Tout"].type)
    try:
        keys, values = tf.raw_ops.LookupTableExportV2(table_handle=handle, Tkeys=key_dtype,
                                                      Tvalues=value_dtype)
    except (tf.errors.OpError, TypeError, ValueError) as e:
        raise GraphError(f"the step reads the lookup table {name!r}, whose entries cannot be "
                         f"read to rebuild it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]})") from None
    return Table(keys.numpy(), values.numpy(), key_dtype, value_dtype)


def make(table: Table, name: str):
    """(the table's resource handle, the op that fills it) in the current graph."""
    handle = tf.raw_ops.HashTableV2(key_dtype=table.key_dtype, value_dtype=table.value_dtype,
                                    shared_name="", use_node_name_sharing=True, name=name)
    fill = tf.raw_ops.InitializeTableV2(
        table_handle=handle, keys=tf.constant(table.keys, table.key_dtype),
        values=tf.constant(table.values, table.value_dtype), name=f"{name}/fill")
    return handle, fill


def _users(graph_def, name: str) -> list:
    """The nodes that take `name`'s output, through Identity ops."""
    by_input: dict[str, list] = {}
    for node in graph_def.node:
        for i in node.input:
            by_input.setdefault(i.lstrip("^").split(":")[0], []).append(node)
    out, todo, seen = [], [name], {name}
    while todo:
        for node in by_input.get(todo.pop(), []):
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op in PASS:
                todo.append(node.name)
            else:
                out.append(node)
    return out
