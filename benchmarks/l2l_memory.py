"""Device memory per training step of examples/transformer_stack.py by depth.

The second CPU device stands in for the accelerator: the model's variables
and ops are placed on it, the input pipeline on CPU:0. The figure is the
bytes of the variables on the device (weights and Adam's slots, held
across steps) plus the step's peak of live tensor bytes its nodes
allocated (parallax_ng/memory.py: the allocation records of a traced step,
charged to the device whose node made them, since both CPU devices share
one allocator). Printed for 6, 12, 24 and 48 layers, one device, no
parallax_ng rewrite: the baseline that layer-by-layer execution is to beat.

    python benchmarks/l2l_memory.py [--layers 6,12,24,48]
"""
import argparse
import os
import sys

import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import transformer_stack  # noqa: E402

from parallax_ng import memory  # noqa: E402

DEVICE = "/device:CPU:1"


def baseline(layers: int, argv=()) -> tuple[int, int]:
    """(resident bytes, step peak bytes) on the stand-in device."""
    args = transformer_stack.arguments(["--layers", str(layers), *argv])
    graph, train_op, _, init = transformer_stack.build(args, device=DEVICE)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        sess.run(train_op)         # slots and first-run allocations settled
        md = tf.compat.v1.RunMetadata()
        sess.run(train_op, options=memory.traced(), run_metadata=md)
    peak = sum(v for d, v in memory.step_peaks(md).items() if d.endswith("CPU:1"))
    return memory.resident_bytes(graph, DEVICE), peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="6,12,24,48")
    args = parser.parse_args()
    print(f"{'layers':>6} {'resident MB':>12} {'step peak MB':>13} {'device MB':>10} "
          f"{'vs first':>9}")
    first = None
    for n in (int(x) for x in args.layers.split(",")):
        resident, peak = baseline(n)
        total = resident + peak
        first = first or total
        print(f"{n:6d} {resident / 1e6:12.3f} {peak / 1e6:13.3f} {total / 1e6:10.3f} "
              f"{total / first:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
