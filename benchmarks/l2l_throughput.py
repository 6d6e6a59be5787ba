"""Training throughput of layer-to-layer execution (L2L) against the
one-device baseline at the same depth, and with 1, 2 and 4 micro-batches
of a fixed size (the shape of the L2L paper's Table 3: the micro-batch
stays, the device batch grows).

examples/transformer_stack.py on one stand-in accelerator (CPU:1; CPU:0 is
the host where L2L keeps the model and runs the optimizer). Every row is
run in this process, one after the other: sequences per second over
`--steps` steps after `--warmup`, the median of `--repeats` windows.

    python benchmarks/l2l_throughput.py [--layers 12] [--micro-batch 16]
                                        [--micro-batches 1,2,4] [--stash host]
"""
import argparse
import os
import statistics
import sys
import time

import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import transformer_stack  # noqa: E402

import parallax_ng as pn  # noqa: E402

LAYERS = r"encoder/layer_(\d+)/"


def rate(run, batch: int, steps: int, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            run()
        rates.append(steps * batch / (time.perf_counter() - start))
    return statistics.median(rates)


def baseline(args, batch: int) -> float:
    model = transformer_stack.arguments(["--layers", str(args.layers), "--batch", str(batch),
                                         "--dim", str(args.dim), "--ffn", str(args.ffn)])
    graph, train_op, _, init = transformer_stack.build(model, device="/device:CPU:1")
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        return rate(lambda: sess.run(train_op), batch, args.steps, args.warmup, args.repeats)


def l2l(args, micro_batches: int, precision: str = "fp32") -> float:
    batch = args.micro_batch * micro_batches
    model = transformer_stack.arguments(["--layers", str(args.layers), "--batch", str(batch),
                                         "--dim", str(args.dim), "--ffn", str(args.ffn)])
    graph, train_op, _, init = transformer_stack.build(model)
    config = {"l2l": {"layers": LAYERS, "micro_batches": micro_batches, "stash": args.stash,
                      "precision": precision}}
    with pn.get_runner(graph, {"hosts": [{"devices": ["cpu:1"]}]}, config) as runner:
        runner.run(init)
        return rate(lambda: runner.run(train_op), batch, args.steps, args.warmup,
                    args.repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", default="1,2,4")
    parser.add_argument("--stash", default="host", choices=("device", "host"))
    parser.add_argument("--precisions", default="fp32", help="L2L precisions: fp32,cmp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.layers} layers, dim {args.dim}, ffn {args.ffn}; micro-batch "
          f"{args.micro_batch} sequences; L2L stash on {args.stash}")
    print(f"{'mode':<10} {'precision':>9} {'#ubatches':>9} {'device batch':>12} "
          f"{'seq/s':>9} {'vs baseline':>11}")
    base = baseline(args, args.micro_batch)
    print(f"{'baseline':<10} {'fp32':>9} {'-':>9} {args.micro_batch:12d} {base:9.1f} "
          f"{1.0:11.2f}", flush=True)
    for precision in args.precisions.split(","):
        for u in (int(x) for x in args.micro_batches.split(",")):
            r = l2l(args, u, precision)
            print(f"{'l2l':<10} {precision:>9} {u:9d} {args.micro_batch * u:12d} {r:9.1f} "
                  f"{r / base:11.2f}", flush=True)
    for u in (int(x) for x in args.micro_batches.split(",")):
        if u > 1:
            r = baseline(args, args.micro_batch * u)
            print(f"{'baseline':<10} {'fp32':>9} {'-':>9} {args.micro_batch * u:12d} "
                  f"{r:9.1f} {r / base:11.2f}", flush=True)


if __name__ == "__main__":
    main()
