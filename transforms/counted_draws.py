"""Counted draws: seeded stateful random ops become stateless ones keyed by a
call counter, so a checkpoint holds where every stream is.

Requires: replicas made by `replicate` (their seeds set); the plan's
`counted` ops (graph/randomness.py `counted`).
Guarantees: every copy of a counted op, with seeds not both 0, is
replaced, under its own name (its consumers untouched), by

    draw = Stateless<kind>V2(shape, key=[seed], counter=[calls, seed2])
    name = Identity(draw, ^calls += 256 * size(shape))

where `calls` is an int64 variable of the copy on the worker's host, read
before it is advanced: the draw is the one the stateful op makes at the
same call (graph/randomness.py), and a call that does not happen (a
branch of a tf.compat.v1 cond not taken) does not advance it. The counters
start at 0 with the session (`CountedDraws.start`, run by the Runner) and
are saved and restored with the input positions (runtime/checkpoint.py).
A candidate sampler (graph/randomness.py REPLAYED) stays stateful, renamed,
and its name becomes `IdentityN(sampler outputs, ^calls += 1)`: its
counter counts calls, which a restore makes again (`CountedDraws.replays`).
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.graph import emit, randomness
from parallax_ng.graph.ir import GraphIR
from parallax_ng.pipeline.results import CountedDraws

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class CountedDrawsPass:
    name: str = "counted_draws"
    requires: tuple = ("replicate",)
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        changed, added, calls, start, replays = {}, [], {}, [], []
        for op in ctx.plan.counted:
            for k in range(ctx.plan.num_replicas):
                name = ctx.replica_name(k, op)
                node = ir.node(name)
                if name in changed or not (node.attr["seed"].i or node.attr["seed2"].i):
                    continue
                if node.op in randomness.REPLAYED:
                    nodes, handle, zero = _replayed(node, ctx.plan.host)
                    classes = node.input[0]
                    replays.append((handle, nodes[-2].name,
                                    classes if ":" in classes else classes + ":0"))
                else:
                    nodes, handle, zero = _counted(node, ctx.plan.host)
                changed[name] = nodes.pop()
                added.extend(nodes)
                calls[(ctx.plan.replica_offset + k, op)] = handle
                start.append(zero)
        ctx.publish(CountedDraws(calls, tuple(start), tuple(replays)))
        return ir.replace(changed, added), {"counted": len(calls)}


def _counter(at: str, host: str) -> list:
    """An int64 call counter `{at}/calls`, the op setting it to 0 and a read."""
    scalar = tf.compat.v1.AttrValue(shape=tf.TensorShape([]).as_proto())
    return [
        emit.node_def(f"{at}/calls", "VarHandleOp", [], host, dtype=tf.int64, shape=scalar,
                      container="", shared_name=f"{at}/calls"),
        emit.const(f"{at}/zero_value", 0, tf.int64, host),
        emit.node_def(f"{at}/zero", "AssignVariableOp", [f"{at}/calls", f"{at}/zero_value"],
                      host, dtype=tf.int64),
        emit.node_def(f"{at}/read", "ReadVariableOp", [f"{at}/calls"], host, dtype=tf.int64)]


def _replayed(node, host: str) -> tuple[list, str, str]:
    """The nodes standing for candidate sampler `node`: its counter, the
    sampler renamed (second to last) and the IdentityN under its name
    (last); the counter's handle and the op that sets it to 0."""
    at = f"{node.name}/parallax_draws"
    sampler = tf.compat.v1.NodeDef()
    sampler.CopyFrom(node)
    sampler.name = f"{at}/sampler"
    one = emit.const(f"{at}/one", 1, tf.int64, host)
    advance = emit.node_def(f"{at}/advance", "AssignAddVariableOp",
                            [f"{at}/calls", f"{at}/one", f"^{sampler.name}"], host,
                            dtype=tf.int64)
    named = emit.node_def(node.name, "IdentityN",
                          [f"{sampler.name}:{i}" for i in range(3)] + [f"^{at}/advance"],
                          node.device, T=[tf.int64, tf.float32, tf.float32])
    return _counter(at, host) + [one, advance, sampler, named], f"{at}/calls", f"{at}/zero"


def _counted(node, host: str) -> tuple[list, str, str]:
    """The nodes standing for stateful random op `node` (the last one takes
    its name), its counter's handle and the op that sets it to 0."""
    at, device = f"{node.name}/parallax_draws", node.device
    inputs = [i for i in node.input if not i.startswith("^")]
    controls = [i for i in node.input if i.startswith("^")]
    shape, extra = inputs[0], inputs[1:]
    shape_type = tf.as_dtype(node.attr["T"].type)
    dtype = tf.as_dtype(node.attr["Tout" if node.op == "RandomUniformInt" else "dtype"].type)
    seed, seed2 = node.attr["seed"].i & _U64, node.attr["seed2"].i & _U64
    out = _counter(at, host) + [
        emit.node_def(f"{at}/low", "Bitcast", [f"{at}/read"], host, T=tf.int64,
                      type=tf.uint64),
        emit.const(f"{at}/seed2", seed2, tf.uint64, host),
        emit.node_def(f"{at}/counter", "Pack", [f"{at}/low", f"{at}/seed2"], host, N=2,
                      T=tf.uint64, axis=0),
        emit.const(f"{at}/key", [seed], tf.uint64, host),
        emit.const(f"{at}/alg", 1, tf.int32, host),       # Philox, the stateful ops' generator
        emit.node_def(f"{at}/draw", randomness.STATELESS[node.op],
                      [shape, f"{at}/key", f"{at}/counter", f"{at}/alg", *extra, *controls],
                      device, dtype=dtype, Tshape=shape_type),
        emit.node_def(f"{at}/shape", "Cast", [shape], host, SrcT=shape_type, DstT=tf.int64,
                      Truncate=False),
        emit.const(f"{at}/axis", [0], tf.int32, host),
        emit.node_def(f"{at}/outputs", "Prod", [f"{at}/shape", f"{at}/axis"], host,
                      T=tf.int64, Tidx=tf.int32, keep_dims=False),
        emit.const(f"{at}/per_output", randomness.SAMPLES_PER_OUTPUT, tf.int64, host),
        emit.node_def(f"{at}/samples", "Mul", [f"{at}/outputs", f"{at}/per_output"], host,
                      T=tf.int64),
        emit.node_def(f"{at}/advance", "AssignAddVariableOp",
                      [f"{at}/calls", f"{at}/samples", f"^{at}/read"], host, dtype=tf.int64),
    ]
    named = emit.node_def(node.name, "Identity", [f"{at}/draw", f"^{at}/advance"], device,
                          T=dtype)
    if "_class" in node.attr:
        named.attr["_class"].CopyFrom(node.attr["_class"])
    return out + [named], f"{at}/calls", f"{at}/zero"
