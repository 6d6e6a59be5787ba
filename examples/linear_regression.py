"""The smallest script: linear regression, parallelized by two calls.

    python examples/linear_regression.py [--steps 200] [--resources configs/resources_2cpu.yaml]
"""
import argparse

import numpy as np
import tensorflow as tf

import parallax_ng as pn

tf1 = tf.compat.v1


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="examples per replica")
    parser.add_argument("--resources", help="resource YAML (default: this machine)")
    parser.add_argument("--config", help="config YAML (default: hybrid)")
    args = parser.parse_args()

    rng = np.random.RandomState(0)
    true_w = np.array([[2.0], [-3.0], [0.5]], np.float32)
    x_all = rng.randn(4096, 3).astype(np.float32)
    y_all = x_all @ true_w + 1.0 + 0.01 * rng.randn(4096, 1).astype(np.float32)

    graph = tf.Graph()
    with graph.as_default():
        ds = tf.data.Dataset.from_tensor_slices((x_all, y_all))
        ds = pn.shard(ds)                                   # call 1
        x, y = tf1.data.make_one_shot_iterator(ds.batch(args.batch).repeat()).get_next()
        w = tf1.get_variable("w", [3, 1], initializer=tf1.zeros_initializer())
        b = tf1.get_variable("b", [1], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()

    runner = pn.get_runner(graph, args.resources, args.config)   # call 2
    runner.run(init)
    for step in range(1, args.steps + 1):
        _, value = runner.run([train_op, loss])
        if step % 50 == 0 or step == 1:
            print(f"step {step:4d}  loss {value:.6f}")
    w_value, b_value = runner.run([w, b])
    print("w =", np.round(w_value.ravel(), 3), "b =", np.round(b_value, 3),
          f"({runner.plan.group_size} replicas)")
    runner.close()


if __name__ == "__main__":
    main()
