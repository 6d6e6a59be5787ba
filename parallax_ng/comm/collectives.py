"""Communication as abstract operations, lowered once per backend.

Passes ask `ctx.comm` (the plan's backend's `Collectives`) for an
operation and get graph nodes back; no pass knows which backend it is.

Requires: the plan (devices, group size, worker) and, for
TensorFlow collectives, the graph's instance keys.
Guarantees, for every backend:
- `all_reduce(scope, tensors, dtype, mean, gradient=False)`: one tensor per
  local replica in, one name per local replica out, each the sum (or mean)
  over every replica of the job; a `gradient` travels in 16 bits where the
  plan compresses gradients (parallax_ng/comm/compression.py);
- `all_gather(scope, values, indices, ...)`: an IndexedSlices per local
  replica in; per replica the concatenation of every replica's slices
  (values scaled by 1/N for a mean; in 16 bits under compression);
  `counts`: every replica's row count, from `gather_counts` (TensorFlow's
  collectives only: one gather of the counts of several gradients; the
  rows and ids by parallax_ng/comm/gathers.py);
- `columns_lookup(scope, ids, handles, part, dtype, id_type, distinct)`:
  rows of a table cut by columns over the replicas (`placement.Columns`),
  one ids tensor and one handle of the replica's part per local replica
  in; per replica the full rows of its ids (EmbRace's forward AlltoAll;
  with `distinct`, a repeated id's row crosses once), and the gathered
  sizes and ids;
- `columns_gradient(scope, values, indices, part, ...)`: the IndexedSlices
  gradient of such a table per local replica in; per replica every
  replica's rows, cut to its own columns (scaled by 1/N for a mean), and
  their indices (the backward AlltoAll; given a lookup's gathered sizes and
  ids when the rows are its distinct ids, nothing is gathered again);
- `join_columns(name, handles, part, dtype, device)`: the whole value of
  such a table from the handles of its parts this worker has (`reaches_parts`:
  whether those are all of them, or this worker's only);
- `op_types`: the prefixes of the op types its exchanges are made of (an op
  after one of them runs only once every worker has entered the step);
- `broadcast(scope, value, dtype, shape)`: worker 0's `value` on every
  worker, as a `Broadcast`: the tensor this worker should use and the ops
  its use must wait for;
- `server_sum(scope, tensor, dtype, server, scale, gradient=False)`: every
  worker's `tensor` (one per worker, equal shapes) summed on the
  parameter-server device `server`, times `scale`, back on every worker
  (`server_sum`, below: queues on the server, no collective op, so any
  backend uses it; a `gradient` in 16 bits each way under compression).
New nodes live under `scope`. TensorFlow's lowering is here; Horovod's is in
parallax_ng/comm/horovod.py. `HostCollectives` are the same operations for
a graph built with TensorFlow's own ops (layer-to-layer's), among one host
device per worker: `all_reduce(t)` and `broadcast(value)` /
`receive(dtype, shape)`, instance keys in call order (the same on every
worker that builds the same graph).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tensorflow as tf

from ..graph import emit
from . import compression, gathers, words
from .keys import HOSTS_GROUP, JOB_GROUP, WORKERS_GROUP, InstanceKeys

GROUP_KEY = JOB_GROUP
BROADCAST_GROUP_KEY = WORKERS_GROUP
# A collective op with a timeout of its own makes TensorFlow start a thread
# per run of the op, which sleeps out the whole timeout (its watchdog), so a
# job of many all-reduces per step piles up threads until the process can
# make no more (thousands within a minute at 300 s). The ops get none; the
# runner bounds every session run instead (RunOptions.timeout_in_ms, from
# config communication.timeout_seconds), which cancels a stuck collective.
OP_TIMEOUT_SECONDS = 0.0


@dataclass(frozen=True)
class Broadcast:
    nodes: list
    value: str                                   # what this worker uses
    before: list = field(default_factory=list)   # control inputs for its use


class TFCollectives:
    """TensorFlow's collective ops (CollectiveReduce, CollectiveGatherV2,
    CollectiveBcastSend/Recv), one instance key per operation."""
    reaches_parts = True     # a worker's graph may read another worker's variables
    op_types = ("Collective",)

    def __init__(self, plan, instance_keys):
        self.plan, self.keys = plan, instance_keys

    def all_reduce(self, scope: str, tensors: list[str], dtype, mean: bool,
                   gradient: bool = False):
        plan, key = self.plan, self.keys.take()
        wire = compression.wire_for(plan, dtype)
        if gradient and plan.group_size > 1 and wire is not None:
            return self._scattered(scope, tensors, dtype, mean, wire, key)
        nodes = [emit.collective_reduce(
            f"{scope}/replica_{k}", t, dtype, device, group_size=plan.group_size,
            group_key=GROUP_KEY, instance_key=key, mean=mean, timeout=OP_TIMEOUT_SECONDS)
            for k, (t, device) in enumerate(zip(tensors, plan.devices))]
        return nodes, [n.name for n in nodes]

    def _scattered(self, scope, tensors, dtype, mean, wire, key):
        """A compressed all-reduce: all-to-all of 16-bit chunks, float32
        sums, all-gather of them (parallax_ng/comm/compression.py)."""
        plan, gather_key = self.plan, self.keys.take()
        common = dict(group_size=plan.group_size, group_key=GROUP_KEY, ordering_token=[],
                      communication_hint="auto", timeout_seconds=OP_TIMEOUT_SECONDS)
        nodes, outs = [], []
        for k, (t, device) in enumerate(zip(tensors, plan.devices)):
            made, (out,) = emit.emit_traced(
                lambda x: tf.identity(compression.scattered_sum(
                    x, plan.group_size, wire, mean,
                    lambda c: tf.raw_ops.CollectiveAllToAllV2(input=c, instance_key=key,
                                                              **common),
                    lambda c: tf.raw_ops.CollectiveGatherV2(input=c, instance_key=gather_key,
                                                            **common)), "sum"),
                [(t, dtype, None)], f"{scope}/replica_{k}", device)
            nodes.extend(made)
            outs.append(out)
        return nodes, outs

    def gather_counts(self, scope: str, indices: list[list[str]], index_types: list):
        """The row counts of several sparse gradients (`indices`: per
        gradient, its indices on each local replica) gathered in one
        collective: (nodes, per gradient the [group size] counts on each
        local replica), for `all_gather`'s `counts`."""
        plan, key = self.plan, self.keys.take()
        n = plan.group_size
        nodes, out = [], [[] for _ in indices]
        for k, device in enumerate(plan.devices):
            made, counts = emit.emit_traced(
                lambda *idx: gathers.counts(idx, n, lambda t: _gather(t, n, key)),
                [(ids[k], t, [None]) for ids, t in zip(indices, index_types)],
                f"{scope}/replica_{k}", device)
            nodes += made
            for j, c in enumerate(counts):
                out[j].append(c)
        return nodes, out

    def all_gather(self, scope: str, values: list[str], indices: list[str], value_type,
                   index_type, value_shape, mean: bool, counts: list[str] | None = None):
        plan, n = self.plan, self.plan.group_size
        wire = compression.wire_for(plan, value_type)
        together = words.slices_layout(value_type, index_type, value_shape, wire)
        what = f"all_gather {scope} {value_type} {value_shape} {index_type} {wire} {together}"
        keys = (None if counts else self.keys.take(), self.keys.take_range(what),
                None if together else self.keys.take_range(what + " indices"))
        nodes, out_v, out_i = [], [], []
        for k, device in enumerate(plan.devices):
            made, (v, i) = emit.emit_traced(
                lambda vals, idx, *sizes: gathers.slices(vals, idx, n, keys, mean, _gather,
                                                         wire, *sizes, together=together),
                [(values[k], value_type, value_shape), (indices[k], index_type, [None])] +
                ([(counts[k], tf.int32, [plan.group_size])] if counts else []),
                f"{scope}/replica_{k}", device)
            nodes.extend(made)
            out_v.append(v)
            out_i.append(i)
        return nodes, out_v, out_i

    def server_sum(self, scope: str, tensor: str, dtype, server: str, scale: float,
                   gradient: bool = False, branched: bool = False):
        return server_sum(self.plan, scope, tensor, dtype, server, scale, gradient,
                          self.keys.shared, branched)

    def _exchange_ops(self, what: str):
        """(gather of one int32 per replica, gather of padded rows, all-to-all
        of [N, ...] blocks): collective ops under fresh keys; the shapes of
        the last two change with the longest part L, so their key is their
        range's first plus L."""
        n = self.plan.group_size
        keys = (self.keys.take(), self.keys.take_range(what + " ids"),
                self.keys.take_range(what + " exchange"))
        common = dict(group_size=n, group_key=GROUP_KEY, ordering_token=[],
                      communication_hint="auto", timeout_seconds=OP_TIMEOUT_SECONDS)
        return (lambda t: tf.raw_ops.CollectiveGatherV2(input=t, instance_key=keys[0],
                                                        **common),
                lambda t, longest: tf.raw_ops.CollectiveGatherV2(
                    input=t, instance_key=keys[1] + longest, **common),
                lambda t, longest: tf.raw_ops.CollectiveAllToAllV2(
                    input=t, instance_key=keys[2] + longest, **common))

    def columns_lookup(self, scope, ids, handles, part, dtype, id_type, distinct=False):
        ops, plan = self._exchange_ops(f"lookup {scope} {part} {dtype} {id_type} {distinct}"), \
            self.plan
        nodes, rows, sizes, every = _per_replica(plan, scope, [
            (lambda i, h, me=plan.replica_offset + k: lookup_columns(i, h, me, part, dtype,
                                                                     *ops, distinct),
             [(ids[k], id_type, None), (handles[k], tf.resource, [])])
            for k in range(plan.num_replicas)])
        return nodes, rows, list(zip(sizes, every))

    def join_columns(self, name: str, handles: list[str], part, dtype, device: str,
                     controls=()):
        return join_parts(name, handles, part, dtype, device, controls)

    def columns_gradient(self, scope, values, indices, part, value_type, index_type, mean,
                         gathered=None):
        wire = compression.wire_for(self.plan, value_type)
        ops, plan = self._exchange_ops(f"gradient {scope} {part} {value_type} {index_type} "
                                       f"{wire} {bool(gathered)}"), self.plan
        return _per_replica(plan, scope, [
            (lambda v, i, *g, me=plan.replica_offset + k: gradient_columns(
                v, i, me, part, mean, *ops, *g, wire=wire),
             [(values[k], value_type, [None, part.width]), (indices[k], index_type, [None])] +
             ([(gathered[k][0], tf.int32, [None]), (gathered[k][1], index_type, [None])]
              if gathered else []))
            for k in range(plan.num_replicas)])

    def broadcast(self, scope: str, value: str, dtype, shape) -> Broadcast:
        plan = self.plan
        common = dict(T=dtype, group_size=plan.num_workers, group_key=BROADCAST_GROUP_KEY,
                      instance_key=self.keys.take(), shape=_shape_attr(shape),
                      communication_hint="auto", timeout_seconds=OP_TIMEOUT_SECONDS)
        if plan.worker == 0:
            send = emit.node_def(f"{scope}/send", "CollectiveBcastSend", [value],
                                 plan.devices[0], **common)
            return Broadcast([send], value, ["^" + send.name])
        recv = emit.node_def(f"{scope}/recv", "CollectiveBcastRecv", [], plan.devices[0],
                             **common)
        return Broadcast([recv], recv.name)


class HostCollectives:
    """TensorFlow collectives among one device per worker (layer-to-layer's
    hosts), as tf ops in the graph under construction, on the current device."""

    def __init__(self, workers: int, worker: int):
        self.workers, self.worker = workers, worker
        self.keys = InstanceKeys()

    def all_reduce(self, t: tf.Tensor) -> tf.Tensor:
        """The sum of `t` over the workers."""
        return tf.raw_ops.CollectiveReduce(
            input=t, group_size=self.workers, group_key=HOSTS_GROUP,
            instance_key=self.keys.take(), merge_op="Add", final_op="Id", subdiv_offsets=[0],
            wait_for=[], communication_hint="auto", timeout_seconds=OP_TIMEOUT_SECONDS)

    def broadcast(self, value: tf.Tensor) -> tf.Operation:
        """Worker 0: send `value` to every worker."""
        return tf.raw_ops.CollectiveBcastSend(input=value, **self._common(value.shape)).op

    def receive(self, dtype, shape) -> tf.Tensor:
        """Every other worker: worker 0's `broadcast`."""
        return tf.raw_ops.CollectiveBcastRecv(T=dtype, **self._common(shape))

    def _common(self, shape) -> dict:
        return dict(group_size=self.workers, group_key=HOSTS_GROUP,
                    instance_key=self.keys.take(), shape=list(shape),
                    communication_hint="auto", timeout_seconds=OP_TIMEOUT_SECONDS)


def server_sum(plan, scope: str, tensor: str, dtype, server: str, scale: float,
               gradient: bool = False, shared=lambda name: name, branched: bool = False):
    """A parameter-server all-reduce of one tensor per worker (on its host),
    through FIFO queues on `server` (one per worker and direction, so sums
    are added in worker order and every worker gets the same bits). Worker
    0 runs the server's side: it dequeues the others' tensors, adds its
    own, scales, and queues the result for each of them; its own result
    waits for those puts. Another worker queues its tensor and dequeues the
    result. Each queue moves one element per step, so steps cannot mix. A
    `gradient` under compression travels in 16 bits both ways and is added
    in float32 on the server. Returns (nodes, the name of this worker's
    result). `shared`: the queues' shared names (InstanceKeys.shared).
    `branched`: `tensor` is computed in a tf.cond's branch, and worker 0's
    takes wait on it (in a step that skips the branch, they do not run)."""
    out, host = f"{scope}/sum", plan.host
    wire = compression.wire_for(plan, dtype) if gradient else None
    sent = wire or dtype
    nodes = []
    if wire is not None:
        nodes.append(emit.node_def(f"{scope}/narrow", "Cast", [tensor], host, SrcT=dtype,
                                   DstT=wire, Truncate=False))
        tensor = f"{scope}/narrow"

    def widened(name, t, device):
        if wire is None:
            return t
        nodes.append(emit.node_def(name, "Cast", [t], device, SrcT=wire, DstT=dtype,
                                   Truncate=False))
        return name

    if plan.worker == 0:
        taken, mine = [], ["^" + tensor.split(":")[0]] * branched
        for w in range(1, plan.num_workers):
            q = f"{scope}/from_{w}"
            nodes += [emit.fifo_queue(q, shared(f"parallax_ng/sum/{scope}/{w}"), [sent], server),
                      emit.node_def(f"{q}/take", "QueueDequeueV2", [q, *mine], server,
                                    component_types=[sent], timeout_ms=-1)]
            taken.append(widened(f"{q}/wide", f"{q}/take", server))
        own = widened(f"{scope}/own", tensor, server)
        total = f"{scope}/total"
        nodes.append(emit.node_def(total, "AddN", [own] + taken, server, T=dtype,
                                   N=1 + len(taken)) if taken else
                     emit.node_def(total, "Identity", [own], server, T=dtype))
        if scale != 1.0:
            nodes += [emit.const(f"{scope}/scale", scale, dtype, server),
                      emit.node_def(f"{scope}/scaled", "Mul", [total, f"{scope}/scale"],
                                    server, T=dtype)]
            total = f"{scope}/scaled"
        if wire is not None:
            nodes.append(emit.node_def(f"{scope}/result", "Cast", [total], server, SrcT=dtype,
                                       DstT=wire, Truncate=False))
            total = f"{scope}/result"
        puts = []
        for w in range(1, plan.num_workers):
            q = f"{scope}/to_{w}"
            nodes += [emit.fifo_queue(q, shared(f"parallax_ng/sum/{scope}/result/{w}"), [sent],
                                      server),
                      emit.node_def(f"{q}/put", "QueueEnqueueV2", [q, total], server,
                                    Tcomponents=[sent], timeout_ms=-1)]
            puts.append(f"^{q}/put")
        done = f"{scope}/done" if wire is not None else out
        nodes.append(emit.node_def(done, "Identity", [total] + puts, server, T=sent))
    else:
        w = plan.worker
        q, back = f"{scope}/to_server", f"{scope}/from_server"
        done = f"{scope}/back" if wire is not None else out
        nodes += [emit.fifo_queue(q, shared(f"parallax_ng/sum/{scope}/{w}"), [sent], server),
                  emit.node_def(f"{q}/put", "QueueEnqueueV2", [q, tensor], server,
                                Tcomponents=[sent], timeout_ms=-1),
                  emit.fifo_queue(back, shared(f"parallax_ng/sum/{scope}/result/{w}"), [sent],
                                  server),
                  emit.node_def(done, "QueueDequeueV2", [back, f"^{q}/put"], server,
                                component_types=[sent], timeout_ms=-1)]
    widened(out, done, host)
    return nodes, out


def join_parts(name: str, handles: list[str], part, dtype, device: str, controls=()):
    """Nodes, the last named `name`: every part of a table cut by columns
    read on its device (after `controls`) through `handles`, and the parts
    put side by side on `device`."""
    scope = f"parallax/columns/{name}"
    reads = [emit.node_def(f"{scope}/read_{j}", "ReadVariableOp", [h, *controls], s.device,
                           dtype=dtype) for j, (h, s) in enumerate(zip(handles, part.shards))]
    axis = emit.const(f"{scope}/axis", 1, tf.int32, device)
    return reads + [axis, emit.node_def(name, "ConcatV2", [r.name for r in reads] +
                                        [axis.name], device, T=dtype, N=len(reads),
                                        Tidx=tf.int32)]


def _per_replica(plan, scope: str, builds) -> tuple:
    """Trace one (function, inputs) per local replica on its device; returns
    (nodes, then one list of names per output, a name per replica)."""
    nodes, outs = [], []
    for k, (fn, inputs) in enumerate(builds):
        made, names = emit.emit_traced(fn, inputs, f"{scope}/replica_{k}", plan.devices[k])
        nodes += made
        outs.append(names)
    return (nodes, *[list(x) for x in zip(*outs)])


def lookup_columns(ids, handle, me: int, part, dtype, gather_sizes, gather_rows, exchange,
                   distinct: bool = False):
    """Full rows of `ids` from a table cut by columns (`part`), on job
    replica `me`, whose `handle` holds its columns: every replica's ids
    gathered (padded to the longest, L), this replica's columns of all of
    them looked up and padded to the widest part, then one all-to-all of
    [N, L * widest] blocks: block j goes to replica j, and block j received
    holds replica j's columns of this replica's ids (EmbRace 4.1). With
    `distinct`, each distinct id of the replica's crosses once and its row
    is copied where the id repeats. Returns the rows, and the gathered
    sizes and padded ids, which the gradient's exchange may reuse."""
    n, widths = len(part.shards), [s.size for s in part.shards]
    widest = max(widths)
    flat = tf.reshape(ids, [-1])
    if distinct:
        flat, where = tf.unique(flat, out_idx=tf.int32)
    size = tf.shape(flat, out_type=tf.int32)[:1]
    sizes = gather_sizes(size)
    longest = gathers.longest(sizes)
    every = gather_rows(tf.pad(flat, [[0, longest - size[0]]]), longest)      # [N * L]
    rows = tf.raw_ops.ResourceGather(resource=handle, indices=every, dtype=dtype)
    rows = tf.pad(rows, [[0, 0], [0, widest - widths[me]]])                   # [N * L, widest]
    got = exchange(tf.reshape(rows, tf.stack([n, longest * widest])), longest)
    got = tf.reshape(got, tf.stack([n, longest, widest]))
    full = tf.concat([got[j, :, :widths[j]] for j in range(n)], 1)[:size[0]]  # [size, D]
    if distinct:
        full = tf.gather(full, where)
    return (tf.identity(tf.reshape(full, tf.concat([tf.shape(ids), [part.width]], 0)),
                        name="rows"), tf.identity(sizes, name="sizes"),
            tf.identity(every, name="ids"))


def gradient_columns(values, indices, me: int, part, mean: bool, gather_sizes, gather_rows,
                     exchange, sizes=None, every=None, wire=None):
    """Every replica's gradient rows of a table cut by columns, with this
    replica's columns only, and their indices: the rows padded to the
    longest replica's count L, each replica's columns (padded to the
    widest part) sent to it by one all-to-all (EmbRace 4.1, backward).
    `sizes` and `every`: the forward lookup's gathered sizes and padded ids,
    when the rows are those distinct ids in that order (nothing gathered
    again; a replica whose count differs fails the step). With `wire`, the
    rows travel in that dtype (compression)."""
    n, widths = len(part.shards), [s.size for s in part.shards]
    widest = max(widths)
    size = tf.shape(indices, out_type=tf.int32)[:1]
    if sizes is None:
        sizes = gather_sizes(size)
        longest = gathers.longest(sizes)
        every = gather_rows(tf.pad(indices, [[0, longest - size[0]]]), longest)   # [N * L]
    else:
        check = tf.debugging.assert_equal(sizes[me], size[0], message=(
            "the gradient's rows are not the lookup's distinct ids"))
        with tf.control_dependencies([check]):
            longest = tf.maximum(tf.reduce_max(sizes), 1)
    keep = tf.reshape(tf.sequence_mask(sizes, longest), [-1])
    rows = tf.pad(tf.reshape(values, [-1, part.width]), [[0, longest - size[0]], [0, 0]])
    blocks = tf.stack([tf.pad(rows[:, s.start:s.start + s.size],
                              [[0, 0], [0, widest - s.size]]) for s in part.shards])
    blocks = tf.reshape(blocks, tf.stack([n, longest * widest]))
    got = exchange(blocks, longest) if wire is None else \
        compression.carried(lambda b: exchange(b, longest), blocks, wire)
    got = tf.reshape(got, tf.stack([n * longest, widest]))[:, :widths[me]]
    out = tf.boolean_mask(got, keep)
    if mean:
        out = out * tf.cast(1.0 / n, values.dtype)
    return tf.identity(out, name="values"), tf.identity(tf.boolean_mask(every, keep),
                                                        name="indices")


def _gather(t, n: int, key: int):
    """TensorFlow's all-gather of `t` over the job's `n` replicas, instance `key`."""
    return tf.raw_ops.CollectiveGatherV2(
        input=t, group_size=n, group_key=GROUP_KEY, instance_key=key, ordering_token=[],
        communication_hint="auto", timeout_seconds=OP_TIMEOUT_SECONDS)


def _shape_attr(shape):
    return tf.compat.v1.AttrValue(shape=tf.TensorShape(list(shape)).as_proto())
