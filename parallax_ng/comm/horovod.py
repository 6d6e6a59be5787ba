"""The Horovod backend (`communication: {backend: horovod}`).

Requires: Horovod built with TensorFlow support (`pip install .[horovod]`;
Horovod 0.28.1 builds against TensorFlow <= 2.18), and a script started by
`horovodrun` (Gloo or MPI): every process is one worker of the job.
Guarantees: `init()` starts Horovod and gives (rank, size);
`HorovodCollectives` lowers the abstract operations of parallax_ng/comm/collectives.py
to Horovod's ops:
- `all_reduce`: this worker's replicas added on its first device, then
  HorovodAllreduce (sum) across workers, scaled by 1/replicas for a mean;
  every local replica reads the result; a compressed gradient goes by
  HorovodAlltoall and HorovodAllgather in 16 bits, summed in float32
  (parallax_ng/comm/compression.py);
- `all_gather`: IndexedSlices values and indices concatenated over local
  replicas, then HorovodAllgather (workers may contribute different row
  counts), values scaled for a mean;
- `columns_lookup`, `columns_gradient`: comm.py's exchange of a table cut
  by columns, with HorovodAllgather for the ids and HorovodAlltoall for
  the rows (one replica per process);
- `broadcast`: HorovodBroadcast from worker 0.
Nodes get the same names on every worker, which is how Horovod matches a
tensor across processes.
"""
from __future__ import annotations

import tensorflow as tf

from ..errors import ConfigError
from ..graph import emit
from . import compression
from .collectives import Broadcast, gradient_columns, lookup_columns, server_sum


def _hvd():
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise ConfigError(
            "config key 'communication.backend' is horovod, but Horovod is not "
            f"importable ({e}); install it with `pip install .[horovod]` (Horovod 0.28.1 "
            "needs TensorFlow <= 2.18, see README), or use backend tf") from None
    return hvd


def init() -> tuple[int, int]:
    """Start Horovod in this process: (rank, size)."""
    hvd = _hvd()
    hvd.init()
    return hvd.rank(), hvd.size()


class HorovodCollectives:
    """parallax_ng.comm.collectives's operations with Horovod's ops."""
    reaches_parts = False    # another rank's variables only through collectives
    op_types = ("Horovod", "Collective")

    def __init__(self, plan):
        self.plan = plan

    def all_reduce(self, scope, tensors, dtype, mean, gradient=False):
        return all_reduce(self.plan, scope, tensors, dtype, mean, gradient)

    def all_gather(self, scope, values, indices, value_type, index_type, value_shape, mean,
                   counts=None):
        # Horovod's allgather takes parts of any count: no counts are gathered first
        nodes, v, i = all_gather(self.plan, scope, values, indices, value_type, index_type,
                                 value_shape, mean)
        return nodes, [v] * len(values), [i] * len(values)

    def server_sum(self, scope, tensor, dtype, server, scale, gradient=False, branched=False):
        # the planner gives Horovod jobs no servers; one process sums alone
        return server_sum(self.plan, scope, tensor, dtype, server, scale, gradient,
                          branched=branched)

    def _exchange_ops(self, what: str = ""):
        hvd = _hvd()
        return (lambda t: hvd.allgather(t, name="sizes"),
                lambda t, longest: hvd.allgather(t, name="ids"),
                lambda t, longest: hvd.alltoall(t, name="exchange"))

    def columns_lookup(self, scope, ids, handles, part, dtype, id_type, distinct=False):
        self._one_replica("alltoall")
        made, (out, sizes, every) = emit.emit_traced(
            lambda i, h: lookup_columns(i, h, self.plan.worker, part, dtype,
                                        *self._exchange_ops(), distinct),
            [(ids[0], id_type, None), (handles[0], tf.resource, [])], scope,
            self.plan.devices[0])
        return made, [out], [(sizes, every)]

    def columns_gradient(self, scope, values, indices, part, value_type, index_type, mean,
                         gathered=None):
        self._one_replica("alltoall")
        made, (v, i) = emit.emit_traced(
            lambda v, i, *g: gradient_columns(v, i, self.plan.worker, part, mean,
                                              *self._exchange_ops(), *g,
                                              wire=compression.wire_for(self.plan,
                                                                        value_type)),
            [(values[0], value_type, [None, part.width]), (indices[0], index_type, [None])] +
            ([(gathered[0][0], tf.int32, [None]), (gathered[0][1], index_type, [None])]
             if gathered else []),
            scope, self.plan.devices[0])
        return made, [v], [i]

    def join_columns(self, name, handles, part, dtype, device, controls=()):
        """This rank's part read, every rank's part all-gathered (along the
        columns: as rows of the transposed parts)."""
        self._one_replica("alltoall")
        scope = f"parallax/columns/{name}"
        read = emit.node_def(f"{scope}/read", "ReadVariableOp", [handles[0], *controls],
                             device, dtype=dtype)
        made, (out,) = emit.emit_traced(lambda t: tf.identity(join_columns(t), "joined"),
                                        [(read.name, dtype, None)], scope, device)
        return [read, *made, emit.node_def(name, "Identity", [out], device, T=dtype)]

    def _one_replica(self, what: str) -> None:
        if self.plan.num_replicas > 1:
            raise ConfigError(f"{what} under communication.backend horovod takes one device "
                              f"per process, but this one has {self.plan.num_replicas}; start "
                              "one process per device (horovodrun -np), or use backend tf")

    def broadcast(self, scope, value, dtype, shape) -> Broadcast:
        nodes, out = broadcast(self.plan, scope, value, dtype, shape)
        return Broadcast(nodes, out)     # every rank takes part, worker 0 included


def all_reduce(plan, scope: str, tensors: list[str], dtype, mean: bool,
               gradient: bool = False):
    """(nodes, one output name per local replica)."""
    nodes, local = _local(scope, tensors, dtype, plan.devices[0], "AddN")
    wire = compression.wire_for(plan, dtype) if gradient else None

    def reduce(t):
        hvd = _hvd()
        if plan.num_workers > 1 and wire is not None:
            out = compression.scattered_sum(
                t, plan.num_workers, wire, False,
                lambda c: hvd.alltoall(c, name="scatter"),
                lambda c: hvd.allgather(c, name="gather"))
        else:
            out = hvd.allreduce(t, op=hvd.Sum, name="allreduce")
        if mean:
            out = out * tf.cast(1.0 / plan.group_size, dtype)
        return tf.identity(out, name="out")

    made, (out,) = emit.emit_traced(reduce, [(local, dtype, None)], scope, plan.devices[0])
    return nodes + made, [out] * len(tensors)


def all_gather(plan, scope: str, values: list[str], indices: list[str], value_type,
               index_type, value_shape, mean: bool):
    """(nodes, values output, indices output), read by every local replica."""
    device = plan.devices[0]
    nodes_v, local_v = _local(scope + "/values_local", values, value_type, device, "ConcatV2")
    nodes_i, local_i = _local(scope + "/indices_local", indices, index_type, device,
                              "ConcatV2")

    wire = compression.wire_for(plan, value_type)

    def gather(v, i):
        hvd = _hvd()
        if wire is not None:
            gv = compression.carried(lambda t: hvd.allgather(t, name="values"), v, wire)
        else:
            gv = hvd.allgather(v, name="values")
        gi = hvd.allgather(i, name="indices")
        if mean:
            gv = gv * tf.cast(1.0 / plan.group_size, value_type)
        return tf.identity(gv, name="values_out"), tf.identity(gi, name="indices_out")

    made, (v, i) = emit.emit_traced(gather, [(local_v, value_type, value_shape),
                                             (local_i, index_type, [None])], scope, device)
    return nodes_v + nodes_i + made, v, i


def join_columns(part):
    """Every rank's columns of a table, side by side (TensorFlow code)."""
    return tf.transpose(_hvd().allgather(tf.transpose(part), name="columns"))


def broadcast(plan, scope: str, value: str, dtype, shape):
    """(nodes, output): worker 0's `value` on every worker."""
    def bcast(t):
        return tf.identity(_hvd().broadcast(t, root_rank=0, name="broadcast"), name="out")

    made, (out,) = emit.emit_traced(bcast, [(value, dtype, shape)], scope, plan.devices[0])
    return made, out


def _local(scope: str, tensors: list[str], dtype, device: str, op: str):
    if len(tensors) == 1:
        return [], tensors[0]
    if op == "AddN":
        return [emit.node_def(scope, "AddN", tensors, device, T=dtype, N=len(tensors))], scope
    axis = scope + "/axis"
    return [emit.const(axis, 0, tf.int32, device),
            emit.node_def(scope, "ConcatV2", tensors + [axis], device, T=dtype,
                          N=len(tensors), Tidx=tf.int32)], scope
