"""Random draws of layer-by-layer execution, and the node rewrites made when
a layer's copy is imported.

A random op in the forward (dropout; the kinds in layers.STATELESS) is
drawn again by its recomputation, so every copy of it draws from the
stateless op of its kind with the seed [step, salt + key] (builder.py's
docstring says what each part is): a (replica, micro-batch) draws the same
numbers in its forward and its backward, other ones than every other, and
new ones every step.

Requires: the user's graph, the L2L graph being built and the host device.
Guarantees: `Seeds.seed` makes each seed once, on the host; `stateless`
rewrites a random NodeDef to read one; `halve` rewrites NodeDefs to compute
in float16 (cross mixed precision).
"""
from __future__ import annotations

import random

import numpy as np
import tensorflow as tf

from ..graph.ir import parse_input
from .layers import STATELESS

BASE_SEED2 = 0x4C324C      # the base seed's op seed when the user's graph has a seed


class Seeds:
    def __init__(self, user_graph, graph, random_ops: list[str], host: str, scope: str,
                 replicas: int, total: int, micro_batches: int, worker: int):
        self.user, self.graph, self.random = user_graph, graph, random_ops
        self.host, self.scope = host, scope
        self.n, self.total, self.u, self.worker = replicas, total, micro_batches, worker
        self.made: dict[tuple, tf.Tensor] = {}   # (random op, replica, micro) -> seed
        self._base: tf.Tensor | None = None
        self._salt = 0

    def seed(self, name: str, r: int, k: int) -> tf.Tensor:
        """The seed of random op `name`'s copies for replica r's micro-batch k:
        made once, on the host, for forward and backward."""
        if (name, r, k) not in self.made:
            with tf.device(self.host), tf.name_scope(f"{self.scope}/seeds/"):
                step, salt = self._parts()
                replica = self.worker * self.n + r
                key = (self.random.index(name) * self.total + replica) * self.u + k
                self.made[name, r, k] = tf.stack(
                    [step, tf.constant(salt + key, tf.int64)], name=f"r{r}_m{k}")
        return self.made[name, r, k]

    def _parts(self) -> tuple[tf.Tensor, int]:
        """(the step's part of every seed, the salt added to the keys)."""
        if self._base is None:
            seed = self.user.seed
            self._salt = (seed if seed is not None else random.getrandbits(31)) << 32
            step = tf.compat.v1.train.get_global_step(self.user)
            if step is not None:        # read before this step's update adds 1
                var = self.graph.get_operation_by_name(step.op.name)
                if var.type == "VarHandleOp":
                    value = tf.raw_ops.ReadVariableOp(resource=var.outputs[0],
                                                      dtype=var.get_attr("dtype"))
                else:
                    value = tf.raw_ops.Snapshot(input=var.outputs[0])
                self._base = tf.cast(value, tf.int64, name="global_step")
            else:
                self._base = tf.raw_ops.RandomUniformInt(
                    shape=tf.constant([], tf.int32), minval=tf.constant(0, tf.int64),
                    maxval=tf.constant(tf.int64.max, tf.int64), seed=seed or 0,
                    seed2=BASE_SEED2 if seed is not None else 0, name="base")
        return self._base, self._salt


def stateless(node, seed: str) -> None:
    """Rewrite random op `node` (a NodeDef) as its stateless kind, reading
    its seed from tensor `seed`: inputs (shape, seed, [minval, maxval])."""
    data = [ref for ref in node.input if not ref.startswith("^")]
    controls = [ref for ref in node.input if ref.startswith("^")]
    dtype = node.attr["Tout" if node.op == "RandomUniformInt" else "dtype"].type
    shape_type = node.attr["T"].type
    node.op = STATELESS[node.op]
    node.ClearField("attr")
    node.attr["dtype"].type = dtype
    node.attr["T"].type = shape_type
    node.attr["Tseed"].type = tf.int64.as_datatype_enum
    del node.input[:]
    node.input.extend([data[0], seed, *data[1:], *controls])


def halve(gd, on_host: set[str], user: tf.Graph) -> None:
    """Rewrite `gd`'s nodes outside `on_host` to compute in float16."""
    f32, f16 = tf.float32.as_datatype_enum, tf.float16.as_datatype_enum
    casts = {}
    for node in gd.node:
        if node.name in on_host:
            continue
        for attr in node.attr.values():
            if attr.type == f32:
                attr.type = f16
            if attr.HasField("list") and f32 in attr.list.type:
                types = [f16 if t == f32 else t for t in attr.list.type]
                del attr.list.type[:]
                attr.list.type.extend(types)
            if attr.HasField("tensor") and attr.tensor.dtype == f32:
                value = tf.make_ndarray(attr.tensor).astype(np.float16)
                attr.tensor.CopyFrom(tf.make_tensor_proto(value))
        for i, ref in enumerate(node.input):
            src, index, control = parse_input(ref)
            if control or src not in on_host:
                continue
            if user.get_tensor_by_name(f"{src}:{index}").dtype != tf.float32:
                continue
            if ref not in casts:
                casts[ref] = f"{src}/to_half_{len(casts)}"
            node.input[i] = casts[ref]
    for ref, name in casts.items():
        cast = gd.node.add()
        cast.name, cast.op = name, "Cast"
        cast.input.append(ref)
        cast.attr["SrcT"].type, cast.attr["DstT"].type = f32, f16
        cast.attr["Truncate"].b = False
