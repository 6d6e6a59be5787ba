"""Whether training can move to another graph's session with its state
(parallax_ng/runtime/moves.py): each kind of state a checkpoint does not
carry is named, and what it does carry moves."""
from dataclasses import replace

import numpy as np
import tensorflow as tf
from models import embedding_regression, local

from parallax_ng.build import Build, resolve
from parallax_ng.graph import frontend
from parallax_ng.runtime import moves

tf1 = tf.compat.v1


def planned(g, config=None):
    """(pass context, plan) of `g` on two local devices."""
    build = Build(frontend.load(g), resolve(local(2), config or {}))
    plan = build.plan()
    _, ctx, _ = build.rewrite(plan)
    return ctx, plan


def linear(extra):
    """A linear model whose step also runs what `extra(x)` makes of its input."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", initializer=np.ones([4, 1], np.float32))
        loss = tf.reduce_mean(tf.matmul(extra(x), w))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return g


def test_a_model_with_iterators_and_slots_moves_and_a_job_only_all_at_once():
    """Adam, clipping, moving averages, a dataset iterator: all in the
    checkpoint, so it moves; a job's plan moves only when every worker
    does (`jobs`)."""
    g, _ = embedding_regression(4, "adam", clip=True, ema=True)
    ctx, plan = planned(g)
    assert moves.why_not(ctx, plan) is None
    job = replace(plan, num_workers=2)
    assert moves.why_not(ctx, job) == "a job's servers and other workers hold state of this graph"
    assert moves.why_not(ctx, job, jobs=True) is None
    assert moves.layout(ctx).workers == 1
    assert moves.training_writers(ctx.tg) and all(
        w in ctx.tg.after_gradients for w in moves.training_writers(ctx.tg))


def test_a_seeded_stream_in_the_step_is_named_and_unseeded_dropout_moves():
    """A seeded RandomShuffle would start its stream again; unseeded
    dropout draws afresh in any session."""
    shuffled = linear(lambda x: tf.gather(x, tf.random.shuffle(tf.range(4), seed=3), axis=1))
    why = moves.why_not(*planned(shuffled))
    assert why.startswith("random ops in the step (['RandomShuffle") and \
        why.endswith("would start their streams again in a new session"), why
    dropped = linear(lambda x: tf1.nn.dropout(x, rate=0.5))
    assert moves.why_not(*planned(dropped)) is None


def test_mutable_tables_and_input_queues_are_named():
    """A table the step inserts into, and a queue runner's input."""
    def counted(x):
        table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0,
                                                        name="seen")
        with tf.control_dependencies([table.insert(tf.constant([1], tf.int64),
                                                   tf.constant([1.0]))]):
            return tf.identity(x)

    why = moves.why_not(*planned(linear(counted)))
    assert why.startswith("mutable tables (['seen") and why.endswith(
        "hold entries a new session would lose"), why

    def queued(x):      # the PTB reader's way: a range producer picks the batch
        i = tf1.train.range_input_producer(3, shuffle=False).dequeue()
        return x * tf.gather(tf.constant([1.0, 2.0, 3.0]), i)

    assert moves.why_not(*planned(linear(queued))) == \
        "input queues hold elements a new session would lose"
