"""Stage: split each step so no run mixes collectives and parameter servers.

Requires: the final graph of a multi-worker job (every node placed).
Guarantees (see parallax_ng/stages.py for why): when the graph has both
collective ops and ops on parameter-server devices, every node gets a stage,
the smallest one its inputs allow: ops on a server run in even stages,
collectives in odd stages, other ops in the stage of their latest input.
Handles and constants float (any stage uses them). A tensor read in a later
stage than it was made goes through a buffer: a resource variable on the
worker (on the reader's device when the tensor comes from a server and is
read in a collective stage), written in the producer's stage and read in the
consumer's; a control edge across stages is dropped and recorded, so the
runner runs its source in the earlier stage. The pass publishes the
`Stages` for the runner; a graph with only one kind of op is left alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng import compat, emit
from parallax_ng.errors import GraphError
from parallax_ng.ir import GraphIR, format_input
from parallax_ng.stages import Stages

COLLECTIVE_OPS = frozenset({
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "CollectiveGather",
    "CollectiveGatherV2", "CollectiveBcastSend", "CollectiveBcastRecv",
    "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveAllToAllV2",
    "CollectiveAllToAllV3", "CollectiveReduceScatterV2"})
FLOATING_OPS = frozenset({
    "Const", "VarHandleOp", "VariableV2", "Placeholder", "FIFOQueueV2", "IteratorV2",
    "Iterator", "OneShotIterator", "HashTableV2", "MutableHashTableV2",
    "MutableHashTableOfTensorsV2"})


_UNKNOWN_SHAPE = tf.compat.v1.AttrValue(shape=tf.TensorShape(None).as_proto())


def on_server(device: str) -> bool:
    return device.startswith("/job:ps")


@dataclass(frozen=True)
class StagePass:
    name: str = "stage"
    requires: tuple = ("place",)
    after: tuple = ("shard_inputs", "aggregate", "state_sync", "init", "server_sync",
                    "shard_variables")

    def run(self, ir: GraphIR, ctx):
        if not ctx.plan.schedule.staged:
            return ir, {}
        nodes = ir.nodes
        if not (any(n.op in COLLECTIVE_OPS for n in nodes) and
                any(on_server(n.device) for n in nodes)):
            return ir, {"stages": 1}
        floating = {n.name for n in nodes if n.op in FLOATING_OPS and not n.input}
        stage = _number(ir, floating)
        out, stages = _cut(ir, stage, floating)
        ctx.publish(stages)
        return out, {"stages": stages.count, "buffers": len(stages.buffer_write),
                     "cut_controls": sum(map(len, stages.after.values()))}


def _number(ir: GraphIR, floating: set[str]) -> dict[str, int]:
    stage: dict[str, int] = {}
    for name in ir.topo_order:
        if name in floating:
            continue
        node = ir.node(name)
        s = max((stage[src] for src, _, _ in ir.parsed_inputs(node)
                 if src in stage), default=0)
        if node.op in COLLECTIVE_OPS:
            s += 1 - s % 2
        elif on_server(node.device):
            s += s % 2
        stage[name] = s
    for node in (n for n in ir.nodes if n.op == "NextIteration"):
        for merge in ir.node_consumers.get(node.name, ()):
            if stage.get(merge) != stage[node.name]:
                raise GraphError(
                    f"while loop through {merge!r} has both collective ops and "
                    "parameter-server ops in its body; a multi-worker job runs them in "
                    "separate steps. Use run_option allreduce, or keep the loop free of "
                    "variables on parameter servers")
    for name, s in stage.items():
        if s % 2:
            for src, _, _ in ir.parsed_inputs(ir.node(name)):
                if src in floating and on_server(ir.node(src).device):
                    raise GraphError(f"{name!r} runs with collectives but reads {src!r} "
                                     "on a parameter server")
    return stage


def _cut(ir: GraphIR, stage: dict[str, int], floating: set[str]):
    changed, added = {}, []
    buffers: dict[tuple[str, str], str] = {}       # (tensor, device) -> buffer handle
    reads: dict[tuple[str, str, int], str] = {}    # (tensor, device, stage) -> read
    buffer_write, after = {}, {}
    for node in ir.nodes:
        name = node.name
        if name in floating:
            continue
        new_inputs, touched = [], False
        for text, (src, idx, control) in zip(node.input, ir.parsed_inputs(node)):
            if src not in stage or stage[src] >= stage[name]:
                new_inputs.append(text)
                continue
            touched = True
            if control:
                after.setdefault(name, []).append(src)
                continue
            producer = ir.node(src)
            device = node.device if on_server(producer.device) and stage[name] % 2 \
                else producer.device
            tensor = format_input(src, idx)
            dtype = _dtype(ir, producer, idx, name)
            key = (tensor, device)
            if key not in buffers:
                handle = buffers[key] = f"parallax/stage/{src}/{idx}/{len(buffers)}"
                write = f"{handle}/write"
                added += [emit.node_def(handle, "VarHandleOp", [], device, dtype=dtype,
                                        shape=_UNKNOWN_SHAPE, container="",
                                        shared_name=handle),
                          emit.node_def(write, "AssignVariableOp", [handle, tensor], device,
                                        dtype=dtype, validate_shape=False)]
                stage[write] = stage[src]
                floating.add(handle)
            rkey = (tensor, device, stage[name])
            if rkey not in reads:
                read = reads[rkey] = f"{buffers[key]}/read_{stage[name]}"
                added.append(emit.node_def(read, "ReadVariableOp", [buffers[key]], device,
                                           dtype=dtype))
                stage[read] = stage[name]
                buffer_write[read] = f"{buffers[key]}/write"
            new_inputs.append(reads[rkey])
        if touched:
            nd = type(node)()
            nd.CopyFrom(node)
            del nd.input[:]
            nd.input.extend(new_inputs)
            changed[name] = nd
    return (ir.replace(changed, added),
            Stages(stage, frozenset(floating), buffer_write, after))


def _dtype(ir: GraphIR, producer, idx: int, consumer: str) -> tf.DType:
    dtypes = compat.output_dtypes(producer, ir.library)
    if dtypes is None or idx >= len(dtypes):
        raise GraphError(f"cannot tell the type of {producer.name}:{idx} ({producer.op}), "
                         f"which {consumer!r} reads in a later stage")
    dtype, is_ref = dtypes[idx]
    if is_ref:
        raise GraphError(f"{consumer!r} reads the reference {producer.name}:{idx} in a later "
                         "stage of a multi-worker step; use resource variables")
    return dtype
