"""Device memory per training step of examples/transformer_stack.py by depth:
the one-device baseline against layer-to-layer execution (L2L).

The second CPU device stands in for the accelerator; CPU:0 is the host. The
baseline places the model's variables and ops on CPU:1 (the input pipeline
stays on the host); L2L runs with that one device as its replica
(parallax_ng/l2l/builder.py), the model and optimizer on the host. The figure is the
bytes of the variables on the device (held across steps) plus the step's
peak of live tensor bytes its nodes allocated (parallax_ng/runtime/memory.py: the
allocation records of a traced step, charged to the device whose node made
them, since both CPU devices share one allocator). L2L's weights reach the
device as copies of their own (DeepCopy), so they are counted as a GPU's
host-to-device copies would be.

    python benchmarks/l2l_memory.py [--layers 6,12,24,48] [--micro-batches 1]
"""
import argparse
import os
import sys
import time

import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import transformer_stack  # noqa: E402

import parallax_ng as pn  # noqa: E402
from parallax_ng.runtime import memory

DEVICE = "/device:CPU:1"
LAYERS = r"encoder/layer_(\d+)/"
STEPS = 3           # traced steps per figure; the figure is their largest peak


def device_bytes(layers: int, mode: str, micro_batches: int = 1, argv=(),
                 steps: int = STEPS) -> tuple[int, int]:
    """(resident bytes, step peak bytes) on the stand-in device; mode is
    baseline, device (L2L, stash on the device) or host (L2L, stash on the
    host), -cmp added for L2L's cross mixed precision (float16 on the device).
    The step peak is the largest of `steps` traced steps: which tensors are
    alive at once depends on the order two threads run the ops in, and an
    allocator must hold the worst step's peak."""
    args = transformer_stack.arguments(["--layers", str(layers), *argv])
    if mode == "baseline":
        graph, train_op, _, init = transformer_stack.build(args, device=DEVICE)
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(init)
            sess.run(train_op)         # slots and first-run allocations settled
            peak = max(_traced_peak(sess.run, train_op) for _ in range(steps))
        resident = memory.resident_bytes(graph, DEVICE)
    else:
        graph, train_op, _, init = transformer_stack.build(args)
        stash, _, precision = mode.partition("-")
        config = {"l2l": {"layers": LAYERS, "stash": stash, "micro_batches": micro_batches,
                          "precision": precision or "fp32"}}
        with pn.get_runner(graph, {"hosts": [{"devices": ["cpu:1"]}]}, config) as runner:
            runner.run(init)
            runner.run(train_op)
            peak = max(_traced_peak(runner.run, train_op) for _ in range(steps))
            resident = memory.resident_bytes(runner.graph, DEVICE)
    return resident, peak


def _traced_peak(run, train_op) -> int:
    md = tf.compat.v1.RunMetadata()
    run(train_op, options=memory.traced(), run_metadata=md)
    return sum(v for d, v in memory.step_peaks(md).items() if d.endswith("CPU:1"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="6,12,24,48")
    parser.add_argument("--modes", default="baseline,device,host,host-cmp")
    parser.add_argument("--micro-batches", type=int, default=1)
    args = parser.parse_args()
    modes = args.modes.split(",")
    print(f"device MB per step (resident + step peak), x = against the first depth; "
          f"L2L with {args.micro_batches} micro-batch(es)")
    print(f"{'layers':>6} " + " ".join(f"{m + ' MB':>12} {'x':>6}" for m in modes))
    first = {}
    for n in (int(x) for x in args.layers.split(",")):
        cells = []
        for mode in modes:
            start = time.time()
            total = sum(device_bytes(n, mode, args.micro_batches))
            first.setdefault(mode, total)
            cells.append(f"{total / 1e6:12.3f} {total / first[mode]:6.2f}")
            print(f"  ({mode}, {n} layers: {time.time() - start:.0f} s)", file=sys.stderr,
                  flush=True)
        print(f"{n:6d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
