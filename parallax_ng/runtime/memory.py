"""Device memory of a step, per device, from a traced run.

A GPU's allocator reports its own peak; on CPU, TensorFlow 2.21 fills
AllocatorMemoryUsed.peak_bytes too, but every CPU device of a process
shares one allocator ("cpu"), so that peak mixes the devices. Here each
allocation is charged to the device whose node made it: a traced run's
step stats list, per device, each node's allocation records (time, bytes;
a release is a negative record on the node that allocated). The live bytes
of a device over the step are the running sum of its records in time
order; the step's peak is their largest value. Memory allocated before the
step and kept (variables, a stash in a variable) has no records in it:
`resident_bytes` adds the variables placed on the device.

Requires: RunMetadata of a traced run (`traced`, compat.trace_level).
Guarantees: `step_peaks` maps every traced device to its peak live bytes
(0 when it allocated nothing); deterministic for a given RunMetadata.
"""
from __future__ import annotations

import tensorflow as tf

from ..compat import trace_level


def traced() -> tf.compat.v1.RunOptions:
    """Run options that record allocations."""
    return tf.compat.v1.RunOptions(trace_level=trace_level())


def step_peaks(run_metadata) -> dict[str, int]:
    """Device -> the largest number of bytes its nodes' allocations held
    at once during the step."""
    out = {}
    for dev in run_metadata.step_stats.dev_stats:
        records = sorted((r.alloc_micros, r.alloc_bytes) for node in dev.node_stats
                         for m in node.memory for r in m.allocation_records)
        live = peak = 0
        for _, size in records:      # at one instant, releases sort before allocations
            live += size
            peak = max(peak, live)
        out[dev.device] = max(out.get(dev.device, 0), peak)
    return out


def resident_bytes(graph: tf.Graph, device: str) -> int:
    """Bytes of the variables `graph` places on `device` (they hold their
    memory across steps, so a step's records do not show it)."""
    want = tf.DeviceSpec.from_string(device)
    total = 0
    for op in graph.get_operations():
        if op.type not in ("VarHandleOp", "VariableV2"):
            continue
        spec = tf.DeviceSpec.from_string(op.device or "")
        if (spec.device_type, spec.device_index) != (want.device_type, want.device_index):
            continue
        dtype = tf.as_dtype(op.get_attr("dtype")).base_dtype
        shape = tf.TensorShape(op.get_attr("shape"))
        if shape.is_fully_defined():
            total += shape.num_elements() * dtype.size
    return total
