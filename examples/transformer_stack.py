"""A transformer-like stack of layers, written as plain tf.compat.v1 code.

Token embeddings, then LAYERS blocks under `encoder/layer_<i>/` (a
single-head self-attention and a feed-forward network, each after a layer
normalization and added back to its input, with dropout on the attention
weights and on each block's two outputs when --dropout is set), a mean over
positions and a classifier head, trained with Adam on a synthetic task (the label is
whether most of the sequence's tokens are in the vocabulary's lower half).
The layer scopes are what a layer-by-layer execution selects with
`encoder/layer_(\\d+)/`.

    python examples/transformer_stack.py [--layers 6] [--steps 100]
                                         [--resources R.yaml] [--config C.yaml]
"""
import argparse

import numpy as np
import tensorflow as tf

import parallax_ng as pn

tf1 = tf.compat.v1


def data(vocab: int, seq: int, n: int = 4096, seed: int = 0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, vocab, size=(n, seq)).astype(np.int32)
    return tokens, ((tokens < vocab // 2).mean(1) > 0.5).astype(np.int64)


def layer(h, i: int, dim: int, ffn: int, dropout: float = 0.0):
    """One block (normalization first): h [batch, seq, dim] -> the same."""
    def drop(x):
        return tf.nn.dropout(x, rate=dropout) if dropout else x
    with tf1.variable_scope(f"encoder/layer_{i}"):
        q, k, v, o = (tf1.get_variable(n, [dim, dim]) for n in ("q", "k", "v", "o"))
        x = _norm(h, "norm_1", dim)
        scores = tf.einsum("bsd,btd->bst", tf.einsum("bsd,de->bse", x, q),
                           tf.einsum("bsd,de->bse", x, k)) / float(np.sqrt(dim))
        attended = tf.einsum("bst,btd->bsd", drop(tf.nn.softmax(scores)),
                             tf.einsum("bsd,de->bse", x, v))
        h = h + drop(tf.einsum("bsd,de->bse", attended, o))
        x = _norm(h, "norm_2", dim)
        w1 = tf1.get_variable("ffn/w1", [dim, ffn])
        b1 = tf1.get_variable("ffn/b1", [ffn], initializer=tf1.zeros_initializer())
        w2 = tf1.get_variable("ffn/w2", [ffn, dim])
        return h + drop(tf.einsum("bsf,fd->bsd",
                                  tf.nn.relu(tf.einsum("bsd,df->bsf", x, w1) + b1), w2))


def _norm(h, name: str, dim: int):
    with tf1.variable_scope(name):
        gain = tf1.get_variable("gain", [dim], initializer=tf1.ones_initializer())
        bias = tf1.get_variable("bias", [dim], initializer=tf1.zeros_initializer())
    mean, var = tf.nn.moments(h, [2], keepdims=True)
    return (h - mean) * tf.math.rsqrt(var + 1e-6) * gain + bias


def build(args, device: str | None = None):
    """(graph, train op, loss, init); with `device`, the model's ops and
    variables on it (the input pipeline stays on the host)."""
    tokens, labels = data(args.vocab, args.seq)
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(args.seed)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((tokens, labels)))
        ds = ds.batch(args.batch, drop_remainder=True).repeat()
        ids, y = tf1.data.make_one_shot_iterator(ds).get_next()
        with tf.device(device):
            emb = tf1.get_variable("embedding", [args.vocab, args.dim])
            h = tf.nn.embedding_lookup(emb, ids)
            for i in range(args.layers):
                h = layer(h, i, args.dim, args.ffn, args.dropout)
            pooled = tf.reduce_mean(_norm(h, "final_norm", args.dim), 1)
            logits = tf.matmul(pooled, tf1.get_variable("head/w", [args.dim, 2]))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=logits), name="loss")
            step = tf1.train.get_or_create_global_step()
            train_op = tf1.train.AdamOptimizer(args.lr).minimize(loss, global_step=step)
        init = tf1.global_variables_initializer()
    return graph, train_op, loss, init


def arguments(argv=None) -> argparse.Namespace:
    """The example's options (benchmarks build the same model from these)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="sequences per replica")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=100)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout rate in the layers")
    parser.add_argument("--seed", type=int, default=0, help="graph-level random seed")
    parser.add_argument("--resources", help="resource YAML (default: this machine)")
    parser.add_argument("--config", help="config YAML")
    parser.add_argument("--log-every", type=int, default=25)
    return parser.parse_args(argv)


def main():
    args = arguments()
    graph, train_op, loss, init = build(args)
    with pn.get_runner(graph, args.resources, args.config) as runner:
        print(f"transformer_stack: {args.layers} layers, {runner.plan.group_size} replicas")
        runner.run(init)
        window = []
        for i in range(1, args.steps + 1):
            window.append(runner.run([train_op, loss])[1])
            if i % args.log_every == 0:
                print(f"step {i:5d}  loss {np.mean(window):.4f}", flush=True)
                window = []


if __name__ == "__main__":
    main()
