"""The layer-to-layer runner: what it fetches and feeds in the user's names,
its plan, and the configurations it refuses."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import read_name, variable_names
from test_l2l import LAYERS, stack

tf1 = tf.compat.v1
ONE = {"hosts": [{"devices": ["cpu:1"]}]}


def test_plan_says_how_the_model_was_cut():
    g, h = stack(4, drop=lambda x: tf.nn.dropout(x, rate=0.1))
    with pn.get_runner(g, {"hosts": [{"devices": ["cpu:1", "cpu:2"]}]},
                       {"l2l": {"layers": LAYERS, "micro_batches": 2, "stash": "host"}}) as r:
        plan = r.plan
        assert plan.group_size == 2
        text = str(plan)
    assert "2 replicas" in text and "2 micro-batches" in text and "stash on host" in text
    assert plan.random == 5 and "5 random ops drawn again" in text
    assert [s[0] for s in plan.segments] == ["pre", "layer_0", "layer_1", "layer_2", "post"]
    assert [s[1] for s in plan.segments] == [1, 2, 2, 2, 1]      # embedding; w, b; head


def test_variables_global_step_and_reductions():
    g, h = stack(4, "sgd")
    step = g.get_collection(tf1.GraphKeys.GLOBAL_STEP)[0]
    emb = [v for v in g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
           if v.op.name == "embedding"][0]
    config = {"l2l": {"layers": LAYERS, "micro_batches": 2},
              "fetch_reduction": {"logits:0": "first"}}
    with pn.get_runner(g, ONE, config) as r:
        r.run(h["init"])
        before = r.run(emb)
        out = r.run({"train": h["train"], "logits": [h["logits"]]})
        assert out["train"] is None
        assert out["logits"][0].shape == (2, 3)       # micro-batch 0's only ("first")
        assert r.run(step) == 1
        assert not np.array_equal(r.run(emb), before)


def test_a_sum_over_the_micro_batches_is_fetched_as_one_devices_sum():
    """The loss's sum of the examples' cross-entropies (a sum over the
    batch: each micro-batch's is part of it) is the micro-batches' sum, the
    cross-entropies themselves joined in order; both equal one device's
    (were averaged: half the sum)."""
    g, h = stack(4, "sgd", loss="sum/batch")
    total = g.get_tensor_by_name("loss:0").op.inputs[0].op.inputs[0]
    xent = total.op.inputs[0]
    assert total.op.type == "Sum" and xent.shape.rank == 1
    with tf1.Session(graph=g) as sess:          # the variables seeded alike
        sess.run(h["init"])
        want = sess.run([total, xent, h["loss"]])
    with pn.get_runner(g, ONE, {"l2l": {"layers": LAYERS, "micro_batches": 2}}) as r:
        r.run(h["init"])
        got = r.run([total, xent, h["loss"]])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ops_made_after_get_runner_run_on_the_host(tmp_path):
    """A late initializer and a late read of the variables are copied in;
    the late initializer counts as initializing: the checkpoint is restored
    after it."""
    config = {"l2l": {"layers": LAYERS},
              "checkpoint": {"dir": str(tmp_path), "every_steps": 2}}
    g, h = stack(4)
    with pn.get_runner(g, ONE, config) as r:
        r.run(h["init"])
        r.run(h["train"])
        r.run(h["train"])                  # saved at step 2
    with pn.get_runner(g, ONE, config) as r:
        with g.as_default():
            init = tf1.global_variables_initializer()
            norm = tf.add_n([tf.reduce_sum(v * v) for v in tf1.trainable_variables()])
        r.run(init)
        assert r.run(read_name("global_step", g)) == 2
        before = r.run(norm)
        r.run(h["train"])
        assert r.run(norm) != before


def test_fetches_it_cannot_serve_are_errors():
    g, h = stack(4)
    with pn.get_runner(g, ONE, {"l2l": {"layers": LAYERS}}) as r:
        r.run(h["init"])
        with pytest.raises(pn.FetchError, match="part of the forward pass"):
            r.run(h["logits"].op)
        with g.as_default():         # a metric the loss does not depend on
            accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(h["logits"], 1), h["y"]),
                                              tf.float32))
        with pytest.raises(pn.FetchError, match="the loss does not depend on it"):
            r.run(accuracy)
        with pytest.raises(pn.FetchError, match="the loss does not depend on it"):
            r.run(h["y"])
        with pytest.raises(pn.FetchError, match="is not in the training graph"):
            r.run("no_such_op:0")
        other = tf.Graph()
        with other.as_default():
            c = tf.constant(1)
        with pytest.raises(pn.FetchError, match="another graph"):
            r.run(c)


def test_configurations_it_refuses():
    g, _ = stack(4)
    with pytest.raises(pn.ConfigError, match="horovod"):
        pn.get_runner(g, ONE, {"l2l": {"layers": LAYERS},
                               "communication": {"backend": "horovod"}})
    with pytest.raises(pn.ConfigError, match="l2l.micro_batches"):
        pn.get_runner(g, ONE, {"l2l": {"layers": LAYERS, "micro_batches": 0}})
    with pytest.raises(pn.ConfigError, match="unknown config key 'l2l.layer'"):
        pn.get_runner(g, ONE, {"l2l": {"layer": LAYERS}})
    with pytest.raises(pn.GraphError, match="batch 8.*3 parts"):
        pn.get_runner(stack(8)[0], ONE, {"l2l": {"layers": LAYERS, "micro_batches": 3}})


def test_checkpoints_resume_exactly(tmp_path):
    """Every 3 steps a checkpoint, and one at close; a new runner restores
    the newest at its first initializing run (variables, slots, the
    iterator's position) and ends where an uninterrupted run ends, dropout
    included (its seeds come from the global step)."""
    config = {"l2l": {"layers": LAYERS, "micro_batches": 2, "stash": "host"},
              "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 3}}
    g, h = stack(4, drop=lambda x: tf.nn.dropout(x, rate=0.2))
    names = variable_names(g)
    reads = [read_name(n, g) for n in names]
    with pn.get_runner(g, ONE, config) as r:
        r.run(h["init"])
        for _ in range(5):                 # saved at 3, and at close (5)
            r.run(h["train"])
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("model.ckpt-*.index"))
    assert saved == ["model.ckpt-3.index", "model.ckpt-5.index"]
    assert tf.train.latest_checkpoint(str(tmp_path / "ckpt")).endswith("model.ckpt-5")
    with pn.get_runner(g, ONE, config) as r:
        r.run(h["init"])
        assert r.run(read_name("global_step", g)) == 5
        for _ in range(5):
            r.run(h["train"])
        resumed = dict(zip(names, r.run(reads)))
    with pn.get_runner(g, ONE, {"l2l": config["l2l"]}) as r:
        r.run(h["init"])
        for _ in range(10):
            r.run(h["train"])
        whole = dict(zip(names, r.run(reads)))
    assert any(n.endswith("Adam") for n in names)
    for name in names:
        np.testing.assert_array_equal(resumed[name], whole[name], err_msg=name)


def test_the_users_saver_writes_a_single_device_checkpoint(tmp_path):
    g, h = stack(4)
    with g.as_default():
        saver = tf1.train.Saver()
    names = variable_names(g)
    with pn.get_runner(g, ONE, {"l2l": {"layers": LAYERS}}) as r:
        r.run(h["init"])
        for _ in range(3):
            r.run(h["train"])
        trained = dict(zip(names, r.run([read_name(n, g) for n in names])))
        path = r.save(saver, str(tmp_path / "model"))
        r.run(h["init"])
        r.restore(saver, path)
        np.testing.assert_array_equal(r.run(read_name("embedding", g)), trained["embedding"])
    with tf1.Session(graph=g) as sess:
        saver.restore(sess, path)
        for name in names:
            np.testing.assert_array_equal(sess.run(read_name(name, g)), trained[name])
