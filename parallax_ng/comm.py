"""Communication as abstract operations, lowered once per backend.

Passes ask `ctx.comm` (the plan's backend's `Collectives`) for an
operation and get graph nodes back; no pass knows which backend it is.

Requires: the plan (devices, group size, worker, timeout) and, for
TensorFlow collectives, the graph's instance keys.
Guarantees, for every backend:
- `all_reduce(scope, tensors, dtype, mean)`: one tensor per local replica
  in, one name per local replica out, each the sum (or mean) over every
  replica of the job;
- `all_gather(scope, values, indices, ...)`: an IndexedSlices per local
  replica in; per replica the concatenation of every replica's slices
  (values scaled by 1/N for a mean);
- `broadcast(scope, value, dtype, shape)`: worker 0's `value` on every
  worker, as a `Broadcast`: the tensor this worker should use and the ops
  its use must wait for.
New nodes live under `scope`. TensorFlow's lowering is here; Horovod's is in
parallax_ng/horovod.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tensorflow as tf

from . import emit

GROUP_KEY = 1             # every replica of the job
BROADCAST_GROUP_KEY = 2   # replica 0 of every worker


@dataclass(frozen=True)
class Broadcast:
    nodes: list
    value: str                                   # what this worker uses
    before: list = field(default_factory=list)   # control inputs for its use


def lowering(plan, instance_keys):
    """The plan's backend's collectives."""
    if plan.backend == "horovod":
        from .horovod import HorovodCollectives
        return HorovodCollectives(plan)
    return TFCollectives(plan, instance_keys)


class TFCollectives:
    """TensorFlow's collective ops (CollectiveReduce, CollectiveGatherV2,
    CollectiveBcastSend/Recv), one instance key per operation."""

    def __init__(self, plan, instance_keys):
        self.plan, self.keys = plan, instance_keys

    def all_reduce(self, scope: str, tensors: list[str], dtype, mean: bool):
        plan, key = self.plan, self.keys.take()
        nodes = [emit.collective_reduce(
            f"{scope}/replica_{k}", t, dtype, device, group_size=plan.group_size,
            group_key=GROUP_KEY, instance_key=key, mean=mean, timeout=plan.timeout_seconds)
            for k, (t, device) in enumerate(zip(tensors, plan.devices))]
        return nodes, [n.name for n in nodes]

    def all_gather(self, scope: str, values: list[str], indices: list[str], value_type,
                   index_type, value_shape, mean: bool):
        plan = self.plan
        keys = (self.keys.take(), self.keys.take(), self.keys.take())
        nodes, out_v, out_i = [], [], []
        for k, device in enumerate(plan.devices):
            made, (v, i) = emit.emit_traced(
                lambda vals, idx: _gather_slices(vals, idx, plan, keys, mean),
                [(values[k], value_type, value_shape), (indices[k], index_type, [None])],
                f"{scope}/replica_{k}", device)
            nodes.extend(made)
            out_v.append(v)
            out_i.append(i)
        return nodes, out_v, out_i

    def broadcast(self, scope: str, value: str, dtype, shape) -> Broadcast:
        plan = self.plan
        common = dict(T=dtype, group_size=plan.num_workers, group_key=BROADCAST_GROUP_KEY,
                      instance_key=self.keys.take(), shape=_shape_attr(shape),
                      communication_hint="auto", timeout_seconds=float(plan.timeout_seconds))
        if plan.worker == 0:
            send = emit.node_def(f"{scope}/send", "CollectiveBcastSend", [value],
                                 plan.devices[0], **common)
            return Broadcast([send], value, ["^" + send.name])
        recv = emit.node_def(f"{scope}/recv", "CollectiveBcastRecv", [], plan.devices[0],
                             **common)
        return Broadcast([recv], recv.name)


def _gather_slices(values, indices, plan, keys, mean: bool):
    """IndexedSlices gathered from every replica: sizes first, every part
    padded to the longest, the padding dropped after."""
    n, timeout = plan.group_size, plan.timeout_seconds

    def all_gather(t, key):
        return tf.raw_ops.CollectiveGatherV2(
            input=t, group_size=n, group_key=GROUP_KEY, instance_key=key,
            ordering_token=[], communication_hint="auto", timeout_seconds=timeout)

    size = tf.shape(indices, out_type=tf.int32)[:1]
    sizes = all_gather(size, keys[0])
    longest = tf.reduce_max(sizes)
    pad = longest - size[0]
    rest = tf.zeros(tf.stack([tf.rank(values) - 1, 2]), tf.int32)
    padded_v = tf.pad(values, tf.concat([[[0, pad]], rest], 0))
    padded_i = tf.pad(indices, [[0, pad]])
    mask = tf.reshape(tf.sequence_mask(sizes, longest), [-1])
    gathered_v = tf.boolean_mask(all_gather(padded_v, keys[1]), mask)
    gathered_i = tf.boolean_mask(all_gather(padded_i, keys[2]), mask)
    if mean:
        gathered_v = gathered_v * tf.cast(1.0 / n, values.dtype)
    return tf.identity(gathered_v, "values"), tf.identity(gathered_i, "indices")


def _shape_attr(shape):
    return tf.compat.v1.AttrValue(shape=tf.TensorShape(list(shape)).as_proto())
