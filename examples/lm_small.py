"""A small word-level language model with a large-vocabulary embedding.

Predicts the next word from the previous CONTEXT words of a synthetic corpus
(a Zipf-distributed vocabulary with a hidden bigram structure, generated
here). The input embedding and the sampled-softmax output weights have
sparse (IndexedSlices) gradients; the hidden layers are dense. With the
default `hybrid` run option the embeddings go through the parameter server
(the host CPU) and the dense layers are all-reduced.

    python examples/lm_small.py [--steps 300] [--run-option hybrid|allreduce|ps]
                                [--resources R.yaml] [--config C.yaml]
"""
import argparse
import time

import numpy as np
import tensorflow as tf

import parallax_ng as pn

tf1 = tf.compat.v1
CONTEXT = 4


def corpus(vocab: int, words: int, seed: int = 0) -> np.ndarray:
    """Words where each word mostly follows from the one before it."""
    rng = np.random.RandomState(seed)
    successor = rng.zipf(1.3, size=vocab) % vocab
    text = np.empty(words, np.int64)
    text[0] = 0
    noise = rng.zipf(1.3, size=words) % vocab
    follow = rng.rand(words) < 0.7
    for i in range(1, words):
        text[i] = successor[text[i - 1]] if follow[i] else noise[i]
    return text


def windows(text: np.ndarray):
    idx = np.arange(CONTEXT)[None, :] + np.arange(len(text) - CONTEXT)[:, None]
    return text[idx].astype(np.int32), text[CONTEXT:].astype(np.int64)


def build(args):
    contexts, targets = windows(corpus(args.vocab, args.words))
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(args.seed)    # the same initial values and samples every run
        ds = tf.data.Dataset.from_tensor_slices((contexts, targets)).shuffle(10000, seed=1)
        ds = pn.shard(ds)
        ds = ds.batch(args.batch, drop_remainder=True).repeat()
        words, nxt = tf1.data.make_one_shot_iterator(ds).get_next()
        emb = tf1.get_variable("embedding", [args.vocab, args.dim],
                               initializer=tf1.random_uniform_initializer(-0.05, 0.05))
        h = tf.reshape(tf.nn.embedding_lookup(emb, words), [-1, CONTEXT * args.dim])
        zeros = tf1.zeros_initializer()
        h = tf.nn.relu(tf.matmul(h, tf1.get_variable("hidden/w", [CONTEXT * args.dim, args.hidden]))
                       + tf1.get_variable("hidden/b", [args.hidden], initializer=zeros))
        h = tf.tanh(tf.matmul(h, tf1.get_variable("project/w", [args.hidden, args.dim]))
                    + tf1.get_variable("project/b", [args.dim], initializer=zeros))
        soft_w = tf1.get_variable("softmax/w", [args.vocab, args.dim])
        soft_b = tf1.get_variable("softmax/b", [args.vocab], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.nn.sampled_softmax_loss(
            soft_w, soft_b, tf.reshape(nxt, [-1, 1]), h, num_sampled=64,
            num_classes=args.vocab), name="loss")
        step = tf1.train.get_or_create_global_step()
        opt = tf1.train.AdagradOptimizer(0.2)
        grads, tvars = zip(*opt.compute_gradients(loss))
        if args.clip:
            grads, _ = tf.clip_by_global_norm(grads, args.clip)
        train_op = opt.apply_gradients(zip(grads, tvars), global_step=step)
        init = tf1.global_variables_initializer()
    return graph, train_op, loss, step, init


def arguments(argv=None) -> argparse.Namespace:
    """The example's options (benchmarks build the same model from these)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128, help="windows per replica")
    parser.add_argument("--vocab", type=int, default=20000)
    parser.add_argument("--words", type=int, default=200000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--run-option", default=None, help="hybrid, allreduce or ps")
    parser.add_argument("--resources", help="resource YAML (default: this machine)")
    parser.add_argument("--config", help="config YAML")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="graph-level random seed")
    parser.add_argument("--clip", type=float, default=5.0,
                        help="global-norm clipping (0: none)")
    return parser.parse_args(argv)


def main():
    args = arguments()

    graph, train_op, loss, step, init = build(args)
    config = args.config or ({"run_option": args.run_option} if args.run_option else None)
    runner = pn.get_runner(graph, args.resources, config)
    plan = runner.plan
    print(f"lm_small: vocab {args.vocab}, {plan.group_size} replicas "
          f"({plan.num_workers} worker(s) x {plan.num_replicas}) x batch {args.batch}, "
          f"run_option {plan.run_option}")
    print(plan.format())
    runner.run(init)
    window, since, logged = [], time.perf_counter(), 0
    for i in range(1, args.steps + 1):
        _, value = runner.run([train_op, loss])
        window.append(value)
        if i % args.log_every == 0 or i == 1:
            # words per second over the steps since the last line, job-wide
            now = time.perf_counter()
            rate = (i - logged) * plan.group_size * args.batch / (now - since)
            print(f"step {i:5d}  loss {np.mean(window):.4f}  {rate:9.0f} words/s",
                  flush=True)
            window, since, logged = [], now, i
    runner.close()


if __name__ == "__main__":
    main()
