"""Trainable variable shapes of two reference models, from their
definitions, for plan-level tests (no training):

- ResNet-50 (He et al. 2016; Keras' ResNet50 layout): a 7x7 stem, bottleneck
  stages of 3, 4, 6 and 3 blocks (1x1, 3x3, 1x1 convolutions with batch-norm
  scale and offset each, a projection shortcut in every stage's first
  block), a 2048 -> 1000 classifier: 25.6 M parameters in 161 variables
  (batch-norm moving statistics are not trained).
- BERT-base (Devlin et al. 2019): 30,522-word embeddings, 512 positions, 2
  token types, hidden 768, 12 layers of self-attention (query, key, value,
  output projections) and a 3072-wide feed-forward, layer norms, a pooler:
  109.5 M parameters in 199 variables.
"""
from __future__ import annotations

import tensorflow as tf

tf1 = tf.compat.v1


def resnet50() -> list[tuple[str, tuple[int, ...]]]:
    out = [("conv1/kernel", (7, 7, 3, 64)), ("conv1/bias", (64,)),
           ("conv1_bn/gamma", (64,)), ("conv1_bn/beta", (64,))]
    width_in = 64
    for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)], 2):
        for block in range(1, blocks + 1):
            name = f"conv{stage}_block{block}"
            if block == 1:
                out += _conv_bn(f"{name}_0", 1, width_in, 4 * width)
            out += _conv_bn(f"{name}_1", 1, width_in if block == 1 else 4 * width, width)
            out += _conv_bn(f"{name}_2", 3, width, width)
            out += _conv_bn(f"{name}_3", 1, width, 4 * width)
        width_in = 4 * width
    return out + [("predictions/kernel", (2048, 1000)), ("predictions/bias", (1000,))]


def _conv_bn(name: str, k: int, c_in: int, c_out: int):
    return [(f"{name}_conv/kernel", (k, k, c_in, c_out)), (f"{name}_conv/bias", (c_out,)),
            (f"{name}_bn/gamma", (c_out,)), (f"{name}_bn/beta", (c_out,))]


def bert_base(layers: int = 12, hidden: int = 768, ffn: int = 3072):
    out = [("embeddings/word", (30522, hidden)), ("embeddings/position", (512, hidden)),
           ("embeddings/token_type", (2, hidden)),
           ("embeddings/ln/gamma", (hidden,)), ("embeddings/ln/beta", (hidden,))]
    for k in range(layers):
        at = f"encoder/layer_{k}"
        for proj in ("query", "key", "value", "output"):
            out += [(f"{at}/attention/{proj}/kernel", (hidden, hidden)),
                    (f"{at}/attention/{proj}/bias", (hidden,))]
        out += [(f"{at}/attention/ln/gamma", (hidden,)), (f"{at}/attention/ln/beta", (hidden,)),
                (f"{at}/intermediate/kernel", (hidden, ffn)), (f"{at}/intermediate/bias", (ffn,)),
                (f"{at}/output/kernel", (ffn, hidden)), (f"{at}/output/bias", (hidden,)),
                (f"{at}/output/ln/gamma", (hidden,)), (f"{at}/output/ln/beta", (hidden,))]
    return out + [("pooler/kernel", (hidden, hidden)), ("pooler/bias", (hidden,))]


def parameters(shapes) -> int:
    total = 0
    for _, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def training_graph(shapes):
    """A graph with these variables, each read once in a chain (so their
    gradients become ready last layer first), and a GradientDescent step. No
    values are ever allocated: the graph is only planned."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None], name="x")
        total = tf.reduce_sum(x)
        for name, shape in shapes:
            v = tf1.get_variable(name, shape, initializer=tf1.zeros_initializer())
            total = total * 0.5 + tf.reduce_sum(v)
        tf1.train.GradientDescentOptimizer(0.1).minimize(total, name="train")
    return g
