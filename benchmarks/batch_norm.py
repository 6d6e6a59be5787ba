"""What `batch_norm: synchronized` costs: a TF1 convolutional net (tf_keras
layers: `--layers` blocks of a 3x3 convolution and a batch normalization,
then a dense classifier; momentum SGD) on 2 replicas in one process, ms
per step with each replica's statistics (per_replica, the fused kernel),
the job's through the fused kernel lowered (synchronized), and the
unfused layer per replica and synchronized, in one run. The exchange is
two tensors of a layer's channels forward and two backward per layer.

    python benchmarks/batch_norm.py [--steps 50] [--layers 4] [--channels 32] [--batch 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def ms_per_step(fused: bool, batch_norm: str, args) -> float:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import parallax_ng as pn
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(0)
        images = rng.rand(args.batch * 4, 16, 16, 3).astype(np.float32)
        labels = rng.randint(0, 10, args.batch * 4).astype(np.int64)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((images, labels)))
        x, y = tf1.data.make_one_shot_iterator(ds.batch(args.batch).repeat()).get_next()
        h = x
        for _ in range(args.layers):
            h = tf_keras.layers.Conv2D(args.channels, 3, padding="same", use_bias=False)(h)
            h = tf_keras.layers.BatchNormalization(fused=fused)(h, training=True)
            h = tf.nn.relu(h)
        logits = tf_keras.layers.Dense(10)(tf_keras.layers.GlobalAveragePooling2D()(h))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    resources = {"hosts": [{"devices": ["cpu:0", "cpu:1"]}]}
    with pn.get_runner(g, resources, {"batch_norm": batch_norm}) as runner:
        runner.run(init)
        for _ in range(5):
            runner.run(train)
        start = time.perf_counter()
        for _ in range(args.steps):
            runner.run(train)
        return (time.perf_counter() - start) / args.steps * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    args = parser.parse_args(argv)
    times = {}
    for fused in (True, False):
        for mode in ("per_replica", "synchronized"):
            times[(fused, mode)] = ms_per_step(fused, mode, args)
    base = times[(True, "per_replica")]
    print(f"{args.layers} conv+batch-norm blocks of {args.channels} channels, global batch "
          f"{args.batch}, 2 replicas:")
    for (fused, mode), ms in times.items():
        print(f"  {'fused' if fused else 'unfused':8} {mode:13} {ms:7.2f} ms/step "
              f"({ms / base:.2f}x fused per_replica)", flush=True)


if __name__ == "__main__":
    main()
