"""A BERT-style encoder written the way BERT's modeling.py writes it, for
layer-by-layer execution's tests: static shapes taken from the tensors as
Python numbers (reshapes to [batch x seq, width] and back), the attention
mask as tf.ones([batch, seq, 1]) times the input mask, tf.compat.v1.layers
dense layers under bert/encoder/layer_<i>/, GELU, layer normalization,
dropout on the embeddings, the attention probabilities, each sub-layer's
output and the pooled output."""
import math

import numpy as np
import tensorflow as tf

import parallax_ng as pn

tf1 = tf.compat.v1
SEQ, WIDTH, HEADS, VOCAB = 8, 16, 2, 50
LAYERS = r"encoder/layer_(\d+)/"


def _shape(t):
    """BERT's get_shape_list: static dimensions as numbers."""
    dynamic = tf.shape(t)
    return [d if d is not None else dynamic[i] for i, d in enumerate(t.shape.as_list())]


def _norm(x, name):
    with tf1.variable_scope(name):
        gamma = tf1.get_variable("gamma", [WIDTH], initializer=tf1.ones_initializer())
        beta = tf1.get_variable("beta", [WIDTH], initializer=tf1.zeros_initializer())
    mean, var = tf.nn.moments(x, [-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-12) * gamma + beta


def _gelu(x):
    return 0.5 * x * (1.0 + tf.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * tf.pow(x, 3))))


def _attention(x2d, mask, batch, seq, drop):
    width = WIDTH // HEADS

    def heads(t):
        return tf.transpose(tf.reshape(t, [batch, seq, HEADS, width]), [0, 2, 1, 3])
    # the key has no bias: softmax ignores what it adds to a row of scores, so
    # its gradient is round-off, which Adam would turn into full-size steps
    q, k, v = (tf1.layers.dense(x2d, WIDTH, name=n, use_bias=n != "key")
               for n in ("query", "key", "value"))
    scores = tf.matmul(heads(q), heads(k), transpose_b=True) / math.sqrt(width)
    scores += (1.0 - tf.expand_dims(mask, 1)) * -10000.0
    context = tf.matmul(drop(tf.nn.softmax(scores)), heads(v))
    return tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [batch * seq, WIDTH])


def build(batch, layers=2, dropout=0.0, seed=1):
    """(graph, train op, loss, init): Adam on a synthetic classification."""
    rng = np.random.RandomState(0)
    ids = rng.randint(1, VOCAB, size=(256, SEQ)).astype(np.int32)
    mask = (rng.rand(256, SEQ) > 0.2).astype(np.int32)
    labels = (ids[:, 0] % 2).astype(np.int64)

    def drop(x):
        return tf.nn.dropout(x, rate=dropout) if dropout else x
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(seed)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((ids, mask, labels)))
        x_ids, x_mask, y = tf1.data.make_one_shot_iterator(
            ds.batch(batch, drop_remainder=True).repeat()).get_next()
        with tf1.variable_scope("bert"):
            with tf1.variable_scope("embeddings"):
                table = tf1.get_variable("word_embeddings", [VOCAB, WIDTH])
                position = tf1.get_variable("position_embeddings", [SEQ, WIDTH])
                x = tf.nn.embedding_lookup(table, x_ids) + tf.expand_dims(position, 0)
                x = drop(_norm(x, "LayerNorm"))
            b, s = _shape(x_ids)
            to_mask = tf.cast(tf.reshape(x_mask, [b, 1, s]), tf.float32)
            attention_mask = tf.ones(shape=[b, s, 1], dtype=tf.float32) * to_mask
            h = tf.reshape(x, [-1, WIDTH])
            for i in range(layers):
                with tf1.variable_scope(f"encoder/layer_{i}"):
                    with tf1.variable_scope("attention"):
                        with tf1.variable_scope("self"):
                            a = _attention(h, attention_mask, b, s, drop)
                        with tf1.variable_scope("output"):
                            a = _norm(drop(tf1.layers.dense(a, WIDTH)) + h, "LayerNorm")
                    with tf1.variable_scope("intermediate"):
                        inner = tf1.layers.dense(a, 4 * WIDTH, activation=_gelu)
                    with tf1.variable_scope("output"):
                        h = _norm(drop(tf1.layers.dense(inner, WIDTH)) + a, "LayerNorm")
            first = tf.squeeze(tf.reshape(h, [b, s, WIDTH])[:, 0:1, :], 1)
            with tf1.variable_scope("pooler"):
                pooled = tf1.layers.dense(first, WIDTH, activation=tf.tanh)
        logits = tf1.layers.dense(drop(pooled), 2, name="classifier")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
        train = tf1.train.AdamOptimizer(1e-3).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        init = tf1.global_variables_initializer()
    return g, train, loss, init
