"""Benchmark: time to transform a 24-block transformer-like graph for 8 devices.

Prints the time TensorFlow takes to build the single-device training graph
(forward, autodiff, Adam), the time parallax_ng takes to transform it (front
end + analysis + plan + all passes, no session), and their ratio; medians of
--repeats runs in one process. Also the time to import the result into a
tf.Graph, which the runner does once.

    python benchmarks/transform_time.py [--blocks 24] [--devices 8] [--repeats 3]
"""
import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import parallax_ng as pn

tf1 = tf.compat.v1


def layer_norm(x, name, dim):
    with tf1.variable_scope(name):
        gamma = tf1.get_variable("gamma", [dim], initializer=tf1.ones_initializer())
        beta = tf1.get_variable("beta", [dim], initializer=tf1.zeros_initializer())
        mean, var = tf.nn.moments(x, [-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta


def dense(x, name, d_in, d_out):
    with tf1.variable_scope(name):
        w = tf1.get_variable("w", [d_in, d_out])
        b = tf1.get_variable("b", [d_out], initializer=tf1.zeros_initializer())
        return tf.tensordot(x, w, 1) + b


def build(blocks=24, vocab=8000, seq=32, dim=64, heads=4):
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None, seq], name="ids")
        targets = tf1.placeholder(tf.int32, [None, seq], name="targets")
        emb = tf1.get_variable("embedding", [vocab, dim])
        pos = tf1.get_variable("position", [seq, dim])
        x = tf.nn.embedding_lookup(emb, ids) + pos
        for i in range(blocks):
            with tf1.variable_scope(f"block_{i}"):
                h = layer_norm(x, "ln1", dim)
                q, k, v = (dense(h, n, dim, dim) for n in ("q", "k", "v"))

                def split(t):
                    return tf.transpose(tf.reshape(t, [-1, seq, heads, dim // heads]),
                                        [0, 2, 1, 3])
                att = tf.nn.softmax(tf.matmul(split(q), split(k), transpose_b=True) /
                                    np.sqrt(dim // heads))
                o = tf.reshape(tf.transpose(tf.matmul(att, split(v)), [0, 2, 1, 3]),
                               [-1, seq, dim])
                x = x + dense(o, "o", dim, dim)
                h = layer_norm(x, "ln2", dim)
                x = x + dense(tf.nn.relu(dense(h, "ff1", dim, 4 * dim)), "ff2", 4 * dim, dim)
        x = layer_norm(x, "final_ln", dim)
        logits = dense(x, "logits", dim, vocab)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=targets, logits=logits))
        tf1.train.AdamOptimizer(1e-3).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        tf1.global_variables_initializer()
    return g


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-option", default="hybrid")
    args = parser.parse_args()
    resources = {"hosts": [{"devices": [f"cpu:{k}" for k in range(args.devices)]}]}
    builds, transforms, imports = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        g = build(args.blocks)
        builds.append(time.perf_counter() - start)
        start = time.perf_counter()
        ir, ctx, manager = pn.transform(g, resources, {"run_option": args.run_option})
        transforms.append(time.perf_counter() - start)
        start = time.perf_counter()
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(ir.graph_def, name="")
        imports.append(time.perf_counter() - start)
    trainable = len(ctx.tg.trainable)
    build_s, transform_s = statistics.median(builds), statistics.median(transforms)
    print(f"graph: {args.blocks} blocks, {trainable} trainable variables, "
          f"{len(ctx.tg.variables)} variables with optimizer state, {len(ctx.tg.ir)} nodes")
    print(f"transformed for {args.devices} devices ({args.run_option}): {len(ir)} nodes")
    print(f"TensorFlow build time      {build_s:8.3f} s (median of {args.repeats})")
    print(f"parallax_ng transform time {transform_s:8.3f} s")
    print(f"ratio transform/build      {transform_s / build_s:8.3f}   (target <= 1.0)")
    print(f"import into tf.Graph       {statistics.median(imports):8.3f} s (runner, once)")
    print("per pass (last run):")
    print(manager.summary())


if __name__ == "__main__":
    main()
