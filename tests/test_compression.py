"""Compressed gradients (parallax_ng/comm/compression.py): 16 bits on the
wire, float32 sums; what crosses is halved, training stays within its
stated error, ids and other tensors stay exact."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.comm import compression
from passkit import cluster_transform
from task_env import TASK_PATH

tf1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
WIRE = {"fp16": (tf.float16, np.float16), "bf16": (tf.bfloat16, None)}


def rounded(x: np.ndarray, wire: str) -> np.ndarray:
    """float32 `x` through the wire's dtype and back."""
    if wire == "fp16":
        return x.astype(np.float16).astype(np.float32)
    bits = x.astype(np.float32).view(np.uint32)       # bfloat16: round to nearest even
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_scattered_sum_adds_16_bit_parts_in_float32(wire, mean):
    """Three replicas (CPU devices), 7 x 5 elements (not a multiple of 3):
    each replica's tensor rounded to 16 bits, summed in float32 in replica
    order, scaled, rounded once more; every replica gets the same bits."""
    n, rng = 3, np.random.RandomState(0)
    parts = [rng.randn(7, 5).astype(np.float32) * 10 ** k for k in range(n)]
    g = tf.Graph()
    with g.as_default():
        common = dict(group_size=n, group_key=1, ordering_token=[], communication_hint="auto",
                      timeout_seconds=0.0)
        outs = []
        for k in range(n):
            with tf.device(f"/device:CPU:{k}"):
                outs.append(compression.scattered_sum(
                    tf.constant(parts[k]), n, WIRE[wire][0], mean,
                    lambda c: tf.raw_ops.CollectiveAllToAllV2(input=c, instance_key=1,
                                                              **common),
                    lambda c: tf.raw_ops.CollectiveGatherV2(input=c, instance_key=2,
                                                            **common)))
    config = tf1.ConfigProto(device_count={"CPU": n})
    config.experimental.collective_group_leader = "/job:localhost/replica:0/task:0"
    with tf1.Session(graph=g, config=config) as sess:
        got = sess.run(outs)
    total = np.zeros([7, 5], np.float32)
    for p in parts:
        total = total + rounded(p, wire)
    if mean:
        total = total / np.float32(n)
    want = rounded(total, wire)
    for k in range(n):
        np.testing.assert_array_equal(got[k], want, err_msg=f"replica {k}")
    exact = sum(parts) / (n if mean else 1)
    bound = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}[wire] * 3   # three roundings at most
    assert np.all(np.abs(got[0] - exact) <= bound * np.abs(parts).sum(0) / (n if mean else 1))


def test_a_job_sends_gradients_in_16_bits_and_everything_else_exact():
    """The generated graphs of a 2-worker job with a server (lm_small, three
    sparse variables): fusion-buffer shards and pushed gradient rows are
    queued as float16 (ids and norms as they were); all-reduced gradients go by an
    all-to-all and an all-gather of float16 (squared norms by a float32
    all-reduce); initial values are broadcast exact."""
    import lm_small
    args = lm_small.arguments(["--vocab", "300", "--words", "3000", "--batch", "8"])
    graph = lm_small.build(args)[0]
    for worker in (0, 1):
        ir, _ = cluster_transform(graph, worker, servers=1,
                                  communication={"compression": "fp16"})
        queued = {n.name: [tf.as_dtype(t).name for t in n.attr["component_types"].list.type]
                  for n in ir.nodes if n.op == "FIFOQueueV2"}
        bfb = [q for q in queued if q.startswith("parallax/bfb/")]
        pushed = [q for q in queued if q.startswith("parallax/server_sync/queue_")]
        assert bfb and all(queued[q] == ["float16"] for q in bfb)
        # per sparse variable: its rows' values in 16 bits, its ids, and the
        # float32 squared norm of its coalesced rows (exact)
        assert pushed and all([t for t in queued[q] if t.startswith("float")] ==
                              ["float16", "float32"] * 3 for q in pushed)
    ir, _ = cluster_transform(graph, 1, servers=0, run_option="allreduce",
                              communication={"compression": "bf16"})
    reduced = [n.name for n in ir.nodes if n.op == "CollectiveReduce"]
    assert reduced and all("/norm" in r for r in reduced)     # squared norms: exact
    moved = [n for n in ir.nodes if n.op in ("CollectiveAllToAllV2", "CollectiveGatherV2")
             and n.name.startswith(("parallax/allreduce", "parallax/bucket_"))]
    assert moved and all(tf.as_dtype(n.attr["T"].type) == tf.float16 for n in moved)
    received = [tf.as_dtype(n.attr["T"].type) for n in ir.nodes
                if n.op == "CollectiveBcastRecv"]
    assert tf.float32 in received and not {tf.float16, tf.bfloat16} & set(received)
    # alltoall: the gradient's rows in 16 bits, the forward's looked-up rows exact
    ir, _ = cluster_transform(graph, 0, servers=0, run_option="allreduce",
                              sparse_method="alltoall", communication={"compression": "fp16"})
    exchanged = {n.name.split("/")[1]: tf.as_dtype(n.attr["T"].type).name for n in ir.nodes
                 if n.op == "CollectiveAllToAllV2" and "embedding" in n.name}
    assert exchanged == {"alltoall": "float16", "columns": "float32"}


@pytest.mark.parametrize("wire,sparse", [("fp16", "allgather"), ("bf16", "allgather"),
                                         ("fp16", "alltoall")])
def test_lm_small_trains_within_one_percent_of_float32(wire, sparse):
    """200 steps of lm_small on 2 replicas (dense by all-reduce, sparse by
    all-gather, or cut by columns with alltoall): the loss of the last 20
    steps within 1% of float32's."""
    import lm_small
    args = lm_small.arguments(["--vocab", "2000", "--words", "20000", "--batch", "16"])
    losses = {}
    for how in ("none", wire):
        graph, train_op, loss, _, init = lm_small.build(args)
        config = {"run_option": "allreduce", "sparse_method": sparse,
                  "communication": {"compression": how}}
        with pn.get_runner(graph, local(2), config) as runner:
            runner.run(init)
            losses[how] = [runner.run([train_op, loss])[1] for _ in range(200)]
    first, last = np.mean(losses["none"][:20]), np.mean(losses["none"][-20:])
    assert last < 0.9 * first                                  # it trained
    assert abs(np.mean(losses[wire][-20:]) - last) <= 0.01 * last


def test_a_hybrid_job_trains_within_one_percent_of_float32(tmp_path):
    """lm_small as 2 workers + 1 server (dense by fusion buffers, sparse rows
    pushed to the server), 200 steps: with fp16 the loss of the last 20
    steps within 1% of float32's."""
    import re
    import subprocess
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2
                   + "ps: [127.0.0.1]\n")
    last = {}
    for how in ("none", "fp16"):
        config = tmp_path / f"{how}.yaml"
        config.write_text(f"run_option: hybrid\ndense_method: bfb\nsparse_method: ps\n"
                          f"communication: {{compression: {how}}}\n")
        done = subprocess.run(
            [sys.executable, "-m", "parallax_ng", "run", os.path.join(ROOT, "examples",
                                                                      "lm_small.py"),
             "-r", str(res), "--", "--steps", "200", "--log-every", "20", "--vocab", "2000",
             "--words", "20000", "--batch", "16", "--config", str(config)],
            capture_output=True, text=True, timeout=600,
            env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        if how != "none":
            assert f"float32 gradients travel as {how}" in done.stdout
        losses = [float(x) for x in re.findall(r"\[worker 0\] step +\d+ +loss (\d+\.\d+)",
                                               done.stdout)]
        assert len(losses) == 11, done.stdout[-2000:]
        last[how] = losses
    assert last["none"][-1] < 0.9 * last["none"][0]
    assert abs(last["fp16"][-1] - last["none"][-1]) <= 0.01 * last["none"][-1]


def test_compression_config_is_checked():
    with pytest.raises(pn.ConfigError, match="communication.compression.*fp16.*bf16"):
        pn.load_config({"communication": {"compression": "int8"}})
    from test_l2l import LAYERS, stack
    g, _ = stack(4)
    with pytest.warns(UserWarning, match="compression.*layer-to-layer.*float32"):
        pn.get_runner(g, local(1), {"l2l": {"layers": LAYERS},
                                    "communication": {"compression": "fp16"}}).close()
