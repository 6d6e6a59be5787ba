"""Checkpoints of a parallel job that resume exactly.

Requires: the runner's graph (replica 0 keeps the user's names) and the
PassContext that made it.
Guarantees: `save(step)` writes every variable of the user's graph (weights,
slots, moving averages, global step) under its single-device name, plus the
position of every replica's input iterator, to `<dir>/model.ckpt-<step>`
(in a multi-worker job each worker writes `<dir>/worker-<i>/`, the variables
being equal on all of them); `restore_latest()` puts the newest checkpoint
back into every replica's copy and every iterator (parameter-server
variables of a multi-worker job: by the chief only). A table cut by columns
over the replicas is saved whole (every part read, other workers' too) and
each replica restores its own columns. A job killed after step k
and started again continues from the last checkpoint and ends with the
variables of an uninterrupted run. The variable part is a plain checkpoint a
single-device `tf.compat.v1.train.Saver` restores.
"""
from __future__ import annotations

import os

import tensorflow as tf

from .compat import is_ref_dtype
from .placement import Columns, Sharded, part_name
from .results import ColumnParts, Deferred

ITERATOR_OPS = ("IteratorV2", "OneShotIterator", "Iterator")


class Checkpointer:
    def __init__(self, graph: tf.Graph, ctx, directory: str):
        plan = ctx.plan
        self.directory = (os.path.join(directory, f"worker-{plan.worker}")
                          if plan.num_workers > 1 else directory)
        names, tensors, restores = [], [], []
        parts = ctx.result(ColumnParts)
        with graph.as_default(), tf.device(plan.host), \
                tf.compat.v1.name_scope("parallax/checkpoint/"):
            self.prefix = tf.compat.v1.placeholder(tf.string, [], name="prefix")
            for var in sorted(ctx.tg.variables):
                names.append(var)
                placement = plan.placement[var]
                if isinstance(placement, Columns):
                    placement = parts.handles[var]
                tensors.append(read_value(graph, ctx.tg.variables[var], placement,
                                          gather=parts is not None and parts.gather))
            iterators = [n.name for n in ctx.tg.ir.nodes if n.op in ITERATOR_OPS]
            for it in iterators:
                for k in range(plan.num_replicas):
                    handle = graph.get_tensor_by_name(ctx.replica_name(k, it) + ":0")
                    names.append(f"parallax/iterator/{plan.replica_offset + k}/{it}")
                    tensors.append(tf.raw_ops.SerializeIterator(
                        resource_handle=handle, external_state_policy=0))
            self.save_op = tf.raw_ops.SaveV2(prefix=self.prefix, tensor_names=names,
                                             shape_and_slices=[""] * len(names),
                                             tensors=tensors)
            loaded = tf.raw_ops.RestoreV2(prefix=self.prefix, tensor_names=names,
                                          shape_and_slices=[""] * len(names),
                                          dtypes=[t.dtype.base_dtype for t in tensors])
            for var, value in zip(sorted(ctx.tg.variables), loaded):
                if var in plan.shared_state() and plan.worker > 0:
                    continue   # the chief restores parameter-server variables
                placement = plan.placement[var]
                if isinstance(placement, Columns):     # each replica its columns
                    restores += [assign_value(graph, ctx.replica_name(k, var), value[
                        :, s.start:s.start + s.size]) for k, s in enumerate(
                            placement.shards[plan.replica_offset:][:plan.num_replicas])]
                    continue
                copies = {ctx.replica_name(k, var) for k in range(plan.num_replicas)}
                restores += [assign_value(graph, c, value, placement) for c in sorted(copies)]
            for i, it in enumerate(iterators):
                for k in range(plan.num_replicas):
                    value = loaded[len(ctx.tg.variables) + i * plan.num_replicas + k]
                    handle = graph.get_tensor_by_name(ctx.replica_name(k, it) + ":0")
                    restores.append(tf.raw_ops.DeserializeIterator(
                        resource_handle=handle, serialized=value))
            deferred = ctx.result(Deferred)     # a restored table has no pending rows
            restores += [graph.get_operation_by_name(c) for c in deferred.clear] \
                if deferred else []
            self.restore_op = tf.group(*restores, name="restore")

    def save(self, session, step: int) -> str:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"model.ckpt-{step}")
        session.run(self.save_op, {self.prefix: path})
        tf.compat.v1.train.update_checkpoint_state(self.directory, path)
        return path

    def latest(self) -> str | None:
        return tf.train.latest_checkpoint(self.directory) if os.path.isdir(self.directory) \
            else None

    def restore(self, session, path: str) -> None:
        session.run(self.restore_op, {self.prefix: path})


def read_value(graph, var, placement=None, gather: bool = False):
    """A new op reading replica 0's value of Variable `var` (resource or
    reference; a sharded variable's parts put together: row ranges along
    axis 0, element ranges (1-D parts) flattened; given the handles of a
    variable cut by columns, its parts side by side, or with `gather` this
    process's part and the others' by all-gather)."""
    dtype = var.dtype.base_dtype
    if isinstance(placement, tuple):
        reads = [tf.raw_ops.ReadVariableOp(resource=graph.get_tensor_by_name(h + ":0"),
                                           dtype=dtype) for h in placement]
        if gather:
            from .horovod import join_columns
            return join_columns(reads[0])
        return tf.concat(reads, 1)
    if isinstance(placement, Sharded):
        parts = tf.concat([tf.raw_ops.ReadVariableOp(
            resource=graph.get_tensor_by_name(part_name(var.name, k) + ":0"), dtype=dtype)
            for k in range(len(placement.shards))], 0)
        return parts if placement.axis == 0 else tf.reshape(parts, var.shape)
    t = graph.get_tensor_by_name(var.name + ":0")
    if is_ref_dtype(t.dtype):
        return tf.identity(t)
    return tf.raw_ops.ReadVariableOp(resource=t, dtype=dtype)


def assign_value(graph, var: str, value, placement=None):
    """An op setting Variable `var` (by name) to `value`."""
    if isinstance(placement, Sharded):
        flat = value if placement.axis == 0 else tf.reshape(value, [-1])
        pieces = tf.split(flat, [s.size for s in placement.shards], 0)
        return tf.group(*[tf.raw_ops.AssignVariableOp(
            resource=graph.get_tensor_by_name(part_name(var, k) + ":0"), value=piece)
            for k, piece in enumerate(pieces)])
    t = graph.get_tensor_by_name(var + ":0")
    if is_ref_dtype(t.dtype):
        return tf.raw_ops.Assign(ref=t, value=value).op
    return tf.raw_ops.AssignVariableOp(resource=t, value=value)
