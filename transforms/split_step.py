"""Split step: a job step as two session runs at once, one with the
collectives and one with the parameter-server work.

Requires: the final graph of a multi-worker job (every node placed).
Guarantees (see parallax_ng/pipeline/step_parts.py for why): when the graph has both
collective ops and ops on parameter-server devices, every node gets a part:
ops on a server run in part 0, collectives in part 1, other ops where the
smallest stage their inputs allow puts them (stages alternate between
server work and collectives, part = stage % 2). Handles and constants
float (both parts use them). A tensor made in one part and read in the
other goes through a queue of this worker (on the reader's device when the
tensor comes from a server and is read beside collectives, else on the
producer's; a GPU's queues on its task's CPU): the producer's part enqueues
it, the reader's part dequeues it, once per step; a control edge across
parts becomes a token through such a queue. The queues are private to the
session (no shared name), of capacity one, so a step that enqueued without
dequeuing cannot leave a stale element for the next: the next enqueue waits
and the run times out. `parallax/split_step/close` and `.../reset` close
(cancelling waits) and then drop every queue, for a step whose other run
failed (the runtime runs them). The pass publishes the `StepParts` for the
runner; a graph with only one kind of op is left alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import tensorflow as tf

from parallax_ng import compat
from parallax_ng.errors import GraphError
from parallax_ng.graph import emit
from parallax_ng.graph.ir import GraphIR, format_input
from parallax_ng.graph.rules import COLLECTIVE_OPS
from parallax_ng.pipeline.step_parts import StepParts

SCOPE = "parallax/split_step"
CLOSE = f"{SCOPE}/close"
RESET = f"{SCOPE}/reset"
FLOATING_OPS = frozenset({
    "Const", "VarHandleOp", "VariableV2", "Placeholder", "FIFOQueueV2", "IteratorV2",
    "Iterator", "OneShotIterator", "HashTableV2", "MutableHashTableV2",
    "MutableHashTableOfTensorsV2"})


def on_server(device: str) -> bool:
    return device.startswith("/job:ps")


@dataclass(frozen=True)
class SplitStepPass:
    name: str = "split_step"
    requires: tuple = ("place",)
    after: tuple = ("shard_inputs", "aggregate", "state_sync", "init", "server_sync",
                    "shard_variables", "part_writes")

    def run(self, ir: GraphIR, ctx):
        if not ctx.plan.schedule.split:
            return ir, {}
        nodes = ir.nodes
        if not (any(n.op in COLLECTIVE_OPS for n in nodes) and
                any(on_server(n.device) for n in nodes)):
            return ir, {"parts": 1}
        floating = {n.name for n in nodes if n.op in FLOATING_OPS and not n.input}
        stage = _number(ir, floating)
        out, parts = _cut(ir, {n: s % 2 for n, s in stage.items()}, floating,
                          ctx.plan.host)
        ctx.publish(parts)
        return out, {"parts": 2, "queues": len(parts.queues),
                     "tokens": sum(1 for q in parts.queues if q.endswith("/token_queue"))}


def _number(ir: GraphIR, floating: set[str]) -> dict[str, int]:
    """The smallest stage of every node: server ops even, collectives odd,
    other ops the stage of their latest input; a while loop with neither
    runs whole in the stage of its latest op (a loop that reads a
    collective's output and feeds server work, as a recurrent layer's
    gradient loop between an alltoall lookup and fusion buffers does,
    would otherwise have ops of both runs)."""
    loops = [ops for ops in _loops(ir).values()
             if not any(ir.node(n).op in COLLECTIVE_OPS or on_server(ir.node(n).device)
                        for n in ops)]
    floor: dict[str, int] = {}
    while True:
        stage = _stages(ir, floating, floor)
        raised = {n: s for ops in loops for s in [max(stage.get(n, 0) for n in ops)]
                  for n in ops if n in stage and stage[n] != s}
        if not raised:
            break
        floor.update(raised)
    _keep_branches_whole(ir, stage)
    for node in (n for n in ir.nodes if n.op == "NextIteration"):
        for merge in ir.node_consumers.get(node.name, ()):
            if stage.get(merge) != stage[node.name]:
                raise GraphError(
                    f"while loop through {merge!r} has both collective ops and "
                    "parameter-server ops in its body; a multi-worker job runs them in "
                    "separate session runs. Use run_option allreduce, or keep the loop free "
                    "of variables on parameter servers")
    for name, s in stage.items():
        if s % 2:
            for src, _, _ in ir.parsed_inputs(ir.node(name)):
                if src in floating and on_server(ir.node(src).device):
                    raise GraphError(f"{name!r} runs with collectives but reads {src!r} "
                                     "on a parameter server")
    return stage


def _stages(ir: GraphIR, floating: set[str], floor: dict[str, int]) -> dict[str, int]:
    stage: dict[str, int] = {}
    for name in ir.topo_order:
        if name in floating:
            continue
        node = ir.node(name)
        s = max([stage[src] for src, _, _ in ir.parsed_inputs(node) if src in stage] +
                [floor.get(name, 0)])
        if node.op in COLLECTIVE_OPS:
            s += 1 - s % 2
        elif on_server(node.device):
            s += s % 2
        stage[name] = s
    return stage


def _loops(ir: GraphIR) -> dict[bytes, list[str]]:
    """The ops of each outermost while loop of control flow v1 (as
    TensorFlow lowers a While), by its frame: an Enter opens one (its
    `frame_name`), an Exit closes it, other ops are in their inputs'."""
    frame: dict[str, tuple] = {}
    for name in ir.topo_order:
        node = ir.node(name)
        here = max((frame[src] for src, _, _ in ir.parsed_inputs(node) if src in frame),
                   key=len, default=())
        if node.op in ("Enter", "RefEnter"):
            here += (node.attr["frame_name"].s,)
        elif node.op in ("Exit", "RefExit"):
            here = here[:-1]
        frame[name] = here
    loops: dict[bytes, list[str]] = {}
    for name, here in frame.items():
        if here:
            loops.setdefault(here[0], []).append(name)
    return loops


SWITCHES = frozenset({"Switch", "RefSwitch"})
LIVE = frozenset({"Merge", "RefMerge", "Exit", "RefExit"})   # live if one input is


def _keep_branches_whole(ir: GraphIR, stage: dict[str, int]) -> None:
    """A conditional branch's ops (after a Switch, before its Merge) may be
    dead: a dead op runs nothing, so a queue it would fill stays empty and
    the other run waits at it for good. Such an op that is neither a
    collective nor server work moves to its consumers' stage (later ops
    first, so a branch moves whole); one whose consumers are in both runs,
    or that must stay where it is, is refused."""
    dead = set()
    for name in ir.topo_order:
        if name in stage and (ir.node(name).op in SWITCHES or ir.node(name).op not in LIVE
                              and any(src in dead for src, _, _ in
                                      ir.parsed_inputs(ir.node(name)))):
            dead.add(name)
    for name in reversed(ir.topo_order):
        node = ir.node(name) if name in dead else None
        if node is None or node.op in COLLECTIVE_OPS or on_server(node.device):
            continue
        later = {stage[c] for c in ir.node_consumers.get(name, ()) if c in stage}
        if later and len({s % 2 for s in later}) == 1 and min(later) % 2 != stage[name] % 2:
            stage[name] = min(later)
    for name in dead:
        for c in ir.node_consumers.get(name, ()):
            if c in stage and stage[c] % 2 != stage[name] % 2:
                raise GraphError(
                    f"{c!r} and {name!r} are in a conditional branch or loop body "
                    "(control flow v1) that has both collective ops and parameter-server "
                    "ops, which a multi-worker job runs in separate session runs. Use "
                    "run_option allreduce, or keep the branch free of variables on "
                    "parameter servers")


def _cut(ir: GraphIR, part: dict[str, int], floating: set[str], host: str):
    changed, added = {}, []
    dequeue: dict[tuple[str, str], str] = {}     # (tensor or ^node, device) -> dequeue
    enqueue_of: dict[str, str] = {}               # dequeue -> enqueue
    queues: list[str] = []
    for node in ir.nodes:
        name = node.name
        if name in floating:
            continue
        new_inputs, touched = [], False
        for text, (src, idx, control) in zip(node.input, ir.parsed_inputs(node)):
            if src not in part or part[src] == part[name]:
                new_inputs.append(text)
                continue
            touched = True
            producer = ir.node(src)
            device = _queue_device(node.device if on_server(producer.device) and part[name]
                                   else producer.device)
            key = (text if control else format_input(src, idx), device)
            if key not in dequeue:
                made, deq, enq = _queue(ir, producer, idx, control, device, len(queues), name)
                added += made
                queues.append(made[0].name)
                dequeue[key], enqueue_of[deq] = deq, enq
                part.update({n.name: part[src] for n in made[1:] if n.name != deq})
                part[deq] = part[name]
            new_inputs.append(f"^{dequeue[key]}" if control else dequeue[key])
        if touched:
            nd = type(node)()
            nd.CopyFrom(node)
            del nd.input[:]
            nd.input.extend(new_inputs)
            changed[name] = nd
    device = {n.name: n.device for n in added if n.name in set(queues)}
    added += _reset_ops(queues, device, host)
    return (ir.replace(changed, added),
            StepParts(part, frozenset(floating) | set(queues), enqueue_of, tuple(queues),
                      CLOSE, RESET))


def _queue(ir: GraphIR, producer, idx: int, control: bool, device: str, k: int,
           consumer: str):
    """(nodes, dequeue, enqueue) moving `producer`'s output `idx` (a token
    after it, for a control edge) through a new queue on `device`."""
    base = f"{SCOPE}/{producer.name}/{'control' if control else idx}/{k}"
    if control:
        dtype = tf.int32
        queue = f"{base}/token_queue"
        token = emit.const(f"{base}/token", 0, dtype, device)
        token.input.append(f"^{producer.name}")
        item, nodes = token.name, [token]
    else:
        dtype = _dtype(ir, producer, idx, consumer)
        queue, item, nodes = f"{base}/queue", format_input(producer.name, idx), []
    enq, deq = f"{base}/enqueue", f"{base}/dequeue"
    nodes = [emit.fifo_queue(queue, "", [dtype], device, capacity=1)] + nodes + [
        emit.node_def(enq, "QueueEnqueueV2", [queue, item], device, Tcomponents=[dtype],
                      timeout_ms=-1),
        emit.node_def(deq, "QueueDequeueV2", [queue], device, component_types=[dtype],
                      timeout_ms=-1)]
    return nodes, deq, enq


def _reset_ops(queues: list[str], device: dict[str, str], host: str) -> list:
    """CLOSE: every queue closed, waits on it cancelled; RESET: every queue
    dropped (the next run makes it again, empty); on this worker (`host`)."""
    nodes, closes, drops = [], [], []
    for q in queues:
        nodes += [emit.node_def(f"{q}/close", "QueueCloseV2", [q], device[q],
                                cancel_pending_enqueues=True),
                  emit.node_def(f"{q}/drop", "DestroyResourceOp", [q], device[q],
                                ignore_lookup_error=True)]
        closes.append(f"^{q}/close")
        drops.append(f"^{q}/drop")
    return nodes + [emit.node_def(CLOSE, "NoOp", closes, host),
                    emit.node_def(RESET, "NoOp", drops, host)]


_ACCELERATOR = re.compile(r"/device:(GPU|TPU):\d+$")


def _queue_device(device: str) -> str:
    """Queues have CPU kernels only: an accelerator's go on its task's CPU."""
    return _ACCELERATOR.sub("/device:CPU:0", device)


def _dtype(ir: GraphIR, producer, idx: int, consumer: str) -> tf.DType:
    dtypes = compat.output_dtypes(producer, ir.library)
    if dtypes is None or idx >= len(dtypes):
        raise GraphError(f"cannot tell the type of {producer.name}:{idx} ({producer.op}), "
                         f"which {consumer!r} reads in the other run of a job's step")
    dtype, is_ref = dtypes[idx]
    if is_ref:
        raise GraphError(f"{consumer!r} reads the reference {producer.name}:{idx} in the "
                         "other run of a multi-worker step (collectives apart from "
                         "parameter servers); use resource variables")
    return dtype


__all__ = ["SplitStepPass"]
