"""Shard inputs: give each replica its own part of every `pn.shard` dataset.

Requires: replicas made by `replicate`; the (num_shards, index) constants
that `parallax_ng.shard` put in the graph, either as graph nodes or inside a
one-shot iterator's dataset function.
Guarantees: replica r of N reads shard (N, r + offset), where offset is this
worker's first replica in the job (0 in-process). One-shot iterators of
replica r get a private copy of their dataset function with those values.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.frontend import SHARD_SCOPE
from parallax_ng.ir import GraphIR
from parallax_ng.passes import replica_of


@dataclass(frozen=True)
class ShardInputsPass:
    name: str = "shard_inputs"
    num_shards: int | None = None     # total replicas in the job (default: plan's)
    offset: int = 0                   # global index of this worker's replica 0

    def run(self, ir: GraphIR, ctx):
        n = ctx.plan.num_replicas
        total = self.num_shards or n
        gd = tf.compat.v1.GraphDef()
        gd.CopyFrom(ir.graph_def)
        values = {}
        for num, index in ctx.tg.shard_consts:
            for k in range(n):
                values[ctx.replica_name(k, num)] = total
                values[ctx.replica_name(k, index)] = self.offset + k
        changed = 0
        for nd in gd.node:
            if nd.name in values:
                _set_scalar(nd, values[nd.name])
                changed += 1
        functions = _shard_functions(gd)
        copies = 0
        if functions:
            copies = self._split_one_shot(gd, ctx, functions, n, total)
        if not changed and not copies and n > 1:
            report = {"warning": "no pn.shard() dataset found; replicas read the same data"}
        else:
            report = {"constants": changed, "function_copies": copies}
        return GraphIR(gd), report

    def _split_one_shot(self, gd, ctx, functions: set[str], n: int, total: int) -> int:
        by_name = {f.signature.name: f for f in gd.library.function}
        copies = 0
        for nd in gd.node:
            if nd.op != "OneShotIterator":
                continue
            fname = nd.attr["dataset_factory"].func.name
            if fname not in functions:
                continue
            k = replica_of(nd.name)[0]
            f = type(by_name[fname])()
            f.CopyFrom(by_name[fname])
            f.signature.name = f"{fname}_parallax_shard_{self.offset + k}_of_{total}"
            for body in f.node_def:
                scope, _, leaf = body.name.rpartition("/")
                if scope.split("/")[-1].startswith(SHARD_SCOPE):
                    if leaf == "num_shards":
                        _set_scalar(body, total)
                    elif leaf == "index":
                        _set_scalar(body, self.offset + k)
            gd.library.function.append(f)
            nd.attr["dataset_factory"].func.name = f.signature.name
            copies += 1
        return copies


def _shard_functions(gd) -> set[str]:
    out = set()
    for f in gd.library.function:
        for body in f.node_def:
            scope, _, leaf = body.name.rpartition("/")
            if leaf == "num_shards" and scope.split("/")[-1].startswith(SHARD_SCOPE):
                out.add(f.signature.name)
    return out


def _set_scalar(nd, value: int) -> None:
    dtype = tf.as_dtype(nd.attr["dtype"].type)
    nd.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=dtype))
