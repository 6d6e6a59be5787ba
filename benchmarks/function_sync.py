"""What a pn.function loop's write-back costs: a Keras 3 classifier (two
hidden layers of `--widths`, Adam, an accuracy metric updated in the step)
on 2 replicas in one process, ms per call with config `batch_sync` never
(the program's variables only at step.sync()), auto (all of them after each
call: the model is under tf2.FOLLOWED bytes) and auto over FOLLOWED (the
metric's state only), in one run.

    python benchmarks/function_sync.py [--steps 100] [--widths 64 1024]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def ms_per_call(width: int, mode: str, steps: int) -> tuple[float, float]:
    """(ms per call, MiB of the step's variables)."""
    os.environ["TF_USE_LEGACY_KERAS"] = "0"
    import keras
    import numpy as np
    import tensorflow as tf

    import parallax_ng as pn
    import parallax_ng.tf2 as tf2
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 256)).astype(np.float32), rng.integers(0, 10, 64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(width, "relu"),
                              keras.layers.Dense(width, "relu"), keras.layers.Dense(10)])
    optimizer, accuracy = keras.optimizers.Adam(1e-3), keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        accuracy.update_state(y, logits)
        return loss
    saved = tf2.FOLLOWED
    tf2.FOLLOWED = 0 if mode == "auto, state only" else saved
    try:
        call = pn.function(step, {"hosts": [{"devices": ["cpu:0", "cpu:1"]}]},
                           {"batch_sync": mode.split(",")[0]})
        for _ in range(5):
            call(x, y)
        start = time.perf_counter()
        for _ in range(steps):
            call(x, y)
        seconds = (time.perf_counter() - start) / steps
    finally:
        tf2.FOLLOWED = saved
    size = sum(v.shape.num_elements() * v.dtype.size for v in
               call._captured.variables.values()) / 2**20
    return seconds * 1e3, size


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 1024])
    args = parser.parse_args(argv)
    for width in args.widths:
        times = {}
        for mode in ("never", "auto", "auto, state only"):
            times[mode], size = ms_per_call(width, mode, args.steps)
        print(f"width {width} ({size:.2f} MiB of variables): " + ", ".join(
            f"{mode} {ms:.2f} ms ({ms / times['never']:.2f}x)" for mode, ms in times.items()),
            flush=True)


if __name__ == "__main__":
    main()
