"""The eager parameter server's sums (parallax_ng/l2l/eps.py): per replica in
arrival order, across replicas, across a job's workers; sparse gradients
kept sparse; cmp's scaled float16 gradients unscaled; pn.shard constants
set per worker."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from models import load_values, read_name, variable_names
from task_env import TASK_PATH
from test_l2l import stack

import parallax_ng as pn
from parallax_ng.comm.collectives import HostCollectives
from parallax_ng.graph import frontend
from parallax_ng.graph.frontend import Gradient
from parallax_ng.graph.ir import TensorRef
from parallax_ng.l2l import eps

tf1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "l2l_job_script.py")
ONE_WORKER = eps.Workers(HostCollectives(1, 0))


def test_dense_sum_over_micro_batches_and_replicas_unscaled():
    g = tf.Graph()
    with g.as_default():
        parts = [(r, tf.constant(np.full([2], 10.0 * r + k, np.float16)))
                 for r in range(2) for k in range(3)]
        out = eps.gradient_sum("w", Gradient("w", TensorRef("g", 0)), parts, 2, tf.float32,
                               None, ONE_WORKER, None, scale=4.0)
        assert list(out) == ["g:0"] and out["g:0"].dtype == tf.float32
        with tf1.Session() as sess:
            np.testing.assert_array_equal(sess.run(out["g:0"]), [(3 + 33) / 4.0] * 2)


def test_sparse_gradient_keeps_every_row():
    g = tf.Graph()
    with g.as_default():
        parts = [(0, tf.IndexedSlices(tf.ones([2, 3]), tf.constant([1, 4]), tf.constant([6, 3]))),
                 (1, tf.IndexedSlices(2 * tf.ones([1, 3]), tf.constant([4]),
                                      tf.constant([6, 3])))]
        out = eps.gradient_sum("e", Gradient("e", TensorRef("v", 0), TensorRef("i", 0)), parts,
                               2, tf.float32, tf.int64, ONE_WORKER, 6)
        with tf1.Session() as sess:
            values, indices = sess.run([out["v:0"], out["i:0"]])
    np.testing.assert_array_equal(indices, [1, 4, 4])
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(values[:, 0], [1, 1, 2])


def test_gradients_no_layer_made_or_of_the_wrong_kind_are_errors():
    grad = Gradient("e", TensorRef("v", 0), TensorRef("i", 0))
    with pytest.raises(pn.GraphError, match="'e' has a gradient .* but no layer reads it"):
        eps.gradient_sum("e", grad, [], 1, tf.float32, tf.int32, ONE_WORKER, 6)
    with tf.Graph().as_default():
        with pytest.raises(pn.GraphError, match="'e': the user's gradient is sparse"):
            eps.gradient_sum("e", grad, [(0, tf.ones([6, 3]))], 1, tf.float32, tf.int32,
                             ONE_WORKER, 6)


def test_shard_constants_set_for_the_worker():
    g, _ = stack(4)
    tg = frontend.load(g)
    gd = tg.ir.graph_def
    nodes = {n.name: n for n in gd.node}
    new_nodes, library = eps.shard_inputs(nodes, gd.library, tg.shard_consts, 2, 1)
    found = {}
    for f in library.function:
        for body in f.node_def:
            if body.name.rpartition("/")[2] in ("num_shards", "index") and \
                    "parallax_shard" in body.name:
                found[body.name.rpartition("/")[2]] = tf.make_ndarray(
                    body.attr["value"].tensor)
    assert found == {"num_shards": 2, "index": 1}
    untouched = [tf.make_ndarray(b.attr["value"].tensor) for f in gd.library.function
                 for b in f.node_def if b.name.endswith("parallax_shard/num_shards")]
    assert untouched and all(v == 1 for v in untouched)
    assert new_nodes.keys() == nodes.keys()


def test_a_two_worker_job_equals_one_device(tmp_path):
    """2 workers x 2 stand-in devices x 2 micro-batches: each worker's host
    sums its replicas' gradients and the two sums are all-reduced; worker
    0's initial values are broadcast. Both workers end equal to one device
    with the global batch (16) after 5 steps, at 1e-5. Checkpoints have a
    job's layout: worker 0 writes the variables, each worker its input
    position; the last one (at close) holds the final values. Worker 0
    names an evaluation pipeline's filter after its shard (never run)."""
    path = tmp_path / "resources.yaml"
    path.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:1, cpu:2]\n" * 2)
    out, ckpt = str(tmp_path / "vars"), str(tmp_path / "ckpt")
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r", str(path), "--", out,
         "5", "--checkpoint", ckpt, "--apart"], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "worker 1 of 2, 2 replicas" in done.stdout
    # the workers split inputs as replicas do: a filter after a shard is named, once
    assert done.stderr.count("FilterDataset 'FilterDataset' comes after pn.shard()") == 1, \
        done.stderr[-3000:]
    workers = [dict(np.load(f"{out}.{k}.npz")) for k in range(2)]
    g, h = stack(16, "adam")
    names = variable_names(g)
    for name in names:
        np.testing.assert_array_equal(workers[1][f"start/{name}"], workers[0][f"start/{name}"])
    with tf1.Session(graph=g) as sess:
        sess.run(h["init"])
        load_values(sess, g, {n: workers[0][f"start/{n}"] for n in names})
        for _ in range(5):
            sess.run(h["train"])
        want = dict(zip(names, sess.run([read_name(n, g) for n in names])))
    for k in range(2):
        for name in names:
            np.testing.assert_allclose(workers[k][f"end/{name}"], want[name], rtol=0,
                                       atol=1e-5, err_msg=f"worker {k}: {name}")
    latest = tf.train.latest_checkpoint(ckpt)
    assert latest.endswith("model.ckpt-5")
    for k in range(2):
        assert tf.train.latest_checkpoint(f"{ckpt}/inputs/worker-{k}").endswith("ckpt-5")
    reader = tf.train.load_checkpoint(latest)
    for name in names:
        np.testing.assert_array_equal(reader.get_tensor(name), workers[0][f"end/{name}"],
                                      err_msg=name)
