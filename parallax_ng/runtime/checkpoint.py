"""Checkpoints of a parallel job that resume exactly.

Requires: the runner's graph and its `Layout`: where the user's variables
and iterators are in it (the passes' replicas, replica 0 under the user's
names, from the PassContext; or layer-to-layer's host).
Guarantees: `save(step)` writes every variable of the user's graph (weights,
slots, moving averages, global step) under its single-device name to
`<dir>/model.ckpt-<step>`, and the position of every replica's input
iterator and random stream (the call counters of
transforms/counted_draws.py): in one process in the same file; in a
multi-worker job worker 0 writes the variables once (they are equal on
every worker) and every worker writes its own replicas' positions to
`<dir>/inputs/worker-<i>/` (with them its replicas' accumulators of
gradients, graph/accumulation.py, each replica's own: the variable's entry
holds their mean, one device's value),
and worker 0 names the step in `<dir>/checkpoint` only once every
worker's positions for it are there (so `<dir>` must be storage every
worker shares; a worker that cannot see the others' files is an error
that says so). `latest()` and `restore()` put the newest such step back
into every replica's copy, every iterator and random stream (a candidate
sampler's by calling it again as often as its counter says) (parameter-server variables
of a multi-worker job: by the chief only). A table cut by columns over the
replicas is saved whole (every part read, other workers' too) and each
replica restores its own columns; then the job's workers meet
(`PartsWritten.meet`), so no worker reads a part another has not restored. A job killed after step k and started
again continues from the last checkpoint and ends with the variables of an
uninterrupted run. The variable part is a plain checkpoint a single-device
`tf.compat.v1.train.Saver` restores.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

from ..compat import is_ref_dtype
from ..errors import ParallaxError
from ..pipeline.results import ColumnParts, CountedDraws, Deferred, PartsWritten
from ..planning.placement import Columns, Sharded, part_name

ITERATOR_OPS = ("IteratorV2", "OneShotIterator", "Iterator")


class CheckpointError(ParallaxError):
    """A checkpoint of a job cannot be written or read as one."""


@dataclass(frozen=True)
class Layout:
    """Where a step graph keeps the user's state: every variable (under
    `replica_name(k, var)` in each of this process's `copies` replicas, or
    by its `placement`) and every input iterator (one per replica); the
    data-parallel passes' layout (`of(ctx)`) or layer-to-layer's (every
    variable and iterator once, on the host)."""
    tg: object                      # the user's TrainingGraph
    host: str                       # the device of the checkpoint's ops
    worker: int = 0
    workers: int = 1
    copies: int = 1                 # replicas of the user's nodes in this process
    offset: int = 0                 # job-wide index of this process's replica 0
    placement: dict = field(default_factory=dict)   # variable -> Placement
    shared: frozenset = frozenset()  # variables that exist once: the chief restores them
    replica_name: Callable = field(default=lambda k, name: name)
    parts: ColumnParts | None = None
    clear: tuple = ()               # ops that drop a restored table's pending rows
    draws: tuple = ()               # (job replica, random op, its call counter's handle)
    replays: tuple = ()             # (counter's handle, sampler, classes): called again
    meet: str | None = None         # every worker runs it after restoring its parts

    @classmethod
    def of(cls, ctx) -> "Layout":
        """The layout of the graph the passes made with `ctx`."""
        plan, deferred, counted = ctx.plan, ctx.result(Deferred), ctx.result(CountedDraws)
        written = ctx.result(PartsWritten)
        return cls(ctx.tg, plan.host, plan.worker, plan.num_workers, plan.num_replicas,
                   plan.replica_offset, dict(plan.placement), frozenset(plan.shared_state()),
                   ctx.replica_name, ctx.result(ColumnParts),
                   tuple(deferred.clear) if deferred else (),
                   tuple((r, op, h) for (r, op), h in sorted(counted.calls.items()))
                   if counted else (), tuple(counted.replays) if counted else (),
                   written.meet if written else None)


class Checkpointer:
    def __init__(self, graph: tf.Graph, layout: Layout, directory: str,
                 timeout_seconds: float = 300):
        lay, tg = layout, layout.tg
        self.directory, self.timeout = directory, timeout_seconds
        self.worker, self.workers = lay.worker, lay.workers
        self.inputs = (os.path.join(directory, "inputs", f"worker-{lay.worker}")
                       if lay.workers > 1 else directory)
        names, tensors, restores = [], [], []
        parts = lay.parts
        with graph.as_default(), tf.device(lay.host), \
                tf.compat.v1.name_scope("parallax/checkpoint/"):
            self.prefix = tf.compat.v1.placeholder(tf.string, [], name="prefix")
            self.input_prefix = tf.compat.v1.placeholder_with_default(self.prefix, [],
                                                                      name="input_prefix")
            sums = sorted(tg.accumulators)   # replica-local sums of gradients
            for var in sorted(tg.variables):
                names.append(var)
                placement = lay.placement.get(var)
                if isinstance(placement, Columns):
                    placement = parts.handles[var]
                if var in sums:     # one device's: the replicas' mean (this process's)
                    tensors.append(tf.add_n(self._copies(graph, lay, var)) / lay.copies)
                    continue
                tensors.append(read_value(graph, tg.variables[var], placement,
                                          gather=parts is not None and parts.gather))
            step = tf.compat.v1.train.get_global_step(tg.graph)
            self.step = tensors[names.index(step.op.name)] \
                if step is not None and step.op.name in names else None
            inputs, positions = [], []
            iterators = [n.name for n in tg.ir.nodes if n.op in ITERATOR_OPS]
            for it in iterators:
                for k in range(lay.copies):
                    handle = graph.get_tensor_by_name(lay.replica_name(k, it) + ":0")
                    inputs.append(f"parallax/iterator/{lay.offset + k}/{it}")
                    positions.append(tf.raw_ops.SerializeIterator(
                        resource_handle=handle, external_state_policy=0))
            for r, op, handle in lay.draws:       # where each random stream is
                inputs.append(f"parallax/draws/{r}/{op}")
                positions.append(tf.raw_ops.ReadVariableOp(
                    resource=graph.get_tensor_by_name(handle + ":0"), dtype=tf.int64))
            for var in sums:             # and each replica's own, as its input position
                inputs += [f"parallax/accumulator/{lay.offset + k}/{var}"
                           for k in range(lay.copies)]
                positions += self._copies(graph, lay, var)
            self.save_op = self._save_ops(names, tensors, inputs, positions, parts)
            loaded = self._restored(names, tensors) if self.workers > 1 else \
                self._restored(names + inputs, tensors + positions)
            moved = self._restored(inputs, positions, self.input_prefix) \
                if self.workers > 1 else loaded[len(names):]
            for var, value in zip(sorted(tg.variables), loaded):
                if var in lay.shared and lay.worker > 0 or var in sums:
                    continue   # the chief restores parameter-server variables
                placement = lay.placement.get(var)
                if isinstance(placement, Columns):     # each replica its columns
                    restores += [assign_value(graph, lay.replica_name(k, var), value[
                        :, s.start:s.start + s.size]) for k, s in enumerate(
                            placement.shards[lay.offset:][:lay.copies])]
                    continue
                copies = {lay.replica_name(k, var) for k in range(lay.copies)}
                restores += [assign_value(graph, c, value, placement) for c in sorted(copies)]
            for i, it in enumerate(iterators):
                for k in range(lay.copies):
                    value = moved[i * lay.copies + k]
                    handle = graph.get_tensor_by_name(lay.replica_name(k, it) + ":0")
                    restores.append(tf.raw_ops.DeserializeIterator(
                        resource_handle=handle, serialized=value))
            for (_, _, handle), value in zip(lay.draws, moved[len(iterators) * lay.copies:]):
                restores.append(tf.raw_ops.AssignVariableOp(
                    resource=graph.get_tensor_by_name(handle + ":0"), value=value))
            own = moved[len(iterators) * lay.copies + len(lay.draws):]
            for i, var in enumerate(sums):
                restores += [assign_value(graph, lay.replica_name(k, var),
                                          own[i * lay.copies + k]) for k in range(lay.copies)]
            restores += [graph.get_operation_by_name(c) for c in lay.clear]
            self.restore_op = tf.group(*restores, name="restore")
            # a job's workers meet after restoring their parts of cut tables
            self.meet = graph.get_operation_by_name(lay.meet) if lay.meet else None
            self._replays = [(tf.raw_ops.ReadVariableOp(
                resource=graph.get_tensor_by_name(handle + ":0"), dtype=tf.int64),
                graph.get_tensor_by_name(sampler + ":0"), graph.get_tensor_by_name(classes))
                for handle, sampler, classes in lay.replays]

    @staticmethod
    def _copies(graph, lay, var: str) -> list:
        """This process's replicas' values of mirrored variable `var`."""
        v = lay.tg.variables[var]
        return [read_value(graph, replace(v, name=lay.replica_name(k, var)))
                for k in range(lay.copies)]

    def global_step(self, session) -> int | None:
        """The user's global step (None when the graph has none)."""
        return None if self.step is None else int(session.run(self.step))

    def _save_ops(self, names, tensors, inputs, positions, parts):
        """One process: variables and positions in one file. A job: worker 0
        writes the variables (the others join in where reading a cut table
        takes all of them), every worker its positions to its own file."""
        def save(prefix, keys, values):
            return tf.raw_ops.SaveV2(prefix=prefix, tensor_names=keys,
                                     shape_and_slices=[""] * len(keys), tensors=values)
        if self.workers == 1:
            return save(self.prefix, names + inputs, tensors + positions)
        ops = [save(self.prefix, names, tensors) if self.worker == 0 else
               tf.group(*tensors) if parts is not None and parts.gather else tf.no_op()]
        if inputs:
            ops.append(save(self.input_prefix, inputs, positions))
        return tf.group(*ops)

    def _restored(self, keys, like, prefix=None):
        if not keys:
            return []
        return tf.raw_ops.RestoreV2(prefix=self.prefix if prefix is None else prefix,
                                    tensor_names=keys, shape_and_slices=[""] * len(keys),
                                    dtypes=[t.dtype.base_dtype for t in like])

    def save(self, session, step: int) -> str:
        path = os.path.join(self.directory, f"model.ckpt-{step}")
        mine = os.path.join(self.inputs, f"model.ckpt-{step}")
        os.makedirs(self.inputs, exist_ok=True)
        session.run(self.save_op, {self.prefix: path, self.input_prefix: mine})
        if self.workers > 1:
            _point(self.inputs, mine)
            if self.worker > 0:
                return path
            self._wait_for_every_worker(step)
        _point(self.directory, path)
        return path

    def _wait_for_every_worker(self, step: int) -> None:
        """Until every worker's positions for `step` are in the directory."""
        deadline = time.monotonic() + self.timeout
        for w in range(1, self.workers):
            where = os.path.join(self.directory, "inputs", f"worker-{w}")
            while _step_of(tf.train.latest_checkpoint(where)) != step:
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"checkpoint.dir {self.directory!r}: worker 0 does not see worker "
                        f"{w}'s input positions for step {step} in {where!r} after "
                        f"{self.timeout:g} s; checkpoint.dir must be storage every worker "
                        "of the job shares (a network file system, say)")
                time.sleep(0.05)

    def latest(self) -> str | None:
        """The newest checkpoint of the job (its step's positions of this
        worker included), or None."""
        path = tf.train.latest_checkpoint(self.directory) if os.path.isdir(self.directory) \
            else None
        if self.workers > 1:
            mine = tf.train.latest_checkpoint(self.inputs) if os.path.isdir(self.inputs) \
                else None
            if path is None and mine is not None:
                raise CheckpointError(
                    f"checkpoint.dir {self.directory!r}: worker {self.worker} finds its own "
                    f"input positions ({mine!r}) but no checkpoint of the job: worker 0 "
                    "writes that one, so checkpoint.dir must be storage every worker of the "
                    "job shares (a network file system, say)")
        return path

    def restore(self, session, path: str) -> int:
        """Put checkpoint `path` back; its step."""
        step = _step_of(path)
        mine = os.path.join(self.inputs, f"model.ckpt-{step}")
        session.run(self.restore_op, {self.prefix: path, self.input_prefix: mine})
        if self.meet is not None:
            session.run(self.meet, options=tf.compat.v1.RunOptions(
                timeout_in_ms=int(self.timeout * 1000)))
        for calls, sampler, classes in self._replays:   # its stream where it was
            shape = classes.shape.as_list() if classes.shape.rank is not None else \
                [1, sampler.op.get_attr("num_true")]
            fed = {classes: np.zeros([d or 1 for d in shape], np.int64)}
            for _ in range(int(session.run(calls))):
                session.run(sampler, fed)
        return step


def _point(directory: str, path: str) -> None:
    """The directory's `checkpoint` file names `path` as its latest (what
    tf.compat.v1.train.update_checkpoint_state writes, without the
    deprecation notice every job printed from here)."""
    checkpoint_management.update_checkpoint_state_internal(directory, path)


def _step_of(path: str | None) -> int | None:
    return int(path.rsplit("-", 1)[1]) if path else None


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
            from ..comm.horovod import join_columns
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
