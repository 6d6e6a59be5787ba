"""Shard inputs: give each replica its own part of every `pn.shard` dataset
and of every input producer queue.

Requires: replicas made by `replicate`; the (num_shards, index) constants
that `parallax_ng.shard` put in the graph, either as graph nodes or inside a
one-shot iterator's dataset function; the plan's producer queues
(parallax_ng/graph/queues.py).
Guarantees: replica r of N reads shard (N, r + offset), where offset is this
worker's first replica in the job (0 in-process); a dataset shuffle without
seeds gets seeds of its name (graph/data.py `seeded_shuffles`), so every
replica shuffles alike and the shards are disjoint. One-shot iterators of
replica r get a private copy of their dataset function with those values.
Each enqueue_many of a producer queue enqueues, in replica r, the elements
r + offset, r + offset + N, ... of what it enqueued on one device (a
producer with fewer elements than replicas is an error).
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng import compat
from parallax_ng.errors import GraphError
from parallax_ng.graph import emit
from parallax_ng.graph.data import seeded_shuffles, set_shard, shard_constant
from parallax_ng.graph.ir import GraphIR, copy_node
from parallax_ng.pipeline.passes import replica_of
from transforms.place import host_cpu_of


@dataclass(frozen=True)
class ShardInputsPass:
    name: str = "shard_inputs"
    requires: tuple = ("replicate",)
    after: tuple = ()
    num_shards: int | None = None     # replicas in the job (default: the plan's)
    offset: int | None = None         # job-wide index of this worker's replica 0

    def run(self, ir: GraphIR, ctx):
        n = ctx.plan.num_replicas
        total = self.num_shards or ctx.plan.group_size
        offset = ctx.plan.replica_offset if self.offset is None else self.offset
        changed = {}
        for num, index in ctx.tg.shard_consts:
            for k in range(n):
                for name in (num, index):
                    nd = copy_node(ir.node(ctx.replica_name(k, name)))
                    set_shard(nd, total, offset + k)
                    changed[nd.name] = nd
        if ctx.tg.shard_consts:         # the replicas' copies of an unseeded shuffle
            nodes = {n.name: changed.get(n.name, n) for n in ir.nodes}
            changed.update(seeded_shuffles(nodes, lambda name: replica_of(name)[1]))
        library = ir.library
        functions = _shard_functions(library) if library is not None else set()
        copies = 0
        if functions:
            library = type(library)()
            library.CopyFrom(ir.library)
            copies = self._split_one_shot(ir, library, changed, functions, total, offset)
        rewires, added = _split_producers(ir, ctx, total, offset)
        if not changed and not added and n > 1:
            report = {"warning": "no pn.shard() dataset or input producer found; "
                                 "replicas read the same data"}
        else:
            report = {"constants": len(changed) - copies, "function_copies": copies,
                      "split_enqueues": len(rewires)}
        return ir.replace(changed, library=library).rewire(rewires, added), report

    def _split_one_shot(self, ir, library, changed, functions: set[str], total: int,
                        offset: int) -> int:
        by_name = {f.signature.name: f for f in library.function}
        copies = 0
        for node in ir.nodes:
            if node.op != "OneShotIterator":
                continue
            fname = node.attr["dataset_factory"].func.name
            if fname not in functions:
                continue
            k = replica_of(node.name)[0]
            f = type(by_name[fname])()
            f.CopyFrom(by_name[fname])
            f.signature.name = f"{fname}_parallax_shard_{offset + k}_of_{total}"
            for body in f.node_def:
                set_shard(body, total, offset + k)
            seeds = seeded_shuffles({body.name: body for body in f.node_def})
            for body in f.node_def:
                if body.name in seeds:
                    body.CopyFrom(seeds[body.name])
            library.function.append(f)
            nd = copy_node(node)
            nd.attr["dataset_factory"].func.name = f.signature.name
            changed[nd.name] = nd
            copies += 1
        return copies


def _split_producers(ir: GraphIR, ctx, total: int, offset: int):
    """Rewires and new nodes giving replica k every total-th element, from
    offset + k, of each component a producer queue's enqueue_many enqueues."""
    rewires, added = {}, []
    if total == 1:
        return rewires, added
    for queue, enqueues in sorted(ctx.plan.split_queues.items()):
        for e in enqueues:
            for pos, ref in enumerate(ctx.tg.ir.data_inputs(e)[1:], start=1):
                t = ctx.tg.tensor(ref)
                count = compat.dim(t.shape, 0)
                if count is not None and count < total:
                    raise GraphError(
                        f"input producer {queue!r} enqueues {count} elements at a time, "
                        f"fewer than the job's {total} replicas, so some would read "
                        "nothing; give it at least as many elements (files, rows) as "
                        "replicas")
                for k, device in enumerate(ctx.plan.devices):
                    scope = f"parallax/shard_queue/{e}/input_{pos}/replica_{k}"
                    host = host_cpu_of(device)
                    added += [emit.const(f"{scope}/begin", [offset + k], tf.int32, host),
                              emit.const(f"{scope}/end", [0], tf.int32, host),
                              emit.const(f"{scope}/strides", [total], tf.int32, host),
                              emit.node_def(scope, "StridedSlice",
                                            [ctx.replica_tensor(k, ref), f"{scope}/begin",
                                             f"{scope}/end", f"{scope}/strides"], host,
                                            T=t.dtype.base_dtype, Index=tf.int32,
                                            begin_mask=0, end_mask=1, ellipsis_mask=0,
                                            new_axis_mask=0, shrink_axis_mask=0)]
                    rewires[(ctx.replica_name(k, e), pos)] = scope
    return rewires, added


def _shard_functions(library) -> set[str]:
    return {f.signature.name for f in library.function
            if any(shard_constant(body.name) == "num_shards" for body in f.node_def)}
